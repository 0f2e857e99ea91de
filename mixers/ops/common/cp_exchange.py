"""The collectives of context parallelism: targeted all-to-alls with autograd, in one order.

    P = ranks, r = this rank; an *element* is ``(M, S)``: the map ``S_out = apply(M, S_in) + S``
    that one rank's tokens apply to the state of the segment leaving it

Every exchange is one ``torch.distributed.all_to_all_single`` over the CP group in which each
rank sends only what the layout says another rank needs (split sizes of 0 elsewhere); its
backward is the reverse all-to-all. Both directions are counted by :func:`record_traffic`.

Ordering. Collectives must run in the same order on every rank, forward and backward. Each
exchange's send buffer carries an empty slice of the previous exchange's output (the run's
``token``), and each op anchors its output on the last one (:meth:`ContextParallelRun.anchor`),
so the collectives of one forward form a chain that every rank's backward walks in exact
reverse order, and reaches even where a rank sends or receives nothing. Requires that the
op inputs' ``requires_grad`` agree across ranks (they do for one model on every rank).

:func:`chain_scan` composes the elements of the ranks a segment crosses (recursive doubling:
``ceil(log2 P)`` rounds at most, each skipped when no rank needs it, then one shift), so a rank
receives the exact state entering its first segment. With segments shorter than a shard every
doubling round is skipped and each rank boundary a segment crosses costs one state.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache

import torch
import torch.distributed as dist

_RECORDERS: list = []


@dataclass
class Traffic:
    """Bytes each exchange of this process sent to other ranks: ``events`` of
    ``(label, "forward" | "backward", bytes)``."""

    events: list = field(default_factory=list)

    def total(self, direction: str | None = None, label: str | None = None) -> int:
        return sum(b for lab, d, b in self.events if (direction in (None, d)) and (label in (None, lab)))

    def calls(self, direction: str | None = None, label: str | None = None) -> int:
        return sum(1 for lab, d, _ in self.events if (direction in (None, d)) and (label in (None, lab)))


@contextmanager
def record_traffic():
    """Count what this process's CP exchanges send (forward and backward) while the block runs."""
    traffic = Traffic()
    _RECORDERS.append(traffic)
    try:
        yield traffic
    finally:
        _RECORDERS.remove(traffic)


def count_sent(label: str, direction: str, nbytes: int) -> None:
    for traffic in _RECORDERS:
        traffic.events.append((label, direction, nbytes))


def _sent_bytes(splits, rank: int, element_size: int) -> int:
    return sum(n for j, n in enumerate(splits) if j != rank) * element_size


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with the reverse all-to-all as its backward.

    Kept rather than ``torch.distributed.nn.functional.all_to_all_single`` (the same autograd
    pair): in the installed torch that function warns ``FutureWarning`` (deprecated) on every
    call and refuses to trace under ``torch.compile``, and its backward cannot count the bytes
    it sends, which :func:`record_traffic` reports for both directions.
    """

    @staticmethod
    def forward(ctx, buffer, group, rank, send_splits, recv_splits, label):
        out = buffer.new_empty(sum(recv_splits))
        dist.all_to_all_single(out, buffer.contiguous(), recv_splits, send_splits, group=group)
        count_sent(label, "forward", _sent_bytes(send_splits, rank, buffer.element_size()))
        ctx.group, ctx.rank, ctx.send_splits, ctx.recv_splits, ctx.label = group, rank, send_splits, recv_splits, label
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty(sum(ctx.send_splits))
        dist.all_to_all_single(back, grad.contiguous(), ctx.send_splits, ctx.recv_splits, group=ctx.group)
        count_sent(ctx.label, "backward", _sent_bytes(ctx.recv_splits, ctx.rank, grad.element_size()))
        return back, None, None, None, None, None


def exchange(run, label: str, sends: dict, recv_shapes: dict, dtype: torch.dtype, anchors=(),
             chained: bool = True) -> dict:
    """One all-to-all over ``run.group``; every rank of the group must call it.

    Args:
        run: the forward's :class:`~ssm_pack.parallel.layout.ContextParallelRun`.
        label: what the traffic is counted under.
        sends: ``{rank: [tensors]}`` for the other ranks (each cast to ``dtype``).
        recv_shapes: ``{rank: [shapes]}`` of what arrives from each rank (the sender's ``sends``).
        anchors: tensors whose autograd graph the send buffer joins (empty slices, exact).
        chained: join the forward's chain of collectives (see the module docstring).

    Returns:
        ``{rank: [tensors]}`` received, shaped as ``recv_shapes`` says.
    """
    size, device = run.layout.size, run.device
    send_splits, recv_splits, parts = [0] * size, [0] * size, []
    for dest in sorted(sends):
        for t in sends[dest]:
            parts.append(t.reshape(-1).to(dtype))
            send_splits[dest] += t.numel()
    for src, shapes in recv_shapes.items():
        recv_splits[src] = sum(_numel(s) for s in shapes)
    links = [a for a in anchors if a is not None and a.is_floating_point()]
    if chained and run.token is not None:
        links.append(run.token)
    parts += [a.reshape(-1)[:0].to(dtype) for a in links]
    buffer = torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=device)
    out = _AllToAll.apply(buffer, run.group, run.rank, send_splits, recv_splits, label)
    if chained:
        run.token = out
    received, offset = {}, 0
    for src in range(size):
        for shape in recv_shapes.get(src, ()):
            n = _numel(shape)
            received.setdefault(src, []).append(out[offset:offset + n].reshape(shape))
            offset += n
    return received


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


@lru_cache(maxsize=256)
def _chain_plan(layout, closed: tuple) -> tuple[list, list]:
    size = layout.size
    done = [closed[j] or j == 0 or not layout.continues_out[j] for j in range(size)]
    rounds, d = [], 1
    while not all(done):
        rounds.append([(j - d, j, not done[j - d]) for j in range(size) if not done[j]])
        done = [done[j] or done[j - d] for j in range(size)]
        d *= 2
    shift = [(j - 1, j) for j in range(1, size) if layout.continues_in[j]]
    return rounds, shift


def chain_plan(layout, closed) -> tuple[list, list]:
    """Who sends what in :func:`chain_scan` (plain ints: every rank derives the same plan).

    Returns ``(rounds, shift)``: ``rounds`` holds, per doubling round that has any traffic,
    ``(sender, receiver, with_m)`` triples (``with_m``: the sender's composite still depends on
    what enters it, so its ``M`` goes along); ``shift`` the ``(sender, receiver)`` pairs of the
    last step, which hands each continuing segment its entering state.
    """
    return _chain_plan(layout, tuple(bool(c) for c in closed))      # the same every forward: kept


def chain_scan(run, label: str, element, closed, apply, compose, *, s_shape, m_shape, dtype, anchors=()):
    """The state entering this rank's first segment (``None`` where it starts on this rank).

    Args:
        element: ``(M, S)`` of the segment leaving this rank (``None`` when it ends here); ``M``
            may be ``None`` where ``closed[rank]``.
        closed: per rank, ``True`` where the leaving segment's outgoing state does not depend on
            the state entering the rank (it starts there, or the op forgets, e.g. a conv window
            filled by the rank's own tokens). The same on every rank (layout facts).
        apply: ``apply(M, S_in) -> M S_in``; compose: ``compose(M_later, M_earlier)``.
        s_shape, m_shape, dtype: what one ``S`` / ``M`` is (the same on every rank).
    """
    r = run.rank
    rounds, shift = chain_plan(run.layout, closed)
    m, s = element if element is not None else (None, None)
    for pairs in rounds:
        sends = {j: [s] + ([m] if with_m else []) for i, j, with_m in pairs if i == r}
        recvs = {i: [s_shape] + ([m_shape] if with_m else []) for i, j, with_m in pairs if j == r}
        got = exchange(run, label, sends, recvs, dtype, anchors)
        if recvs:
            pieces = got[next(iter(recvs))]               # one sender per receiver and round
            s = apply(m, pieces[0]) + s
            m = compose(m, pieces[1]) if len(pieces) > 1 else None
    if not shift:
        return None
    got = exchange(run, label, {j: [s] for i, j in shift if i == r}, {i: [s_shape] for i, j in shift if j == r},
                   dtype, anchors)
    return got[r - 1][0] if run.layout.continues_in[r] else None


__all__ = ["Traffic", "chain_plan", "chain_scan", "count_sent", "exchange", "record_traffic"]
