"""``InferenceCache``: every mixer's slots of one model, reset and advanced together.

    S = slots (``max_batch_size``), L = ``max_seqlen``

``model.allocate_inference_cache(max_batch_size, max_seqlen)`` returns one: one
:class:`~mixers.inference.layer_cache.LayerCache` per block, all sharing one
:class:`~mixers.inference.slots.SlotTable`. A forward with ``cache=`` and ``cache_slots=`` resolves
the slots once (:meth:`resolve`), every block reads and writes its own states for them, and the
table advances once at the end (:meth:`advance`). ``reset(slots)`` frees slots for new sequences.
"""

from __future__ import annotations

import weakref

import torch

from .layer_cache import LayerCache
from .slots import SlotBatch, SlotTable


class InferenceCache:
    """Per-slot states of every block of a model (see the module docstring)."""

    def __init__(self, owner, table: SlotTable, layers: list[LayerCache], dtype: torch.dtype, device):
        self._owner = weakref.ref(owner)
        self.owner_name = type(owner).__name__
        self.table, self.layers, self.dtype, self.device = table, list(layers), dtype, torch.device(device)

    @classmethod
    def allocate(cls, model, mixers, max_batch_size: int, max_seqlen: int, dtype=None, device=None) -> InferenceCache:
        """One cache for ``mixers`` (the blocks' mixers, in order) of ``model``."""
        table = SlotTable(max_batch_size, max_seqlen)
        reference = next(model.parameters())
        dtype = reference.dtype if dtype is None else dtype
        device = reference.device if device is None else torch.device(device)
        layers = [m.allocate_inference_cache(max_batch_size, max_seqlen, dtype=dtype, device=device, table=table)
                  for m in mixers]
        return cls(model, table, layers, dtype, device)

    @property
    def capacity(self) -> int:
        return self.table.capacity

    @property
    def max_seqlen(self) -> int:
        return self.table.max_seqlen

    @property
    def lengths(self) -> torch.Tensor:
        """``[S]`` tokens each slot holds (a host copy)."""
        return self.table.lengths.clone()

    def free_slots(self) -> list[int]:
        """The slots that hold no token."""
        return torch.nonzero(self.table.lengths == 0).reshape(-1).tolist()

    def check(self, owner, dtype: torch.dtype, device, what: str = "input_ids") -> None:
        """Refuse a cache of another model, dtype or device (nothing is written); ``what`` names the
        thing on ``device`` in the message."""
        if self._owner() is not owner:
            raise ValueError(f"this cache was allocated by another {self.owner_name}; allocate one with this "
                             "model's allocate_inference_cache (a cache serves the model that allocated it)")
        if dtype != self.dtype:
            raise ValueError(f"the cache was allocated for {self.dtype} activations but the model now runs "
                             f"{dtype}; allocate a new cache (allocate_inference_cache(..., dtype={dtype}))")
        if torch.device(device) != self.device:
            raise ValueError(f"the cache lives on {self.device} but {what} on {device}; allocate it on the "
                             f"device of {what}")

    def resolve(self, cache_slots, rows: int, steps: int, varlen, device) -> SlotBatch:
        """Validate one call's slots (see :meth:`SlotTable.resolve`)."""
        return self.table.resolve(cache_slots, rows, steps, varlen, device)

    def advance(self, batch: SlotBatch) -> None:
        if batch.table is not self.table:
            raise ValueError("cache_slots were resolved for another cache")
        self.table.advance(batch)

    def reset(self, slots=None) -> None:
        """Free ``slots`` (default: every slot) for new sequences: zero states, no tokens."""
        host = self.table.reset(list(range(self.capacity)) if slots is None else slots)
        for layer in self.layers:
            layer.clear(host)

    def __repr__(self) -> str:
        return (f"InferenceCache({self.owner_name}, {len(self.layers)} mixers, {self.capacity} slots x "
                f"{self.max_seqlen} tokens, dtype={self.dtype}, device={self.device})")
