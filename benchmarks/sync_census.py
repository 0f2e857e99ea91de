"""The host-sync census: which aten ops of a step would stall a GPU, and in which layer.

On CUDA a value read on the host (``.item()``, ``bool(t)``, ``.tolist()``, ``nonzero``, a
boolean-mask index, an output whose size depends on the values) waits for every kernel queued
before it. :class:`SyncCensus` is a ``TorchDispatchMode`` that counts such ops wherever the
tensors live (CPU included), so the count is the same on every machine:

* :data:`ONE_READ` ops read one value set back (``_local_scalar_dense`` is ``item`` / ``bool`` /
  ``int``; ``equal`` answers a Python bool; ``nonzero``, ``masked_select`` and ``unique`` size
  their output from the values); ``index`` / ``index_put_`` with a boolean index run ``nonzero``;
* ``repeat_interleave`` without ``output_size`` reads twice (the total and the non-negativity
  check, aten/src/ATen/native/Repeat.h ``repeat_interleave_common``, torch 2.13);
* a copy from another device to the CPU, and ``tolist`` / ``numpy`` (seen by the companion
  ``TorchFunctionMode``: on CPU tensors they dispatch nothing).

The census cannot tell a host tensor from a device tensor when both are CPU tensors, so a read
of boundaries kept on the host counts too (the figures outside the layers are an upper bound).

Each sync is attributed to the layer running it: in the forward, the innermost watched module
on the stack (forward pre / post hooks); in the backward, the layer that created the autograd
node being run (each watched module's new nodes are collected when its forward returns).
"""

from __future__ import annotations

import contextlib
import traceback
from collections import Counter
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from benchmarks.common import PausableMode

OUTSIDE = "outside layers"
ONE_READ = {"_local_scalar_dense", "equal", "nonzero", "argwhere", "masked_select", "unique", "_unique", "_unique2",
            "unique_dim", "unique_consecutive", "unique_dim_consecutive", "bincount"}
BOOL_INDEXED = {"index", "index_put", "index_put_", "_index_put_impl_"}
HOST_METHODS = {"tolist", "numpy", "__array__"}


def _is_mask(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


def syncs_of(func, args, kwargs) -> int:
    """How many host reads the aten op ``func`` makes on a GPU with these arguments."""
    name = func.overloadpacket.__name__
    if name in ONE_READ:
        return 1
    if name in BOOL_INDEXED:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return int(any(_is_mask(i) for i in indices if i is not None))
    if name == "repeat_interleave" and func._overloadname in ("Tensor", "self_Tensor"):
        return 2 if kwargs.get("output_size") is None else 0
    if name in ("_to_copy", "copy_"):
        src = args[1] if name == "copy_" else args[0]
        dest = args[0].device if name == "copy_" else kwargs.get("device")
        return int(dest is not None and torch.device(dest).type == "cpu" and src.device.type != "cpu")
    return 0


@dataclass
class Sync:
    where: str
    op: str
    phase: str
    reads: int
    line: str = ""


class SyncCensus(PausableMode):
    """Counts host syncs; :meth:`watch` names the layers; :meth:`pause` hides a stretch (a fake kernel).
    ``trace``: also note the file and line of each sync (slow; for finding them)."""

    def __init__(self, trace: bool = False):
        super().__init__()
        self.trace, self.syncs = trace, []
        self.paused, self.stack, self.nodes, self.backward = 0, [], {}, False
        self.host_reads = _HostMethods(self)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.paused:
            n = syncs_of(func, args, kwargs)
            if n:
                self.record(func.overloadpacket.__name__, n)
        return func(*args, **kwargs)

    def record(self, op: str, reads: int) -> None:
        line = ""
        if self.trace:
            frames = [f for f in traceback.extract_stack()[:-2] if "/torch/" not in f.filename
                      and not f.filename.endswith("sync_census.py")]
            line = f"{frames[-1].filename.split('/')[-1]}:{frames[-1].lineno}" if frames else ""
        self.syncs.append(Sync(self.where(), op, "backward" if self.backward else "forward", reads, line))

    def where(self) -> str:
        if self.stack:
            return self.stack[-1]
        node = torch._C._current_autograd_node()
        return OUTSIDE if node is None else self.nodes.get(node, OUTSIDE)

    @contextlib.contextmanager
    def resume(self):
        """Count again inside a paused stretch (upstream's own host work inside a fake kernel)."""
        paused, self.paused = self.paused, 0
        try:
            yield
        finally:
            self.paused = paused

    def watch(self, modules: dict[str, torch.nn.Module]) -> list:
        """Attribute what runs inside each named module to it; returns the hook handles."""
        handles = []
        for name, module in modules.items():
            def pre(_module, inputs, name=name):
                self.stack.append(name)
                _module._census_boundary = {t.grad_fn for t in _tensors(inputs) if t.grad_fn is not None}

            def post(_module, _inputs, output, name=name):
                self.stack.pop()
                self._claim(output, name, _module.__dict__.pop("_census_boundary", set()))
            handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
        return handles

    def _claim(self, output, name: str, boundary: set) -> None:
        """Every autograd node behind ``output`` made inside the module belongs to ``name``."""
        todo = [t.grad_fn for t in _tensors(output) if t.grad_fn is not None]
        while todo:
            node = todo.pop()
            if node is None or node in boundary or node in self.nodes:
                continue
            self.nodes[node] = name
            todo += [n for n, _ in node.next_functions]

    def __enter__(self):
        self.host_reads.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        self.host_reads.__exit__(*exc)
        return out

    # ---- summaries --------------------------------------------------------------------------
    def per_place(self) -> Counter:
        counts = Counter()
        for s in self.syncs:
            counts[s.where] += s.reads
        return counts

    def inside_layers(self) -> int:
        return sum(s.reads for s in self.syncs if s.where != OUTSIDE)

    def total(self) -> int:
        return sum(s.reads for s in self.syncs)


class _HostMethods(TorchFunctionMode):
    """``tolist`` / ``numpy``: a copy to the host that dispatches nothing on CPU tensors."""

    def __init__(self, census: SyncCensus):
        super().__init__()
        self.census = census

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_METHODS and not self.census.paused:
            self.census.record(func.__name__, 1)
        return func(*args, **(kwargs or {}))


def _tensors(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def backward_phase(census: SyncCensus):
    """A context marking the syncs recorded inside it as the backward's."""
    @contextlib.contextmanager
    def phase():
        census.backward = True
        try:
            yield
        finally:
            census.backward = False
    return phase()
