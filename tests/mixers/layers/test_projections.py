"""``mixers.layers.blocks.projections``: several projections of one input, one input gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mixers import GatedDeltaNetMixer, KDAMixer
from mixers.layers.blocks.projections import project, shared_input_linear
from tests.support.oracles import check_close

WIDTHS = [17, 1, 40]


def _params(dtype, biases=(True, False, True), dim=12):
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(o, dim, generator=g, dtype=dtype, requires_grad=True) for o in WIDTHS]
    bs = [torch.randn(o, generator=g, dtype=dtype, requires_grad=True) if b else None for o, b in zip(WIDTHS, biases)]
    x = torch.randn(2, 9, dim, generator=g, dtype=dtype, requires_grad=True)
    return x, ws, bs


def _grads(loss, tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None], allow_unused=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("used", [pytest.param((0, 1, 2), id="all-outputs"), pytest.param((2,), id="one-output"),
                                  pytest.param((0, 2), id="middle-unused")])
def test_matches_separate_linears(dtype, used):
    x, ws, bs = _params(dtype)
    ours = shared_input_linear(x, ws, bs)
    plain = [F.linear(x, w, b) for w, b in zip(ws, bs)]
    g = torch.Generator().manual_seed(1)
    cot = [torch.randn(y.shape, generator=g, dtype=dtype) for y in plain]
    for a, b in zip(ours, plain):
        assert a.shape == b.shape and a.is_contiguous()
        check_close(a, b, dtype)
    leaves = [x, *ws, *bs]
    got = _grads(sum((ours[i] * cot[i]).sum() for i in used), leaves)
    want = _grads(sum((plain[i] * cot[i]).sum() for i in used), leaves)
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if a is not None:
            check_close(a, b, dtype)


def test_input_without_grad_and_no_grad_mode():
    x, ws, bs = _params(torch.float64)
    x = x.detach()
    ys = shared_input_linear(x, ws, bs)
    g_w = torch.autograd.grad(sum(y.sum() for y in ys), ws)
    for a, w in zip(g_w, ws):
        torch.testing.assert_close(a, x.reshape(-1, x.shape[-1]).sum(0).expand_as(w), rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        ys = shared_input_linear(x, ws, bs)
    assert all(y.grad_fn is None for y in ys)


class _CountInputSized(TorchDispatchMode):
    """Counts the fresh tensors of a given shape that ops return (in-place results excluded)."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.count = torch.Size(shape), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {a.untyped_storage().data_ptr() for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)}
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor) and o.numel() == self.shape.numel() and \
                    o.untyped_storage().data_ptr() not in ins:
                self.count += 1
        return out


def test_one_input_gradient_tensor():
    """The point of the function: backward builds one ``[N, D]`` tensor, where separate linear layers
    build one per projection plus a sum per extra projection."""
    x, ws, _ = _params(torch.float32)
    x = x.reshape(-1, x.shape[-1]).detach().requires_grad_()
    for fn, expected in ((lambda: shared_input_linear(x, ws), 1),
                         (lambda: [F.linear(x, w) for w in ws], 2 * len(ws) - 1)):
        loss = sum(y.sum() for y in fn())
        with _CountInputSized(x.shape) as mode:
            loss.backward()
        assert mode.count == expected
        x.grad = None


def test_autocast_casts_like_linear():
    x, ws, bs = _params(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = shared_input_linear(x, ws, bs)
        plain = [F.linear(x, w, b) for w, b in zip(ws, bs)]
        g_ours = _grads(sum(y.float().sum() for y in ours), [x, *ws])
    g_plain = _grads(sum(y.float().sum() for y in plain), [x, *ws])
    for a, b in zip(ours, plain):
        assert a.dtype == b.dtype == torch.bfloat16
        check_close(a, b, torch.bfloat16)
    for a, b in zip(g_ours, g_plain):
        assert a.dtype == b.dtype == torch.float32
        check_close(a, b, torch.bfloat16)


@pytest.mark.parametrize("weights, biases", [pytest.param([], None, id="no-weights"),
                                             pytest.param([torch.ones(2, 3)], [None, None], id="bias-count")])
def test_bad_arguments(weights, biases):
    with pytest.raises(ValueError, match="weights"):
        shared_input_linear(torch.ones(4, 3), weights, biases)


class _Doubled(nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


def test_project_calls_modules_that_are_not_plain_linears():
    """A subclass (LoRA, quantized) or a hooked linear runs its own forward: the fused path would skip it."""
    torch.manual_seed(0)
    x = torch.randn(5, 4, dtype=torch.float64)
    plain, doubled = nn.Linear(4, 3).double(), _Doubled(4, 3).double()
    out = project(x, [plain, doubled])
    torch.testing.assert_close(out[1], 2 * F.linear(x, doubled.weight, doubled.bias))
    seen = []
    handle = plain.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    try:
        project(x.requires_grad_(), [plain, plain])
    finally:
        handle.remove()
    assert seen == [(5, 3), (5, 3)]
    y = project(x, [plain])[0]
    assert "SharedInputLinear" in type(y.grad_fn.next_functions[0][0]).__name__   # under the reshape


def test_project_takes_low_rank_sequentials():
    """An ``nn.Sequential`` of linears (KDA's low-rank gates): its first linear joins the fused
    products, the rest runs after; outputs and gradients are the modules' own."""
    torch.manual_seed(0)
    lin, seq = nn.Linear(4, 3).double(), nn.Sequential(nn.Linear(4, 2, bias=False), nn.Linear(2, 6)).double()
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    got, want = project(x, [lin, seq]), [lin(x), seq(x)]
    assert "SharedInputLinear" in type(got[0].grad_fn.next_functions[0][0]).__name__
    leaves = [x, *lin.parameters(), *seq.parameters()]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-14)
    g_got, g_want = _grads(sum(y.sum() for y in got), leaves), _grads(sum(y.sum() for y in want), leaves)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-13)


@pytest.mark.parametrize("cls, name", [pytest.param(GatedDeltaNetMixer, "q_proj", id="gdn-q_proj"),
                                       pytest.param(GatedDeltaNetMixer, "a_proj", id="gdn-a_proj"),
                                       pytest.param(KDAMixer, "q_proj", id="kda-q_proj"),
                                       pytest.param(KDAMixer, "f_proj", id="kda-f_proj-sequential"),
                                       pytest.param(KDAMixer, "g_proj.0", id="kda-g_proj-first-linear")])
def test_mixer_honours_a_hook_on_a_projection(cls, name):
    """A forward hook on a projection (what adapters do) runs and changes the mixer's output; without
    hooks the same layer takes the fused path again."""
    torch.manual_seed(0)
    layer = cls(64, backend="reference").double()
    x = torch.randn(1, 12, 64, dtype=torch.float64)
    base = layer(x)
    seen = []
    handle = layer.get_submodule(name).register_forward_hook(lambda m, i, o: seen.append(1) or o * 0.5)
    try:
        hooked = layer(x)
    finally:
        handle.remove()
    assert seen == [1]
    assert not torch.allclose(base, hooked)
    torch.testing.assert_close(layer(x), base, rtol=0, atol=0)
