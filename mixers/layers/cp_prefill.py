"""Context-parallel prefill: a prompt split over the ranks of a CP group fills the cache of the
rank (or ranks) that will decode it with exactly what a one-process prefill leaves there.

    P = ranks, r = this rank, N = documents of the row (one slot each), T = tokens of the row,
    R_r = real tokens of rank r's shard (those before the padding tail)

Every rank calls the usual packed prefill on its shard: ``packed_seq_params`` from
:func:`ssm_pack.shard_for_context_parallel` with ``cp_group`` set, and the **same**
``cache_slots`` on every rank; a rank passes ``cache=`` where the states should land and
``cache=None`` elsewhere (one rank: gather to the decoder; every rank: each gets the whole
cache). The mixers run their context-parallel ops (state passing, as in training), so each
document's final conv and recurrent states come out exact on the rank holding its end
(:meth:`~ssm_pack.parallel.layout.ContextParallelRun.mask_owned`), and each rank's keys and
values are those of its own tokens. Then, per mixer, before anything is stored:

* states ``[N, ...]``: the rank owning document i sends row i to every rank with a cache, which
  stores the owners' rows (a copy: nothing is summed, so the slot holds the owner's bits);
* keys and values ``[R_r, Hk, Dh]``: each rank sends its real tokens' to every rank with a
  cache, which stores them in row order at their documents' slots and positions.

Each is one :func:`mixers.ops.common.cp_exchange.exchange` (an ``all_to_all_single`` sending only
to the ranks with a cache, counted by ``record_traffic`` under ``"prefill state"`` and
``"prefill kv"``). The cache's slot lengths then advance by each document's whole length, and
decoding continues on a rank with the cache as after a one-process prefill.

Before any of it, one ``all_gather_object`` over the group (:func:`agree`) collects from every
rank whether it holds a cache, its ``cache_slots`` and any problem it found with its own input,
so that a refusal is one exception on every rank (never a rank waiting in a collective its peers
skipped) and no cache is touched. Refused: slots that differ between ranks, no rank with a
cache, a slot that already holds tokens (a CP prefill starts sequences; continue them with a
one-process call on a rank with the cache), per-document padding in the boundaries (checked
first, from the params alone: :func:`refuse_unsupported`), and every single-process refusal of
the cache (another model, dtype or device, a slot out of range or repeated, ``max_seqlen``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..inference.slots import SlotBatch, SlotTable, parse_slots
from ..ops.common.cp_exchange import exchange


def is_context_parallel(packed_seq_params) -> bool:
    """The params describe a rank's shard of a row split over ranks (reads attributes only)."""
    if packed_seq_params is None:
        return False
    if getattr(packed_seq_params, "cp", None) is not None:              # a resolved VarlenBatch
        return True
    layout = getattr(packed_seq_params, "cp_layout", None)
    return layout is not None and layout.size > 1


def refuse_unsupported(packed_seq_params, name: str) -> None:
    """What a CP prefill cannot take, read from the params alone (the same answer on every rank, so
    it raises on every rank before any collective): per-document padding."""
    padded = getattr(packed_seq_params, "cu_seqlens_q_padded", None)
    if padded is None:
        return
    real = packed_seq_params.cu_seqlens_q
    if isinstance(padded, torch.Tensor) and isinstance(real, torch.Tensor) and torch.equal(
            padded.to("cpu", torch.int64), real.to("cpu", torch.int64)):
        return
    raise ValueError(f"{name}: a context-parallel prefill needs tight boundaries, but packed_seq_params carry "
                     "per-document padding (cu_seqlens_q_padded differs from cu_seqlens_q); build the row without "
                     "pad_to_multiple_of before shard_for_context_parallel (a padding tail after the last document "
                     "is fine)")


def _document_lengths(layout) -> torch.Tensor:
    """``[N]`` int64 tokens of each document in the whole row (tight boundaries)."""
    cover = layout.cover[:-1]
    return cover[1:] - cover[:-1]


class ContextParallelPrefill:
    """One CP prefill call on one rank: the agreed slots, the ranks with a cache, and the exchanges
    that bring the states and the keys and values to them."""

    def __init__(self, varlen, batch: SlotBatch, holders: tuple[int, ...]):
        self.varlen, self.batch, self.holders = varlen, batch, holders
        self.run = varlen.cp
        self.layout = self.run.layout

    @property
    def holds(self) -> bool:
        return self.run.rank in self.holders

    def _receivers(self) -> list[int]:
        return [h for h in self.holders if h != self.run.rank]

    def states(self, values: torch.Tensor) -> torch.Tensor | None:
        """This rank's per-document final states ``[N, ...]`` (exact on the documents it owns) ->
        every document's from its owner, on a rank with a cache (``None`` elsewhere)."""
        r, owners = self.run.rank, self.layout.owners
        mine = torch.nonzero(owners == r).reshape(-1).to(values.device)
        sends = {h: [values.index_select(0, mine)] for h in self._receivers()}
        recvs = {}
        if self.holds:
            recvs = {j: [(int((owners == j).sum()), *values.shape[1:])] for j in range(self.layout.size)
                     if j != r and bool((owners == j).any())}
        got = exchange(self.run, "prefill state", sends, recvs, values.dtype, chained=False)
        if not self.holds:
            return None
        full = values.clone()
        for j, (rows,) in got.items():
            full.index_copy_(0, torch.nonzero(owners == j).reshape(-1).to(values.device), rows)
        return full

    def _real_counts(self) -> list[int]:
        """``R_j`` for every rank: its tokens before the padding tail."""
        end = int(self.layout.cover[-2])
        bounds = self.layout.bounds
        return [max(0, min(bounds[j + 1], end) - bounds[j]) for j in range(self.layout.size)]

    def tokens(self, values: torch.Tensor) -> torch.Tensor | None:
        """This rank's real tokens' ``values [R_r, ...]`` -> the whole row's ``[sum R_j, ...]`` in row
        order, on a rank with a cache (``None`` elsewhere)."""
        r, counts = self.run.rank, self._real_counts()
        sends = {h: [values] for h in self._receivers()} if values.shape[0] else {}
        recvs = {}
        if self.holds:
            recvs = {j: [(counts[j], *values.shape[1:])] for j in range(self.layout.size) if j != r and counts[j]}
        got = exchange(self.run, "prefill kv", sends, recvs, values.dtype, chained=False)
        if not self.holds:
            return None
        pieces = [values if j == r else got[j][0] for j in range(self.layout.size) if counts[j]]
        return torch.cat(pieces) if pieces else values[:0]

    def token_places(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(slots, positions)`` ``[sum R_j]`` of the row's real tokens in row order (fresh slots:
        a token's position is its place in its document)."""
        cover = self.layout.cover[:-1]
        index = torch.arange(int(cover[-1]), dtype=torch.int64)
        doc = torch.searchsorted(cover, index, right=True) - 1
        device = self.batch.device
        return self.batch.slots[doc.to(device)], (index - cover[doc]).to(device)


class ShardedLayerCache:
    """What a mixer's cached forward writes to during a CP prefill: the rank's
    :class:`~mixers.inference.LayerCache` (or ``None`` on a rank without a cache) behind the
    exchanges of :class:`ContextParallelPrefill`. Its slots are fresh, so nothing is read."""

    def __init__(self, prefill: ContextParallelPrefill, local):
        self.prefill, self.local = prefill, local

    @property
    def table(self) -> SlotTable:
        return self.prefill.batch.table

    def check(self, owner, hidden_states: torch.Tensor) -> None:
        if self.local is not None:
            self.local.check(owner, hidden_states)

    def gather(self, name: str, batch: SlotBatch):
        raise RuntimeError(f"a context-parallel prefill starts fresh slots; nothing to read ({name})")

    def __getitem__(self, name: str):
        raise RuntimeError(f"a context-parallel prefill starts fresh slots; nothing to read ({name})")

    def write(self, name: str, batch: SlotBatch, values: torch.Tensor) -> None:
        full = self.prefill.states(values.detach())
        if self.local is not None:
            self.local.write(name, batch, full)

    def write_tokens(self, name: str, slots: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> None:
        full = self.prefill.tokens(values.detach())
        if self.local is not None:
            self.local.write_tokens(name, *self.prefill.token_places(), full)


def agree(varlen, cache, cache_slots, *, name: str, check_cache, rows: int, device) -> ContextParallelPrefill:
    """Check this rank's part of a CP prefill and agree with the others (one ``all_gather_object``):
    every rank raises if any rank found a problem, nothing is written.

    ``check_cache(cache)`` checks a given cache (its type, owner, dtype, device) and returns its
    :class:`~mixers.inference.SlotTable` (a model's or a mixer's cache)."""
    run = varlen.cp
    layout = run.layout
    counts = _document_lengths(layout)
    error, host, batch = None, None, None
    try:
        if rows != 1:
            raise ValueError(f"{name}: a packed call is one row [1, T], got {rows} rows")
        host = parse_slots("cache_slots", cache_slots, None)
        if cache is not None:
            table = check_cache(cache)
            batch = table.resolve(cache_slots, 1, varlen.total_tokens, varlen, device, counts=counts)
            busy = [s for s, start in zip(batch.host, batch.starts.tolist()) if start]
            if busy:
                raise ValueError(f"{name}: a context-parallel prefill starts sequences, but slot {busy[0]} already "
                                 f"holds {int(cache.table.lengths[busy[0]])} tokens; reset it (cache.reset"
                                 f"([{busy[0]}])) or continue it with a one-process call on this rank")
    except (TypeError, ValueError) as err:
        error = err
    mine = {"holds": cache is not None, "slots": host, "problem": None if error is None else str(error)}
    every = [None] * layout.size
    dist.all_gather_object(every, mine, group=run.group)
    if error is not None:
        raise error
    for j, theirs in enumerate(every):
        if theirs["problem"] is not None:
            raise ValueError(f"{name}: rank {j} of the context-parallel prefill refused its input, so this rank "
                             f"stops too (nothing was written): {theirs['problem']}")
    slots = [theirs["slots"] for theirs in every]
    if any(s != host for s in slots):
        raise ValueError(f"{name}: every rank of a context-parallel prefill must pass the same cache_slots (one per "
                         f"document of the whole row), got {', '.join(f'rank {j}: {s}' for j, s in enumerate(slots))}")
    holders = tuple(j for j, theirs in enumerate(every) if theirs["holds"])
    if not holders:
        raise ValueError(f"{name}: no rank of the context-parallel prefill passed cache=; pass the cache on the "
                         "rank that will decode (cache=None on the others)")
    if batch is None:      # a rank without a cache: the same slots, resolved against a table of their size
        longest = int(counts.max()) if counts.numel() else 0
        table = SlotTable(max(host, default=0) + 1, max(longest, 1))
        batch = table.resolve(host, 1, varlen.total_tokens, varlen, device, counts=counts)
    return ContextParallelPrefill(varlen, batch, holders)


__all__ = ["ContextParallelPrefill", "ShardedLayerCache", "agree", "is_context_parallel", "refuse_unsupported"]
