"""FSDP2 composed with context parallelism: 2 x 2 gloo ranks (dp x cp) against one process, fp64.

Each dp rank trains on its own packed row, split over its 2 cp ranks; one process trains on both
rows with the mean of the two rows' losses. Two recipes, both 2 AdamW steps of ``HybridLM("MGA")``:

* ``dp``: ``fully_shard`` on the ``dp`` mesh dimension (FSDP averages over dp), then each
  gradient all-reduced (summed) over the ``cp`` group;
* ``flat``: ``fully_shard`` on a 1-D mesh of all ``dp x cp`` ranks (what torchtitan gets from the
  private ``DeviceMesh._flatten``; a second ``init_device_mesh`` over the same ranks is public): FSDP's
  reduce-scatter sums over cp too but divides by ``dp * cp``, so the loss is scaled by the cp size.

Gradients (before each step) and parameters (after each step) match the single process to 1e-12.
Negative controls: the same recipes without the cp all-reduce / without the loss scaling give
wrong gradients.
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ssm_pack import PackedSeqParams, shard_for_context_parallel

DP, CP, STEPS, TOL = 2, 2, 2, 1e-12
ROWS = ([10, 7, 7], [5, 13, 6])          # dp rank d's row: every document but one crosses the cp boundary
T, VOCAB, LR, WD = 24, 64, 1e-2, 0.1


def _model():
    from mixers import HybridLM
    from tests.context_parallel.cases import HIDDEN, SMALL
    torch.manual_seed(0)
    return HybridLM(VOCAB, HIDDEN, "MGA", mixer_overrides=SMALL).double()


def _row(step: int, d: int):
    g = torch.Generator().manual_seed(100 * step + d)
    ids = torch.randint(0, VOCAB, (1, T), generator=g)
    labels = torch.where(torch.rand(1, T, generator=g) < 0.2, -100, ids)
    return ids, labels, PackedSeqParams.from_lengths(list(ROWS[d]), total_tokens=T)


def _local(t):
    """This rank's dim-0 shard (no collective: the test puts the shards together)."""
    return t.to_local().detach().clone()


def _train(recipe: str, mesh, shard_mesh, d: int, c: int, *, control: bool = False) -> list:
    """Per step ``{"grads", "params"}``, this rank's shards (``control``: the recipe's CP step left out, one step)."""
    from torch.distributed.fsdp import fully_shard
    model = _model()
    fully_shard(model, mesh=shard_mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    cp_group = mesh["cp"].get_group()
    record = []
    for step in range(1 if control else STEPS):
        ids, labels, params = _row(step, d)
        start, end, local = shard_for_context_parallel(params, c, CP, cp_group=cp_group)
        loss = model(ids[:, start:end], packed_seq_params=local, labels=labels[:, start:end])["loss"]
        if recipe == "flat" and not control:
            loss = loss * CP                  # FSDP divides by dp * cp; the cp shares must sum
        loss.backward()
        if recipe == "dp" and not control:
            for p in model.parameters():      # the row's gradient is the sum of its cp shares
                dist.all_reduce(p.grad.to_local(), group=cp_group)
        grads = {n: _local(p.grad) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        record.append({"grads": grads, "params": {n: _local(p) for n, p in model.named_parameters()}})
    return record


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=DP * CP, timeout=datetime.timedelta(seconds=120))
    try:
        mesh = init_device_mesh("cpu", (DP, CP), mesh_dim_names=("dp", "cp"))
        flat = init_device_mesh("cpu", (DP * CP,), mesh_dim_names=("dp_cp",))   # every rank, in the same order
        d, c = mesh["dp"].get_local_rank(), mesh["cp"].get_local_rank()
        results = {"dp": _train("dp", mesh, mesh["dp"], d, c), "flat": _train("flat", mesh, flat, d, c),
                   "dp_control": _train("dp", mesh, mesh["dp"], d, c, control=True),
                   "flat_control": _train("flat", mesh, flat, d, c, control=True)}
        torch.save(results, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _reference() -> list:
    """One process, both rows, the mean of their losses."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    record = []
    for step in range(STEPS):
        losses = []
        for d in range(DP):
            ids, labels, params = _row(step, d)
            losses.append(model(ids, packed_seq_params=params, labels=labels)["loss"])
        (sum(losses) / DP).backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        record.append({"grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}})
    return record


def _gathered(per_rank: list, key: str) -> list:
    """Full tensors from the dim-0 shards: over dp (cp rank 0's; cp ranks hold copies) for ``dp``,
    over all ranks in order (the flattened mesh) for ``flat``; per step ``{"grads", "params"}``."""
    ranks = range(0, DP * CP, CP) if key.startswith("dp") else range(DP * CP)
    steps = []
    for step in range(len(per_rank[0][key])):
        steps.append({what: {n: torch.cat([per_rank[r][key][step][what][n] for r in ranks])
                             for n in per_rank[0][key][step][what]} for what in ("grads", "params")})
    return steps


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tests.context_parallel.worker import free_port
    path = tmp_path_factory.mktemp("fsdp")
    mp.start_processes(_rank_main, args=(free_port(), str(path)), nprocs=DP * CP, join=True, start_method="spawn")
    per_rank = [torch.load(path / f"{r}.pt") for r in range(DP * CP)]
    return {key: _gathered(per_rank, key) for key in per_rank[0]}, per_rank, _reference()


def _worst(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max(float((got[n] - want[n]).abs().max()) for n in want)


@pytest.mark.parametrize("recipe", [pytest.param("dp", id="fsdp-on-dp+cp-allreduce"),
                                    pytest.param("flat", id="fsdp-on-flat-dp-cp+loss-times-cp")])
def test_fsdp2_with_cp_equals_one_process(runs, recipe):
    full, per_rank, ref = runs
    for step in range(STEPS):
        grads = _worst(full[recipe][step]["grads"], ref[step]["grads"])
        params = _worst(full[recipe][step]["params"], ref[step]["params"])
        assert grads <= TOL and params <= TOL, f"step {step}: grads {grads:.2e}, params {params:.2e}"
    if recipe == "dp":                 # the cp ranks of one dp rank hold the same shard
        for d in range(0, DP * CP, CP):
            for c in range(1, CP):
                assert _worst(per_rank[d + c][recipe][-1]["params"], per_rank[d][recipe][-1]["params"]) == 0


@pytest.mark.parametrize("recipe", [pytest.param("dp", id="no-cp-allreduce"),
                                    pytest.param("flat", id="no-loss-scaling")])
def test_without_the_cp_step_the_gradients_are_wrong(runs, recipe):
    """Negative control: leaving out the recipe's CP step (the all-reduce, the loss scaling)."""
    full, _, ref = runs
    assert _worst(full[f"{recipe}_control"][0]["grads"], ref[0]["grads"]) > 1e-4
