"""Non-finite values stay inside their own segment (document): detect, sanitize, re-poison.

    S = segments (numbered 0 .. S-1 in flat token order, as :mod:`ssm_pack.formats.segments` builds them)

The references mix documents on purpose: a chunk holds several documents, and every
cross-document term is a masked zero (``0 * x``, a matmul over the chunk's tokens, the state of
a finished document multiplied by ``keep = 0``, a triangular solve over a block-diagonal system,
SDPA over a key range holding other documents' keys). That is exact for finite values and bitwise
independent of the other documents, but ``0 * nan = nan``: one non-finite value would reach every
document that shares a chunk (and, through state passing, every later one), forward and backward.

Fixing each masked product separately (``torch.where`` everywhere, sanitizing the operands of
every matmul) would touch the hot loops of every op and their hand-written backwards. Instead,
every function that mixes documents is guarded at its boundary, which closes the whole class:

1. **detect** (cheap): one ``sum`` per input; only when a sum is not finite, ``isfinite`` finds
   the tokens. ``-inf`` log-decays are not poison (a gate ``g = -inf`` is a full reset, and the
   chunked references handle it exactly). When everything is finite (the usual case) nothing else
   runs and the computation is bitwise what it was.
2. **sanitize**: non-finite entries become 0 (``torch.where``) before any mixing op sees them. The
   references are bitwise document-independent for finite values, so every other document's
   outputs, states and gradients are exactly those of the same call with any finite value there.
3. **re-poison**: afterwards the values the recurrence would make non-finite are set to NaN:
   outputs of tokens that read a non-finite value (``reads``: q, C, z) and outputs from a
   document's first non-finite state input on (``writes``: k, v, beta, g, x, dt, B, or a
   non-finite initial state) to its end, and the final state of such a document. So the poisoned
   document never comes out as silently finite garbage.
4. **gradients**: the cotangent of a poisoned value is dropped (so no NaN enters the backward's
   mixing either), and so is a non-finite cotangent anywhere (an inf output gradient of one
   document would leak through the backward's mixing like a NaN input through the forward's).
   If a dropped cotangent was nonzero (the loss depends on a poisoned value, or its gradient is
   not finite), the segment is "hot": every sanitized input of that segment gets a NaN gradient
   (at all its tokens, an over-approximation of where autograd through the true recurrence is
   NaN), and every shared parameter a guard wraps (:meth:`Isolation.shared`) gets a NaN
   gradient. With a zero cotangent there (a ``torch.where``-masked loss), the gradients are those
   of the recurrence with the non-finite entries held constant: finite, and exact for the tokens
   before them.

**Branch-free** (the ``"cuda"`` device policy, :func:`mixers.ops.device_policy.branch_free_isolation`):
steps 1-4 read no tensor value on the host, so no op call waits for the device. The guard is
always active: every input goes through ``where(finite, x, 0)``, every output through
``where(bad, nan, y)`` and every cotangent through ``where(drop, 0, grad)``, with masks that are all
false when every value is finite (the same values, bitwise, at the cost of those passes); hot
segments are scattered into a per-token table instead of being gathered. ``python -m
benchmarks.bench_syncs`` prints the cost of that form on the CPU.

Under ``torch.compile`` (while tracing) the guard is off: detection reads tensor values, which a
graph cannot, so compiled references do not isolate non-finite values (the eager references and
the upstream kernels do). Compile a model whose inputs can be non-finite only if a NaN reaching
other documents of the row is acceptable.

Not covered: values that become non-finite *inside* a document from finite inputs (overflow,
e.g. an unstable delta rule with ``beta * |k|^2 > 2`` growing past the dtype's range) can still
reach other documents that share a chunk with it; they are a property of the inputs, not a NaN
or inf passed in.

The input guards are autograd nodes even when nothing is non-finite (identity views, no copy),
so the backward graph has the same shape with and without a poisoned document: gradients that
several paths sum into a leaf are summed in the same order, hence bitwise equal. For the same
reason an input used by several paths is cleaned once. (On the output side a node or a hook is
transparent to that order; the outputs stay ordinary tensors, modifiable in place.)
"""

from __future__ import annotations

import torch

from .. import device_policy

_NAN = float("nan")


def _trailing(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """View ``mask`` (the leading dims of ``like``) with ones appended up to ``like.dim()``."""
    return mask.reshape(*mask.shape, *([1] * (like.dim() - mask.dim())))


def _scattered(index: torch.Tensor, flags: torch.Tensor, size: int) -> torch.Tensor:
    """``[size]`` bool: True at every ``index`` whose flag is set (a scatter: no value read)."""
    hits = torch.zeros(size, dtype=torch.int32, device=index.device)
    if size == 0:                    # no token, no segment: every owner is -1 and no flag is set
        return hits > 0
    return hits.index_add_(0, index.reshape(-1), flags.reshape(-1).to(torch.int32)) > 0


def _finite_ok(t: torch.Tensor, gate: bool) -> torch.Tensor:
    """Entries that are not poison: finite, or (for log-decays) ``-inf``."""
    return t < float("inf") if gate else torch.isfinite(t)


class _Clean(torch.autograd.Function):
    """``where(ok, x, 0)``; backward: NaN on the entries of hot segments, else the gradient."""

    @staticmethod
    def forward(ctx, x, owner, iso, gate):
        ctx.owner, ctx.iso = owner, iso
        if not iso.active:
            return x.view_as(x)
        return torch.where(_finite_ok(x, gate), x, 0.0)

    @staticmethod
    def backward(ctx, grad):
        hot = ctx.iso.hot_of(ctx.owner)
        if hot is not None:
            grad = torch.where(_trailing(hot, grad), _NAN, grad)
        return grad, None, None, None


def _drop_cotangent(grad, drop, owner, iso):
    """``grad`` with 0 on ``drop`` and on its own non-finite entries; the segments (``owner``,
    the leading dims) that lost a nonzero value become hot. ``None``: nothing to drop."""
    if grad is None:
        return None
    if iso.branch_free:                     # no host read: drop (and mark) through masks, always
        drop = ~torch.isfinite(grad) if drop is None else drop.expand_as(grad) | ~torch.isfinite(grad)
        iso.mark_hot_where(owner, (drop & (grad != 0)).reshape(*owner.shape, -1).any(-1))
        return torch.where(drop, 0.0, grad)
    finite = bool(torch.isfinite(grad.sum()))
    if drop is None and finite:
        return None
    drop = torch.zeros_like(grad, dtype=torch.bool) if drop is None else drop.expand_as(grad)
    if not finite:
        drop = drop | ~torch.isfinite(grad)
    iso.mark_hot(owner[(drop & (grad != 0)).reshape(*owner.shape, -1).any(-1)])
    return torch.where(drop, 0.0, grad)


class _Poison(torch.autograd.Function):
    """``where(bad, nan, y)``; backward drops the cotangent on ``bad`` and wherever it is not
    finite itself (a non-finite output gradient would leak like a non-finite input), and marks
    the segments whose dropped cotangent was nonzero as hot."""

    @staticmethod
    def forward(ctx, y, bad, owner, iso):
        ctx.save_for_backward(bad, owner)
        ctx.iso = iso
        return torch.where(_trailing(bad, y), _NAN, y)

    @staticmethod
    def backward(ctx, grad):
        bad, owner = ctx.saved_tensors
        kept = _drop_cotangent(grad, _trailing(bad, grad), owner, ctx.iso)
        return grad if kept is None else kept, None, None, None


class _Shared(torch.autograd.Function):
    """Identity; backward: NaN when any segment is hot (a parameter every document shares)."""

    @staticmethod
    def forward(ctx, x, iso):
        ctx.iso = iso
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        hot = ctx.iso.hot
        if hot is not None and ctx.iso.branch_free:
            grad = torch.where(hot.any(), _NAN, grad)
        elif hot is not None and bool(hot.any()):
            grad = torch.full_like(grad, _NAN)
        return grad, None


class Isolation:
    """The guard of one mixing function; see the module docstring.

    ``seg`` (``[B, T]`` or ``[T]``) numbers the segments of the tokens, non-decreasing in flat
    order from 0. Scan every input (:meth:`scan`, :meth:`scan_states`); if :attr:`active`,
    pass every input through :meth:`clean` / :meth:`clean_states` (shared parameters through
    :meth:`shared`), compute, then pass the results through :meth:`poison_tokens` /
    :meth:`poison_states`. While the guard is not active the input methods are identity views
    (autograd nodes all the same, see the module docstring) and the output methods return their
    input (with a hook that drops non-finite cotangents).
    """

    def __init__(self, seg: torch.Tensor):
        self.seg = seg
        self.enabled = not torch.compiler.is_compiling()      # see the module docstring
        self.branch_free = self.enabled and device_policy.branch_free_isolation(seg)
        self.active = self.branch_free                        # branch-free: masks always in use
        self.hot: torch.Tensor | None = None
        self._reads = self._writes = None
        self._starts: list[tuple] = []              # (owners, flags or None: all of them)
        self._masks = None

    # ---- detection ------------------------------------------------------------------------
    def _token_bad(self, t: torch.Tensor, gate: bool, every: int = 1) -> torch.Tensor | None:
        if not self.branch_free and bool(torch.isfinite(t.sum())):   # one pass, no allocation: all finite
            return None
        bad = ~_finite_ok(t, gate).reshape(*self._every(self.seg, every).shape, -1).all(-1)
        if not self.branch_free and not bool(bad.any()):
            return None
        if every > 1:                            # back to every token
            full = bad.new_zeros(self.seg.shape)
            self._every(full, every).copy_(bad)
            bad = full
        return bad

    @staticmethod
    def _every(t: torch.Tensor, every: int) -> torch.Tensor:
        """The last token of each group of ``every`` (a view of the last dim)."""
        return t if every == 1 else t[..., every - 1::every]

    def scan(self, t: torch.Tensor | None, *, reads: bool = False, gate: bool = False, every: int = 1) -> None:
        """Record the tokens where ``t`` (``[*seg.shape, ...]``) is non-finite. ``reads``: a value
        read at its own token only (q, C, z); else it enters the state (k, v, beta, g, x, dt, B).
        ``gate``: a log-decay, where ``-inf`` is allowed (a reset). ``every > 1``: ``t`` holds the
        last token of each group of ``every`` only (Gated DeltaProduct's queries)."""
        if not self.enabled or t is None or t.numel() == 0:
            return
        bad = self._token_bad(t, gate, every)
        if bad is None:
            return
        self.active = True
        if reads:
            self._reads = bad if self._reads is None else self._reads | bad
        else:
            self._writes = bad if self._writes is None else self._writes | bad

    def scan_states(self, s: torch.Tensor | None, owner: torch.Tensor) -> None:
        """Record non-finite initial states ``s [n, ...]`` of segments ``owner [n]`` (-1: a state
        no token reads, e.g. of an empty document; it is still sanitized)."""
        if not self.enabled or s is None or s.numel() == 0:
            return
        if self.branch_free:
            bad = ~torch.isfinite(s).reshape(s.shape[0], -1).all(-1)
            self._starts.append((owner.clamp(min=0), bad & (owner >= 0)))
            return
        if bool(torch.isfinite(s.sum())):
            return
        bad = ~torch.isfinite(s).reshape(s.shape[0], -1).all(-1)
        if bool(bad.any()):
            self.active = True
            self._starts.append((owner[bad & (owner >= 0)], None))

    # ---- sanitizing -----------------------------------------------------------------------
    def clean(self, t: torch.Tensor | None, *, gate: bool = False, owner: torch.Tensor | None = None):
        """``t`` with its non-finite entries (``+-inf``/NaN; ``+inf``/NaN for a ``gate``) set to 0."""
        if t is None or not self.enabled:
            return t
        return _Clean.apply(t, self.seg if owner is None else owner, self, gate)

    def clean_states(self, s: torch.Tensor | None, owner: torch.Tensor):
        """Per-segment states ``s [n, ...]`` (``owner [n]``) with non-finite entries set to 0."""
        return self.clean(s, owner=owner)

    def shared(self, p: torch.Tensor | None):
        """A parameter every document shares: unchanged, NaN gradient when any segment is hot."""
        if p is None or not self.enabled:
            return p
        return _Shared.apply(p, self)

    # ---- re-poisoning ---------------------------------------------------------------------
    def _compute_masks(self):
        """``(out_bad [*seg.shape], state_bad [S], through [*seg.shape], start_bad [S])`` from
        everything scanned (``through``: the state is non-finite at or before the token)."""
        if self._masks is not None:
            return self._masks
        seg = self.seg.reshape(-1).to(torch.int64)
        n = seg.numel()
        count = self._segment_slots()
        writes = self._writes.reshape(-1) if self._writes is not None else seg.new_zeros(n, dtype=torch.bool)
        start_bad = torch.zeros(count, dtype=torch.bool, device=seg.device)
        for owners, flags in self._starts:
            if flags is None:
                start_bad[owners] = True
            else:                                                    # branch-free: a scatter, no gather
                start_bad = start_bad | _scattered(owners, flags, count)
        ids = torch.arange(count, device=seg.device)
        # branch-free, ids past the last segment exist (clamped; nothing reads them)
        first = torch.searchsorted(seg, ids).clamp(max=max(n - 1, 0))
        last = (torch.searchsorted(seg, ids, right=True) - 1).clamp(min=0)
        c = torch.cumsum(writes.to(torch.int64), 0)
        before = c[first] - writes[first].to(torch.int64)            # bad state inputs before the segment
        through = (c - before[seg] > 0) | start_bad[seg]            # state non-finite at or before t
        out_bad = through if self._reads is None else through | self._reads.reshape(-1)
        state_bad = start_bad | (c[last] - before > 0)
        self._masks = (out_bad.reshape(self.seg.shape), state_bad, through.reshape(self.seg.shape), start_bad)
        return self._masks

    def state_bad_after(self, flat: torch.Tensor, first_seg: torch.Tensor) -> torch.Tensor:
        """Bool, shaped like ``flat``: is the state non-finite after flat token ``flat`` (its own
        segment's, the state carried on), or, where ``flat < 0``, the initial state of segment
        ``first_seg``? For states entering chunks. All False while the guard is not active."""
        if not self.active:
            return torch.zeros_like(flat, dtype=torch.bool)
        _, _, through, start_bad = self._compute_masks()
        after = through.reshape(-1)[flat.clamp(min=0)]
        start = start_bad[first_seg] if start_bad.numel() else torch.zeros_like(after)
        return torch.where(flat >= 0, after, start)

    def _guard_output(self, y: torch.Tensor, bad: torch.Tensor | None, owner: torch.Tensor) -> torch.Tensor:
        """NaN where ``bad``, through :class:`_Poison`; while the guard is not active, ``y`` itself
        with a hook that drops non-finite cotangents (a node here would be a view of ``y``,
        which autograd forbids modifying in place; a node or a hook on the output side is
        transparent to the order in which gradients are summed)."""
        if not self.enabled:
            return y
        if bad is not None:
            return _Poison.apply(y, bad, owner, self)
        if y.requires_grad:
            y.register_hook(lambda grad: _drop_cotangent(grad, None, owner, self))
        return y

    def poison_tokens(self, y: torch.Tensor, every: int = 1) -> torch.Tensor:
        """``y [*seg.shape, ...]`` with NaN where the recurrence is non-finite (``every > 1``: ``y``
        holds the last token of each group of ``every`` only)."""
        bad = self._every(self._compute_masks()[0], every) if self.active else None
        return self._guard_output(y, bad, self._every(self.seg, every))

    def poison_states(self, s: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
        """Final states ``s [n, ...]`` of segments ``owner [n]``: NaN for those whose state is
        non-finite (``owner`` -1: left unchanged)."""
        if not self.active:
            return self._guard_output(s, None, owner)
        state_bad = self._compute_masks()[1]
        if state_bad.numel():
            bad = state_bad[owner.clamp(min=0)] & (owner >= 0)
        else:                                                        # no token: no segment is bad
            bad = torch.zeros_like(owner, dtype=torch.bool)
        return self._guard_output(s, bad, owner)

    def poison_where(self, y: torch.Tensor, bad: torch.Tensor | None, owner: torch.Tensor | None = None):
        """``y`` with NaN where ``bad`` (its leading dims), for a caller that knows better."""
        return self._guard_output(y, bad if self.active else None, self.seg if owner is None else owner)

    def _segment_slots(self) -> int:
        """Entries of the per-segment tables: the segments (read on the host), or, branch-free, the
        tokens (at least as many; reads nothing)."""
        n = self.seg.numel()
        if self.branch_free:
            return n
        return int(self.seg.reshape(-1)[-1]) + 1 if n else 0

    # ---- backward bookkeeping -------------------------------------------------------------
    def mark_hot_where(self, owner: torch.Tensor, flags: torch.Tensor) -> None:
        """Branch-free :meth:`mark_hot`: the segments ``owner`` where ``flags`` (same shape) become hot."""
        count = self._segment_slots()
        hot = _scattered(owner.clamp(min=0), flags & (owner >= 0), count)
        self.hot = hot if self.hot is None else self.hot | hot

    def mark_hot(self, owners: torch.Tensor) -> None:
        owners = owners[owners >= 0]
        if owners.numel() == 0:
            return
        if self.hot is None:
            count = int(self.seg.reshape(-1)[-1]) + 1
            self.hot = torch.zeros(count, dtype=torch.bool, device=owners.device)
        self.hot[owners] = True

    def hot_of(self, owner: torch.Tensor) -> torch.Tensor | None:
        """``owner``-shaped bool: the entry belongs to a hot segment (None: no segment is hot)."""
        if self.hot is None:
            return None
        return self.hot[owner.clamp(min=0)] & (owner >= 0)
