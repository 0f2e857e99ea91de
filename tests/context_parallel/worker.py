"""Spawned CP ranks: one gloo group per world size runs every case, writing each rank's results.

``launch(world, out_dir, case_ids)`` starts ``world`` processes (``torch.multiprocessing``),
each joins a gloo group on localhost and, for every case, runs the subject on its shard with CP
(``local.cp_group`` set) and without the exchange (the same shard's params with the CP layout
dropped: the negative control), and, for the ops on the 4-rank spanning layout, once more with a
NaN inside the spanning document; saving ``{case}.{rank}.pt``. A failure writes
``{case}.{rank}.err`` and stops the rank (the others then fail on gloo's timeout).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mixers.ops.common.cp_exchange import record_traffic
from ssm_pack import shard_for_context_parallel
from tests.context_parallel.cases import OPS, cases, layout, run_subject

TIMEOUT_S = 120
NAN_AT = 20          # spanning layout, 4 ranks: document 2 holds tokens 2..38, rank 1 tokens 12..23


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trace_case(case_id: str | None) -> None:
    """Labels the lines that follow with ``case_id`` for the mutation lane's tracer, when it runs in this
    rank (``tests/mutation/coverage_map.py``: a test then counts only the cases its id names)."""
    tracer = sys.modules.get("_ssm_pack_trace")
    if tracer is not None:
        tracer.enter(case_id)


@contextlib.contextmanager
def errors_to(path):
    """Run the ``with`` body; an exception writes its traceback to ``path`` (the launcher fails the test
    with it: a spawned rank's own traceback is otherwise lost) and propagates."""
    try:
        yield
    except Exception:
        with open(path, "w") as fh:
            fh.write(traceback.format_exc())
        raise


@contextlib.contextmanager
def gloo_rank(rank: int, world: int, port: int, error_file=None):
    """This spawned process as ``rank`` of a ``world``-rank gloo group on localhost (one thread) for
    the ``with`` body, then the group destroyed; with ``error_file``, a failure writes its traceback
    there (:func:`errors_to`)."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        with errors_to(error_file) if error_file is not None else contextlib.nullcontext():
            yield
    finally:
        dist.destroy_process_group()


def _rank_main(rank: int, world: int, port: int, out_dir: str, wanted: tuple) -> None:
    with gloo_rank(rank, world, port):
        try:
            for case_id, subject, kind, seed in cases(world):
                if case_id not in wanted:
                    continue
                _trace_case(case_id)
                with errors_to(os.path.join(out_dir, f"{case_id}.{rank}.err")):
                    lay = layout(kind, world, seed)
                    start, end, local = shard_for_context_parallel(lay.params(), rank, world, total_tokens=lay.total,
                                                                   bounds=lay.shard_bounds(world))
                    local.cp_group = dist.group.WORLD
                    t0 = time.perf_counter()
                    with record_traffic() as traffic:
                        result = run_subject(subject, lay, local, start, end, seed)
                    result["seconds"] = time.perf_counter() - t0
                    result["traffic"] = (traffic.total("forward"), traffic.total("backward"))
                    alone = local.replace(cp_layout=None, cp_group=None)    # the same shard, no exchange
                    result["control"] = run_subject(subject, lay, alone, start, end, seed)["out"]
                    result["span"] = (start, end)
                    if subject in OPS and kind == "spanning" and world == 4:    # a NaN inside the spanning document
                        result["poisoned"] = run_subject(subject, lay, local, start, end, seed, nan_at=NAN_AT)
                    torch.save(result, os.path.join(out_dir, f"{case_id}.{rank}.pt"))
        finally:
            _trace_case(None)


def runs_per_world(tmp_path_factory, rank_main, prefix: str):
    """``get(world)``: the folder where ``rank_main(rank, world, port, folder)`` wrote its results on
    ``world`` spawned gloo ranks, started once per world size. A failed rank fails the test with
    the first ``*.err`` traceback the ranks wrote (``rank_main`` writes ``{rank}.err``)."""
    import pytest
    done = {}

    def get(world: int):
        if world not in done:
            path = tmp_path_factory.mktemp(f"{prefix}{world}")
            try:
                mp.start_processes(rank_main, args=(world, free_port(), str(path)), nprocs=world, join=True,
                                   start_method="spawn")
            except Exception:
                errors = sorted(path.glob("*.err"))
                pytest.fail(errors[0].read_text() if errors else "a spawned rank failed")
            done[world] = path
        return done[world]
    return get


def spawned_results(rank_main, folder, world: int = 2) -> list:
    """Each rank's ``folder/rank{r}.pt`` after ``rank_main(rank, port, folder)`` ran on ``world`` spawned
    gloo ranks; a rank that failed fails the caller with the first ``*.err`` traceback the ranks wrote
    (``rank_main`` writes ``rank{r}.err``)."""
    from pathlib import Path
    folder = Path(folder)
    try:
        mp.start_processes(rank_main, args=(free_port(), str(folder)), nprocs=world, join=True, start_method="spawn")
    finally:
        errors = [p.read_text() for p in sorted(folder.glob("*.err"))]
    assert not errors, errors[0]
    return [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(world)]


def launch(world: int, out_dir: str, case_ids) -> float:
    """Run the cases on ``world`` spawned ranks; returns the wall time in seconds."""
    t0 = time.perf_counter()
    ctx = mp.start_processes(_rank_main, args=(world, free_port(), out_dir, tuple(case_ids)), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + 4 * TIMEOUT_S
    try:
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {world} CP ranks did not finish in {4 * TIMEOUT_S} s")
    except Exception:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
        raise
    return time.perf_counter() - t0
