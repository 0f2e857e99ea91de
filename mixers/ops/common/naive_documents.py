"""The documents of a packed call, as the ``naive.py`` specs walk them one at a time.

    rows = B, total = T, cu_seqlens [N+1] or None
"""

from __future__ import annotations


def document_spans(cu_seqlens, rows: int, total: int) -> list[tuple[int, int, int, int | None]]:
    """``(row, start, end, doc)`` of every segment: without ``cu_seqlens`` each of the ``rows`` rows is one
    document; with it the one row ``[1, T]`` splits at the boundaries, and tokens after ``cu_seqlens[-1]``
    are one more segment whose ``doc`` is ``None`` (a padding tail)."""
    if cu_seqlens is None:
        return [(b, 0, total, b) for b in range(rows)]
    bounds = [int(c) for c in cu_seqlens]
    spans = [(0, s, e, i) for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:]))]
    if total > bounds[-1]:
        spans.append((0, bounds[-1], total, None))
    return spans
