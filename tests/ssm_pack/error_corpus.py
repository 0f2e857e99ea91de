"""A fixed corpus of bad inputs to the public entry points, plus the property corpus, classified.

``python -m tests.ssm_pack.error_corpus [--out DIR] [--examples N]`` runs every case of
:data:`CASES` and ``N`` drawn inputs of each property of :mod:`tests.ssm_pack.contracts`, and
writes the counts of each verdict (clear / ok / obscure / silent / hang) to
``DIR/error-corpus-<date>.md`` (default ``bench_out/``), listing every case that is not clear or
ok. The contract page (docs/errors.md) names each fixed case by id; the tests check that every
named case exists and is refused clearly.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
from collections import Counter
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings

import ssm_pack as sp
from mixers import GatedDeltaNetMixer, HybridLM, Mamba2Mixer
from mixers.checkpoints import from_state_dict, to_state_dict
from mixers.integrations.transformers import packing_from_model_kwargs
from mixers.layers import Mamba2Config
from mixers.model import CarriedStates
from tests.context_parallel.test_shard_properties import shard_case, shard_verdict
from tests.mixers.checkpoints.test_convert_properties import convert_verdict, tampering
from tests.ssm_pack.contracts import Case, from_lengths_verdict, lengths_case, stream_case, stream_verdict

V = 16


def _model():
    torch.manual_seed(0)
    return HybridLM(V, 16, "GA", mixer_overrides={"G": {"head_dim": 8, "chunk_size": 4}, "A": {"head_dim": 8}})


def _ids(t=6):
    return torch.arange(t).remainder(V).reshape(1, t)


def _drain_then_next(documents, **kwargs):
    stream = sp.pack_stream(documents, 4, **kwargs)
    try:
        list(stream)
    except (ValueError, TypeError):
        pass
    return next(stream)


def _state(edit):
    stream = sp.pack_stream([[1, 2], [3, 4, 5], [6]], 4, lookahead=1)
    next(stream)
    state = stream.state_dict()
    edit(state)
    return sp.pack_stream([[1, 2], [3, 4, 5], [6]], 4, lookahead=1).load_state_dict(state)


def _carry(order):
    torch.manual_seed(0)
    model = HybridLM(V, 16, "G", mixer_overrides={"G": {"head_dim": 8, "chunk_size": 4}})
    packs = list(sp.pack_stream([torch.arange(20).remainder(V)], 6))
    carried = CarriedStates(model, max_documents=2, max_document_tokens=24)
    with torch.no_grad():
        for i in order:
            carried(packs[i])


def _mamba_integer_weight():
    """A Mamba2 state dict with an integer weight: refused naming the key and its dtype."""
    config = Mamba2Config(32, num_heads=3, head_dim=16, state_size=8, num_groups=3)
    sd = to_state_dict(Mamba2Mixer(config=config, backend="reference"), "mamba_ssm")
    sd["dt_bias"] = sd["dt_bias"].long()
    from_state_dict(sd, "mamba_ssm", config)


def _mamba_missing_key():
    """A Mamba2 state dict missing a key: refused naming the key, and the D hint kept out of it."""
    config = Mamba2Config(32, num_heads=3, head_dim=16, state_size=8, num_groups=3)
    sd = to_state_dict(Mamba2Mixer(config=config, backend="reference"), "mamba_ssm")
    sd.pop("out_proj.weight")
    try:
        from_state_dict(sd, "mamba_ssm", config)
    except ValueError as err:
        if "D_has_hdim" in str(err):
            raise RuntimeError(f"the D hint blames D for another problem: {err}") from None
        raise


CU = torch.tensor([0, 2, 6], dtype=torch.int32)
P = sp.PackedSeqParams

CASES = [
    Case("params-lengths-negative", "PackedSeqParams", ("lengths",), lambda: P.from_lengths([3, -1])),
    Case("params-lengths-past-int32", "PackedSeqParams", ("lengths",), lambda: P.from_lengths([2**31 - 1, 5])),
    Case("params-cu-not-at-zero", "PackedSeqParams", ("cu_seqlens",), lambda: P.from_cu_seqlens([3, 5])),
    Case("params-cu-decreasing", "PackedSeqParams", ("cu_seqlens",), lambda: P.from_cu_seqlens([0, 5, 3])),
    Case("params-total-below-boundary", "PackedSeqParams", ("total_tokens",),
         lambda: P.from_lengths([4], total_tokens=2)),
    Case("hf-positions-disagree", "PackedSeqParams.from_hf_batch", ("position_ids",),
         lambda: P.from_hf_batch({"input_ids": _ids(), "cu_seq_lens_q": CU,
                                  "position_ids": torch.arange(6)[None]})),
    Case("hf-seq-idx-disagrees", "PackedSeqParams.from_hf_batch", ("seq_idx",),
         lambda: P.from_hf_batch({"input_ids": _ids(), "cu_seq_lens_q": CU,
                                  "seq_idx": torch.tensor([[0, 0, 0, 1, 1, 1]])})),
    Case("hf-fields-of-other-lengths", "PackedSeqParams.from_hf_batch", ("position_ids",),
         lambda: P.from_hf_batch({"input_ids": _ids(), "position_ids": torch.tensor([[0, 1, 0, 1]])})),
    Case("packing-cu-seq-lens-k-disagrees", "enable_packing", ("cu_seq_lens_k",),
         lambda: packing_from_model_kwargs({"input_ids": _ids(), "cu_seq_lens_q": CU,
                                            "cu_seq_lens_k": torch.tensor([0, 6], dtype=torch.int32)})),
    Case("packing-positions-of-other-length", "enable_packing", ("position_ids",),
         lambda: packing_from_model_kwargs({"input_ids": _ids(), "position_ids": torch.arange(4)[None]})),
    Case("model-params-of-other-tokens", "HybridLM", ("total_tokens",),
         lambda: _model()(_ids(), packed_seq_params=P.from_lengths([2, 2]))),
    Case("model-positions-short", "HybridLM", ("position_ids",),
         lambda: _model()(_ids(), position_ids=torch.tensor([[0, 1, 0, 1]]))),
    Case("model-labels-out-of-range", "HybridLM", ("labels",), lambda: _model()(_ids(), labels=_ids() + V)),
    Case("model-labels-float", "HybridLM", ("labels",), lambda: _model()(_ids(), labels=torch.zeros(1, 6))),
    Case("model-empty-input", "HybridLM", ("input_ids",), lambda: _model()(torch.zeros(1, 0, dtype=torch.long))),
    Case("model-token-outside-vocab", "HybridLM", ("input_ids",), lambda: _model()(_ids() + V)),
    Case("model-vocab-negative", "HybridLM", ("vocab_size",), lambda: HybridLM(vocab_size=-1)),
    Case("model-unknown-pattern", "HybridLM", ("pattern",), lambda: HybridLM(pattern="MX")),
    Case("model-params-and-collator", "HybridLM", ("packed_seq_params",),
         lambda: _model()(_ids(), packed_seq_params=P.from_lengths([6]), position_ids=torch.arange(6)[None])),
    Case("model-cache-slot-out-of-range", "HybridLM", ("slot",),
         lambda: (m := _model())(_ids(), packed_seq_params=P.from_lengths([6]),
                                 cache=m.allocate_inference_cache(2, 8), cache_slots=[5])),
    Case("layer-params-of-other-tokens", "mixers layers", ("total_tokens",),
         lambda: GatedDeltaNetMixer(32, head_dim=8)(torch.randn(1, 6, 32), packed_seq_params=P.from_lengths([2, 2]))),
    Case("generate-generator-not-a-generator", "generate", ("generator",),
         lambda: _model().generate([[1, 2]], max_new_tokens=2, temperature=1.0, generator=5)),
    Case("generate-temperature-nan", "generate", ("temperature",),
         lambda: _model().generate([[1, 2]], max_new_tokens=2, temperature=float("nan"))),
    Case("stream-max-tokens-zero", "pack_stream", ("max_tokens",), lambda: sp.pack_stream([[1]], 0)),
    Case("stream-after-refused-long", "pack_stream", ("stopped at a refused document",),
         lambda: _drain_then_next([[1, 2], [1] * 9, [3]], split_long="refuse")),
    Case("stream-after-float-token", "pack_stream", ("stopped at a refused document",),
         lambda: _drain_then_next([[1, 2], [1.5, 2], [3]], lookahead=1)),
    Case("stream-endless-empty", "pack_stream", ("MAX_EMPTY_RUN",),
         lambda: next(sp.pack_stream(itertools.repeat([]), 4))),
    Case("stream-state-missing-key", "PackStream.load_state_dict", ("state['pass']",),
         lambda: _state(lambda s: s["pass"].pop("num_workers"))),
    Case("stream-state-config-not-dict", "PackStream.load_state_dict", ("state['config']",),
         lambda: _state(lambda s: s.__setitem__("config", "x"))),
    Case("carry-same-pack-twice", "CarriedStates", ("the pack continues",), lambda: _carry([0, 1, 1])),
    Case("carry-skipped-pack", "CarriedStates", ("the pack continues",), lambda: _carry([0, 2])),
    Case("carry-max-documents-zero", "CarriedStates", ("max_documents",),
         lambda: CarriedStates(_model(), max_documents=0, max_document_tokens=4)),
    Case("convert-missing-key", "mixers.checkpoints", ("out_proj.weight",), _mamba_missing_key),
    Case("convert-integer-weight", "mixers.checkpoints", ("'dt_bias' has dtype torch.int64",), _mamba_integer_weight),
]


def property_verdicts(examples: int) -> Counter:
    """Verdicts of ``examples`` drawn inputs of each property (hypothesis, no example database)."""
    found: Counter = Counter()
    config = settings(max_examples=examples, database=None, deadline=None,
                      suppress_health_check=list(HealthCheck))
    for name, strategy, verdict in (("from_lengths", lengths_case(), from_lengths_verdict),
                                    ("pack_stream", stream_case(), stream_verdict),
                                    ("shard_for_context_parallel", shard_case(), shard_verdict),
                                    ("from_state_dict", tampering(), convert_verdict)):
        config(given(strategy)(_recorder(found, name, verdict)))()
    return found


def _recorder(found: Counter, name: str, verdict):
    def record(case):
        found[(name, verdict(case))] += 1
    return record


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_out", help="folder of the dated report (default bench_out/)")
    parser.add_argument("--examples", type=int, default=200, help="drawn inputs per property (default 200)")
    args = parser.parse_args(argv)
    fixed = {case.id: case.verdict() for case in CASES}
    drawn = property_verdicts(args.examples)
    counts = Counter(fixed.values())
    for (_, verdict), n in drawn.items():
        counts[verdict] += n
    lines = [f"# error corpus, {datetime.date.today().isoformat()}", "",
             f"{len(CASES)} fixed cases, {sum(drawn.values())} drawn inputs; torch {torch.__version__}", "",
             "| verdict | fixed | drawn | total |", "|---|---|---|---|"]
    for verdict in ("clear", "ok", "obscure", "silent", "hang"):
        fixed_n = sum(v == verdict for v in fixed.values())
        drawn_n = sum(n for (_, v), n in drawn.items() if v == verdict)
        lines.append(f"| {verdict} | {fixed_n} | {drawn_n} | {fixed_n + drawn_n} |")
    bad = [f"- {cid}: {v}" for cid, v in fixed.items() if v != "clear"]
    bad += [f"- {name} (drawn): {n} {v}" for (name, v), n in sorted(drawn.items()) if v not in ("clear", "ok")]
    lines += ["", "Not clear:" if bad else "Every case is clear or ok.", *bad]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"error-corpus-{datetime.date.today().isoformat()}.md"
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"written to {path}")
    return path


if __name__ == "__main__":
    main()
