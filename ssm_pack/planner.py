"""Budgeted pack planner: group documents into packs of at most ``max_tokens`` tokens.

    N = documents, P = packs

First-fit-decreasing: documents sorted by (aligned) length, longest first, each placed in the
first pack with room. A max-segment-tree over the packs' free space finds that pack in
``O(log P)``, so planning 20,000 documents takes milliseconds. ``align_to`` pads every document
up to a multiple (context parallelism needs ``2 * cp_size``, block-sparse attention its block
size); the padding counts against the budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from .checks import as_index_tensor, check_int, check_lengths
from .params import PackedSeqParams


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
        lengths = [self.lengths[d] for d in self.packs[i]]
        return PackedSeqParams.from_lengths(lengths, pad_to_multiple_of=self.align_to, device=device,
                                            total_tokens=self.max_tokens if fixed_length else None)

    def summary(self) -> str:
        return (f"{len(self.lengths)} documents, {self.real_tokens} tokens -> {len(self.packs)} packs of "
                f"<= {self.max_tokens}: padding {self.padding_fraction_padded:.1%} (padded batch) -> "
                f"{self.padding_fraction_packed:.1%} (packed), {self.padding_removed:.1%} of it removed")


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
