"""fla's ``l2norm`` as one blocked autograd function equals autograd through the plain steps.

    N = rows, K = normalised dim

Blocks are forced small (a few rows), so the uneven last block is exercised; an all-zero row
(``r = 1 / sqrt(1e-6)``) and a row of huge values stay finite and exact.
"""

import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mixers.ops.common import chunks
from mixers.ops.delta_rule import l2norm
from mixers.ops.delta_rule.l2norm import l2_normalize
from tests.support.oracles import check_close


def plain(x):
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + 1e-6)


def run(fn, x, g_out):
    leaf = x.detach().clone().requires_grad_()
    out = fn(leaf)
    return out, torch.autograd.grad(out, leaf, g_out)[0]


@pytest.mark.parametrize("shape", [
    pytest.param((1, 37, 3, 16), id="37-tokens-3-heads"),
    pytest.param((2, 15, 1, 64), id="batch-2"),
    pytest.param((1, 1, 2, 8), id="one-token"),
    pytest.param((1, 0, 2, 8), id="no-tokens"),
])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_blocked_equals_autograd(monkeypatch, shape, dtype):
    monkeypatch.setattr(l2norm, "row_blocks", functools.partial(chunks.row_blocks, elements=5 * shape[-1]))
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype)
    if x.shape[1] > 2:
        x[0, 1] = 0                                  # all-zero rows: output 0, gradient r * dy
        x[0, 2] *= 1e6
    g_out = torch.randn(shape, dtype=dtype)
    got, want = run(l2_normalize, x, g_out), run(plain, x, g_out)
    for name, a, b in zip(("out", "x"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.isfinite(a).all(), name
        if not b.numel():
            continue
        check_close(a, b, dtype, grad=name != "out", what=name)


def test_non_contiguous_input_and_no_grad():
    torch.manual_seed(0)
    x = torch.randn(4, 6, 8, dtype=torch.float64).transpose(0, 1)
    torch.testing.assert_close(l2_normalize(x), plain(x), rtol=0, atol=1e-14)
    with torch.no_grad():
        assert l2_normalize(x.requires_grad_()).grad_fn is None


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["fp64", "fp32", "bf16"])
def test_no_grad_decode_path_is_the_training_path(dtype):
    # a small input without gradients skips the autograd function: bit-identical output
    torch.manual_seed(0)
    x = torch.randn(1, 1, 3, 64).to(dtype)
    with torch.no_grad():
        fast = l2_normalize(x)
    trained = l2_normalize(x.clone().requires_grad_())
    assert fast.grad_fn is None and trained.grad_fn is not None
    assert fast.dtype == dtype and torch.equal(fast, trained.detach())


class _CountInputSized(TorchDispatchMode):
    """Counts the fresh tensors of ``numel`` elements that ops return (in-place and ``out=`` results excluded)."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {a.untyped_storage().data_ptr() for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)}
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor) and o.numel() == self.numel and o.untyped_storage().data_ptr() not in ins:
                self.count += 1
        return out


@pytest.mark.parametrize("shape", [pytest.param((1, 37, 3, 16), id="37-tokens-3-heads"),
                                   pytest.param((2, 15, 1, 64), id="batch-2")])
def test_training_pass_allocates_only_the_output_and_the_gradient(monkeypatch, shape):
    """With autograd recording, forward and backward go over blocks of rows: the only full-size tensors
    built are the output and the input's gradient (autograd through the plain steps builds more)."""
    monkeypatch.setattr(l2norm, "row_blocks", functools.partial(chunks.row_blocks, elements=5 * shape[-1]))
    torch.manual_seed(0)
    x, g_out = torch.randn(shape, requires_grad=True), torch.randn(shape)
    with _CountInputSized(x.numel()) as mode:
        out = l2_normalize(x)
        grad, = torch.autograd.grad(out, x, g_out)
    assert mode.count == 2, f"{mode.count} full-size tensors built, want 2 (the output and the gradient)"
    check_close(out, plain(x.detach()), torch.float32, what="out")
