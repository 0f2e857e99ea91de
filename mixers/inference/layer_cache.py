"""``LayerCache``: the per-slot states of one mixer.

    S = slots, ... = the state's own dims (upstream's layouts)

A mixer's cache is a few named tensors with the slot as their first dim (conv states ``[S, D,
W-1]``, recurrent states ``[S, H, P, Ns]`` / ``[S, HV, K, V]``, keys and values ``[S, L, Hk, Dh]``),
the :class:`~mixers.inference.slots.SlotTable` it shares with the other mixers of its model,
and the mixer that allocated it (a cache only serves its own mixer, in the dtype and on the
device it was allocated for). States are written detached: no autograd history is kept.
"""

from __future__ import annotations

import weakref

import torch

from .slots import SlotBatch, SlotTable


class LayerCache:
    """Per-slot states of one mixer (see the module docstring).

    Args:
        owner: the mixer.
        table: the slot table (shared by the mixers of one model cache).
        states: ``{name: [S, ...] tensor}``.
        dtype: the activations' dtype the cache serves (recurrent states are kept in the compute
            dtype: fp32 for fp16 / bf16).
        shared: the table belongs to a model cache (:class:`~mixers.inference.cache.InferenceCache`),
            which resets and advances it.
    """

    def __init__(self, owner, table: SlotTable, states: dict[str, torch.Tensor], dtype: torch.dtype, *,
                 shared: bool = False):
        self._owner = weakref.ref(owner)
        self.owner_name = type(owner).__name__
        self.table, self.states, self.dtype, self.shared = table, dict(states), dtype, shared
        self.device = next(iter(self.states.values())).device

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.states[name]

    def check(self, owner, hidden_states: torch.Tensor) -> None:
        """Refuse a cache of another mixer, dtype or device (nothing is written)."""
        if self._owner() is not owner:
            raise ValueError(f"this cache was allocated by another {self.owner_name}; allocate one with this "
                             "mixer's allocate_inference_cache (a cache serves the mixer that allocated it)")
        if hidden_states.dtype != self.dtype:
            raise ValueError(f"the cache was allocated for {self.dtype} but hidden_states are {hidden_states.dtype}; "
                             f"allocate a new cache (allocate_inference_cache(..., dtype={hidden_states.dtype}))")
        if hidden_states.device != self.device:
            raise ValueError(f"the cache lives on {self.device} but hidden_states on {hidden_states.device}; "
                             "allocate it on the input's device")

    def gather(self, name: str, batch: SlotBatch) -> torch.Tensor:
        """``[N, ...]`` copies of the named slots' state."""
        return self.states[name].index_select(0, batch.slots)

    def write(self, name: str, batch: SlotBatch, values: torch.Tensor) -> None:
        """Store ``values [N, ...]`` as the named slots' state."""
        state = self.states[name]
        state.index_copy_(0, batch.slots, values.detach().to(state.dtype))

    def write_tokens(self, name: str, slots: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``values [R, ...]`` at ``(slots[r], positions[r])`` (the keys and values of a packed call)."""
        state = self.states[name]
        state[slots, positions] = values.detach().to(state.dtype)

    def clear(self, slots: list[int]) -> None:
        """Zero the states of ``slots`` (the table is not touched)."""
        if slots:
            index = torch.tensor(slots, dtype=torch.int64, device=self.device)
            for state in self.states.values():
                state.index_fill_(0, index, 0)

    def reset(self, slots=None) -> None:
        """Make ``slots`` (default: all) fresh: zero states, no tokens. A mixer's cache that is part
        of a model cache is reset through the model cache, which resets every mixer together."""
        if self.shared:
            raise ValueError("this mixer cache is part of a model's InferenceCache; reset the slots there "
                             "(cache.reset(slots)) so every mixer of the model forgets them together")
        slots = range(self.table.capacity) if slots is None else slots
        self.clear(self.table.reset(list(slots) if isinstance(slots, range) else slots))

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}={list(v.shape)}" for k, v in self.states.items())
        return f"LayerCache({self.owner_name}, {shapes}, dtype={self.dtype}, device={self.device})"
