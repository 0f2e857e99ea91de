"""Which Hugging Face hybrid families pack exactly, natively and with ``enable_packing``?

For every hybrid family in transformers (:data:`FAMILIES`), a tiny random-weight model (two layers,
hidden 32; the models of ``tests/mixers/integrations/hf_models.py`` where one exists, else the
config here) is called on three documents of uneven lengths flattened into one row by
``DataCollatorWithFlattening`` (``position_ids`` restarting at each document), for each attention
implementation ``enable_packing`` wraps (``eager``, ``sdpa``; ``flash_attention_2`` when flash-attn
and a GPU are there) and two call styles:

* ``trainer``: ``model(**batch, use_cache=False)``, the collator's batch with its labels;
* ``loop``: ``model(input_ids=, position_ids=)``, the default call of a plain training loop.

Per row: the flattened row's logits against each document run alone (relative RMS, fp32), first
as transformers computes them (``native``), then after ``enable_packing``; and the gradient
leak, the largest ``|d logits(document) / d embeddings(another document)|`` over the documents,
both ways. A call that raises is ``raises: <reason>``; a model ``enable_packing`` refuses is
``refused: <reason>`` (its patched leak ``-``). An exact row reads an error near 1e-7 and a leak of exactly 0.

    python -m benchmarks.bench_families [--out DIR] [--families bamba lfm2 ...]

``--out DIR`` writes the table to ``DIR/YYYY-MM-DD-<machine>-families.md`` (the naming of
docs/benchmarks.md) and updates ``DIR/index.md``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

LENGTHS = (70, 1, 12)        # uneven; a 1-token document; crosses the delta rules' chunk of 64 and the convs
VOCAB = 64
CALLS = ("trainer", "loop")


def _jamba(monkeypatch, impl):
    import transformers
    return transformers.JambaForCausalLM(transformers.JambaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
        expert_layer_offset=1, num_experts=2, num_experts_per_tok=1, mamba_d_state=8, mamba_d_conv=4,
        mamba_expand=2, mamba_dt_rank=4, use_mamba_kernels=False, attn_implementation=impl))


def _mamba(monkeypatch, impl):
    import transformers
    return transformers.MambaForCausalLM(transformers.MambaConfig(
        vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4,
        time_step_rank=4, use_mambapy=False))


def _falcon_mamba(monkeypatch, impl):
    import transformers
    return transformers.FalconMambaForCausalLM(transformers.FalconMambaConfig(
        vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4,
        time_step_rank=4, use_mambapy=False))


def _recurrent_gemma(monkeypatch, impl):
    import transformers
    return transformers.RecurrentGemmaForCausalLM(transformers.RecurrentGemmaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, lru_width=32, attention_window_size=16, conv1d_width=4,
        block_types=["recurrent", "attention"], attn_implementation=impl))


def _minimax(monkeypatch, impl):
    import transformers
    return transformers.MiniMaxForCausalLM(transformers.MiniMaxConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, layer_types=["linear_attention", "full_attention"],
        num_local_experts=2, num_experts_per_tok=1, block_size=16, attn_implementation=impl))


# (family, hf_models factory name, the config here when hf_models has none)
FAMILIES: tuple[tuple[str, str, Callable | None], ...] = (
    ("Bamba", "bamba", None), ("NemotronH", "nemotron_h", None), ("GraniteMoeHybrid", "granite", None),
    ("FalconH1", "falcon_h1", None), ("Zamba2", "zamba2", None), ("Mamba2", "mamba2", None),
    ("Qwen3-Next", "qwen3_next", None), ("Qwen3.5", "qwen3_5", None), ("KimiLinear", "kimi_linear", None),
    ("LFM2", "lfm2", None), ("LFM2-MoE", "lfm2_moe", None), ("LFM3", "lfm3", None),
    ("OLMo-hybrid", "olmo_hybrid", None), ("Jamba", "jamba", _jamba), ("Mamba", "mamba", _mamba),
    ("Falcon-Mamba", "falcon_mamba", _falcon_mamba), ("RecurrentGemma", "recurrent_gemma", _recurrent_gemma),
    ("MiniMax", "minimax", _minimax),
)


def implementations() -> list[str]:
    """The attention implementations enable_packing wraps that run here (flash-attn: with a GPU)."""
    impls = ["eager", "sdpa"]
    if torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None:
        impls.append("flash_attention_2")
    return impls


def _factory(key: str, fallback: Callable | None) -> Callable:
    from tests.mixers.integrations import hf_models
    factory = hf_models.FACTORIES.get(key, fallback)
    if factory is None:
        raise KeyError(f"no tiny model for {key!r}")
    return factory


def build(key: str, fallback: Callable | None, impl: str, monkeypatch) -> torch.nn.Module:
    """The tiny model in fp32 with every parameter moved off its init (seeded), as the tests build it."""
    torch.manual_seed(0)
    model = _factory(key, fallback)(monkeypatch, impl).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def _short(err: BaseException, width: int = 64) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= width else text[:width - 3] + "..."


def _call(model, batch: dict, style: str, **inputs):
    """The logits ``[T, V]`` of one call in ``style`` (``inputs`` replace ``input_ids``)."""
    inputs = inputs or {"input_ids": batch["input_ids"]}
    if style == "trainer":
        rest = {k: v for k, v in batch.items() if k != "input_ids"}
        return model(**inputs, **rest, use_cache=False).logits[0]
    return model(**inputs, position_ids=batch["position_ids"]).logits[0]


def _documents() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


def packed_error(model, batch: dict, docs, style: str) -> float:
    """Relative RMS of the flattened row's logits against each document alone."""
    with torch.no_grad():
        got = _call(model, batch, style).double()
        want = torch.cat([model(input_ids=torch.tensor([d])).logits[0] for d in docs]).double()
    return float((got - want).square().mean().sqrt() / want.square().mean().sqrt())


def gradient_leak(model, batch: dict, style: str) -> float:
    """Largest ``|d logits(document) / d embeddings(another document)|`` over the documents."""
    bounds = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    embeds = model.get_input_embeddings()(batch["input_ids"]).detach().requires_grad_(True)
    logits = _call(model, batch, style, inputs_embeds=embeds)
    worst = 0.0
    for target, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        g = torch.Generator().manual_seed(target)
        weights = torch.randn(hi - lo, logits.shape[-1], generator=g)
        (grad,) = torch.autograd.grad((logits[lo:hi] * weights).sum(), embeds, retain_graph=True)
        others = torch.ones(bounds[-1], dtype=torch.bool)
        others[lo:hi] = False
        worst = max(worst, float(grad[0, others].abs().max()))
    return worst


def _measure(fn) -> str:
    try:
        value = fn()
    except Exception as err:                                   # noqa: BLE001 - the table reports it
        return f"raises: {_short(err)}"
    return "0" if value == 0 else f"{value:.1e}"


@dataclass
class Row:
    family: str
    impl: str
    call: str
    native_error: str
    packed_error: str
    native_leak: str
    packed_leak: str


def _monkeypatch():
    """What the hf_models factories patch transformers' kernel routing with, undone after each model."""
    import pytest
    return pytest.MonkeyPatch.context()


def family_rows(family: str, key: str, fallback, impls, log=print) -> list[Row]:
    """The rows of one family: one per attention implementation and call style (one implementation,
    ``-``, for a model without attention)."""
    import transformers

    from mixers.integrations.hf_attention import attention_modules
    from mixers.integrations.transformers import enable_packing
    transformers.logging.set_verbosity_error()
    docs = _documents()
    collate = transformers.DataCollatorWithFlattening()
    batch = collate([{"input_ids": d} for d in docs])
    rows = []
    for impl in impls:
        with _monkeypatch() as mp:
            try:
                model = build(key, fallback, impl, mp)
            except Exception as err:                           # noqa: BLE001
                rows += [Row(family, impl, call, f"raises: {_short(err)}", "-", "-", "-") for call in CALLS]
                continue
            attention = bool(attention_modules(model))
            shown = impl if attention else "-"
            native = {call: (_measure(lambda c=call: packed_error(model, batch, docs, c)),
                             _measure(lambda c=call: gradient_leak(model, batch, c))) for call in CALLS}
            try:
                enable_packing(model)
                refused = None
            except Exception as err:                           # noqa: BLE001
                refused = f"refused: {_short(err)}"
            for call in CALLS:
                if refused:
                    patched = (refused, "-")
                else:
                    patched = (_measure(lambda c=call: packed_error(model, batch, docs, c)),
                               _measure(lambda c=call: gradient_leak(model, batch, c)))
                rows.append(Row(family, shown, call, native[call][0], patched[0], native[call][1], patched[1]))
        log(f"  {family} {shown}")
        if not attention:
            break
    return rows


def markdown(rows: list[Row]) -> str:
    head = ("| family | attention | call | packed error, native | packed error, enable_packing "
            "| gradient leak, native | gradient leak, enable_packing |")
    lines = [head, "|---|---|---|---|---|---|---|"]
    lines += [f"| {r.family} | {r.impl} | {r.call} | {r.native_error} | {r.packed_error} | {r.native_leak} "
              f"| {r.packed_leak} |" for r in rows]
    return "\n".join(lines)


def run(families=None, log=print) -> list[Row]:
    chosen = [f for f in FAMILIES if families is None or f[1] in families or f[0] in families]
    impls = implementations()
    rows = []
    for family, key, fallback in chosen:
        rows += family_rows(family, key, fallback, impls, log=log)
    return rows


def report(rows: list[Row], machine_line: str, day: datetime.date) -> str:
    return (f"# Hugging Face hybrid families: packed calls ({day})\n\n"
            f"Machine: {machine_line}\n\nCommand: `python -m benchmarks.bench_families`\n\n"
            f"Three documents of {', '.join(map(str, LENGTHS))} tokens flattened by `DataCollatorWithFlattening`; "
            "errors are the relative RMS of the row's logits against each document alone (fp32), leaks the "
            "largest |d logits(document) / d embeddings(another document)|.\n\n" + markdown(rows) + "\n")


def main(argv=None) -> int:
    from benchmarks.__main__ import write_index
    from benchmarks.common import machine, machine_slug

    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_families", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder of the dated report")
    parser.add_argument("--families", nargs="*", default=None,
                        help="families by name or hf_models key (default: every family)")
    args = parser.parse_args(argv)
    rows = run(args.families)
    day, line = datetime.date.today(), machine()
    text = report(rows, line, day)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"{day.isoformat()}-{machine_slug(line)}-families.md"
        path.write_text(text)
        write_index(args.out)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
