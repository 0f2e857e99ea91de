"""A kernel against ssm-pack's reference, the way the correctness and speed stages grade it.

* :func:`compare`: the kernel (``backend="kernel"``, inputs in the case's dtype) and the reference
  (the same values in fp32) on the same inputs; every output and input gradient as a relative RMS
  against the project's limits (fp32 1e-5, bf16 / fp16 5e-3 forward and 1e-2 gradients).
* :func:`pinned`: one kernel of a family (the short convolution: causal-conv1d or fla's conv;
  attention: PyTorch's ``varlen_attn`` or flash-attn), so each is checked even where dispatch would
  take the other first.
* :func:`as_skip`: dispatch refusing ``backend="kernel"`` becomes a :class:`.record.Skip`:
  ``refused`` for a ``ValueError`` (inputs the kernel cannot do), ``unavailable`` for a
  ``RuntimeError`` (the kernel is missing here), as :func:`mixers.ops.dispatch.choose_kernel` raises them.
"""

from __future__ import annotations

import contextlib
import math

import torch

from ssm_pack.testing import TOLERANCES

from .record import Skip

LIMITS = {dtype: TOLERANCES[dtype] for dtype in (torch.float32, torch.bfloat16, torch.float16)}   # (forward, grads)


def rel_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).square().mean().sqrt() / want.square().mean().sqrt().clamp_min(1e-30))


def kernel_refusal(err: Exception) -> bool:
    """Whether ``err`` is dispatch refusing ``backend="kernel"`` (a feature upstream lacks, a package
    missing here, no device), as opposed to a failure inside a kernel that ran."""
    text = str(err)
    refused = "backend='kernel'" in text or "use backend='reference'" in text
    return isinstance(err, (ValueError, RuntimeError)) and refused


def missing_kernels(kernels) -> tuple[str, ...]:
    """The kernels of ``kernels`` whose support check fails here."""
    from mixers.ops import dispatch
    return tuple(k for k in kernels if not dispatch.cached_support(k)[0])


def as_skip(err: Exception, kernels=()) -> Skip | None:
    """The :class:`Skip` for a refusal of ``backend="kernel"``, else ``None`` (a real failure)."""
    if not kernel_refusal(err):
        return None
    if isinstance(err, ValueError):
        return Skip(str(err), "refused")
    return Skip(str(err), "unavailable", missing_kernels(kernels))


@contextlib.contextmanager
def refusals_as_skips(kernels=()):
    """Inside: a refusal of ``backend="kernel"`` is raised as :func:`as_skip`'s :class:`Skip`."""
    try:
        yield
    except (ValueError, RuntimeError) as err:
        skip = as_skip(err, kernels)
        if skip is None:
            raise
        raise skip from err


@contextlib.contextmanager
def pinned(kernel: str):
    """Inside: every op that chooses among kernels (:func:`mixers.ops.dispatch.choose_kernel`) is offered
    ``kernel`` alone. Yields the list of what each call chose; an op that does not offer ``kernel``
    raises ``AssertionError`` (a case pinned to the wrong op)."""
    from mixers.ops import dispatch
    real = dispatch.choose_kernel
    chosen: list[str] = []

    def only(op, backend, *, on_cuda, candidates):
        candidates = tuple(candidates)
        kept = tuple(c for c in candidates if c[0] == kernel)
        if not kept:
            raise AssertionError(f"{op} offers {[c[0] for c in candidates]}, not the pinned {kernel}")
        name = real(op, backend, on_cuda=on_cuda, candidates=kept)
        chosen.append(name)
        return name

    dispatch.choose_kernel = only
    try:
        yield chosen
    finally:
        dispatch.choose_kernel = real


def compare(op, tensors: dict, dtype, setup, *, grad=True, keep_fp32=(), kernels=(), pin=None):
    """``op(backend, args)`` on the kernel (inputs in ``dtype``; with ``pin``, that kernel of its family
    alone) and on the reference (the same values in fp32); returns ``(detail, figures, ok)`` over every
    output and input gradient."""
    def leaves(reference):
        out = {}
        for name, t in tensors.items():
            if t is not None and t.is_floating_point():
                t = t if name in keep_fp32 else t.to(dtype)
                t = (t.float() if reference else t).to(setup.device).detach().requires_grad_(grad)
            out[name] = t.to(setup.device) if isinstance(t, torch.Tensor) else t
        return out

    projections = []

    def run(backend, args):
        outs = op(backend, args)
        outs = outs if isinstance(outs, tuple) else (outs,)
        if not grad:
            return outs, {}
        if not projections:
            gen = torch.Generator().manual_seed(7)
            projections.extend(torch.randn(o.shape, generator=gen) for o in outs)
        loss = sum((o.float() * p.to(o.device)).sum() for o, p in zip(outs, projections))
        present = {k: v for k, v in args.items() if isinstance(v, torch.Tensor) and v.requires_grad}
        return outs, dict(zip(present, torch.autograd.grad(loss, list(present.values()), allow_unused=True)))

    with refusals_as_skips(kernels), (pinned(pin) if pin else contextlib.nullcontext([])) as chosen:
        k_outs, k_grads = run("kernel", leaves(False))
    if pin and (not chosen or set(chosen) != {pin}):
        raise AssertionError(f"pinned to {pin}, the op chose {chosen}")
    r_outs, r_grads = run("reference", leaves(True))
    fwd, bwd = LIMITS[dtype]
    figures = {f"out{i}": rel_rms(k, r) for i, (k, r) in enumerate(zip(k_outs, r_outs))}
    figures.update({f"d{name}": math.inf if k_grads.get(name) is None else rel_rms(k_grads[name], r_grads[name])
                    for name in r_grads if r_grads[name] is not None})          # a missing kernel gradient fails
    bad = [n for n, e in figures.items() if not e <= (fwd if n.startswith("out") else bwd)]
    worst = max(figures, key=lambda n: figures[n] if math.isfinite(figures[n]) else math.inf)
    detail = f"worst {worst} {figures[worst]:.2e} (limits {fwd:.0e} / {bwd:.0e})"
    return (detail + (f"; over the limit: {bad}" if bad else "")), figures, not bad
