"""Ranks that disagree about the layout fail with one ValueError on every rank (2 spawned gloo ranks).

Scenarios, run in order on both ranks for Mamba2, GatedDeltaNet and attention mixers:
different shard bounds, different documents, the same layout (no error: the negative control, and
checked once under the default ``"first"``, twice under ``"always"``), and under ``"always"`` a
rank repeating an agreed layout while the other runs a new one. A second run does that last one
under the default ``"first"``: the skip of an agreed layout is itself decided by all ranks.
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ssm_pack import PackedSeqParams, shard_for_context_parallel
from ssm_pack.parallel import layout_check
from ssm_pack.parallel.layout_check import fingerprint, layout_check_mode, set_layout_check

SUBJECTS = ("M", "G", "A")
AGREED = ([5, 4, 3], (0, 6, 12))
SCENARIOS = {                      # name: (rank 0's (lengths, bounds), rank 1's)
    "bounds": (AGREED, ([5, 4, 3], (0, 4, 12))),
    "documents": (AGREED, ([3, 6, 3], (0, 6, 12))),
    "same": (AGREED, AGREED),
    "same_again": (AGREED, AGREED),
}


def _forward(subject, rank, lengths, bounds):
    from tests.context_parallel.cases import HIDDEN, build_module
    module = build_module(subject, 0)
    x = torch.randn(1, 12, HIDDEN, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    start, end, local = shard_for_context_parallel(PackedSeqParams.from_lengths(lengths), rank, 2, bounds=bounds,
                                                   cp_group=dist.group.WORLD)
    module(x[:, start:end], packed_seq_params=local).sum().backward()


def _attempt(subject, rank, spec):
    before = layout_check.checks_run()
    try:
        _forward(subject, rank, *spec)
        error = None
    except ValueError as err:
        error = str(err)
    return {"error": error, "checks": layout_check.checks_run() - before}


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    results = {}
    try:
        for subject in SUBJECTS:
            layout_check._AGREED.clear()         # each subject starts with no layout agreed
            for name, specs in SCENARIOS.items():
                results[(subject, name)] = _attempt(subject, rank, specs[rank])
            set_layout_check("always")
            results[(subject, "same_always")] = _attempt(subject, rank, AGREED)
            results[(subject, "repeat_vs_new")] = _attempt(subject, rank, AGREED if rank == 0 else
                                                           ([5, 4, 3], (0, 5, 12)))
            set_layout_check("first")
    finally:
        torch.save(results, os.path.join(out_dir, f"{rank}.pt"))
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    from tests.context_parallel.worker import free_port
    path = tmp_path_factory.mktemp("layout")
    mp.start_processes(_rank_main, args=(free_port(), str(path)), nprocs=2, join=True, start_method="spawn")
    return [torch.load(path / f"{r}.pt") for r in range(2)]


@pytest.mark.parametrize("subject", [pytest.param(s, id=s) for s in SUBJECTS])
@pytest.mark.parametrize("scenario, wanted", [pytest.param("bounds", "bounds [0, 4, 12]", id="bounds"),
                                              pytest.param("documents", "documents", id="documents"),
                                              pytest.param("repeat_vs_new", "bounds [0, 5, 12]", id="always")])
def test_disagreeing_ranks_raise_on_every_rank(outcomes, subject, scenario, wanted):
    for rank, result in enumerate(outcomes):
        error = result[(subject, scenario)]["error"]
        assert error is not None, f"rank {rank} ran {scenario} without an error"
        assert "disagree" in error and "rank 0:" in error and "rank 1:" in error and wanted in error, error


NEW = ([5, 4, 3], (0, 5, 12))


def _repeat_main(rank: int, port: int, out_dir: str) -> None:
    """Under the default mode: both ranks agree on a layout, then rank 0 repeats it while rank 1
    runs a new one (a gloo group with a short timeout: a rank left waiting fails, not hangs)."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=20))
    results = {}
    try:
        for subject in SUBJECTS:
            layout_check._AGREED.clear()
            results[(subject, "agree")] = _attempt(subject, rank, AGREED)
            results[(subject, "repeat_vs_new")] = _attempt(subject, rank, AGREED if rank == 0 else NEW)
    finally:
        torch.save(results, os.path.join(out_dir, f"{rank}.pt"))
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def repeat_outcomes(tmp_path_factory):
    from tests.context_parallel.worker import free_port
    path = tmp_path_factory.mktemp("repeat")
    mp.start_processes(_repeat_main, args=(free_port(), str(path)), nprocs=2, join=True, start_method="spawn")
    return [torch.load(path / f"{r}.pt") for r in range(2)]


@pytest.mark.parametrize("subject", [pytest.param(s, id=s) for s in SUBJECTS])
def test_a_repeated_layout_against_a_new_one_raises_under_the_default(repeat_outcomes, subject):
    """Rank 0 has agreed its layout before, rank 1's is new: the cache must not let rank 0 skip
    alone (it would run its first exchange against rank 1's check)."""
    for rank, result in enumerate(repeat_outcomes):
        assert result[(subject, "agree")]["error"] is None, result[(subject, "agree")]
        error = result[(subject, "repeat_vs_new")]["error"]
        assert error is not None, f"rank {rank} ran a repeated layout against a new one without an error"
        assert "disagree" in error and "rank 0:" in error and "bounds [0, 5, 12]" in error, error


@pytest.mark.parametrize("subject", [pytest.param(s, id=s) for s in SUBJECTS])
def test_agreeing_ranks_check_once_per_layout(outcomes, subject):
    """Negative control (no error when the layouts agree) and the cost in collectives: under the
    default a layout's first forward runs the deciding all-reduce and the all-gather, its repeat
    the all-reduce only; under ``"always"`` every forward runs the all-gather only."""
    for result in outcomes:
        assert [result[(subject, s)]["error"] for s in ("same", "same_again", "same_always")] == [None] * 3
        assert [result[(subject, s)]["checks"] for s in ("same", "same_again", "same_always")] == [2, 1, 1]


def test_fingerprint_tells_layouts_apart():
    def lay(lengths, bounds, rank=0):
        return shard_for_context_parallel(PackedSeqParams.from_lengths(lengths), rank, 2, bounds=bounds)[2].cp_layout
    base = fingerprint(lay([5, 4, 3], (0, 6, 12)))
    assert fingerprint(lay([5, 4, 3], (0, 6, 12), rank=1)) == base
    assert fingerprint(lay([5, 4, 3], (0, 4, 12))) != base
    assert fingerprint(lay([3, 6, 3], (0, 6, 12))) != base
    assert fingerprint(lay([5, 4, 0, 3], (0, 6, 12))) != base


@pytest.mark.parametrize("mode", [pytest.param("sometimes", id="word"), pytest.param(None, id="none")])
def test_a_bad_mode_is_refused(mode, monkeypatch):
    with pytest.raises(ValueError, match="mode must be one of"):
        set_layout_check(mode)
    monkeypatch.setenv("SSM_PACK_CP_LAYOUT_CHECK", "sometimes")
    with pytest.raises(ValueError, match="SSM_PACK_CP_LAYOUT_CHECK must be one of"):
        layout_check_mode()


def test_the_mode_set_overrides_the_environment(monkeypatch):
    monkeypatch.setitem(layout_check._state, "mode", None)          # restored after the test
    monkeypatch.setenv("SSM_PACK_CP_LAYOUT_CHECK", "always")
    assert layout_check_mode() == "always"
    assert set_layout_check("off") == "always"
    assert layout_check_mode() == "off"
    assert set_layout_check("first") == "off"
    assert layout_check_mode() == "first"
