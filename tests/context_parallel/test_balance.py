"""Cost-balanced contiguous shards (``ssm_pack.parallel.balance``): the work per rank, the cost
model against the attention mask it stands for, and exactness of CP under the uneven bounds.

    P = ranks, T = tokens of the physical row

Arithmetic tests run in one process. The exactness test spawns one gloo group per world size
(2 and 4 ranks) running ``HybridLM("MGKPA")`` in fp64 on balanced bounds, against one process.
"""

from __future__ import annotations

import itertools
import os
import random
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

from ssm_pack import PackedSeqParams, balanced_bounds, shard_for_context_parallel
from ssm_pack.parallel.balance import mixer_weights, token_costs, work_imbalance


def _even(total, world):
    return [r * total // world for r in range(world + 1)]


def _one_document_even_imbalance(total, world) -> Fraction:
    """Exact max / mean of attention-only work (query i reads i + 1 keys) for the even split."""
    def work(a, b):          # sum of (p + 1) for p in [a, b)
        return (b * (b + 1) - a * (a + 1)) // 2
    bounds = _even(total, world)
    per_rank = [work(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    return Fraction(max(per_rank) * world, sum(per_rank))


@pytest.mark.parametrize("world", [pytest.param(w, id=f"p{w}") for w in (2, 4, 8)])
def test_one_long_document_equal_tokens_overload_the_last_rank_balanced_do_not(world):
    total = 1 << 16
    costs = token_costs([0, total], linear=0.0, attention=1.0)
    expected = _one_document_even_imbalance(total, world)
    assert abs(Fraction(2 * world - 1, world) - expected) < Fraction(1, 1000)     # (2P - 1) / P
    assert work_imbalance(costs, _even(total, world)) == pytest.approx(float(expected), rel=1e-12)
    bounds = balanced_bounds([0, total], world, linear=0.0, attention=1.0)
    assert len(bounds) == world + 1 and bounds[0] == 0 and bounds[-1] == total
    assert work_imbalance(costs, bounds) <= 1.001
    assert bounds != _even(total, world)


def _row(kind):
    """``(params, T)`` of packed rows: uneven documents, padded cu_seqlens, a padding tail, empties."""
    rng = random.Random(kind)
    if kind == "uneven":
        lengths = [rng.randint(1, 3000) for _ in range(12)] + [9000]
        return PackedSeqParams.from_lengths(lengths), sum(lengths)
    if kind == "padded":
        lengths = [rng.randint(1, 2000) for _ in range(10)] + [6000, 3]
        params = PackedSeqParams.from_lengths(lengths, pad_to_multiple_of=64)
        return params, int(params.cu_seqlens_q_padded[-1])
    if kind == "tail":
        return PackedSeqParams.from_lengths([7000, 500, 2500], total_tokens=12000), 12000
    if kind == "empties":
        return PackedSeqParams.from_lengths([0, 4000, 0, 0, 1200, 6000, 0], total_tokens=11500), 11500
    raise ValueError(kind)


ROWS = ("uneven", "padded", "tail", "empties")
MIXES = {"attention": dict(linear=0.0, attention=1.0), "window": dict(linear=0.0, attention=1.0, window=1024),
         "hybrid": dict(zip(("linear", "attention"), mixer_weights("GGGGA", 256)))}


@pytest.mark.parametrize("world", [pytest.param(w, id=f"p{w}") for w in (2, 4, 8)])
@pytest.mark.parametrize("mix", [pytest.param(m, id=m) for m in MIXES])
@pytest.mark.parametrize("kind", [pytest.param(k, id=k) for k in ROWS])
def test_balanced_bounds_even_out_packed_rows(kind, mix, world):
    params, total = _row(kind)
    costs = token_costs(params, linear=MIXES[mix]["linear"], attention=MIXES[mix]["attention"],
                        window=MIXES[mix].get("window"))
    assert costs.shape == (total,)
    bounds = balanced_bounds(params, world, **MIXES[mix])
    assert bounds[0] == 0 and bounds[-1] == total and all(b > a for a, b in zip(bounds[:-1], bounds[1:]))
    assert work_imbalance(costs, bounds) <= 1.05
    assert work_imbalance(costs, bounds) <= work_imbalance(costs, _even(total, world)) + 1e-12
    for r in range(world):       # the bounds are what shard_for_context_parallel takes
        shard_for_context_parallel(params, r, world, bounds=bounds)


def test_equal_tokens_are_the_before():
    """The rows above with their long document at the end: equal-token shards are far from even."""
    params, total = _row("uneven")
    costs = token_costs(params, linear=0.0, attention=1.0)
    assert work_imbalance(costs, _even(total, 8)) > 1.5
    assert work_imbalance(costs, balanced_bounds(params, 8, linear=0.0, attention=1.0)) <= 1.05


def _best_max(costs, world) -> float:
    prefix = [0.0] + torch.cumsum(costs, 0).tolist()
    best = float("inf")
    for cuts in itertools.combinations(range(1, costs.numel()), world - 1):
        b = (0, *cuts, costs.numel())
        best = min(best, max(prefix[y] - prefix[x] for x, y in zip(b[:-1], b[1:])))
    return best


@pytest.mark.parametrize("seed", [pytest.param(s, id=f"seed{s}") for s in range(48)])
def test_the_largest_shard_is_the_least_contiguous_cuts_allow(seed):
    """Against every contiguous split of small rows (the nearest-quantile cuts alone miss the least
    maximum on seeds 28, 40, 41, 44 and 45: the improvement step is needed)."""
    rng = random.Random(seed)
    total, world = rng.randint(4, 13), rng.randint(2, 4)
    cuts = sorted(rng.randint(0, total) for _ in range(rng.randint(0, 4)))
    cu = [0, *cuts]
    linear = rng.choice([0.0, 0.5, 3.0])
    window = rng.choice([None, 3])
    costs = token_costs(cu, total, linear=linear, attention=1.0, window=window)
    bounds = balanced_bounds(cu, world, total_tokens=total, linear=linear, attention=1.0, window=window)
    prefix = [0.0] + torch.cumsum(costs, 0).tolist()
    got = max(prefix[y] - prefix[x] for x, y in zip(bounds[:-1], bounds[1:]))
    assert all(b > a for a, b in zip(bounds[:-1], bounds[1:]))
    assert got == pytest.approx(_best_max(costs, world), rel=1e-9)


@pytest.mark.parametrize("align", [pytest.param(a, id=f"align{a}") for a in (8, 64, 100)])
def test_aligned_bounds(align):
    params, total = _row("tail")
    bounds = balanced_bounds(params, 8, linear=0.0, attention=1.0, align=align)
    assert all(b % align == 0 for b in bounds[:-1]) and bounds[-1] == total
    costs = token_costs(params, linear=0.0, attention=1.0)
    pieces = torch.stack([c.sum() for c in costs.split(align)])
    mean = float(costs.sum()) / 8       # within one aligned piece of even (quantile cuts snapped to the grid)
    assert work_imbalance(costs, bounds) <= 1 + float(pieces.max()) / mean
    assert work_imbalance(costs, bounds) < work_imbalance(costs, _even(total, 8))


def test_defaults_balance_tokens():
    bounds = balanced_bounds([0, 7, 7, 20], 4, total_tokens=23)
    assert sorted(b - a for a, b in zip(bounds[:-1], bounds[1:])) == [5, 6, 6, 6]


def test_a_row_without_attention_work_splits_evenly():
    """Attention only and no real token (a padding row): no work anywhere, so the even split."""
    assert balanced_bounds([0, 0], 4, total_tokens=12, linear=0.0, attention=1.0) == [0, 3, 6, 9, 12]
    assert balanced_bounds([0, 3], 4, total_tokens=12, linear=0.0, attention=1.0) != [0, 3, 6, 9, 12]


# ------------------------------------------------------------------ the cost model, counted
def _counted_pairs(params, total, window) -> torch.Tensor:
    """``[T]`` query-key pairs per query, from the attention spec's own mask (``mixers.ops.attention.naive``)
    applied to each document's real tokens; padding and the tail count none."""
    from mixers.ops.attention.naive import _visible
    physical = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
    real = params.cu_seqlens_q
    pairs = torch.zeros(total, dtype=torch.int64)
    for i in range(real.numel() - 1):
        n, s = int(real[i + 1] - real[i]), int(physical[i])
        if n:
            mask = _visible(n, True, None if window is None else (window - 1, 0), "cpu")
            pairs[s:s + n] = mask.sum(1)
    return pairs


COUNTED = {"plain": ([5, 1, 0, 17, 3], 26, 1, None), "tail": ([9, 2, 11], 30, 1, None),
           "padded": ([5, 0, 13, 2, 7], 44, 4, None), "window": ([21, 4, 0, 15], 44, 1, 6),
           "window_padded": ([21, 3, 9], 48, 8, 4)}


@pytest.mark.parametrize("case", [pytest.param(c, id=c) for c in COUNTED])
def test_token_costs_count_the_attention_mask_exactly(case):
    lengths, total, pad_to, window = COUNTED[case]
    params = PackedSeqParams.from_lengths(lengths, pad_to_multiple_of=pad_to, total_tokens=total)
    pairs = _counted_pairs(params, total, window)
    costs = token_costs(params, linear=0.0, attention=1.0, window=window)
    assert torch.equal(costs, pairs.to(torch.float64))
    linear = token_costs(params, linear=2.5, attention=0.0)
    assert torch.equal(linear, torch.full((total,), 2.5, dtype=torch.float64))
    both = token_costs(params, linear=2.5, attention=3.0, window=window)
    assert torch.equal(both, 2.5 + 3.0 * pairs.to(torch.float64))
    for world in (2, 3, 4):          # per shard: the counted pairs of its queries, exactly
        bounds = balanced_bounds(params, world, linear=0.0, attention=1.0, window=window)
        for a, b in zip(bounds[:-1], bounds[1:]):
            assert float(costs[a:b].sum()) == int(pairs[a:b].sum())


def test_token_costs_match_the_segment_mask_of_position_ids():
    """A second count, from ``dense_segment_keep`` (the segment model of position ids), on a row
    of documents only (the mask counts no padding)."""
    from ssm_pack import dense_segment_keep
    lengths = [4, 1, 12, 7]
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    keep = dense_segment_keep(position_ids)[0, 0]
    costs = token_costs(PackedSeqParams.from_lengths(lengths), linear=0.0, attention=1.0)
    assert torch.equal(costs, keep.sum(1).to(torch.float64))
    assert not torch.equal(costs, token_costs([0, sum(lengths)], linear=0.0, attention=1.0))   # control


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize("kwargs, words", [
    pytest.param(dict(cp_size=0), ("cp_size", "0"), id="cp_size"),
    pytest.param(dict(linear=-1.0), ("linear", "-1.0"), id="negative_linear"),
    pytest.param(dict(attention=-2.0), ("attention", "-2.0"), id="negative_attention"),
    pytest.param(dict(linear=0.0, attention=0.0), ("linear=0", "attention=0"), id="no_work"),
    pytest.param(dict(align=0), ("align", "0"), id="align"),
    pytest.param(dict(align=8, cp_size=4), ("align=8", "cp_size=4"), id="align_too_coarse"),
    pytest.param(dict(window=0), ("window", "0"), id="window"),
    pytest.param(dict(cp_size=30), ("cp_size=30", "20 tokens"), id="too_many_ranks"),
    pytest.param(dict(total_tokens=10), ("total_tokens=10", "17"), id="short_total"),
    pytest.param(dict(linear=float("nan")), ("linear", "nan"), id="nan_weight"),
])
def test_bad_input_is_refused_by_name(kwargs, words):
    args = dict(cp_size=2, total_tokens=20) | kwargs
    with pytest.raises(ValueError) as err:
        balanced_bounds([0, 5, 17], args.pop("cp_size"), **args)
    for word in words:
        assert word in str(err.value)


def test_a_shard_is_refused_and_so_are_bad_kinds():
    _, _, local = shard_for_context_parallel(PackedSeqParams.from_lengths([6, 6]), 0, 2)
    with pytest.raises(ValueError, match="cp_layout"):
        balanced_bounds(local, 2)
    with pytest.raises(TypeError, match="attention"):
        token_costs([0, 4], linear=1.0, attention="1")
    with pytest.raises(ValueError, match="bounds"):
        work_imbalance(torch.ones(4), [0, 3, 2, 4])


@pytest.mark.parametrize("bounds", [
    pytest.param([0, 3, 2, 4], id="middle-pair-decreases"),
    pytest.param([0, 1, 5, 4], id="last-pair-decreases"),
])
def test_work_imbalance_refuses_decreasing_bounds_anywhere(bounds):
    with pytest.raises(ValueError, match=r"bounds must be non-decreasing offsets from 0 to len\(costs\)=4"):
        work_imbalance(torch.ones(4), bounds)


def test_mixer_weights_are_the_documented_per_token_costs():
    """``12 * hidden**2`` per block, ``2 * hidden`` per key read per attention block (the docstring)."""
    assert mixer_weights("MGA", 64) == (12.0 * 3 * 64 ** 2, 2.0 * 1 * 64)
    assert mixer_weights("AMA", 10, attention_letters="A") == (12.0 * 3 * 100, 2.0 * 2 * 10)
    assert mixer_weights("MG", 32) == (12.0 * 2 * 32 ** 2, 0.0)


def test_work_imbalance_takes_an_empty_shard():
    """Non-decreasing bounds: a rank with no token does no work and still counts in the mean."""
    costs = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    assert work_imbalance(costs, [0, 2, 2, 4]) == pytest.approx(7.0 / (10.0 / 3.0), rel=1e-12)
    assert work_imbalance(costs, [0, 0, 4]) == pytest.approx(2.0, rel=1e-12)


# ------------------------------------------------------------------ exact under balanced bounds (gloo)
EXACT = {"tail": ((3, 40, 0, 6), 52, 1), "padded": ((5, 0, 29, 2, 7), 54, 4)}   # lengths, T, pad_to
WEIGHTS = dict(linear=0.5, attention=1.0)
SEED = 5


def _layout(name, world):
    from tests.context_parallel.cases import Layout
    lengths, total, pad_to = EXACT[name]
    lay = Layout(lengths, total, None, pad_to)
    bounds = balanced_bounds(lay.params(), world, total_tokens=total, **WEIGHTS)
    return Layout(lengths, total, tuple(bounds), pad_to)


def _rank_main(rank, world, port, out_dir):
    from tests.context_parallel.cases import run_subject
    from tests.context_parallel.worker import gloo_rank
    with gloo_rank(rank, world, port, os.path.join(out_dir, f"{rank}.err")):
        for name in EXACT:
            lay = _layout(name, world)           # every rank computes the same bounds from the same row
            start, end, local = shard_for_context_parallel(lay.params(), rank, world, total_tokens=lay.total,
                                                           bounds=lay.bounds, cp_group=dist.group.WORLD)
            result = run_subject("model", lay, local, start, end, SEED)
            alone = local.replace(cp_layout=None, cp_group=None)            # negative control: no exchange
            result["control"] = run_subject("model", lay, alone, start, end, SEED)["out"]
            result["span"] = (start, end)
            torch.save(result, os.path.join(out_dir, f"{name}.{rank}.pt"))


@pytest.fixture(scope="module")
def balanced_runs(tmp_path_factory):
    from tests.context_parallel.worker import runs_per_world
    return runs_per_world(tmp_path_factory, _rank_main, "balanced")


@pytest.mark.parametrize("world", [pytest.param(w, id=f"p{w}") for w in (2, 4)])
@pytest.mark.parametrize("name", [pytest.param(n, id=n) for n in EXACT])
def test_hybrid_model_is_exact_under_balanced_bounds(balanced_runs, name, world):
    """``HybridLM("MGKPA")`` in fp64 on the uneven balanced shards equals one process: logits and
    embedding gradients slice for slice, loss shares and parameter gradients summed; the same
    shards without the exchange differ (negative control)."""
    from tests.context_parallel.cases import run_subject
    path = balanced_runs(world)
    per_rank = [torch.load(path / f"{name}.{r}.pt") for r in range(world)]
    lay = _layout(name, world)
    assert lay.bounds != tuple(_even(lay.total, world)), "the balanced bounds should be uneven here"
    assert [r["span"] for r in per_rank] == list(zip(lay.bounds[:-1], lay.bounds[1:]))
    ref = run_subject("model", lay, lay.params(), 0, lay.total, SEED)
    errors = {key: float((torch.cat([r[key] for r in per_rank], dim=1) - ref[key]).abs().max())
              for key in ("out", "grad_x")}
    errors["loss"] = float((sum(r["loss"] for r in per_rank) - ref["loss"]).abs())
    assert ref["param_grads"]
    for pname, grad in ref["param_grads"].items():
        errors[pname] = float((sum(r["param_grads"][pname] for r in per_rank) - grad).abs().max())
    bad = {k: v for k, v in errors.items() if not v <= 1e-9}
    assert not bad, f"CP on balanced bounds differs from one process: {bad}"
    control = torch.cat([r["control"] for r in per_rank], dim=1)
    assert float((control - ref["out"]).abs().max()) > 1e-3, "the shards alone match the row"
