"""Property tests of ``shard_for_context_parallel`` (drawn lengths, padding multiples, row lengths,
world sizes, ranks and shard offsets): a clear refusal naming the argument, or shards that tile
the row (putting the ranks' slices back together gives the row) where each rank holds exactly
the part of each document (real and padded tokens) the per-document oracle says, and the
global positions continue across ranks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ssm_pack import PackedSeqParams, VarlenBatch, shard_for_context_parallel
from tests.context_parallel.test_shard import FakeGroup
from tests.ssm_pack.contracts import outcome

NAMES = ("cp_size", "cp_rank", "total_tokens", "bounds")


@st.composite
def shard_case(draw):
    lengths = draw(st.lists(st.integers(0, 9), min_size=1, max_size=5))
    multiple = draw(st.sampled_from([1, 2, 4]))
    tail = draw(st.one_of(st.none(), st.integers(-3, 5)))      # None: the params' own total
    cp_size = draw(st.integers(-1, 5))
    cp_rank = draw(st.integers(-1, max(cp_size, 0)))
    bounds = None
    if draw(st.booleans()):                                       # drawn offsets, valid or not
        cuts = draw(st.lists(st.integers(-1, 40), min_size=max(cp_size - 1, 0), max_size=max(cp_size - 1, 0)))
        bounds = [0, *sorted(cuts), "end"] if draw(st.booleans()) else [0, *cuts, "end"]
    return lengths, multiple, tail, cp_size, cp_rank, bounds


def _slots(lengths, multiple):
    """Per document: (physical start, physical end, real end), computed without the library."""
    out, at = [], 0
    for n in lengths:
        slot = -(-n // multiple) * multiple
        out.append((at, at + slot, at + n))
        at += slot
    return out


def _overlap(a, b, start, end) -> int:
    return max(0, min(b, end) - max(a, start))


def _due_bounds(case) -> tuple | None:
    """The shard offsets the oracle expects, or None where a refusal is due."""
    lengths, multiple, tail, cp_size, cp_rank, bounds = case
    last = _slots(lengths, multiple)[-1][1]
    total = last if tail is None else last + tail
    if cp_size < 1 or not 0 <= cp_rank < cp_size or total < last:
        return None
    if bounds is None:
        return tuple(r * total // cp_size for r in range(cp_size + 1)) if total >= cp_size else None
    bounds = [total if b == "end" else b for b in bounds]
    ok = len(bounds) == cp_size + 1 and all(a < b for a, b in zip(bounds, bounds[1:])) and bounds[-1] == total
    return tuple(bounds) if ok else None


def _holds(case, want, rank: int, start: int, end: int, local) -> bool:
    lengths, multiple = case[0], case[1]
    slots = _slots(lengths, multiple)
    physical = [_overlap(a, b, start, end) for a, b, _ in slots]
    real = [_overlap(a, r, start, end) for a, _, r in slots]
    got_real = local.cu_seqlens_q.diff().tolist()
    got_physical = local.cu_seqlens.diff().tolist()
    return (start, end) == (want[rank], want[rank + 1]) and local.total_tokens == end - start \
        and got_real == real and got_physical == physical and local.cp_layout.bounds == want


def shard_verdict(case) -> str:
    lengths, multiple, tail, cp_size, cp_rank, bounds = case
    params = PackedSeqParams.from_lengths(lengths, pad_to_multiple_of=multiple)
    last = int(params.cu_seqlens[-1])
    total = None if tail is None else last + tail
    drawn = None if bounds is None else [last if total is None and b == "end" else total if b == "end" else b
                                         for b in bounds]
    before = [t.clone() for t in (params.cu_seqlens_q, params.cu_seqlens)]
    want = _due_bounds(case)

    def oracle(result) -> bool:
        return want is not None and _holds(case, want, cp_rank, *result)

    verdict = outcome(lambda: shard_for_context_parallel(params, cp_rank, cp_size, total_tokens=total,
                                                         bounds=drawn), NAMES, oracle)
    if verdict == "clear" and want is not None:
        return "obscure"                                  # refused a valid layout
    if not all(torch.equal(a, b) for a, b in zip(before, (params.cu_seqlens_q, params.cu_seqlens))):
        return "silent"                                   # the caller's params were written to
    if verdict == "ok" and not _tiles_and_positions_continue(params, cp_size, total, drawn):
        return "silent"
    return verdict


def _tiles_and_positions_continue(params, cp_size, total, bounds) -> bool:
    """Every rank's shard, put back together, is the row: tokens and global positions."""
    row_len = params.total_tokens if total is None else total
    row = torch.arange(row_len)
    pieces, positions = [], []
    for rank in range(cp_size):
        start, end, local = shard_for_context_parallel(params, rank, cp_size, total_tokens=total, bounds=bounds,
                                                       cp_group=FakeGroup(cp_size))
        pieces.append(row[start:end])
        positions.append(VarlenBatch.build(local, end - start).position_ids[0])
    whole = params.replace(total_tokens=row_len)
    return torch.equal(torch.cat(pieces), row) and torch.equal(
        torch.cat(positions), VarlenBatch.build(whole, row_len).position_ids[0])


@given(shard_case())
def test_a_shard_is_refused_clearly_or_holds_the_oracles_part(case):
    assert shard_verdict(case) in ("clear", "ok")


@pytest.mark.parametrize("case,want", [
    pytest.param(([5, 0, 9, 3], 1, 3, 3, 1, None), "ok", id="even-with-tail"),
    pytest.param(([3, 6], 4, 2, 2, 1, [0, 6, "end"]), "ok", id="padded-uneven"),
    pytest.param(([3, 6], 1, None, 2, 2, None), "clear", id="rank-out-of-range"),
    pytest.param(([3, 6], 1, -1, 2, 0, None), "clear", id="total-short"),
    pytest.param(([3], 1, None, 5, 0, None), "clear", id="fewer-tokens-than-ranks"),
    pytest.param(([3, 6], 1, None, 3, 0, [0, 4, 4, "end"]), "clear", id="empty-shard"),
])
def test_the_shard_verdict_is_not_vacuous(case, want):
    """Negative controls: each verdict the property accepts is reached."""
    assert shard_verdict(case) == want


def test_the_oracle_sees_a_shifted_shard():
    """Negative control of the oracle: one token moved between ranks is not the oracle's part."""
    case = ([5, 0, 9, 3], 1, 3, 3, 1, None)
    start, end, local = shard_for_context_parallel(PackedSeqParams.from_lengths([5, 0, 9, 3]), 1, 3,
                                                   total_tokens=20, bounds=[0, 7, 13, 20])
    assert not _holds(case, _due_bounds(case), 1, start, end, local)
