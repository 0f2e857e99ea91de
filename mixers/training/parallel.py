"""Processes, the DeviceMesh and FSDP2 for ``ssm-pack train``.

    world = dp * cp ranks; B = data.batch_packs packs per optimizer step

The global batch is ``B`` packs, each from its own stream shard ``s`` (``pack_stream(rank=s,
world=B)``), whatever the world size: dp rank ``d`` trains on shards ``d * B/dp ... (d+1) * B/dp
- 1``, one after another (gradient accumulation), and the ``cp`` ranks of one dp rank split each
pack (context parallelism by state passing). So a step sees the same packs at every world size,
and a checkpoint's stream shards are dealt again when the world size changes.

FSDP2 shards parameters, gradients and optimizer state over all ``world`` ranks (a 1-D mesh of
every rank, the public equivalent of flattening the ``(dp, cp)`` mesh); its reduce-scatter averages
over ``world``, which the loop undoes by scaling each rank's loss by ``world`` (see
:func:`mixers.training.train.step_loss`).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .model import blocks


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    if value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"the environment variable {name}={value!r} must be an integer (torchrun sets it)") from None


def attempt_store(world: int, timeout: datetime.timedelta):
    """The store of this torchrun attempt: torchrun's agent keeps one TCPStore across restarts, and a
    restarted rank can read the address a killed rank published in the attempt before (and fail to
    connect to it); keys prefixed by ``TORCHELASTIC_RESTART_COUNT`` keep each attempt apart. ``None``
    outside torchrun's agent store (``init_process_group`` then reads ``MASTER_ADDR`` / ``MASTER_PORT``)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"ssm-pack/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)


@dataclass
class World:
    """This process's place: ``rank`` of ``world``, ``dp_rank`` of ``dp`` and ``cp_rank`` of ``cp``
    (rank = dp_rank * cp + cp_rank), its device and, once :meth:`start` ran, its process groups."""

    rank: int
    world: int
    local_rank: int
    cp: int
    device: torch.device
    cp_group: object = None
    fsdp_mesh: object = None

    @classmethod
    def from_environment(cls, cp: int) -> World:
        """Read torchrun's ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` (one process without them);
        nothing is started."""
        world, rank, local = _env_int("WORLD_SIZE", 1), _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
        if not 0 <= rank < world:
            raise ValueError(f"RANK={rank} is outside WORLD_SIZE={world}; launch with torchrun")
        device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
        return cls(rank=rank, world=world, local_rank=local, cp=cp, device=device)

    @property
    def dp(self) -> int:
        return self.world // self.cp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.cp

    @property
    def cp_rank(self) -> int:
        return self.rank % self.cp

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def shards(self, batch_packs: int) -> list[int]:
        """The stream shards this rank trains on in every step, in order."""
        per_rank = batch_packs // self.dp
        return list(range(self.dp_rank * per_rank, (self.dp_rank + 1) * per_rank))

    def start(self, timeout_s: float = 600.0) -> None:
        """Start the process group (gloo on CPU, NCCL on CUDA), the FSDP mesh and the cp groups."""
        if not self.distributed:
            return
        from torch.distributed.device_mesh import init_device_mesh
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if not dist.is_initialized():
            timeout = datetime.timedelta(seconds=timeout_s)
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo", timeout=timeout,
                                    store=attempt_store(self.world, timeout), rank=self.rank, world_size=self.world)
        self.fsdp_mesh = init_device_mesh(self.device.type, (self.world,), mesh_dim_names=("world",))
        if self.cp > 1:
            mesh = init_device_mesh(self.device.type, (self.dp, self.cp), mesh_dim_names=("dp", "cp"))
            self.cp_group = mesh["cp"].get_group()

    def stop(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()

    def all_sum(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` summed over every rank (itself at world 1)."""
        if self.distributed:
            value = value.clone()
            dist.all_reduce(value)
        return value


def mixed_precision(dtype: torch.dtype):
    """FSDP2's policy: parameters cast to ``dtype`` for compute, gradients reduced in fp32.

    Forward inputs are not cast: the embedding already gives ``dtype`` activations, and FSDP2's
    cast rebuilds every dataclass it meets in the arguments (the packing metadata, the cache slots
    of carried states), which must stay the objects the caller resolved."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)


def shard_model(model: torch.nn.Module, world: World, compute_dtype: torch.dtype) -> None:
    """``fully_shard`` every block, then the model (embedding, final norm), over all ranks."""
    if not world.distributed:
        return
    from torch.distributed.fsdp import fully_shard
    policy = {} if compute_dtype == torch.float32 else {"mp_policy": mixed_precision(compute_dtype)}
    for block in blocks(model):
        fully_shard(block, mesh=world.fsdp_mesh, **policy)
    fully_shard(model, mesh=world.fsdp_mesh, **policy)


def checkpoint_blocks(model: torch.nn.Module) -> None:
    """Recompute each block's activations in the backward (the parameter names stay the same)."""
    from torch.utils.checkpoint import checkpoint
    for block in blocks(model):
        forward = block.forward
        block.forward = lambda *args, _forward=forward, **kwargs: checkpoint(_forward, *args, use_reentrant=False,
                                                                             **kwargs)


def compile_blocks(model: torch.nn.Module, backend: str = "inductor") -> None:
    """``torch.compile`` each block in place (the parameter names stay the same)."""
    for block in blocks(model):
        block.compile(backend=backend)
