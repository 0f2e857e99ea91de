"""Context parallelism equals the single-process run on the same packed row (gloo, spawned ranks).

For world sizes 2 and 4, every op (with per-document initial and final states; the selective scan
also with its default arguments), every mixer and
``HybridLM("MGKPA")`` run on each rank's shard with CP; the parent process runs the whole row
alone and compares, fp64 within 1e-9 (``model32``: the model in fp32 against the fp64 row, relative
RMS within 1e-5, the decay parameters' cancelling sums within 2e-4):
outputs and row-input gradients slice for slice, shared
gradients (initial states, weights, parameters) and final states summed over the ranks (each
rank returns the documents it ends and reads the initial states of those it starts), and the
model's loss shares summed. Negative control: the same shards without the exchange differ
wherever a segment crosses a rank boundary (and equal it where none does). ``rg_lru`` asked for
no final state returns none under CP either.

One spawn per world size runs every case (``worker.launch``), so the suite pays the process
start-up twice; each case's test then reads its ranks' results.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.context_parallel.cases import KERNEL_ATTENTION, OPS, crosses, layout, run_subject
from tests.context_parallel.cases import cases as all_cases
from tests.context_parallel.worker import NAN_AT, launch

WORLDS = (2, 4)
TOL = 1e-9
FP32_REL = 1e-5
# The per-head decay parameters' gradients are one sum over every token of cancelling terms: in
# one process, fp32 rounding alone moves them by up to 3e-5 between chunk sizes 4 and 32 on this
# case (docs/checkpoints.md: up to ~7e-5 against upstream); each mixer alone under CP stays within 1e-6.
DECAY_PARAMS, DECAY_REL = ("A_log", "dt_bias", "D"), 2e-4
# Attention on the (fake) CUDA kernels runs in fp16: the kernels and the whole-row reference round
# fp32 sums of different order to fp16 (one ulp is 2 ** -11 relative), and the keys' gradients sum
# over ranks in fp16.
FP16_REL = 1e-3
ROW_KEYS = ("out", "grad_x", "grad_u", "grad_delta",
            "grad_q", "grad_k", "grad_v", "grad_g", "grad_beta", "grad_dt", "grad_B", "grad_C",
            "grad_z", "grad_gate_x", "grad_gate_a")
CASES = [(world, *c) for world in WORLDS for c in all_cases(world)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """``get(world)``: the directory of that world's per-rank results (spawned once)."""
    done = {}

    def get(world):
        if world not in done:
            path = tmp_path_factory.mktemp(f"cp{world}")
            launch(world, str(path), [c[0] for c in all_cases(world)])
            done[world] = path
        return done[world]
    return get


def _load(directory, case_id, world):
    errors = [f for f in os.listdir(directory) if f.startswith(f"{case_id}.") and f.endswith(".err")]
    if errors:
        pytest.fail(f"rank failed on {case_id}:\n{(directory / errors[0]).read_text()}")
    return [torch.load(directory / f"{case_id}.{r}.pt") for r in range(world)]


def _row_dim(subject, key):
    if subject == "conv" and key in ("out", "grad_x"):
        return 2
    if subject.startswith("selective_scan") and key in ("out", "grad_u", "grad_delta", "grad_B", "grad_C", "grad_z"):
        return 2
    return 0 if subject.startswith("attention") else 1


def _max_err(got, want) -> float:
    return float((got - want).abs().max()) if want.numel() else 0.0


def _rel_rms(got, want) -> float:
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def _compare(subject, per_rank, ref, err=_max_err) -> dict:
    """``{what: error}`` of the CP run against the single-process one."""
    errors = {}
    for key, want in ref.items():
        if want is None or key in ("seconds", "kernels"):
            continue
        if key == "param_grads":
            assert want, "no parameter received a gradient"
            for name, grad in want.items():
                errors[f"param {name}"] = err(sum(r[key][name] for r in per_rank), grad)
        elif key in ROW_KEYS:
            errors[key] = err(torch.cat([r[key] for r in per_rank], dim=_row_dim(subject, key)), want)
        else:
            errors[key] = err(sum(r[key] for r in per_rank), want)
    return errors


@pytest.mark.parametrize("world, case_id, subject, kind, seed",
                         [pytest.param(*c, id=c[1]) for c in CASES])
def test_cp_equals_single_process(ranks, world, case_id, subject, kind, seed):
    per_rank = _load(ranks(world), case_id, world)
    lay = layout(kind, world, seed)
    assert [r["span"] for r in per_rank] == list(zip(lay.shard_bounds(world)[:-1], lay.shard_bounds(world)[1:]))
    fp32, fp16 = subject == "model32", subject in KERNEL_ATTENTION
    ref = run_subject("model" if fp32 else subject, lay, lay.params(), 0, lay.total, seed)     # fp64
    errors = _compare(subject, per_rank, ref, _rel_rms if fp32 or fp16 else _max_err)
    with_states = ("conv", "ssd", "gdn", "kda", "gdp", "rg_lru")
    expected = {"out"} | ({"states", "grad_h0"} if subject in with_states else set()) | \
        ({"loss", "grad_x"} if subject.startswith("model") else set())
    assert expected <= set(errors), f"missing comparisons: {expected - set(errors)}"
    limits = dict.fromkeys(errors, FP16_REL if fp16 else TOL)
    if fp32:
        limits = {k: DECAY_REL if k.split(".")[-1] in DECAY_PARAMS else FP32_REL for k in errors}
    bad = {k: f"{v:.2e} > {limits[k]:.2e}" for k, v in errors.items() if not v <= limits[k]}
    assert not bad, f"CP differs from the single-process run: {bad}"


@pytest.mark.parametrize("world, case_id, subject, kind, seed",
                         [pytest.param(*c, id=c[1]) for c in CASES])
def test_without_the_exchange_cp_differs(ranks, world, case_id, subject, kind, seed):
    """Negative control: the shards run alone (no exchange) are wrong exactly when a segment
    crosses a rank boundary."""
    per_rank = _load(ranks(world), case_id, world)
    lay = layout(kind, world, seed)
    ref = run_subject(subject, lay, lay.params(), 0, lay.total, seed)["out"]
    alone = torch.cat([r["control"] for r in per_rank], dim=_row_dim(subject, "out"))
    if crosses(lay, world):
        assert _max_err(alone, ref) > 1e-3, "the shards alone match the row although a document crosses a boundary"
    else:
        assert _max_err(alone, ref) <= TOL
    if subject in KERNEL_ATTENTION:         # the CP run itself is within FP16_REL of the row (rel. RMS)
        assert _rel_rms(alone, ref) > 10 * FP16_REL or not crosses(lay, world)


@pytest.mark.parametrize("world, case_id, subject, kind, seed",
                         [pytest.param(*c, id=c[1]) for c in CASES if c[2] == "rg_lru"])
def test_cp_returns_no_final_state_unless_asked(ranks, world, case_id, subject, kind, seed):
    """``rg_lru`` under CP with ``output_final_state`` left at its default returns ``(out, None)`` on
    every rank, as the single-process call does."""
    per_rank = _load(ranks(world), case_id, world)
    lay = layout(kind, world, seed)
    assert run_subject(subject, lay, lay.params(), 0, lay.total, seed)["unasked_states"] is None
    given = [r for r, result in enumerate(per_rank) if result["unasked_states"] is not None]
    assert not given, f"ranks {given} returned a final state that was not asked for"


@pytest.mark.parametrize("world, case_id, subject, kind, seed",
                         [pytest.param(*c, id=c[1]) for c in CASES if c[2] in KERNEL_ATTENTION])
def test_cp_attention_takes_the_cuda_policy_kernel(ranks, world, case_id, subject, kind, seed):
    """Under the CUDA policy CP attention runs the single-rank order: the installed kernel (varlen_attn
    with flash-attn absent; flash-attn with varlen_attn absent), for the continuing segment too, as one
    document of T1 queries over T_pre + T1 keys."""
    per_rank = _load(ranks(world), case_id, world)
    facts = _shard_facts(kind, world, seed)
    want = KERNEL_ATTENTION[subject][0].replace("flash_attn", "flash")
    for r, result in enumerate(per_rank):
        kinds = {k for k, _ in result["kernels"]}
        assert kinds <= {want}, f"rank {r} ran {kinds}"
        continuing = [b for _, b in result["kernels"] if len(b) == 2]
        if facts.continues_in[r]:
            (q0, t1), (k0, tk) = continuing[0]
            left = (KERNEL_ATTENTION[subject][1] or (-1,))[0]
            start = facts.first_seg_start[r] if left < 0 else max(facts.first_seg_start[r], facts.bounds[r] - left)
            assert len(continuing) == 1 and q0 == k0 == 0 and 0 < t1 <= facts.bounds[r + 1] - facts.bounds[r]
            assert tk - t1 == facts.bounds[r] - start, "the keys are the earlier ranks' ones, then the rank's own"
        else:
            assert continuing == [], f"rank {r} starts a document yet ran a continuing call"
    assert any(result["kernels"] for result in per_rank)


def _steps(subject, key):
    return 2 if subject == "gdp" and key in ("grad_k", "grad_v", "grad_beta") else 1


@pytest.mark.parametrize("subject", [pytest.param(s, id=s)
                                     for s in OPS])
def test_a_nan_stays_in_its_document(ranks, subject):
    """NaN isolation under CP: a NaN in the document spanning the 4 ranks (token 20, rank 1)
    leaves every other document's outputs, gradients and final states finite and bitwise as
    without it, on every rank; it does reach its own document's later tokens (negative control)."""
    per_rank = _load(ranks(4), f"{subject}-spanning-p4", 4)
    doc_start, doc_end = 2, 39
    for key in [k for k in ROW_KEYS if k in per_rank[0]]:
        dim, steps = _row_dim(subject, key), _steps(subject, key)
        clean = torch.cat([r[key] for r in per_rank], dim=dim).movedim(dim, 0)
        dirty = torch.cat([r["poisoned"][key] for r in per_rank], dim=dim).movedim(dim, 0)
        token = torch.arange(clean.shape[0]) // steps
        other = (token < doc_start) | (token >= doc_end)
        assert torch.isfinite(dirty[other]).all(), f"{key}: a NaN left its document"
        assert torch.equal(dirty[other], clean[other]), f"{key}: other documents changed"
    if per_rank[0]["states"] is not None:
        clean, dirty = sum(r["states"] for r in per_rank), sum(r["poisoned"]["states"] for r in per_rank)
        others = [i for i in range(clean.shape[0]) if i != 2]
        assert torch.equal(dirty[others], clean[others])
    out = torch.cat([r["poisoned"]["out"] for r in per_rank], dim=_row_dim(subject, "out")).movedim(
        _row_dim(subject, "out"), 0)
    assert torch.isnan(out[NAN_AT:doc_end]).any(), "negative control: the NaN did not reach its own document"


def _shard_facts(kind, world, seed):
    from ssm_pack import shard_for_context_parallel
    lay = layout(kind, world, seed)
    return shard_for_context_parallel(lay.params(), 0, world, bounds=lay.shard_bounds(world))[2].cp_layout


@pytest.mark.parametrize("subject", [pytest.param(s, id=s) for s in ("gdn", "ssd", "conv")])
def test_bytes_follow_the_plan(ranks, subject):
    """What each rank sends is what the layout needs: one document across all 4 ranks costs the
    doubling rounds (rank 0: S three times; rank 1: S and M, then S; rank 2: S; the conv needs
    none: each middle rank holds a full window of its own), a layout of short documents one
    state per crossed boundary; the backward sends back exactly what came in."""
    sizes = {"gdn": (4 * 4 * 3, 4 * 4 * 4), "ssd": (4 * 3 * 4, 4), "conv": (6 * 3, 3 * 3)}[subject]
    s, m = (8 * n for n in sizes)
    spanning = _load(ranks(4), f"{subject}-spanning-p4", 4)
    want = [s, s, s, 0] if subject == "conv" else [3 * s, 2 * s + m, s, 0]
    assert [r["traffic"][0] for r in spanning] == want
    facts = _shard_facts("boundary", 4, 44)
    boundary = _load(ranks(4), f"{subject}-boundary-p4", 4)
    assert [r["traffic"][0] for r in boundary] == [s * facts.continues_out[j] for j in range(4)]
    assert [r["traffic"][1] for r in boundary] == [s * facts.continues_in[j] for j in range(4)]


def test_every_op_and_mixer_is_covered():
    subjects = {c[2] for c in CASES}
    assert set(OPS) | {"M", "G", "K", "P", "A", "C", "S", "R", "L", "model", "model32"} <= subjects
