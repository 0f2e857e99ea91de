"""The delta layers' log decay ``-exp(A) * softplus(pre + bias)``, one blocked autograd function,
equals autograd through the plain steps (output and the gradients of ``pre``, ``bias``, ``A``).

    N = rows, W = channels

Blocks are forced small so the uneven last block and the bias / ``A`` gradients summed over
blocks are exercised; ``pre`` may be half precision (a projection under autocast) while the
gate is computed in fp32.
"""

import functools

import pytest
import torch
import torch.nn.functional as F

from mixers.layers.blocks import decay_gate as gate_module
from mixers.layers.blocks.decay_gate import decay_gate
from mixers.ops.common import chunks
from tests.support.oracles import check_close


def plain(pre, bias, A):
    compute = torch.float64 if pre.dtype == torch.float64 else torch.float32
    return -torch.exp(A) * F.softplus(pre.to(compute) + bias)


def run(fn, pre, bias, A, g_out):
    leaves = [t.detach().clone().requires_grad_() for t in (pre, bias, A)]
    out = fn(*leaves)
    return (out, *torch.autograd.grad(out, leaves, g_out))


@pytest.mark.parametrize("shape", [
    pytest.param((1, 37, 12), id="37-tokens-12-channels"),
    pytest.param((3, 5, 2), id="batch-3"),
    pytest.param((1, 1, 4), id="one-token"),
])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_blocked_equals_autograd(monkeypatch, shape, dtype):
    monkeypatch.setattr(gate_module, "row_blocks", functools.partial(chunks.row_blocks, elements=4 * shape[-1]))
    torch.manual_seed(0)
    w = shape[-1]
    pre, bias, A = torch.randn(shape, dtype=dtype) * 5, torch.randn(w, dtype=dtype), torch.randn(w, dtype=dtype)
    g_out = torch.randn(shape, dtype=dtype)
    got, want = run(decay_gate, pre, bias, A, g_out), run(plain, pre, bias, A, g_out)
    for name, a, b in zip(("out", "pre", "bias", "A"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        check_close(a, b, dtype, grad=name != "out", what=name)


def test_half_projection_output_gives_fp32_gate():
    torch.manual_seed(0)
    pre, bias, A = torch.randn(2, 9, 6).bfloat16(), torch.randn(6), torch.randn(6)
    got = run(decay_gate, pre, bias, A, torch.ones(2, 9, 6))
    want = run(plain, pre, bias, A, torch.ones(2, 9, 6))
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.bfloat16
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bias_shape, A_shape", [pytest.param((5,), (6,), id="A-per-head-not-repeated"),
                                                 pytest.param((6, 1), (6,), id="bias-2d")])
def test_shapes_must_match_the_channels(bias_shape, A_shape):
    with pytest.raises(ValueError, match=r"decay_gate: bias .* must both be \[6\]"):
        decay_gate(torch.zeros(1, 3, 6), torch.zeros(bias_shape), torch.zeros(A_shape))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["fp64", "fp32", "bf16"])
def test_no_grad_decode_path_is_the_training_path(dtype):
    # a small input without gradients skips the autograd function: bit-identical output
    torch.manual_seed(0)
    pre = torch.randn(1, 1, 12).to(dtype)
    bias, A = torch.randn(12), torch.randn(12)
    if dtype == torch.float64:
        bias, A = bias.double(), A.double()
    with torch.no_grad():
        fast = decay_gate(pre, bias, A)
    trained = decay_gate(pre, bias, A.requires_grad_())
    assert fast.grad_fn is None and trained.grad_fn is not None
    assert fast.dtype == trained.dtype and torch.equal(fast, trained.detach())
