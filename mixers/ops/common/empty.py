"""No token (T == 0, or no row: B == 0): what every op returns, without calling a kernel.

A pack or a context-parallel shard can hold zero tokens; a batch of unpacked rows can hold no row.
A kernel launched over them runs a grid with a zero dimension: causal-conv1d's and flash-attn's
CUDA launches fail with an invalid configuration, and a Triton launcher skips the grid, leaving
what it allocated with ``torch.empty`` (final states included) uninitialised. So each op's ``__init__`` asks
:func:`no_tokens` once its call is checked (after context parallelism, which passes each rank's
local call back through the op) and returns its empty result: outputs of the right shape and
dtype, every final state its initial state (:func:`passed_through`) or zeros.
"""

from __future__ import annotations

import torch


def no_tokens(*sizes: int) -> bool:
    """Whether the call has no token to compute: one of ``sizes`` (its rows, its length) is zero (a static
    shape: nothing is read on the device)."""
    return 0 in sizes


def passed_through(initial: torch.Tensor | None, shape, like: torch.Tensor, dtype=None) -> torch.Tensor:
    """The final states of a call with no token: a copy of ``initial`` (differentiable: its gradient
    is the final states' cotangent; a copy, so writing into one never changes the other) in ``dtype``,
    or zeros of ``shape`` like ``like`` when there is no initial state."""
    dtype = like.dtype if dtype is None else dtype
    if initial is None:
        return like.new_zeros(shape, dtype=dtype)
    return initial.to(dtype, copy=True)


def empty_output(source: torch.Tensor, shape, dtype=None) -> torch.Tensor:
    """Zeros of ``shape`` in ``dtype`` on the autograd graph of ``source`` (empty: T == 0), so a gradient
    asked of ``source`` is found (empty, or zero), as a kernel's output would give it."""
    dtype = source.dtype if dtype is None else dtype
    return source.new_zeros(shape, dtype=dtype) + source.sum().to(dtype)
