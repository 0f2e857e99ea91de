"""The mixers' RMS norms: the blocked autograd functions against autograd through the plain
steps, and their no-grad path (torch's ``rms_norm`` per block) against the training path.

    N = rows, D = normalised dim

Blocks are forced small (a few rows), so the uneven last block is exercised.
"""

import functools

import pytest
import torch
import torch.nn.functional as F

from mixers.layers.blocks import norm
from mixers.layers.blocks.norm import GatedRMSNorm, RMSNorm
from mixers.ops.common import chunks
from tests.support.oracles import check_close

GATED = [
    pytest.param(dict(norm_before_gate=True, activation="swish"), id="fla-swish"),
    pytest.param(dict(norm_before_gate=True, activation="sigmoid"), id="fla-sigmoid"),
    pytest.param(dict(norm_before_gate=False, activation="silu", group_size=8), id="mamba-groups-of-8"),
]


def plain_rms(x, w, eps):
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w


def plain_gated(x, gate, w, eps, norm_before_gate, activation, group_size=None):
    act = F.silu(gate) if activation != "sigmoid" else torch.sigmoid(gate)
    y = x if norm_before_gate else x * act
    g = y.reshape(*y.shape[:-1], -1, group_size or y.shape[-1])
    o = (g * torch.rsqrt(g.square().mean(-1, keepdim=True) + eps)).reshape(y.shape) * w
    return o * act if norm_before_gate else o


def small_blocks(monkeypatch, width):
    monkeypatch.setattr(norm, "row_blocks", functools.partial(chunks.row_blocks, elements=5 * width))


def inputs(dtype, n=2):
    torch.manual_seed(0)
    return [torch.randn(1, 37, 16, dtype=dtype) for _ in range(n)]


def grads(out, leaves, g_out):
    return torch.autograd.grad(out, leaves, g_out)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_rms_norm_equals_autograd(monkeypatch, dtype):
    small_blocks(monkeypatch, 16)
    layer = RMSNorm(16).to(dtype)
    torch.nn.init.normal_(layer.weight)
    x, g_out = inputs(dtype)
    x.requires_grad_()
    got = layer(x)
    want = plain_rms(x, layer.weight, layer.eps)
    check_close(got, want, dtype, what="out")
    for name, a, b in zip(("x", "weight"), grads(got, (x, layer.weight), g_out),
                          grads(want, (x, layer.weight), g_out)):
        check_close(a, b, dtype, grad=True, what=name)


@pytest.mark.parametrize("kwargs", GATED)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_gated_norm_equals_autograd(monkeypatch, kwargs, dtype):
    small_blocks(monkeypatch, 16)
    layer = GatedRMSNorm(16, **kwargs).to(dtype)
    torch.nn.init.normal_(layer.weight)
    x, gate, g_out = inputs(dtype, 3)
    x.requires_grad_(), gate.requires_grad_()
    got = layer(x, gate)
    want = plain_gated(x, gate, layer.weight, layer.eps, **kwargs)
    check_close(got, want, dtype, what="out")
    for name, a, b in zip(("x", "gate", "weight"), grads(got, (x, gate, layer.weight), g_out),
                          grads(want, (x, gate, layer.weight), g_out)):
        check_close(a, b, dtype, grad=True, what=name)


@pytest.mark.parametrize("rows", [1, 37], ids=["one-row", "37-rows"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["fp64", "fp32", "bf16"])
def test_no_grad_path_is_the_training_path(monkeypatch, rows, dtype):
    # without gradients nothing is kept and torch's rms_norm runs per block: bit-identical output
    small_blocks(monkeypatch, 16)
    torch.manual_seed(0)
    x, gate = torch.randn(1, rows, 16).to(dtype), torch.randn(1, rows, 16).to(dtype)
    layers = [(RMSNorm(16), (x,))] + [(GatedRMSNorm(16, **p.values[0]), (x, gate)) for p in GATED]
    for layer, args in layers:
        layer = layer.to(dtype)
        torch.nn.init.normal_(layer.weight)
        with torch.no_grad():
            fast = layer(*args)
        trained = layer(*args)
        assert trained.grad_fn is not None and fast.grad_fn is None
        assert fast.dtype == dtype and torch.equal(fast, trained.detach()), type(layer).__name__
