"""Real kernels vs the reference on a GPU (skipped without CUDA; run by benchmarks/gpu_check.sh)."""

import pytest
import torch

from mixers.ops import _dispatch, causal_conv1d_fn, mamba_chunk_scan_combined
from ssm_pack import lengths_to_cu_seqlens
from tests.oracles import rel_rms

pytestmark = pytest.mark.cuda
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}   # kernel and reference round differently in low precision


def need(name, features=()):
    ok, reason = _dispatch.cached_support(name, features) if features else _dispatch.cached_support(name)
    if not ok:
        pytest.skip(reason)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_conv_kernel_matches_reference(dtype, packed):
    need("causal_conv1d", ("seq_idx",))
    cu = lengths_to_cu_seqlens([0, 15, 100, 300, 1], device="cuda") if packed else None
    x = torch.randn(1, 416, 256, device="cuda").transpose(1, 2).to(dtype).requires_grad_()
    w = torch.randn(256, 4, device="cuda", dtype=dtype, requires_grad=True)
    b = torch.randn(256, device="cuda", dtype=dtype, requires_grad=True)
    outs = []
    for backend in ("kernel", "reference"):
        out = causal_conv1d_fn(x, w, b, activation="silu", cu_seqlens=cu, backend=backend)
        grads = torch.autograd.grad(out.float().square().sum(), (x, w, b))
        outs.append((out, grads))
    (ko, kg), (ro, rg) = outs
    assert rel_rms(ko.float(), ro.float()) < TOL[dtype]
    for a, r in zip(kg, rg):
        assert rel_rms(a.float(), r.float()) < 2 * TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_ssd_kernel_matches_reference(dtype, packed):
    need("mamba_ssm")
    t, h, p, g, n = 416, 8, 64, 1, 64
    cu = lengths_to_cu_seqlens([0, 15, 100, 300, 1], device="cuda") if packed else None
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=dtype).requires_grad_()  # noqa: E731
    x, dt, B, C = mk(1, t, h, p), mk(1, t, h), mk(1, t, g, n), mk(1, t, g, n)
    A = (-torch.rand(h, device="cuda")).requires_grad_()
    outs = []
    for backend in ("kernel", "reference"):
        out = mamba_chunk_scan_combined(x, dt, A, B, C, 64, cu_seqlens=cu, dt_softplus=True, backend=backend)
        grads = torch.autograd.grad(out.float().square().sum(), (x, dt, A, B, C))
        outs.append((out, grads))
    (ko, kg), (ro, rg) = outs
    assert rel_rms(ko.float(), ro.float()) < TOL[dtype]
    for a, r in zip(kg, rg):
        assert rel_rms(a.float(), r.float()) < 2 * TOL[dtype]
