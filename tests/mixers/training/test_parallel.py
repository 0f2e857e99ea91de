"""The per-block wrappers of ``ssm-pack train``: activation checkpointing and ``torch.compile``
wrap every block in place, keep the parameter names, and change no number (compile's own
code generation is left out: the ``eager`` backend checks the wiring in seconds; inductor on a
CPU takes minutes for the first step)."""

import copy

import pytest
import torch

from mixers import HybridLM
from mixers.training.parallel import checkpoint_blocks, compile_blocks
from ssm_pack import PackedSeqParams


def _loss_and_grads(model):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (1, 40), generator=g)
    params = PackedSeqParams.from_lengths([17, 9, 14], total_tokens=40)
    model.zero_grad(set_to_none=True)
    loss = model(ids, params, labels=ids)["loss"]
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("wrap", [pytest.param(checkpoint_blocks, id="activation-checkpointing"),
                                  pytest.param(lambda m: compile_blocks(m, backend="eager"), id="compile")])
def test_a_wrapped_model_gives_the_same_loss_and_gradients(wrap):
    torch.manual_seed(0)
    plain = HybridLM(64, 32, "MGA")
    wrapped = copy.deepcopy(plain)
    wrap(wrapped)
    assert list(dict(wrapped.named_parameters())) == list(dict(plain.named_parameters()))
    (loss_a, grads_a), (loss_b, grads_b) = _loss_and_grads(plain), _loss_and_grads(wrapped)
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-6, atol=0)
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-5, atol=1e-7, msg=name)


def test_compile_wraps_every_block():
    model = HybridLM(64, 32, "MGA")
    compile_blocks(model, backend="eager")
    assert all(block._compiled_call_impl is not None for block in model.blocks)


def test_outside_torchruns_agent_store_the_process_group_reads_master_addr(monkeypatch):
    import datetime

    from mixers.training.parallel import attempt_store
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    assert attempt_store(2, datetime.timedelta(seconds=5)) is None


def test_each_torchrun_attempt_keeps_its_keys_apart(monkeypatch):
    """Under torchrun's agent store a restarted attempt writes under its own prefix: a key it sets
    is not the key the attempt before set."""
    import datetime

    import torch.distributed as dist

    from mixers.training.parallel import attempt_store
    from tests.context_parallel.worker import free_port
    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=datetime.timedelta(seconds=10),
                          wait_for_workers=False)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    stores = {}
    for attempt, value in (("0", b"first"), ("1", b"second")):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
        stores[attempt] = attempt_store(2, datetime.timedelta(seconds=10))
        assert stores[attempt] is not None, "under torchrun's agent store each attempt gets its own store"
        stores[attempt].set("address", value)
    assert stores["0"].get("address") == b"first" and stores["1"].get("address") == b"second"
    assert agent.num_keys() >= 2


def _world2_main(rank: int, port: int, root: str) -> None:
    """One rank of a cp=1 world of 2: its process groups, and a bf16 / fp32 model under FSDP2."""
    import os

    from mixers.training.parallel import World, shard_model
    from tests.context_parallel.worker import errors_to
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    world = World(rank=rank, world=2, local_rank=rank, cp=1, device=torch.device("cpu"))
    try:
        with errors_to(os.path.join(root, f"rank{rank}.err")):
            world.start(timeout_s=120)
            result = {"cp_group": None if world.cp_group is None else repr(world.cp_group)}
            ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(rank))
            params = PackedSeqParams.from_lengths([17, 9, 14], total_tokens=40)
            for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
                torch.manual_seed(0)
                model = HybridLM(64, 32, "MGA")
                shard_model(model, world, dtype)
                result[name] = model(ids, params)["logits"].dtype
            torch.save(result, os.path.join(root, f"rank{rank}.pt"))
    finally:
        world.stop()


def test_a_world_of_2_computes_in_the_training_dtype_and_starts_no_cp_group_at_cp1(tmp_path):
    """FSDP2 casts the parameters to a bf16 run's dtype (fp32 stays fp32), and a world without
    context parallelism starts no cp process group."""
    from tests.context_parallel.worker import spawned_results
    for rank, result in enumerate(spawned_results(_world2_main, tmp_path)):
        assert result["bfloat16"] == torch.bfloat16, f"rank {rank}: a bf16 run computed in {result['bfloat16']}"
        assert result["float32"] == torch.float32, f"rank {rank}: an fp32 run computed in {result['float32']}"
        assert result["cp_group"] is None, f"rank {rank}: cp=1 started a cp group {result['cp_group']}"


def test_a_cuda_rank_binds_its_local_device_before_nccl_starts(monkeypatch):
    """On GPUs each torchrun rank takes ``cuda:LOCAL_RANK`` and binds it before the NCCL group and
    the meshes are made (unbound, every rank's NCCL communicator would sit on GPU 0). The CUDA calls
    are recorded, not run: no GPU is needed."""
    import torch.distributed as dist
    import torch.distributed.device_mesh as device_mesh

    from mixers.training.parallel import World
    calls = []
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", str(device))))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append(("group", backend)))
    monkeypatch.setattr(device_mesh, "init_device_mesh",
                        lambda kind, shape, mesh_dim_names: calls.append(("mesh", kind, shape)) or {})
    world = World.from_environment(cp=1)
    assert world.device == torch.device("cuda", 1) and (world.dp, world.dp_rank) == (4, 3)
    world.start()
    assert calls == [("set_device", "cuda:1"), ("group", "nccl"), ("mesh", "cuda", (4,))]


@pytest.mark.parametrize("env, want", [
    pytest.param({}, (0, 1, 0), id="one-process-without-torchrun"),
    pytest.param({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}, (0, 2, 0), id="rank-0-of-2"),
    pytest.param({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1"}, (3, 4, 1), id="rank-3-of-4"),
    pytest.param({"WORLD_SIZE": "2", "RANK": "2"}, "RANK=2 is outside WORLD_SIZE=2", id="rank-past-the-world"),
    pytest.param({"WORLD_SIZE": "2", "RANK": "-1"}, "RANK=-1 is outside WORLD_SIZE=2", id="negative-rank"),
])
def test_the_world_read_from_torchruns_environment(monkeypatch, env, want):
    """``World.from_environment`` on a machine without CUDA: rank, world and local rank from torchrun's
    variables (one process of rank 0 without them), the CPU as the device; a rank outside the world
    is refused."""
    from mixers.training.parallel import World
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    if isinstance(want, str):
        with pytest.raises(ValueError, match=f"^{want}; launch with torchrun$"):
            World.from_environment(cp=1)
        return
    world = World.from_environment(cp=1)
    assert (world.rank, world.world, world.local_rank) == want and world.device == torch.device("cpu")
