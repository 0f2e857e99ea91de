"""Slots: the per-sequence rows of an inference cache, and the slots one call names.

    S = slots (``max_batch_size``), N = documents (packed call) or rows (row call) of one call,
    T = tokens of the call, t = tokens per row

A :class:`SlotTable` is the bookkeeping every mixer cache of a model shares: how many tokens each
slot holds since its last reset (on the host: the caller knows how many tokens it feeds, so no
device value is read to keep it). A :class:`SlotBatch` is one call's slots, validated and
resolved once (like :class:`ssm_pack.VarlenBatch` for the packing metadata): a model builds it
once per forward and hands it to every mixer; a mixer called on its own builds it itself.
Validation happens before anything is written, so bad input leaves the cache unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from ssm_pack.checks import check_int, describe
from ssm_pack.varlen import VarlenBatch


def parse_slots(name: str, slots, capacity: int | None, *, unique: bool = True) -> list[int]:
    """``slots`` (a 1-D integer tensor or a sequence of ints) as host ints, each in ``0 .. capacity - 1``
    (``capacity=None``: any int >= 0), each once when ``unique``."""
    if slots is None:
        raise ValueError(f"{name} is required with cache=: one slot per document (packed call) or per row, "
                         f"e.g. {name}=[0, 1, 2]")
    if isinstance(slots, torch.Tensor):
        if slots.dim() != 1 or slots.is_floating_point() or slots.is_complex() or slots.dtype == torch.bool:
            raise TypeError(f"{name} must be a 1-D integer tensor or a list of ints, got {describe(slots)}")
        values = [int(s) for s in slots.tolist()]
    elif isinstance(slots, Sequence) and not isinstance(slots, (str, bytes)):
        values = []
        for s in slots:
            if isinstance(s, bool) or not isinstance(s, int):
                raise TypeError(f"{name} must hold ints, got element {describe(s)}")
            values.append(s)
    else:
        raise TypeError(f"{name} must be a 1-D integer tensor or a list of ints, got {describe(slots)}")
    seen: dict[int, int] = {}
    for i, s in enumerate(values):
        if s < 0 or (capacity is not None and s >= capacity):
            bound = "" if capacity is None else f" for a cache of {capacity} slots (max_batch_size)"
            fix = "slot indices >= 0" if capacity is None else f"0..{capacity - 1}"
            raise ValueError(f"{name}[{i}]={s} is out of range{bound}; use {fix}")
        if unique and s in seen:
            raise ValueError(f"{name} names slot {s} twice (entries {seen[s]} and {i}); every document or "
                             "row needs a slot of its own")
        seen.setdefault(s, i)
    return values


class SlotTable:
    """``capacity`` slots of up to ``max_seqlen`` tokens each; ``lengths`` (host int64 ``[S]``) is
    how many tokens each slot holds since its last reset (0 = fresh)."""

    def __init__(self, capacity: int, max_seqlen: int):
        self.capacity = check_int("max_batch_size", capacity, minimum=1)
        self.max_seqlen = check_int("max_seqlen", max_seqlen, minimum=1)
        self.lengths = torch.zeros(self.capacity, dtype=torch.int64)

    def indices(self, name: str, slots, *, unique: bool = True) -> list[int]:
        """``slots`` (a 1-D integer tensor or a sequence of ints) checked against the table."""
        return parse_slots(name, slots, self.capacity, unique=unique)

    def resolve(self, cache_slots, rows: int, steps: int, varlen: VarlenBatch | None, device, *,
                counts: torch.Tensor | None = None) -> SlotBatch:
        """Validate one call's slots; ``varlen`` is the packing of a ``[1, T]`` call (``None``: ``rows``
        rows of ``steps`` tokens, each row continuing its slot). ``counts`` (host int64 ``[N]``): the
        real tokens each document brings, where ``varlen`` holds only a part of them (a
        context-parallel shard: the whole row's, :mod:`mixers.layers.cp_prefill`)."""
        if counts is not None:
            what = f"{counts.numel()} documents (packed_seq_params)"
        elif varlen is not None:
            real = varlen.real_cu_seqlens.to("cpu", torch.int64)
            counts = real[1:] - real[:-1]
            what = f"{varlen.num_docs} documents (packed_seq_params)"
        else:
            counts = torch.full((rows,), steps, dtype=torch.int64)
            what = f"{rows} rows"
        host = self.indices("cache_slots", cache_slots)
        if len(host) != counts.numel():
            raise ValueError(f"cache_slots names {len(host)} slots but the call has {what}; pass one slot per "
                             f"{'document' if varlen is not None else 'row'}")
        starts = self.lengths[host] if host else torch.zeros(0, dtype=torch.int64)
        ends = starts + counts
        over = torch.nonzero(ends > self.max_seqlen).reshape(-1)
        if over.numel():
            i = int(over[0])
            raise ValueError(f"slot {host[i]} would hold {int(ends[i])} tokens ({int(starts[i])} cached + "
                             f"{int(counts[i])} new) but the cache was allocated with max_seqlen={self.max_seqlen}; "
                             "allocate a longer cache or reset the slot")
        slots = torch.tensor(host, dtype=torch.int64, device=device)
        return SlotBatch(table=self, slots=slots, host=tuple(host), starts=starts, counts=counts, varlen=varlen,
                         steps=steps)

    def advance(self, batch: SlotBatch) -> None:
        """After a call: each named slot holds its new tokens too."""
        if batch.host:
            self.lengths[list(batch.host)] += batch.counts

    def reset(self, slots) -> list[int]:
        """Mark ``slots`` fresh (repeats allowed); returns them."""
        host = self.indices("slots", slots, unique=False)
        if host:
            self.lengths[host] = 0
        return host


@dataclass(frozen=True, eq=False)
class SlotBatch:
    """One call's slots, resolved once (see the module docstring).

    Attributes:
        slots: ``[N]`` int64 on the tokens' device; ``host`` the same on the host.
        starts: ``[N]`` host int64 tokens each slot held before the call; ``counts``: real tokens
            the call adds to each.
        varlen: the packing of a packed ``[1, T]`` call, or ``None`` for ``[N, t]`` rows.
        steps: tokens per row of the input (T for a packed call, t for rows).
    """

    table: SlotTable
    slots: torch.Tensor
    host: tuple[int, ...]
    starts: torch.Tensor
    counts: torch.Tensor
    varlen: VarlenBatch | None
    steps: int

    @property
    def packed(self) -> bool:
        return self.varlen is not None

    @property
    def decode(self) -> bool:
        """Rows of one token each: the decode-step kernels' case."""
        return self.varlen is None and self.steps == 1

    @cached_property
    def all_fresh(self) -> bool:
        """No named slot holds a token yet: no initial state to read."""
        return not bool((self.starts > 0).any())

    @property
    def device(self) -> torch.device:
        return self.slots.device

    @cached_property
    def starts_device(self) -> torch.Tensor:
        return self.starts.to(self.device)

    @cached_property
    def ends_device(self) -> torch.Tensor:
        return (self.starts + self.counts).to(self.device)

    # ----------------------------------------------------------------- packed calls: state layout
    @cached_property
    def state_varlen(self) -> VarlenBatch | None:
        """The boundaries the conv and the scans get in a packed call, so each document's final
        state is the one after its last *real* token: the call's own, or, with per-document padding,
        every physical document split into its real tokens then its padding."""
        v = self.varlen
        if v is None or v.real_cu_seqlens is v.cu_seqlens:
            return v
        start = v.cu_seqlens[:-1].to(torch.int64)
        real_end = start + (v.real_cu_seqlens[1:] - v.real_cu_seqlens[:-1]).to(torch.int64)
        cu = torch.cat([torch.stack([start, real_end], 1).reshape(-1), v.cu_seqlens[-1:].to(torch.int64)])
        return VarlenBatch.build(cu.to(torch.int32), v.total_tokens, device=v.device)

    @cached_property
    def state_rows(self) -> torch.Tensor | None:
        """``[N]`` the entry of each document in :attr:`state_varlen` (``None``: the same order)."""
        if self.state_varlen is self.varlen:
            return None
        return torch.arange(0, 2 * len(self.host), 2, device=self.device)

    def spread(self, states: torch.Tensor | None) -> torch.Tensor | None:
        """Per-slot ``[N, ...]`` initial states -> one per document of :attr:`state_varlen` (zeros for
        the padding pieces)."""
        if states is None or self.state_rows is None:
            return states
        out = states.new_zeros(self.state_varlen.num_docs, *states.shape[1:])
        return out.index_copy(0, self.state_rows, states)

    def pick(self, states: torch.Tensor) -> torch.Tensor:
        """Final states of :attr:`state_varlen`'s documents -> one per named slot ``[N, ...]``."""
        return states if self.state_rows is None else states.index_select(0, self.state_rows)

    # ----------------------------------------------------------------- positions (attention)
    @cached_property
    def positions(self) -> torch.Tensor:
        """``[B, T]`` int64 position of every token in its sequence: the slot's cached length plus
        its place in the call (a packed call's padding gets its own positions, never read)."""
        if self.varlen is None:
            return self.starts_device.unsqueeze(1) + torch.arange(self.steps, device=self.device)
        doc = self.varlen.seq_idx[0].to(torch.int64)
        if not self.host:
            return self.varlen.position_ids
        offset = self.starts_device[doc.clamp(max=len(self.host) - 1)] * (doc < len(self.host))
        return (offset + self.varlen.position_ids[0]).unsqueeze(0)

    @cached_property
    def real_token_layout(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(index, doc, place)``: the real tokens of a packed call (their index in the row), the
        document of each, and its place within the document (device int64 ``[R]``)."""
        v = self.varlen
        doc = v.seq_idx[0].to(torch.int64)
        if v.cp is not None:        # a context-parallel shard (tight boundaries): every token before the tail
            keep = doc < v.num_docs
        else:
            keep = v.real_tokens[0] & (doc < v.num_docs)
        index = torch.nonzero(keep).reshape(-1)
        return index, doc[index], v.position_ids[0, index]

    @cached_property
    def longest(self) -> int:
        """The most real tokens any document of the call brings (at least 1)."""
        return max(int(self.counts.max()) if self.counts.numel() else 0, 1)
