"""The training config: TOML file and overrides in, every name and type checked, values checked
against each other and the world size, and the docs' table is the one the fields generate."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from mixers.training.config import (
    Config,
    check_config,
    config_from_dict,
    config_to_dict,
    keys_table,
    known_keys,
    load_config,
    parse_overrides,
)

ROOT = Path(__file__).resolve().parents[3]


def test_defaults_round_trip_through_a_dict():
    config = Config()
    assert config_from_dict(config_to_dict(config)) == config
    assert load_config() == config
    assert config_to_dict(config)["data"]["files"] == [] and config_to_dict(config)["model"]["mixer_overrides"] == {}


def test_a_changed_config_round_trips_and_a_missing_key_takes_its_default():
    config = load_config(None, ["train.steps=7", "model.mixer_overrides={M = {state_size = 16}}"])
    assert config_from_dict(config_to_dict(config)) == config
    stored = config_to_dict(config)
    del stored["train"]["lr"]
    assert config_from_dict(stored).train.lr == Config().train.lr


def test_a_file_then_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('out_dir = "runs/a"\n[model]\npattern = "MGA"\nhidden_size = 32\n'
                    '[train]\nsteps = 5\nlr = 1\n[data]\nfiles = ["x.txt"]\ncarry = false\n')
    config = load_config(path, ["train.lr=1e-3", "model.pattern=GA", 'data.files=["a.txt", "b/*.md"]',
                                "train.steps=9", 'out_dir="runs/b"'])
    assert config.out_dir == "runs/b" and config.model.hidden_size == 32 and config.data.carry is False
    assert config.model.pattern == "GA" and config.train.steps == 9 and config.data.files == ["a.txt", "b/*.md"]
    assert config.train.lr == 1e-3 and isinstance(load_config(path).train.lr, float)     # an int for a float
    assert config.checkpoint == Config().checkpoint                                       # untouched: defaults


def test_mixer_overrides_as_toml_tables(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[model]\npattern = "MA"\n[model.mixer_overrides.M]\nstate_size = 16\n')
    config = load_config(path)
    assert config.model.mixer_overrides == {"M": {"state_size": 16}}
    check_config(config, world=1)


@pytest.mark.parametrize("args,wanted", [
    pytest.param(["--train.steps=10"], ["train.steps=10"], id="equals"),
    pytest.param(["--train.steps", "10", "--model.pattern", "MGA"], ["train.steps=10", "model.pattern=MGA"],
                 id="separate"),
    pytest.param(["data.carry=false"], ["data.carry=false"], id="bare"),
    pytest.param(["--data.shuffle_seed", "-1"], ["data.shuffle_seed=-1"], id="negative-value"),
    pytest.param([], [], id="none"),
])
def test_parse_overrides(args, wanted):
    assert parse_overrides(args) == wanted


@pytest.mark.parametrize("args", [
    pytest.param(["--train.steps"], id="no-value"),
    pytest.param(["--train.steps", "--train.lr=1"], id="flag-after"),
    pytest.param(["train.steps"], id="bare-no-value"),
])
def test_parse_overrides_refuses_a_missing_value(args):
    with pytest.raises(ValueError, match="has no value.*--section.key=value"):
        parse_overrides(args)


FILE_ERRORS = [
    pytest.param("[trian]\nsteps = 1\n", r"'trian'.*run\.toml.*did you mean 'train'", id="unknown-section"),
    pytest.param("[train]\nstpes = 1\n", r"'train\.stpes'.*run\.toml.*did you mean 'train\.steps'", id="unknown-key"),
    pytest.param("[train]\nsteps = true\n", r"train\.steps must be an int, got True.*run\.toml.*integer",
                 id="bool-for-int"),
    pytest.param('[train]\nsteps = "5"\n', r"train\.steps must be an int, got '5'.*integer", id="str-for-int"),
    pytest.param("[model]\npattern = 5\n", r"model\.pattern must be a str, got 5.*string", id="int-for-str"),
    pytest.param("[data]\ncarry = 1\n", r"data\.carry must be a bool, got 1.*boolean", id="int-for-bool"),
    pytest.param('[data]\nfiles = "a.txt"\n', r"data\.files must be a list.*array", id="str-for-list"),
    pytest.param('[data]\nfiles = [1]\n', r"data\.files must be a list of str", id="int-in-files"),
    pytest.param("train = 3\n", r"\[train\] must be a table", id="section-as-value"),
    pytest.param("[train\n", r"not valid TOML", id="bad-toml"),
]


@pytest.mark.parametrize("text,message", FILE_ERRORS)
def test_a_bad_file_is_refused_naming_key_file_and_fix(tmp_path, text, message):
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_config(path)


@pytest.mark.parametrize("override,message", [
    pytest.param("train.stpes=1", r"'train\.stpes'.*command-line override.*did you mean 'train\.steps'", id="key"),
    pytest.param("modle.pattern=1", r"'modle\.pattern'.*did you mean 'model\.pattern'", id="section"),
    pytest.param("train.steps=1.5", r"train\.steps must be an int, got 1\.5", id="float-for-int"),
    pytest.param("train.lr=fast", r"train\.lr='fast'.*not a TOML value.*float", id="word-for-float"),
    pytest.param("model.pattern=true", r"model\.pattern must be a str, got True", id="bool-for-str"),
    pytest.param("train.steps", r"must be section\.key=value", id="no-equals"),
])
def test_a_bad_override_is_refused(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [override])


def test_a_missing_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "none.toml")


def test_a_bare_word_is_a_string_only_for_str_keys():
    assert load_config(None, ["model.pattern=MGA", "out_dir=runs/x y"]).model.pattern == "MGA"
    assert load_config(None, ["out_dir=runs/x"]).out_dir == "runs/x"
    with pytest.raises(ValueError, match="data.carry"):
        load_config(None, ["data.carry=yes"])


def _with(**changes) -> Config:
    """The default config with ``section__key=value`` changes."""
    config = Config()
    for name, value in changes.items():
        section, _, leaf = name.partition("__")
        setattr(getattr(config, section) if leaf else config, leaf or section, value)
    return config


def test_the_defaults_pass_the_checks():
    check_config(Config(), world=1)
    check_config(_with(data__batch_packs=8), world=8)


REFUSALS = [
    pytest.param(_with(train__steps=0), 1, r"train\.steps=0 must be >= 1; set train\.steps", id="steps"),
    pytest.param(_with(train__lr=0.0), 1, r"train\.lr=0\.0 must be > 0; set train\.lr", id="lr"),
    pytest.param(_with(data__max_tokens=1), 1, r"data\.max_tokens=1 must be >= 2", id="max-tokens"),
    pytest.param(_with(data__batch_packs=0), 1, r"data\.batch_packs=0 must be >= 1", id="batch-packs"),
    pytest.param(_with(checkpoint__keep=0), 1, r"checkpoint\.keep=0 must be >= 1", id="keep"),
    pytest.param(_with(checkpoint__every=-1), 1, r"checkpoint\.every=-1 must be >= 0", id="every"),
    pytest.param(_with(metrics__log_every=0), 1, r"metrics\.log_every=0 must be >= 1", id="log-every"),
    pytest.param(_with(parallel__cp=0), 1, r"parallel\.cp=0 must be >= 1", id="cp-zero"),
    pytest.param(_with(model__vocab_size=-1), 1, r"model\.vocab_size=-1 must be >= 0", id="vocab"),
    pytest.param(_with(train__dtype="fp8"), 1, r"train\.dtype='fp8' is not one of .*bfloat16.*set train\.dtype",
                 id="dtype"),
    pytest.param(_with(model__kind="mamba"), 1, r"model\.kind='mamba' is not one of", id="kind"),
    pytest.param(_with(model__backend="triton"), 1, r"model\.backend='triton' is not one of", id="backend"),
    pytest.param(_with(checkpoint__resume="nowhere/ckpt"), 1, r"checkpoint\.resume='nowhere/ckpt'.*fix the path",
                 id="resume"),
    pytest.param(_with(parallel__cp=3, data__carry=False), 4,
                 r"parallel\.cp=3 does not divide the world size 4; set parallel\.cp to one of \[1, 2, 4\]",
                 id="cp-world"),
    pytest.param(_with(data__batch_packs=3), 2, r"data\.batch_packs=3 is not a multiple of dp=2.*e\.g\. 4",
                 id="batch-dp"),
    pytest.param(_with(parallel__cp=2, data__carry=False, data__max_tokens=2050), 2,
                 r"data\.max_tokens=2050 is not a multiple of 2 \* parallel\.cp = 4.*2048 or 2052", id="tokens-cp"),
    pytest.param(_with(parallel__cp=2), 2, r"data\.carry=true with parallel\.cp=2.*set data\.carry=false",
                 id="carry-cp"),
    pytest.param(_with(data__files=["nowhere/*.txt"]), 1, r"data\.files entry 'nowhere/\*\.txt' matches no file",
                 id="empty-glob"),
    pytest.param(_with(data__files=["nowhere.txt"]), 1, r"data\.files entry 'nowhere\.txt' is not a file",
                 id="missing-file"),
    pytest.param(_with(data__dataset="nowhere"), 1, r"data\.dataset='nowhere' does not exist; fix the path",
                 id="dataset"),
    pytest.param(_with(data__tokenizer="nowhere"), 1, r"data\.tokenizer='nowhere' does not exist", id="tokenizer"),
    pytest.param(_with(model__init_from="nowhere"), 1, r"model\.init_from='nowhere' does not exist", id="init-from"),
    pytest.param(_with(model__kind="hf"), 1, r'model\.kind="hf" needs model\.hf_path', id="hf-no-path"),
    pytest.param(_with(model__kind="hf", model__hf_path="nowhere"), 1, r"model\.hf_path='nowhere' does not exist",
                 id="hf-path"),
    pytest.param(_with(data__files=["a"], data__dataset="b"), 1, r"data\.files=.*data\.dataset=.*keep one",
                 id="two-sources"),
    pytest.param(_with(data__streaming=True), 1, r"data\.streaming=true.*data\.dataset.*empty", id="stream-no-ds"),
    pytest.param(_with(train__activation_checkpointing=True), 1,
                 r"train\.activation_checkpointing=true with data\.carry=true.*set one of them to false",
                 id="checkpointing-carry"),
    pytest.param(_with(data__dataset=".", data__streaming=True), 1,
                 r"data\.carry=true with data\.streaming=true.*set data\.carry=false", id="stream-carry"),
    pytest.param(_with(model__kind="hf", model__hf_path="."), 1, r'model\.kind="hf" with data\.carry=true.*'
                 r"set data\.carry=false", id="hf-carry"),
    pytest.param(_with(model__kind="hf", model__hf_path=".", data__carry=False, parallel__cp=2), 2,
                 r'model\.kind="hf" with parallel\.cp=2.*set parallel\.cp=1', id="hf-cp"),
    pytest.param(_with(model__pattern="MXA"), 1, r"model\.pattern='MXA' must be letters of.*fix model\.pattern",
                 id="pattern"),
    pytest.param(_with(model__pattern=""), 1, r"model\.pattern='' must be letters", id="empty-pattern"),
    pytest.param(_with(model__hidden_size=100), 1,
                 r"model\.hidden_size=100: block 0 \('M'.*model\.hidden_size=96.*model\.mixer_overrides=", id="size"),
    pytest.param(_with(model__mixer_overrides={"M": {"stat_size": 16}}), 1,
                 r"model\.mixer_overrides=.*stat_size.*fix the option", id="override-option"),
    pytest.param(_with(model__mixer_overrides={"X": {}}), 1, r"model\.mixer_overrides=.*mixer letter", id="letter"),
    pytest.param(_with(train__steps="5"), 1, r"train\.steps must be an int, got '5' \(str\) \(the config\)",
                 id="type-in-code"),
]


@pytest.mark.parametrize("config,world,message", REFUSALS)
def test_check_config_refuses_naming_key_value_and_fix(config, world, message):
    with pytest.raises(ValueError, match=message):
        check_config(config, world=world)


@pytest.mark.parametrize("world", [0, -1, True, 2.0])
def test_check_config_refuses_a_bad_world(world):
    with pytest.raises(ValueError, match="world must be"):
        check_config(Config(), world=world)


def test_check_config_accepts_what_exists(tmp_path):
    (tmp_path / "a.txt").write_text("x")
    (tmp_path / "ckpt").mkdir()
    config = _with(data__files=[str(tmp_path / "*.txt")], checkpoint__resume=str(tmp_path / "ckpt"),
                   model__kind="hf", model__hf_path=str(tmp_path), model__pattern="not checked for hf",
                   data__carry=False)
    check_config(config, world=1)
    check_config(_with(parallel__cp=2, data__carry=False, data__batch_packs=2), world=4)


def test_every_key_has_help_and_appears_in_the_table():
    table = keys_table()
    assert len(table.splitlines()) == 2 + len(known_keys())
    for name in known_keys():
        assert re.search(rf"^\| `{re.escape(name)}` \| \w+ \| `[^`]*` \| \S", table, flags=re.M), name
    sections = {f.name for f in dataclasses.fields(Config)} - {"out_dir"}
    assert {name.split(".")[0] for name in known_keys() if "." in name} == sections


def test_docs_training_holds_the_generated_keys_table():
    text = (ROOT / "docs" / "training.md").read_text()
    found = re.search(r"<!-- keys:start -->\n(.*?)<!-- keys:end -->", text, flags=re.S)
    assert found, "docs/training.md lacks the markers <!-- keys:start --> / <!-- keys:end -->"
    assert found.group(1) == keys_table(), "regenerate the block with mixers.training.config.keys_table()"
