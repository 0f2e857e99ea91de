"""Budgeted pack planner: group documents into packs of at most ``max_tokens`` tokens.

    N = documents, P = packs

First-fit-decreasing: documents sorted by (aligned) length, longest first, each placed in the
first pack with room. A max-segment-tree over the packs' free space finds that pack in
``O(log P)``, so planning 20,000 documents takes milliseconds. ``align_to`` pads every document
up to a multiple (context parallelism needs ``2 * cp_size``, block-sparse attention its block
size); the padding counts against the budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..checks import as_index_tensor, check_int, check_lengths, describe
from ..formats.boundaries import _gather_index, lengths_to_cu_seqlens, position_ids_from_cu_seqlens
from ..formats.params import PackedSeqParams
from ..formats.seq_idx import seq_idx_from_cu_seqlens


class _FirstFit:
    """Leftmost bin with at least ``need`` free tokens, bins opened on demand."""

    def __init__(self, max_bins: int, capacity: int):
        self.size = 1
        while self.size < max(max_bins, 1):
            self.size *= 2
        self.tree = [capacity] * (2 * self.size)  # unopened bins are empty bins

    def place(self, need: int) -> int:
        node = 1
        if self.tree[node] < need:
            raise AssertionError("every document fits an empty bin")  # checked by the caller
        while node < self.size:
            node = 2 * node if self.tree[2 * node] >= need else 2 * node + 1
        leaf = node - self.size
        self.tree[node] -= need
        node //= 2
        while node:
            self.tree[node] = max(self.tree[2 * node], self.tree[2 * node + 1])
            node //= 2
        return leaf


@dataclass(frozen=True)
class PackPlan:
    """Which documents go in which pack, and what the packing saved.

    Attributes:
        packs: document indices per pack, in placement order.
        lengths: the documents' real lengths.
        max_tokens / align_to: the budget and alignment used.
        padded_row_length: row length of the padded batch this plan is compared against
            (the longest document unless given).
    """

    packs: tuple[tuple[int, ...], ...]
    lengths: tuple[int, ...]
    max_tokens: int
    align_to: int
    padded_row_length: int

    @property
    def real_tokens(self) -> int:
        return sum(self.lengths)

    def pack_tokens(self, i: int) -> int:
        """Physical tokens of pack ``i`` (real plus alignment padding)."""
        a = self.align_to
        return sum((self.lengths[d] + a - 1) // a * a for d in self.packs[i])

    @property
    def padding_fraction_padded(self) -> float:
        """Padding share of the padded batch: one row of ``padded_row_length`` per document."""
        slots = len(self.lengths) * self.padded_row_length
        return 1.0 - self.real_tokens / slots if slots else 0.0

    @property
    def padding_fraction_packed(self) -> float:
        """Padding share of the packs as fixed rows of ``max_tokens`` (alignment and tails)."""
        slots = len(self.packs) * self.max_tokens
        return 1.0 - self.real_tokens / slots if slots else 0.0

    @property
    def padding_removed(self) -> float:
        """Fraction of the padded batch's padding tokens that packing removed."""
        pad_before = len(self.lengths) * self.padded_row_length - self.real_tokens
        pad_after = len(self.packs) * self.max_tokens - self.real_tokens
        return 1.0 - pad_after / pad_before if pad_before else 0.0

    def packed_seq_params(self, i: int, *, fixed_length: bool = True, device=None) -> PackedSeqParams:
        """Metadata of pack ``i``: its documents back to back, each aligned to ``align_to``.

        ``fixed_length=True`` sets ``total_tokens = max_tokens`` (static shapes; the tail is one
        extra document in ``seq_idx``), else the pack's own physical length.
        """
        lengths = [self.lengths[d] for d in self.packs[self._check_pack(i)]]
        return PackedSeqParams.from_lengths(lengths, pad_to_multiple_of=self.align_to, device=device,
                                            total_tokens=self.max_tokens if fixed_length else None)

    def assemble(self, i: int, tokens, *, labels=None, loss_mask=None, position_ids=None,
                 fixed_length: bool = True, pad_token_id: int = 0, device=None) -> dict:
        """Pack ``i``'s tokens laid out exactly as :meth:`packed_seq_params` describes them.

        :func:`ssm_pack.assemble_packed_sequence` builds a tight row (documents back to back);
        this plan's metadata describes each document in a slot aligned to ``align_to`` (and,
        with ``fixed_length``, a row of ``max_tokens``), so use this to build the row for it.

        Args:
            i: the pack.
            tokens / labels / loss_mask / position_ids: the plan's documents, indexed like the
                ``lengths`` it was made from: a padded ``[N, S]`` tensor (row ``d`` holds document
                ``d`` in its first ``lengths[d]`` entries; MRoPE positions ``[3, N, S]``) or a
                sequence of ``N`` token sequences (tensors, lists of ints, bytes) of exactly
                ``lengths[d]`` entries. Only ``tokens`` is required.
            fixed_length / device: as for :meth:`packed_seq_params`.
            pad_token_id: the token id written into the padding.

        Returns:
            ``input_ids`` ``[1, T]`` (``pad_token_id`` on padding), ``labels`` ``[1, T]`` (``-100``
            on padding), ``loss_mask`` ``[1, T]`` (0 on padding), ``position_ids`` ``[1, T]`` or
            ``[3, 1, T]`` (given ones on the documents; counting on through each slot's padding and
            from 0 over a tail; built from the layout when not given) and ``packed_seq_params``
            (``labels`` / ``loss_mask`` are ``None`` when not given).
        """
        if device is None:
            device = next((v.device for v in (tokens, labels, loss_mask, position_ids) if isinstance(v, torch.Tensor)),
                          None)
        params = self.packed_seq_params(i, fixed_length=fixed_length, device=device)
        docs = self.packs[i]
        lengths = [self.lengths[d] for d in docs]
        physical = params.cu_seqlens.to(torch.int64)
        tight = lengths_to_cu_seqlens(lengths, device=physical.device).to(torch.int64)
        doc_of = seq_idx_from_cu_seqlens(tight, int(tight[-1]))[0].to(torch.int64)
        dest = torch.arange(int(tight[-1]), device=physical.device) - tight[doc_of] + physical[doc_of]  # real tokens

        def place(name, value, fill):
            if value is None:
                return None
            real = _documents(name, value, docs, lengths, self.lengths, device)            # [..., real tokens]
            out = real.new_full((*real.shape[:-1], params.total_tokens), fill)
            return out.index_copy_(-1, dest, real).unsqueeze(-2)

        layout_positions = position_ids_from_cu_seqlens(physical, params.total_tokens).to(device)   # [1, T]
        positions = place("position_ids", position_ids, 0)
        if positions is None:
            positions = layout_positions
        else:
            padding = torch.ones(params.total_tokens, dtype=torch.bool, device=device).index_fill_(0, dest, False)
            positions = torch.where(padding, layout_positions.to(positions.dtype), positions)
        return {"input_ids": place("tokens", tokens, pad_token_id), "labels": place("labels", labels, -100),
                "loss_mask": place("loss_mask", loss_mask, 0), "position_ids": positions,
                "packed_seq_params": params}

    def _check_pack(self, i) -> int:
        i = check_int("i", i, minimum=0)
        if i >= len(self.packs):
            raise ValueError(f"i must be a pack index in [0, {len(self.packs)}), got {i}")
        return i

    def summary(self) -> str:
        return (f"{len(self.lengths)} documents, {self.real_tokens} tokens -> {len(self.packs)} packs of "
                f"<= {self.max_tokens}: padding {self.padding_fraction_padded:.1%} (padded batch) -> "
                f"{self.padding_fraction_packed:.1%} (packed), {self.padding_removed:.1%} of it removed")


def _documents(name: str, value, docs, lengths, all_lengths, device) -> torch.Tensor:
    """The real tokens of documents ``docs`` of ``value`` back to back: ``[L]`` or ``[3, L]``."""
    n_docs = len(all_lengths)
    if isinstance(value, torch.Tensor):
        mrope = value.dim() == 3 and value.shape[0] == 3
        if value.dim() != 2 and not mrope:
            raise ValueError(f"{name} must be a padded [N, S] tensor (row d = document d; MRoPE position_ids "
                             f"[3, N, S]) or a sequence of N documents, got shape {tuple(value.shape)}")
        rows, width = value.shape[-2:]
        if rows != n_docs:
            raise ValueError(f"{name} has {rows} rows but the plan has {n_docs} documents; pass every "
                             "document the plan was made from, indexed like its lengths")
        if lengths and max(lengths) > width:
            raise ValueError(f"{name} rows hold {width} tokens but pack documents are up to {max(lengths)} long")
        index = _gather_index(torch.tensor(lengths, dtype=torch.int64), width,
                              rows=torch.tensor(docs, dtype=torch.int64)).to(value.device)
        flat = value.reshape(*value.shape[:-2], rows * width)
        return flat.index_select(-1, index).to(device)
    if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a padded [N, S] tensor or a sequence of N documents, got {describe(value)}")
    if len(value) != n_docs:
        raise ValueError(f"{name} holds {len(value)} documents but the plan has {n_docs}; pass every document "
                         "the plan was made from, indexed like its lengths")
    parts = []
    for d in docs:
        doc = value[d]
        doc = torch.tensor(list(doc)) if isinstance(doc, (bytes, bytearray)) else torch.as_tensor(doc)
        if doc.dim() != 1 or doc.shape[0] != all_lengths[d]:
            raise ValueError(f"{name}[{d}] has shape {tuple(doc.shape)} but the plan was made with lengths[{d}]="
                             f"{all_lengths[d]}; pass the same documents")
        parts.append(doc.to(device))
    if not parts:
        return torch.zeros(0, dtype=torch.int64, device=device)
    return torch.cat(parts)


def plan_packs(lengths, max_tokens: int, *, align_to: int = 1,
               padded_row_length: int | None = None) -> PackPlan:
    """Group documents of ``lengths`` into packs of at most ``max_tokens`` (first-fit-decreasing).

    Args:
        lengths: ``[N]`` real document lengths (list or integer tensor); zeros are allowed and
            cost nothing.
        max_tokens: token budget of one pack (aligned lengths count).
        align_to: pad each document up to a multiple of this.
        padded_row_length: row length of the padded batch to compare against (default: the
            longest document).

    Raises:
        ValueError: a document that does not fit ``max_tokens`` once aligned.
    """
    lengths_t = as_index_tensor("lengths", lengths)
    check_lengths("lengths", lengths_t)
    max_tokens = check_int("max_tokens", max_tokens, minimum=1)
    align_to = check_int("align_to", align_to, minimum=1)
    sizes = ((lengths_t + align_to - 1) // align_to * align_to).tolist()
    if sizes and max(sizes) > max_tokens:
        worst = max(range(len(sizes)), key=sizes.__getitem__)
        raise ValueError(f"document {worst} needs {sizes[worst]} tokens (length {int(lengths_t[worst])}, "
                         f"align_to={align_to}) but max_tokens={max_tokens}; raise max_tokens or split "
                         "long documents first")
    order = sorted(range(len(sizes)), key=lambda d: (-sizes[d], d))
    fit = _FirstFit(len(sizes), max_tokens)
    bins: list[list[int]] = []
    for d in order:
        b = fit.place(sizes[d])
        if b == len(bins):
            bins.append([])
        bins[b].append(d)
    real = tuple(int(x) for x in lengths_t.tolist())
    longest = max(real) if real else 0
    row = longest if padded_row_length is None else check_int("padded_row_length", padded_row_length,
                                                               minimum=longest)
    return PackPlan(packs=tuple(tuple(b) for b in bins), lengths=real, max_tokens=max_tokens,
                    align_to=align_to, padded_row_length=row)
