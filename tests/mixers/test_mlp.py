"""HybridLM's SwiGLU over blocks of rows equals autograd through the plain three steps.

    N = rows, D = hidden, I = inner

Blocks are forced small (a few rows) so the uneven last block and the weight gradients summed
over blocks are exercised; the no-gradient call keeps nothing; under autocast it computes what
two ``nn.Linear`` layers compute there.
"""

import pytest
import torch
import torch.nn.functional as F

from mixers.layers.blocks import mlp
from mixers.layers.blocks.mlp import SwiGLU
from tests.support.oracles import check_close
from tests.support.output_shapes import OutputShapes
from tests.support.tolerances import FP64_ABS

HIDDEN = 24                     # I = 64, so a block of 2^9 numbers in [rows, 2I] is 4 rows


def plain(module, x):
    gate, up = F.linear(x, module.gate_up.weight).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, module.down.weight)


def run(fn, module, x, g_out):
    leaf = x.detach().clone().requires_grad_()
    out = fn(leaf)
    return (out, *torch.autograd.grad(out, [leaf, *module.parameters()], g_out))


@pytest.mark.parametrize("shape, block", [
    pytest.param((1, 37, HIDDEN), 1 << 9, id="37-rows-blocks-of-4"),
    pytest.param((3, 15, HIDDEN), 1 << 9, id="batch-3x15-blocks-of-4"),
    pytest.param((1, 1, HIDDEN), 1 << 9, id="one-row"),
    pytest.param((1, 0, HIDDEN), 1 << 9, id="no-rows"),
    pytest.param((2, 100, HIDDEN), 1 << 20, id="one-block"),
])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_blocked_equals_autograd(monkeypatch, shape, block, dtype):
    monkeypatch.setattr(mlp, "_BLOCK_ELEMENTS", block)
    torch.manual_seed(0)
    module = SwiGLU(HIDDEN).to(dtype)
    x = torch.randn(shape, dtype=dtype)
    g_out = torch.randn(shape, dtype=dtype)
    got, want = run(module, module, x, g_out), run(lambda t: plain(module, t), module, x, g_out)
    for name, a, b in zip(("out", "x", "gate_up", "down"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        if not b.any():                          # no rows: empty output and input gradient, zero weight gradients
            assert torch.equal(a, b), name
            continue
        check_close(a, b, dtype, grad=name != "out", what=name)


def test_no_grad_keeps_nothing_and_equals(monkeypatch):
    monkeypatch.setattr(mlp, "_BLOCK_ELEMENTS", 1 << 9)
    torch.manual_seed(0)
    module = SwiGLU(HIDDEN).double()
    x = torch.randn(2, 21, HIDDEN, dtype=torch.float64)
    with torch.no_grad(), OutputShapes() as shapes:
        out = module(x)
    assert out.grad_fn is None
    assert (out - plain(module, x)).abs().max() < FP64_ABS
    # the parameters require grad but no_grad is on: the [N, 2I] projection is not kept whole
    assert (42, module.gate_up.out_features) not in shapes.seen
    with OutputShapes() as shapes:
        module(x)
    assert (42, module.gate_up.out_features) in shapes.seen      # the control: training keeps it
    frozen = x.clone()                           # inputs that need no gradient: nothing is kept either
    module.requires_grad_(False)
    assert module(frozen).grad_fn is None


@pytest.mark.parametrize("backward_in_autocast", [False, True], ids=["backward-outside", "backward-inside"])
def test_autocast_computes_like_linear_layers(monkeypatch, backward_in_autocast):
    """bf16 under CPU autocast, as ``nn.Linear`` runs there; fp32 parameters get fp32 gradients; a
    backward started inside an autocast region computes in the forward's dtype all the same."""
    monkeypatch.setattr(mlp, "_BLOCK_ELEMENTS", 1 << 9)
    torch.manual_seed(0)
    module = SwiGLU(HIDDEN)
    x = torch.randn(1, 37, HIDDEN)
    g_out = torch.randn(1, 37, HIDDEN, dtype=torch.bfloat16)
    results = []
    for fn in (module, lambda t: plain(module, t)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            leaf = x.clone().requires_grad_()
            out = fn(leaf)
            if backward_in_autocast:
                grads = torch.autograd.grad(out, [leaf, *module.parameters()], g_out)
        if not backward_in_autocast:
            grads = torch.autograd.grad(out, [leaf, *module.parameters()], g_out)
        results.append((out, *grads))
    (out, *grads), (want, *want_grads) = results
    assert out.dtype == want.dtype == torch.bfloat16
    check_close(out, want, torch.bfloat16, what="out")
    for g, w in zip(grads, want_grads):
        assert g.dtype == w.dtype == torch.float32
        check_close(g, w, torch.bfloat16, grad=True, what="gradient")      # computed in bf16


def test_fp32_backward_inside_autocast_stays_fp32():
    """Autocast is off in both passes: an fp32 forward run outside autocast and backpropagated
    inside it gives the fp32 gradients (autocast would round the backward's products to bf16)."""
    torch.manual_seed(0)
    module = SwiGLU(HIDDEN)
    x = torch.randn(1, 37, HIDDEN, requires_grad=True)
    out = module(x)
    g_out = torch.randn_like(out)
    outside = torch.autograd.grad(out, [x, *module.parameters()], g_out, retain_graph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = torch.autograd.grad(out, [x, *module.parameters()], g_out)
    for a, b in zip(inside, outside):
        assert torch.equal(a, b)
