"""Context parallelism (CP): one packed row split over the ranks of a process group, exactly.

    P = ranks, r = this rank, T = tokens of the whole physical row, T_r = tokens of rank r,
    N = documents, segment = a document or the padding tail (segment N, empty without a tail)

The row is cut into P contiguous shards ``bounds[r]:bounds[r+1]`` (even by default, any
non-empty sizes with ``bounds=``). Each rank runs its shard with the **global** document
structure, so a segment crossing a rank boundary continues exactly:

* :func:`shard_for_context_parallel` returns ``(start, end, local)``: ``local`` is a
  :class:`~ssm_pack.PackedSeqParams` of the rank's ``T_r`` tokens (its documents clipped to the
  shard, empty where a document lies elsewhere, so document indices stay global) carrying a
  :class:`ContextParallelLayout` (``local.cp_layout``);
* setting ``local.cp_group`` to the group (size P) turns CP on: :class:`ssm_pack.VarlenBatch`
  then carries a :class:`ContextParallelRun` (``varlen.cp``), every op given that metadata runs
  its context-parallel version (``mixers/ops/<op>/cp.py``), attention gets global positions,
  and ``HybridLM``'s loss is this rank's share of the row's mean.

The layout is plain integers known to every rank, so each rank can tell, without talking,
which ranks must exchange what (:mod:`mixers.ops.common.cp_exchange` does the talking).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ..checks import as_boundaries, check_boundaries, check_int, describe
from ..formats.params import PackedSeqParams
from ..formats.seq_idx import get_cu_seqlens
from .layout_check import check_layout_agreement


@dataclass(frozen=True, eq=False)
class ContextParallelLayout:
    """Where one packed row's shards lie (the same on every rank but for ``rank``).

    Attributes:
        rank: this rank's index in the CP group.
        bounds: ``P + 1`` token offsets of the shards in the physical row (0 ... T, increasing).
        cover: ``[N+2]`` int64 (CPU) physical document boundaries followed by T, so segment N is
            the padding tail.

    Per-rank facts (tuples of P entries, derived once): ``first_seg`` / ``last_seg`` (segment of
    the rank's first / last token), ``continues_in`` (the first segment started on an earlier
    rank), ``continues_out`` (the last segment goes on after the rank), ``first_len`` /
    ``last_len`` (tokens of those segments on the rank), ``last_starts_here``.
    """

    rank: int
    bounds: tuple
    cover: torch.Tensor

    @property
    def size(self) -> int:
        return len(self.bounds) - 1

    @property
    def total_tokens(self) -> int:
        return self.bounds[-1]

    @property
    def start(self) -> int:
        return self.bounds[self.rank]

    @property
    def end(self) -> int:
        return self.bounds[self.rank + 1]

    @property
    def local_tokens(self) -> int:
        return self.end - self.start

    @property
    def num_docs(self) -> int:
        return self.cover.numel() - 2

    @cached_property
    def _facts(self) -> dict:
        cover = self.cover
        starts = torch.tensor(self.bounds[:-1], dtype=torch.int64)
        ends = torch.tensor(self.bounds[1:], dtype=torch.int64)
        first = torch.searchsorted(cover, starts, right=True) - 1
        last = torch.searchsorted(cover, ends - 1, right=True) - 1
        cont_in = cover[first] < starts
        cont_out = cover[last + 1] > ends
        last_start = torch.maximum(cover[last], starts)
        facts = {
            "first_seg": first, "last_seg": last, "continues_in": cont_in, "continues_out": cont_out,
            "first_len": torch.minimum(cover[first + 1], ends) - starts, "last_len": ends - last_start,
            "first_seg_start": cover[first], "last_starts_here": last_start > starts,
        }
        facts["last_starts_here"] = facts["last_starts_here"] | ~cont_in
        return {name: tuple(v.tolist()) for name, v in facts.items()}

    first_seg = property(lambda self: self._facts["first_seg"])
    last_seg = property(lambda self: self._facts["last_seg"])
    continues_in = property(lambda self: self._facts["continues_in"])
    continues_out = property(lambda self: self._facts["continues_out"])
    first_len = property(lambda self: self._facts["first_len"])
    last_len = property(lambda self: self._facts["last_len"])
    first_seg_start = property(lambda self: self._facts["first_seg_start"])
    last_starts_here = property(lambda self: self._facts["last_starts_here"])

    @cached_property
    def owners(self) -> torch.Tensor:
        """``[N]`` int64: the rank that returns document i's final state, the one holding its last
        token (for an empty document, the one holding its position; position T: the last rank)."""
        ends = torch.tensor(self.bounds[1:], dtype=torch.int64)
        return torch.searchsorted(ends, self.cover[1:-1], right=False).clamp(max=self.size - 1)

    def rank_of(self, token: int) -> int:
        """The rank holding global token ``token`` (``0 <= token < T``)."""
        return int(torch.searchsorted(torch.tensor(self.bounds[1:]), token, right=True))

    def __repr__(self) -> str:
        return (f"ContextParallelLayout(rank={self.rank}, size={self.size}, shard={self.start}:{self.end}, "
                f"total_tokens={self.total_tokens}, documents={self.num_docs})")


def _check_bounds(bounds, cp_size: int, total: int) -> tuple:
    if bounds is None:
        if total < cp_size:
            raise ValueError(f"total_tokens={total} is smaller than cp_size={cp_size}: every rank needs at least "
                             "one token; use fewer ranks or a longer row")
        return tuple(r * total // cp_size for r in range(cp_size + 1))
    if isinstance(bounds, torch.Tensor):
        bounds = bounds.tolist()
    try:
        bounds = tuple(check_int(f"bounds[{i}]", b) for i, b in enumerate(bounds))
    except TypeError as err:
        raise TypeError(f"bounds must be {cp_size + 1} ints (the shard offsets 0 ... {total}): {err}") from None
    if len(bounds) != cp_size + 1 or bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(f"bounds must be cp_size + 1 = {cp_size + 1} offsets from 0 to total_tokens={total} "
                         f"that tile the row, got {list(bounds)}")
    for i in range(cp_size):
        if bounds[i + 1] <= bounds[i]:
            raise ValueError(f"bounds must increase (every rank needs at least one token), got bounds[{i}]="
                             f"{bounds[i]} and bounds[{i + 1}]={bounds[i + 1]} in {list(bounds)}")
    return bounds


def whole_row(params, total_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor, bool, int]:
    """The boundaries of a whole packed row, checked: ``(physical, real, padded, T)``.

    Args:
        params: the whole row's :class:`~ssm_pack.PackedSeqParams` or its ``cu_seqlens``.
        total_tokens: T (default ``params.total_tokens``, else the last physical boundary).

    Returns:
        ``physical`` [N+1] int64 (CPU): the padded slot boundaries (the physical layout);
        ``real`` [N+1] int64: cumulative real-token counts (equal to ``physical`` without padding);
        ``padded``: whether ``params`` carry padded boundaries; ``T``: the row length.

    Raises ``ValueError`` for a shard's params (``cp_layout`` set), boundaries that do not agree
    (counts, a document longer than its slot) and a T shorter than the last boundary.
    """
    if hasattr(params, "cu_seqlens_q"):
        if getattr(params, "cp_layout", None) is not None:
            raise ValueError("params are already one rank's shard (params.cp_layout is set); pass the whole row's "
                             "PackedSeqParams")
        physical = as_boundaries("params.cu_seqlens", get_cu_seqlens(params)).to("cpu", torch.int64)
        real = as_boundaries("params.cu_seqlens_q", params.cu_seqlens_q).to("cpu", torch.int64)
        padded = getattr(params, "cu_seqlens_q_padded", None) is not None
        given_total = getattr(params, "total_tokens", None)
    else:
        physical = real = as_boundaries("params", params).to("cpu", torch.int64)
        padded, given_total = False, None
    check_boundaries("params.cu_seqlens", physical)
    check_boundaries("params.cu_seqlens_q", real)
    if real.numel() != physical.numel():
        raise ValueError(f"params.cu_seqlens_q has {real.numel()} offsets but the padded boundaries "
                         f"{physical.numel()}; give both for the same documents")
    lengths, slots = real[1:] - real[:-1], physical[1:] - physical[:-1]
    if bool((lengths > slots).any()):
        i = int(torch.nonzero(lengths > slots)[0, 0])
        raise ValueError(f"document {i} has {int(lengths[i])} real tokens but a padded slot of {int(slots[i])}; "
                         "the padded boundaries must hold every document")
    last = int(physical[-1])
    total = total_tokens if total_tokens is not None else (given_total if given_total is not None else last)
    total = check_int("total_tokens", total, minimum=0)
    if total < last:
        raise ValueError(f"total_tokens={total} is smaller than the last physical boundary {last}; pass the "
                         "length of the whole packed row")
    return physical, real, padded, total


def shard_for_context_parallel(params, cp_rank: int, cp_size: int, *, total_tokens: int | None = None,
                               bounds=None, cp_group=None):
    """Rank ``cp_rank``'s contiguous shard of a packed row split over ``cp_size`` ranks.

    Args:
        params: the whole row's :class:`~ssm_pack.PackedSeqParams` (padded boundaries are the
            physical layout, as everywhere) or its ``cu_seqlens``.
        cp_rank, cp_size: this rank and the number of ranks.
        total_tokens: T, the physical row length (default ``params.total_tokens``, else the
            last boundary); tokens after the last boundary are the padding tail.
        bounds: ``cp_size + 1`` increasing offsets ``0 ... T`` for uneven shards (default: even
            split, sizes differing by at most one token).
        cp_group: optionally set ``local.cp_group`` (must have ``cp_size`` ranks).

    Returns:
        ``(start, end, local)``: the shard is ``tokens[:, start:end]`` and ``local`` its
        ``PackedSeqParams`` (``end - start`` tokens, N documents clipped to the shard, the
        layout in ``local.cp_layout``). Set ``local.cp_group`` before the forward.
    """
    cp_size = check_int("cp_size", cp_size, minimum=1)
    cp_rank = check_int("cp_rank", cp_rank, minimum=0)
    if cp_rank >= cp_size:
        raise ValueError(f"cp_rank must be in [0, cp_size={cp_size}), got {cp_rank}")
    physical, real, padded, total = whole_row(params, total_tokens)
    bounds = _check_bounds(bounds, cp_size, total)
    layout = ContextParallelLayout(cp_rank, bounds, torch.cat([physical, physical.new_tensor([total])]))
    start, end = layout.start, layout.end
    local_physical = (physical - start).clamp(0, end - start)
    if padded:   # each document's real tokens open its padded slot: clip that range to the shard
        real_ends = physical[:-1] + (real[1:] - real[:-1])
        lengths = (torch.minimum(real_ends, physical.new_tensor(end))
                   - torch.maximum(physical[:-1], physical.new_tensor(start))).clamp(min=0)
        local_real = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    else:
        local_real = local_physical
    local_real, local_physical = local_real.to(torch.int32), local_physical.to(torch.int32)
    longest = int((local_physical[1:] - local_physical[:-1]).max()) if local_physical.numel() > 1 else 0
    local = PackedSeqParams(qkv_format="thd", cu_seqlens_q=local_real, cu_seqlens_kv=local_real,
                            cu_seqlens_q_padded=local_physical if padded else None,
                            cu_seqlens_kv_padded=local_physical if padded else None,
                            max_seqlen_q=longest, max_seqlen_kv=longest, total_tokens=end - start,
                            pad_between_seqs=padded or None, cp_layout=layout)
    if cp_group is not None:
        _check_group(cp_group, layout)
        local.cp_group = cp_group
    return start, end, local


def _group_size(group) -> int:
    size = getattr(group, "size", None)
    if not callable(size):
        raise TypeError(f"cp_group must be a process group (with .size()), got {describe(group)}")
    return int(size())


def _check_group(group, layout: ContextParallelLayout) -> None:
    size = _group_size(group)
    if size != layout.size:
        raise ValueError(f"cp_group has {size} ranks but the params were sharded for cp_size={layout.size}; "
                         f"shard with shard_for_context_parallel(params, rank, {size}) or pass the matching group")
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized() and isinstance(group, dist.ProcessGroup):
        rank = dist.get_rank(group)
        if rank != layout.rank:
            raise ValueError(f"these params are cp_rank {layout.rank}'s shard but this process is rank {rank} of "
                             f"cp_group; shard with shard_for_context_parallel(params, {rank}, {size})")


def resolve(params, total_tokens: int, device, build_local) -> ContextParallelRun | None:
    """The CP run of one forward (``None``: CP off), checking the group against the layout and,
    collectively, that every rank holds the same layout (:mod:`ssm_pack.parallel.layout_check`).

    ``build_local(cu_seqlens, total_tokens, device=...)`` builds the run's local, CP-free
    metadata (:meth:`ssm_pack.VarlenBatch.build`, passed in by its caller).
    """
    layout = getattr(params, "cp_layout", None)
    group = getattr(params, "cp_group", None)
    if layout is None:
        if group is not None and _group_size(group) > 1:
            raise ValueError(f"packed_seq_params.cp_group has {_group_size(group)} ranks but the params describe a "
                             "whole row; give each rank its shard: start, end, local = "
                             "ssm_pack.shard_for_context_parallel(params, rank, cp_size), then local.cp_group = group")
        return None
    if group is None:
        raise ValueError(f"these params are rank {layout.rank}'s shard of a row split over {layout.size} ranks "
                         "(params.cp_layout) but params.cp_group is None; set params.cp_group to the CP group "
                         "(or run the whole row's params on one process)")
    _check_group(group, layout)
    if total_tokens != layout.local_tokens:
        raise ValueError(f"rank {layout.rank}'s shard has {layout.local_tokens} tokens "
                         f"({layout.start}:{layout.end}) but the input has {total_tokens}; pass "
                         f"tokens[:, {layout.start}:{layout.end}]")
    if layout.size == 1:
        return None
    device = torch.device(device) if device is not None else torch.device("cpu")
    check_layout_agreement(layout, group, device)       # an all-reduce; + an all-gather for a new layout
    return ContextParallelRun(layout, group, device, build_local)


class ContextParallelRun:
    """The CP facts of one forward on one rank (``VarlenBatch.cp``): the layout, the group, the
    local row as the ops see it, and the order of this forward's collectives (``token``, see
    :mod:`mixers.ops.common.cp_exchange`)."""

    def __init__(self, layout: ContextParallelLayout, group, device: torch.device, build_local):
        self.layout, self.group, self.device = layout, group, device
        self._build_local = build_local
        self.token: torch.Tensor | None = None

    @property
    def rank(self) -> int:
        return self.layout.rank

    @cached_property
    def local_cover(self):
        """:class:`~ssm_pack.VarlenBatch` of the local row with N + 1 documents (the padding tail is
        document N), no CP: what each op's local pass runs on."""
        lay = self.layout
        cu = (lay.cover - lay.start).clamp(0, lay.local_tokens).to(device=self.device, dtype=torch.int32)
        return self._build_local(cu, lay.local_tokens, device=self.device)

    @cached_property
    def after_first(self):
        """:class:`~ssm_pack.VarlenBatch` of the local row without its first segment's ``first_len``
        tokens (that segment empty, documents as in :attr:`local_cover`): for ops that run the
        continuing segment apart."""
        cu = (self.local_cover.cu_seqlens - self.first_len).clamp(min=0)
        return self._build_local(cu, self.layout.local_tokens - self.first_len, device=self.device)

    @cached_property
    def owned(self) -> torch.Tensor:
        """``[N]`` bool: this rank returns document i's final state (it holds its end)."""
        return (self.layout.owners == self.rank).to(self.device)

    @property
    def continues_in(self) -> bool:
        return self.layout.continues_in[self.rank]

    @property
    def continues_out(self) -> bool:
        return self.layout.continues_out[self.rank]

    @property
    def first_len(self) -> int:
        return self.layout.first_len[self.rank]

    def global_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Local per-segment positions ``[1, T_r]`` -> global ones (the first segment continues)."""
        lay = self.layout
        offset = lay.start - lay.first_seg_start[self.rank]
        if offset == 0:
            return positions
        return torch.cat([positions[:, :self.first_len] + offset, positions[:, self.first_len:]], dim=1)

    def mask_owned(self, states: torch.Tensor) -> torch.Tensor:
        """Per-document states ``[N, ...]``: zero the rows this rank does not own."""
        keep = self.owned.reshape(-1, *([1] * (states.dim() - 1)))
        return torch.where(keep, states, torch.zeros((), dtype=states.dtype, device=states.device))

    def anchor(self, out: torch.Tensor) -> torch.Tensor:
        """``out`` made to depend on the forward's last collective (adds an exact zero), so every
        rank's backward reaches every collective, in reverse order."""
        if self.token is None or not self.token.requires_grad:
            return out
        return out + self.token.reshape(-1)[:0].sum().to(out.dtype)

    def __repr__(self) -> str:
        return f"ContextParallelRun({self.layout!r})"


__all__ = ["ContextParallelLayout", "ContextParallelRun", "shard_for_context_parallel"]
