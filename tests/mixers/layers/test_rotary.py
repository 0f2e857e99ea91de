"""The rotary embedding as one autograd function equals autograd through the plain half-split
steps: output and input gradient, per dtype, and the no-grad (decoding) path is bit-identical.

    T = tokens, H = heads, Dh = head dim
"""

import pytest
import torch

from mixers.layers.blocks.rotary import rotary
from tests.support.oracles import check_close


def plain(x, positions, theta):
    half = x.shape[-1] // 2
    wide = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    freq = theta ** (-torch.arange(half, dtype=wide.dtype) / half)
    angle = positions.to(wide.dtype).unsqueeze(-1) * freq
    cos, sin = angle.cos().unsqueeze(-2), angle.sin().unsqueeze(-2)
    x1, x2 = wide[..., :half], wide[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def positions_of(lengths):
    # rotary positions restart at every document
    return torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)


@pytest.mark.parametrize("lengths", [pytest.param([0, 15, 100, 300], id="uneven-docs"),
                                     pytest.param([1], id="one-token")])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["fp64", "fp32", "bf16"])
def test_equals_autograd_through_the_steps(lengths, dtype):
    torch.manual_seed(0)
    pos = positions_of(lengths)
    t = pos.shape[1]
    x = torch.randn(1, t, 3, 16, dtype=torch.float64)
    g_out = torch.randn(1, t, 3, 16, dtype=torch.float64)
    leaf = x.to(dtype).requires_grad_()
    got = rotary(leaf, pos, 10000.0)
    (g_got,) = torch.autograd.grad(got, leaf, g_out.to(dtype))
    ref = x.clone().requires_grad_()                          # the fp64 oracle
    want = plain(ref, pos, 10000.0)
    (g_want,) = torch.autograd.grad(want, ref, g_out)
    assert got.dtype == g_got.dtype == dtype
    check_close(got, want, dtype, what="out")
    check_close(g_got, g_want, dtype, grad=True, what="x")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["fp64", "fp32", "bf16"])
def test_no_grad_path_is_the_training_path(dtype):
    torch.manual_seed(0)
    pos = positions_of([7, 9])
    x = torch.randn(2, 16, 2, 8).to(dtype)
    with torch.no_grad():
        fast = rotary(x, pos.expand(2, -1), 500.0)
    trained = rotary(x.clone().requires_grad_(), pos.expand(2, -1), 500.0)
    assert fast.grad_fn is None and trained.grad_fn is not None
    assert torch.equal(fast, trained.detach())


def test_backward_is_the_inverse_rotation():
    # the rotation is orthogonal: the gradient of <rotary(x), g> is the inverse rotation of g,
    # so rotating it forward again gives g back
    torch.manual_seed(0)
    pos = positions_of([5, 11])
    x = torch.randn(1, 16, 2, 8, dtype=torch.float64, requires_grad=True)
    g = torch.randn(1, 16, 2, 8, dtype=torch.float64)
    (dx,) = torch.autograd.grad(rotary(x, pos, 10000.0), x, g)
    torch.testing.assert_close(rotary(dx, pos, 10000.0), g, rtol=0, atol=1e-14)
