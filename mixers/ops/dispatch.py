"""Backend choice for every op: one small pure function, an explicit ``backend=`` wins.

``"reference"`` always runs ssm-pack's PyTorch path. ``"kernel"`` runs the upstream CUDA kernel
or raises (never a silent fallback when a kernel was asked for). ``"auto"`` takes the kernel
when the tensors are on CUDA, the support check passes and the kernel can do every requested
feature; otherwise the reference, which is exact, so "auto" never runs an unpacked kernel.

Interpreter lane: with ``SSM_PACK_TRITON_INTERPRET=1`` and ``TRITON_INTERPRET=1`` (see
:func:`ssm_pack.support.installed.triton_interpreter`, the one switch) :func:`is_cuda` also answers yes
for CPU tensors, and the Triton kernels' support checks accept the interpreter as the device,
so the real upstream Triton kernels run through these wrappers on CPU in tests.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ssm_pack.support import installed, requirements

BACKENDS = ("auto", "kernel", "reference")


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def select_backend(op: str, backend: str, *, on_cuda: bool,
                   support_state: Callable[[], tuple[bool, str | None]],
                   missing_feature: str | None = None) -> str:
    """``"kernel"`` or ``"reference"`` for one call of ``op``.

    Args:
        backend: the user's choice (``"auto"``, ``"kernel"``, ``"reference"``).
        on_cuda: whether the inputs live on a CUDA device.
        support_state: returns ``(ok, reason)`` for the upstream package (called only when a
            kernel is still possible, so CPU calls never read package metadata).
        missing_feature: a requested feature upstream cannot do (e.g. "per-document initial
            states"), or ``None``.
    """
    check_backend(backend)
    if backend == "reference":
        return "reference"
    if backend == "kernel":
        if missing_feature is not None:
            raise ValueError(f"{op}: the upstream kernel cannot do {missing_feature}; use "
                             "backend='reference' (or 'auto', which picks it)")
        if not on_cuda:
            raise ValueError(f"{op}: backend='kernel' needs CUDA tensors; use backend='reference' on CPU")
        ok, reason = support_state()
        if not ok:
            raise RuntimeError(f"{op}: backend='kernel' is unavailable: {reason}")
        return "kernel"
    if not on_cuda or missing_feature is not None:
        return "reference"
    return "kernel" if support_state()[0] else "reference"


def records_grad(*tensors) -> bool:
    """Whether autograd records through a call with ``tensors`` (``None`` entries are skipped)."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def backward_of(*tensors) -> tuple[str, ...]:
    """``(BACKWARD,)`` when autograd records through ``tensors``, else ``()``: the feature that makes the
    support decision ask every row's backward minimum (:data:`ssm_pack.support.requirements.BACKWARD`)."""
    return (requirements.BACKWARD,) if records_grad(*tensors) else ()


def forward_only(kernel: str, *tensors) -> str | None:
    """The missing feature of a forward-only kernel (the decode kernels) when autograd records through
    ``tensors``, else ``None``: ``"auto"`` then takes the differentiable reference and ``"kernel"``
    refuses, so no output ever comes back silently detached."""
    if not records_grad(*tensors):
        return None
    return (f"a backward pass ({kernel} has no backward and autograd is recording: an input requires grad; "
            "call it under torch.no_grad() or torch.inference_mode() for the kernel)")


def is_cuda(t) -> bool:
    """Whether ``t`` lives on a CUDA device (one place, so kernel-contract tests can pretend), or
    on the CPU with the interpreter switch on (:func:`ssm_pack.support.installed.triton_interpreter`)."""
    return t.is_cuda or (t.device.type == "cpu" and installed.triton_interpreter())


@functools.lru_cache(maxsize=None)
def cached_support(kernel: str, features: tuple[str, ...] = ()) -> tuple[bool, str | None]:
    """``(ok, reason)`` of ``kernel`` with ``features`` from the requirements table
    (:mod:`ssm_pack.support.requirements`), read once per process (``cache_clear()`` resets)."""
    return requirements.kernel_support(kernel, tuple(features))


def choose_kernel(op: str, backend: str, *, on_cuda: bool, candidates) -> str:
    """The first kernel of ``candidates`` that can run this call, else ``"reference"``.

    ``candidates``: ``(name, label, missing, support_state)`` in the order to try, where
    ``missing`` is a feature the kernel cannot do for these inputs (or ``None``) and
    ``support_state()`` returns ``(ok, reason)`` (called only when the kernel is still possible).
    ``"kernel"`` raises naming every kernel's reason when none can run: ``ValueError`` when the
    inputs are what no kernel takes, ``RuntimeError`` when a package is missing.
    """
    check_backend(backend)
    if backend == "reference" or (backend == "auto" and not on_cuda):
        return "reference"
    if not on_cuda:
        raise ValueError(f"{op}: backend='kernel' needs CUDA tensors; use backend='reference' on CPU")
    name, reasons, cannot = _first_kernel(candidates)
    if name is not None:
        return name
    if backend == "kernel":
        error = ValueError if cannot == len(candidates) else RuntimeError
        raise error(f"{op}: backend='kernel' is unavailable ({'; '.join(reasons)}); "
                    "use backend='reference' (or 'auto', which picks it)")
    return "reference"


def _first_kernel(candidates) -> tuple[str | None, list[str], int]:
    """``(name, reasons, cannot)``: the first kernel of ``candidates`` that can run (``None``: none),
    each earlier kernel's reason, and how many of them could not take the inputs."""
    reasons, cannot = [], 0
    for name, label, missing, state in candidates:
        if missing is not None:
            reasons.append(f"{label} cannot do {missing}")
            cannot += 1
            continue
        ok, reason = state()
        if ok:
            return name, reasons, cannot
        reasons.append(f"{label}: {reason}")
    return None, reasons, cannot


def auto_choice(candidates) -> tuple[str, list[str]]:
    """``(kernel, reasons)``: what ``backend="auto"`` takes on CUDA among ``candidates`` (as for
    :func:`choose_kernel`; ``"reference"`` when none can run) and why each kernel before it was passed
    over: the limit it cannot do, or its package's state. The support report prints these."""
    name, reasons, _ = _first_kernel(candidates)
    return name or "reference", reasons
