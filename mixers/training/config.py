"""The training config: one TOML file, every key with a default, overridable from the command line.

    [model] [data] [train] [parallel] [checkpoint] [metrics]: see docs/training.md for every key.

Each key is a dataclass field whose ``metadata["help"]`` is its one line of documentation; the
table of docs/training.md is :func:`keys_table`'s output. :func:`load_config` reads a file and
``section.key=value`` overrides (values in TOML syntax) and checks every key's name and type;
:func:`check_config` checks the values against each other and the world size, before any process
group starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import glob
import os
import sys
from dataclasses import dataclass, field

if sys.version_info >= (3, 11):
    import tomllib
else:                                            # pragma: no cover - Python 3.10
    import tomli as tomllib


def key(default, help: str):
    """A config key: its default and its one line of documentation (read by :func:`keys_table`)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class ModelConfig:
    kind: str = key("hybrid", '"hybrid" (HybridLM) or "hf" (a Hugging Face hybrid with enable_packing)')
    pattern: str = key("MGKPA", "HybridLM: one letter per block")
    hidden_size: int = key(64, "HybridLM: the width of every block")
    vocab_size: int = key(0, "0: the tokenizer's vocabulary (256 for bytes)")
    mixer_overrides: dict = key({}, "per letter, e.g. {M = {state_size = 16}}")
    backend: str = key("auto", '"auto", "kernel" or "reference" for every mixer')
    hf_path: str = key("", 'kind = "hf": a local model directory')
    init_from: str = key("", "initial weights: a checkpoint the converters read")


@dataclass
class DataConfig:
    files: list = key([], "text / jsonl / parquet paths or globs; empty: the embedded corpus")
    dataset: str = key("", "a Hugging Face dataset saved with save_to_disk")
    text_field: str = key("text", "the column / jsonl key holding each document's text")
    streaming: bool = key(False, "read the dataset as an IterableDataset")
    tokenizer: str = key("", 'a local Hugging Face tokenizer directory; "": bytes (vocabulary 256)')
    max_tokens: int = key(2048, "tokens per pack")
    batch_packs: int = key(4, "packs per optimizer step (the global batch, split over dp ranks)")
    lookahead: int = key(4096, "documents held for best-fit packing")
    shuffle_seed: int = key(-1, "-1: the source's order; else shuffle per epoch with this seed")
    carry: bool = key(True, "a document longer than a pack continues from its carried states")


@dataclass
class TrainConfig:
    steps: int = key(50, "optimizer steps (the default run: about a minute on a laptop CPU)")
    lr: float = key(3e-3, "peak learning rate (AdamW)")
    weight_decay: float = key(0.01, "AdamW weight decay")
    warmup_steps: int = key(5, "steps of linear warmup to lr, then cosine decay to lr / 10 at train.steps")
    grad_clip: float = key(1.0, "0: no clipping")
    seed: int = key(0, "parameter initialisation seed")
    dtype: str = key("float32", 'parameters; "bfloat16" / "float16": mixed precision (FSDP2 policy)')
    activation_checkpointing: bool = key(False, "recompute each block in the backward")
    compile: bool = key(False, "torch.compile each block")


@dataclass
class ParallelConfig:
    cp: int = key(1, "context-parallel degree; dp = world size / cp")
    balance: bool = key(True, "cp > 1: cut each pack where the ranks' work (attention quadratic within a document) "
                              "is even, not the tokens (ssm_pack.balanced_bounds)")


@dataclass
class CheckpointConfig:
    every: int = key(0, "steps between checkpoints; 0: only at the end and on SIGTERM")
    keep: int = key(2, "complete checkpoints kept (the newest)")
    resume: str = key("auto", '"auto": the latest complete one in out_dir; "never"; or a path')
    export: bool = key(True, "at the end, the weights in the upstream layout (safetensors)")


@dataclass
class MetricsConfig:
    log_every: int = key(1, "steps per progress line")
    tensorboard: bool = key(True, "when tensorboard is installed")
    plot: bool = key(True, "loss against tokens at the end (matplotlib when installed)")


@dataclass
class Config:
    out_dir: str = key("runs/ssm-pack-train", "checkpoints, metrics.jsonl, the plot and the export")
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)


SECTIONS = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig, "parallel": ParallelConfig,
            "checkpoint": CheckpointConfig, "metrics": MetricsConfig}
_TOML_NAMES = {"int": "integer", "float": "float", "str": "string", "bool": "boolean", "list": "array",
               "dict": "table"}
_TYPES = {"int": int, "float": float, "str": str, "bool": bool, "list": list, "dict": dict}


def _keys(cls) -> dict[str, dataclasses.Field]:
    """The plain keys of a section (or the top-level keys of :class:`Config`), by name."""
    return {f.name: f for f in dataclasses.fields(cls) if f.name not in SECTIONS}


def known_keys() -> list[str]:
    """Every key as ``section.key`` (top-level keys bare), in the dataclasses' order."""
    names = list(_keys(Config))
    for section, cls in SECTIONS.items():
        names += [f"{section}.{name}" for name in _keys(cls)]
    return names


# ------------------------------------------------------------------ types
def _check_type(name: str, value, wanted: str, where: str):
    """``value`` as the type ``wanted`` (an int is taken for a float; a bool is never an int)."""
    kind = _TYPES[wanted]
    ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not ok:
        article = "an" if wanted == "int" else "a"
        raise ValueError(f"{name} must be {article} {wanted}, got {value!r} ({type(value).__name__}){where}; "
                         f"write a TOML {_TOML_NAMES[wanted]}, e.g. {name.split('.')[-1]} = {_toml(_default(name))}")
    if kind is list and name == "data.files" and not all(isinstance(item, str) for item in value):
        raise ValueError(f"data.files must be a list of str (paths or globs), got {value!r}{where}; "
                         'write e.g. files = ["corpus/*.txt"]')
    return value


def _default(name: str):
    section, _, leaf = name.rpartition(".")
    owner = Config() if not section else getattr(Config(), section)
    return getattr(owner, leaf)


def _closest(name: str) -> str:
    candidates = known_keys() + ([] if "." in name else list(SECTIONS))
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.5)
    if close:
        return f"; did you mean {close[0]!r}?"
    return f"; the sections are {', '.join(SECTIONS)} (every key: docs/training.md)"


def _unknown(name: str, where: str) -> ValueError:
    what = "key" if "." in name else "key or section"
    return ValueError(f"unknown {what} {name!r}{where}{_closest(name)}")


def _build(tree: dict, where: str) -> Config:
    """A :class:`Config` from nested dicts (missing keys: their defaults), names and types checked."""
    if not isinstance(tree, dict):
        raise ValueError(f"a config must be a table of sections, got {type(tree).__name__}{where}")
    top, sections = {}, {}
    for name, value in tree.items():
        if name in SECTIONS:
            if not isinstance(value, dict):
                raise ValueError(f"[{name}] must be a table (section), got {value!r}{where}; write it as "
                                 f"[{name}] followed by its keys")
            sections[name] = _section(name, value, where)
        elif name in _keys(Config):
            top[name] = _check_type(name, value, _keys(Config)[name].type, where)
        else:
            raise _unknown(name, where)
    return Config(**top, **sections)


def _section(section: str, values: dict, where: str):
    cls, known = SECTIONS[section], _keys(SECTIONS[section])
    checked = {}
    for name, value in values.items():
        if name not in known:
            raise _unknown(f"{section}.{name}", where)
        checked[name] = _check_type(f"{section}.{name}", value, known[name].type, where)
    return cls(**checked)


# ------------------------------------------------------------------ loading
def parse_overrides(args: list[str]) -> list[str]:
    """Command-line words to overrides: ``--train.steps=10`` or ``--train.steps 10`` (or a bare
    ``train.steps=10``) -> ``["train.steps=10"]``."""
    found, words = [], list(args)
    while words:
        word = words.pop(0)
        name = word[2:] if word.startswith("--") else word
        if "=" in name:
            found.append(name)
        elif word.startswith("--") and words and not words[0].startswith("--"):
            found.append(f"{name}={words.pop(0)}")
        else:
            raise ValueError(f"override {word!r} has no value; write --section.key=value or --section.key value "
                             "(e.g. --train.steps=10)")
    return found


def _parse_value(name: str, text: str, where: str):
    """An override's value as TOML; a word that is not TOML is a string for a str key."""
    try:
        return tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError as err:
        if _key_type(name) == "str":
            return text
        raise ValueError(f"{name}={text!r}{where} is not a TOML value ({err}); write a "
                         f"{_key_type(name)} like {_toml(_default(name))}") from None


def _key_type(name: str) -> str | None:
    """The type name of key ``name`` (``section.key``, or a top-level key), ``None`` if unknown."""
    section, _, leaf = name.rpartition(".")
    owner = Config if not section else SECTIONS.get(section)
    found = None if owner is None else _keys(owner).get(leaf)
    return None if found is None else found.type


def _apply_override(tree: dict, override: str) -> None:
    where = f" (command-line override {override!r})"
    name, sep, text = override.partition("=")
    name = name.strip()
    if not sep or not name:
        raise ValueError(f"override {override!r} must be section.key=value (e.g. train.steps=10)")
    if _key_type(name) is None:
        raise _unknown(name, where)
    value = _check_type(name, _parse_value(name, text.strip(), where), _key_type(name), where)
    section, _, leaf = name.rpartition(".")
    (tree.setdefault(section, {}) if section else tree)[leaf] = value


def load_config(path: str | os.PathLike | None = None, overrides: list[str] = ()) -> Config:
    """The config of TOML file ``path`` (``None``: the defaults) with ``overrides`` applied
    (``"section.key=value"``, value in TOML syntax). Unknown names and wrong types raise
    ``ValueError`` naming the key, the file and the fix; values are checked by :func:`check_config`."""
    tree: dict = {}
    where = ""
    if path is not None:
        where = f" in {os.fspath(path)}"
        try:
            with open(path, "rb") as handle:
                tree = tomllib.load(handle)
        except FileNotFoundError:
            raise ValueError(f"config file {os.fspath(path)!r} does not exist; pass an existing TOML file "
                             "(or none for the defaults)") from None
        except tomllib.TOMLDecodeError as err:
            raise ValueError(f"config file {os.fspath(path)!r} is not valid TOML: {err}") from None
    _build(tree, where)                          # the file's names and types, before the overrides
    for override in overrides:
        _apply_override(tree, override)
    return _build(tree, where)


def config_to_dict(config: Config) -> dict:
    """Nested plain dicts (TOML / JSON types only): what a checkpoint stores."""
    return dataclasses.asdict(config)


def config_from_dict(d: dict) -> Config:
    """The inverse of :func:`config_to_dict` (names and types checked; missing keys: defaults)."""
    return _build(d, " (a stored config)")


# ------------------------------------------------------------------ docs
def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    return repr(value)


def keys_table() -> str:
    """Every key as a markdown table: key, type, default (as TOML) and meaning."""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for name in known_keys():
        section, _, leaf = name.rpartition(".")
        spec = _keys(SECTIONS[section] if section else Config)[leaf]
        meaning = spec.metadata["help"].replace("|", "\\|")
        rows.append(f"| `{name}` | {spec.type} | `{_toml(_default(name))}` | {meaning} |")
    return "\n".join(rows) + "\n"


# ------------------------------------------------------------------ values
CHOICES = {"model.kind": ("hybrid", "hf"), "model.backend": ("auto", "kernel", "reference"),
           "train.dtype": ("float32", "bfloat16", "float16")}
MINIMUMS = {"model.hidden_size": 1, "model.vocab_size": 0, "data.max_tokens": 2, "data.batch_packs": 1,
            "data.lookahead": 1, "data.shuffle_seed": -1, "train.steps": 1, "train.warmup_steps": 0,
            "train.weight_decay": 0, "train.grad_clip": 0, "parallel.cp": 1, "checkpoint.every": 0,
            "checkpoint.keep": 1, "metrics.log_every": 1}
PATHS = ("data.dataset", "data.tokenizer", "model.hf_path", "model.init_from")


def _get(config: Config, name: str):
    section, _, leaf = name.rpartition(".")
    return getattr(getattr(config, section) if section else config, leaf)


def check_config(config: Config, *, world: int) -> None:
    """Every value in range and consistent with the others and with ``world`` processes; a
    ``ValueError`` naming the key, its value and the fix. Call it before any process group starts."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be the number of processes (an int >= 1), got {world!r}")
    _build(config_to_dict(config), " (the config)")          # names and types, as a file would be checked
    for name, choices in CHOICES.items():
        if _get(config, name) not in choices:
            raise ValueError(f"{name}={_get(config, name)!r} is not one of {choices}; set {name} to one of them")
    for name, low in MINIMUMS.items():
        if _get(config, name) < low:
            raise ValueError(f"{name}={_get(config, name)!r} must be >= {low}; set {name} to {low} or more")
    if not config.train.lr > 0:
        raise ValueError(f"train.lr={config.train.lr!r} must be > 0; set train.lr to e.g. 3e-3")
    _check_parallel(config, world)
    check_data_source(config.data)
    for name in PATHS:
        if _get(config, name) and not os.path.exists(_get(config, name)):
            raise ValueError(f"{name}={_get(config, name)!r} does not exist; fix the path or set {name}=\"\"")
    resume = config.checkpoint.resume
    if resume not in ("auto", "never") and not os.path.exists(resume):
        raise ValueError(f"checkpoint.resume={resume!r} is neither \"auto\", \"never\" nor an existing path; "
                         "fix the path or set checkpoint.resume=\"auto\"")
    _check_model(config.model)
    _check_combinations(config)


def _check_combinations(config: Config) -> None:
    """Options that each work but not together."""
    data, model = config.data, config.model
    if data.carry and data.streaming:
        raise ValueError("data.carry=true with data.streaming=true: carried states size their cache by the longest "
                         "document, which a stream cannot tell up front; set data.carry=false or read the dataset "
                         "map-style (data.streaming=false)")
    if data.carry and config.train.activation_checkpointing:
        raise ValueError("train.activation_checkpointing=true with data.carry=true: the recompute would start from "
                         "carried states the forward already advanced; set one of them to false")
    if model.kind == "hf" and data.carry:
        raise ValueError('model.kind="hf" with data.carry=true: carried states need a HybridLM\'s inference cache; '
                         "set data.carry=false")
    if model.kind == "hf" and config.parallel.cp > 1:
        raise ValueError(f'model.kind="hf" with parallel.cp={config.parallel.cp}: a Hugging Face model\'s attention '
                         "layers do not pass context-parallel state; set parallel.cp=1 (data parallelism only)")


def _check_parallel(config: Config, world: int) -> None:
    cp, data = config.parallel.cp, config.data
    if world % cp:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise ValueError(f"parallel.cp={cp} does not divide the world size {world}; set parallel.cp to one of "
                         f"{divisors} or launch a multiple of {cp} processes")
    dp = world // cp
    if data.batch_packs % dp:
        raise ValueError(f"data.batch_packs={data.batch_packs} is not a multiple of dp={dp} (world {world} / "
                         f"parallel.cp {cp}); set data.batch_packs to a multiple of {dp}, e.g. "
                         f"{-(-data.batch_packs // dp) * dp}")
    if cp > 1 and data.max_tokens % (2 * cp):
        step = 2 * cp
        raise ValueError(f"data.max_tokens={data.max_tokens} is not a multiple of 2 * parallel.cp = {step} "
                         f"(context parallelism splits each pack into {step} chunks); set data.max_tokens to "
                         f"{max(step, data.max_tokens // step * step)} or {-(-data.max_tokens // step) * step}")
    if cp > 1 and data.carry:
        raise ValueError(f"data.carry=true with parallel.cp={cp}: carried states run unsharded; set "
                         "data.carry=false (long documents are then cut at the pack's end) or parallel.cp=1")


def check_data_source(data: DataConfig) -> None:
    """One source at most, and streaming only from a dataset."""
    if data.files and data.dataset:
        raise ValueError(f"data.files={data.files!r} and data.dataset={data.dataset!r} are both set; keep one "
                         "source (set the other to its empty default)")
    if data.streaming and not data.dataset:
        raise ValueError("data.streaming=true reads data.dataset, which is empty; set data.dataset to a dataset "
                         "saved with save_to_disk, or data.streaming=false")
    if data.streaming and data.shuffle_seed >= 0:
        raise ValueError(f"data.shuffle_seed={data.shuffle_seed} shuffles by index but data.streaming=true has no "
                         "index; set data.shuffle_seed=-1 (or shuffle the dataset before save_to_disk)")
    for entry in data.files:
        if glob.has_magic(entry):
            if not glob.glob(entry, recursive=True):
                raise ValueError(f"data.files entry {entry!r} matches no file; fix the glob or the working folder")
        elif not os.path.isfile(entry):
            raise ValueError(f"data.files entry {entry!r} is not a file; fix the path")


def _check_model(model: ModelConfig) -> None:
    if model.kind == "hf":
        if not model.hf_path:
            raise ValueError('model.kind="hf" needs model.hf_path (a local Hugging Face model directory); set '
                             'model.hf_path, or model.kind="hybrid"')
        return
    from ..layers import registry
    from ..model.sizes import size_problem

    if not model.pattern or registry.unknown_letters(model.pattern):
        raise ValueError(f"model.pattern={model.pattern!r} must be letters of {registry.letters()} "
                         f"({registry.legend()}); fix model.pattern")
    for letter, options in model.mixer_overrides.items():
        if letter not in registry.MIXERS or not isinstance(options, dict):
            raise ValueError(f"model.mixer_overrides={model.mixer_overrides!r}: each key must be a mixer letter "
                             f"of {registry.letters()} holding a table, e.g. {{M = {{state_size = 16}}}}")
    try:
        problem = size_problem(model.pattern, model.hidden_size, model.mixer_overrides)
    except TypeError as err:                     # an option the mixer's config does not have
        raise ValueError(f"model.mixer_overrides={model.mixer_overrides!r}: {err}; fix the option's name") from None
    if problem is not None:
        raise ValueError(problem.message("model.hidden_size", model.pattern, "model.mixer_overrides"))
