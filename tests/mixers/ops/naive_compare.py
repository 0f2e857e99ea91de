"""Compare two implementations of one op in fp64: every output and the gradient of every input."""

from __future__ import annotations

import torch

from tests.support.oracles import check_close


def leaves(*tensors):
    """fp64 leaves that record gradients (``None`` stays ``None``)."""
    return [None if t is None else t.detach().to(torch.float64).requires_grad_() for t in tensors]


def assert_same(fn, spec, inputs, *, what: str):
    """``fn(*inputs)`` and ``spec(*inputs)`` return tuples of tensors: the same values, and the
    same gradients of a random weighted sum of them with respect to every input tensor."""
    mine, theirs = leaves(*inputs), leaves(*inputs)
    got, want = fn(*mine), spec(*theirs)
    assert len(got) == len(want), what
    gen = torch.Generator().manual_seed(7)
    weights = [torch.randn(w.shape, generator=gen, dtype=torch.float64) for w in want]
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape, f"{what} output {i}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        check_close(a, b, torch.float64, what=f"{what} output {i}")
    pairs = [(a, b) for a, b in zip(mine, theirs) if a is not None]
    loss = sum((o * w).sum() for o, w in zip(got, weights))
    ref = sum((o * w).sum() for o, w in zip(want, weights))
    grads = torch.autograd.grad(loss, [a for a, _ in pairs], allow_unused=True, materialize_grads=True)
    ref_grads = torch.autograd.grad(ref, [b for _, b in pairs], allow_unused=True, materialize_grads=True)
    for i, (a, b) in enumerate(zip(grads, ref_grads)):
        check_close(a, b, torch.float64, grad=True, what=f"{what} grad of input {i}")
