"""Best-fit-decreasing over a bounded lookahead buffer: which pieces of which documents form a pack.

    U = slot units of a pack (``max_tokens // align_to``); a document of L tokens needs
    ``ceil(L / align_to)`` units

The buffer keeps its documents in one FIFO bucket per size (in units) and a bit mask of the
non-empty buckets (a Python int), so "the largest document that fits the room left" is one mask
and one ``bit_length``: each pack takes the largest buffered document, then the largest that
fits what is left, until nothing fits (the best-fit decreasing of Ding et al., 2024, "Fewer
Truncations Improve Language Modeling", over a window instead of the whole corpus).

Packs are planned in one global order on every rank and worker (only lengths are read), so every
shard agrees on the plan without communicating. Packs are planned in rounds of ``world``; slot
``j`` of a round plans with lane ``j`` and :func:`deal` gives the round's packs to ranks (one
each) to balance real tokens. Documents longer than a pack (``split_long="carry"``) wait in a
FIFO queue; their head fills the room a pack has left and the rest continues at the start of the
same rank's next pack (its lane), so a pack that touches a lane stays on that lane's rank.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(slots=True)
class Doc:
    """A document waiting in the buffer (``tokens`` is the source's object, unconverted)."""

    index: int
    doc: object
    length: int            # tokens to pack (after truncation)
    units: int


@dataclass(slots=True)
class Piece:
    """``length`` tokens of document ``index`` from token ``offset`` on."""

    index: int
    doc: object
    offset: int
    length: int
    continued: bool        # the document goes on in the next pack of this lane


class Buffer:
    """Documents by size: FIFO per size, a bit mask of the sizes present, and a queue of long ones."""

    def __init__(self):
        self.buckets: dict[int, deque] = {}
        self.mask = 0
        self.long: deque = deque()
        self.count = 0
        self.tokens = 0                                 # held, for the memory figure

    def __len__(self) -> int:
        return self.count

    def add(self, item: Doc, *, long: bool = False) -> None:
        self.count += 1
        self.tokens += item.length
        if long:
            self.long.append(item)
            return
        bucket = self.buckets.get(item.units)
        if bucket is None:
            bucket = self.buckets[item.units] = deque()
        if not bucket:
            self.mask |= 1 << item.units
        bucket.append(item)

    def extend(self, items: list[Doc]) -> None:
        """:meth:`add` for each of ``items`` (documents that fit a pack), in order."""
        buckets, mask = self.buckets, self.mask
        for item in items:
            bucket = buckets.get(item.units)
            if bucket is None:
                bucket = buckets[item.units] = deque()
            if not bucket:
                mask |= 1 << item.units
            bucket.append(item)
            self.tokens += item.length
        self.mask = mask
        self.count += len(items)

    def take_largest(self, room: int) -> Doc | None:
        """The oldest of the largest documents of at most ``room`` units, removed; ``None`` if none fits."""
        fits = self.mask & ((2 << room) - 1)
        if not fits:
            return None
        units = fits.bit_length() - 1
        bucket = self.buckets[units]
        item = bucket.popleft()
        if not bucket:
            self.mask ^= 1 << units
        self.count -= 1
        self.tokens -= item.length
        return item

    def take_long(self) -> Doc | None:
        if not self.long:
            return None
        self.count -= 1
        self.tokens -= self.long[0].length
        return self.long.popleft()

    def items(self) -> list[Doc]:
        """Every buffered document (bucketed ones by source order within a size, then the long queue)."""
        return [d for units in sorted(self.buckets) for d in self.buckets[units]] + list(self.long)


class Planner:
    """Plans packs one at a time from a :class:`Buffer` and the per-rank carry lanes."""

    def __init__(self, max_tokens: int, align_to: int, world: int):
        self.align_to = align_to
        self.capacity = max_tokens // align_to          # units of one pack
        self.buffer = Buffer()
        self.lanes: list[Piece | None] = [None] * world   # the rest of a split document, per rank

    def idle(self) -> bool:
        return not len(self.buffer) and all(lane is None for lane in self.lanes)

    def units(self, length: int) -> int:
        return -(-length // self.align_to)

    def spread(self, totals: list[int]) -> list[list[Piece]] | None:
        """The last round of an epoch (nothing left to read, no long document, no carry): every
        buffered document, largest first, into the pack of the rank with the fewest real tokens so far
        (``totals`` plus this round) that has room; one pack per rank, so the epoch ends balanced.
        ``None`` (buffer untouched) when the documents do not fit ``len(totals)`` packs that way."""
        buffer, world = self.buffer, len(totals)
        if buffer.long or any(lane is not None for lane in self.lanes) or not len(buffer):
            return None
        items = sorted(buffer.items(), key=lambda d: -d.units)
        if sum(d.units for d in items) > world * self.capacity:
            return None
        packs: list[list[Piece]] = [[] for _ in range(world)]
        load, room = list(totals), [self.capacity] * world
        for d in items:
            fits = [r for r in range(world) if room[r] >= d.units]
            if not fits:
                return None
            r = min(fits, key=lambda r: load[r])
            packs[r].append(Piece(d.index, d.doc, 0, d.length, False))
            load[r] += d.length
            room[r] -= d.units
        self.buffer = Buffer()
        return packs

    def plan(self, g: int) -> list[Piece]:
        """The pieces of pack ``g`` in layout order (a carried piece first, a split head last)."""
        lane = g % len(self.lanes)
        room, pieces = self.capacity, []
        rest = self.lanes[lane]
        if rest is not None:
            need = self.units(rest.length)
            if need > room:                                   # the document fills this pack too
                take = room * self.align_to
                self.lanes[lane] = Piece(rest.index, rest.doc, rest.offset + take, rest.length - take, True)
                return [Piece(rest.index, rest.doc, rest.offset, take, True)]
            self.lanes[lane] = None
            pieces.append(Piece(rest.index, rest.doc, rest.offset, rest.length, False))
            room -= need
        while room:
            item = self.buffer.take_largest(room)
            if item is None:
                break
            pieces.append(Piece(item.index, item.doc, 0, item.length, False))
            room -= item.units
        if room:
            item = self.buffer.take_long()
            if item is not None:                              # its head fills the room, the rest carries on
                take = room * self.align_to
                pieces.append(Piece(item.index, item.doc, 0, take, True))
                self.lanes[lane] = Piece(item.index, item.doc, take, item.length - take, True)
        return pieces


def deal(tokens: list[int], pinned: list[bool], totals: list[int]) -> list[int]:
    """Ranks for one round's packs: ``tokens[j]`` real tokens in slot ``j``, ``pinned[j]`` when the
    pack carries a document in or out (it stays on rank ``j``); the others, fullest first, go to the
    free ranks with the fewest real tokens so far (``totals``, per rank, updated in place; ties by
    the lower slot / rank). Returns ``rank[j]`` for ``j < len(tokens)``, a permutation of those slots."""
    n = len(tokens)
    free = [j for j in range(n) if not pinned[j]]
    ranks = list(range(n))
    by_size = sorted(free, key=lambda j: -tokens[j])
    by_total = sorted(free, key=lambda r: totals[r])
    for j, r in zip(by_size, by_total):
        ranks[j] = r
    for j in range(n):
        totals[ranks[j]] += tokens[j]
    return ranks
