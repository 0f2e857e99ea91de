"""``norm_linear``: the blocked norm + linear function against the two modules it replaces.

    N = rows, C = the linear's in features (R heads of the norm's D channels), O = out features

Blocks are forced small (a few rows), so the uneven last block is exercised.
"""

import functools

import pytest
import torch
from torch import nn

from mixers.layers.blocks import norm_linear as nl
from mixers.layers.blocks.norm import GatedRMSNorm
from mixers.layers.blocks.norm_linear import norm_linear
from mixers.ops.common import chunks
from tests.support.oracles import check_close

CASES = [
    pytest.param(dict(heads=3, dim=8, norm_before_gate=True, activation="swish"), True, id="fla-3-heads-swish"),
    pytest.param(dict(heads=2, dim=8, norm_before_gate=True, activation="sigmoid"), False, id="fla-2-heads-sigmoid"),
    pytest.param(dict(heads=1, dim=16, norm_before_gate=False, activation="silu", group_size=4), True,
                 id="mamba-groups-of-4-bias"),
]


def build(heads, dim, bias, dtype, **kwargs):
    torch.manual_seed(0)
    norm = GatedRMSNorm(dim, **kwargs).to(dtype)
    nn.init.normal_(norm.weight)
    linear = nn.Linear(heads * dim, 5, bias=bias).to(dtype)
    x = torch.randn(2, 19, heads * dim, dtype=dtype, requires_grad=True)
    gate = torch.randn(2, 19, heads * dim, dtype=dtype, requires_grad=True)
    return norm, linear, x, gate


def two_modules(norm, linear, x, gate):
    """What the layers did before: the norm per head, then the linear."""
    heads = x.reshape(*x.shape[:-1], -1, norm.weight.shape[0])
    return linear(norm(heads, gate.reshape(heads.shape)).reshape(x.shape))


def fused(out):
    """Whether ``out`` (a view of the function's output) came from the fused function."""
    return type(out.grad_fn.next_functions[0][0]).__name__ == "_NormLinearFnBackward"


def leaves_of(norm, linear, x, gate):
    return [x, gate, norm.weight, *linear.parameters()]


@pytest.mark.parametrize("spec,bias", CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("rows", [3, 1 << 20], ids=["3-row-blocks", "one-block"])
def test_equals_the_two_modules(monkeypatch, spec, bias, dtype, rows):
    spec = dict(spec)
    heads, dim = spec.pop("heads"), spec.pop("dim")
    monkeypatch.setattr(nl, "row_blocks", functools.partial(chunks.row_blocks, elements=rows * heads * dim))
    norm, linear, x, gate = build(heads, dim, bias, dtype, **spec)
    got = norm_linear(norm, x, gate, linear)
    assert fused(got)
    want = two_modules(norm, linear, x, gate)
    check_close(got, want, dtype, what="out")
    g_out = torch.randn(want.shape, dtype=dtype, generator=torch.Generator().manual_seed(1))
    leaves = leaves_of(norm, linear, x, gate)
    names = ["x", "gate", "norm weight", "linear weight", "linear bias"]
    for name, a, b in zip(names, torch.autograd.grad(got, leaves, g_out), torch.autograd.grad(want, leaves, g_out)):
        check_close(a, b, dtype, grad=True, what=name)


def test_frozen_linear():
    """A frozen projection (no weight gradient wanted): the rest of the gradients as before."""
    norm, linear, x, gate = build(3, 8, True, torch.float64, activation="swish")
    linear.requires_grad_(False)
    got = norm_linear(norm, x, gate, linear)
    assert fused(got)
    want = two_modules(norm, linear, x, gate)
    g_out = torch.randn(want.shape, dtype=torch.float64)
    leaves = [x, gate, norm.weight]
    for name, a, b in zip(("x", "gate", "norm weight"), torch.autograd.grad(got, leaves, g_out),
                          torch.autograd.grad(want, leaves, g_out)):
        check_close(a, b, torch.float64, grad=True, what=name)


def test_no_grad_and_hooks_call_the_modules():
    """Without gradients, or with a hook on either module, the two modules run as they are."""
    norm, linear, x, gate = build(2, 8, False, torch.float32, activation="swish")
    with torch.no_grad():
        assert torch.equal(norm_linear(norm, x, gate, linear), two_modules(norm, linear, x, gate))
    seen = []
    handle = linear.register_forward_hook(lambda m, args, out: seen.append(out.shape))
    out = norm_linear(norm, x, gate, linear)
    handle.remove()
    assert seen == [out.shape] and not fused(out)
    assert fused(norm_linear(norm, x, gate, linear))          # the hook removed: fused again


def test_autocast_calls_the_modules():
    """Under autocast the linear runs as autocast casts it (bf16 here), not in the fused function."""
    norm, linear, x, gate = build(2, 8, True, torch.float32, activation="swish")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = norm_linear(norm, x, gate, linear)
        want = two_modules(norm, linear, x, gate)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_channels_must_be_whole_heads():
    norm, linear, x, gate = build(2, 8, False, torch.float32)
    with pytest.raises(ValueError, match="x's last dim 15 must be a multiple of the norm's 8"):
        norm_linear(norm, x[..., :15], gate[..., :15], linear)
