"""Kernel limits decided before any launch: outside a limit ``auto`` takes the next kernel of the
device policy (or the reference) and ``kernel`` raises ``ValueError`` naming the limit; the strict
fakes (``tests/support/fakes.py``) refuse what upstream refuses, so a call past a limit would fail."""

import pytest
import torch

from mixers.ops import chunk_gated_delta_rule, dispatch, varlen_attention
from mixers.ops.attention import kernel_torch as tv
from ssm_pack import lengths_to_cu_seqlens
from tests.support import fakes
from tests.support.fakes import of_kind

LENGTHS = [5, 1, 7]


def delta_inputs(k_dim):
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 13, 1, k_dim, generator=g).to(torch.bfloat16) for _ in range(2))
    v = torch.randn(1, 13, 1, 8, generator=g).to(torch.bfloat16)
    gate = -torch.rand(1, 13, 1, generator=g)
    beta = torch.rand(1, 13, 1, generator=g).to(torch.bfloat16)
    return q, k, v, gate, beta


@pytest.mark.parametrize("k_dim,runs", [pytest.param(256, True, id="K-256-runs"),
                                        pytest.param(264, False, id="K-264-reference")])
def test_fla_key_dim_limit_auto(monkeypatch, k_dim, runs):
    calls = fakes.install(monkeypatch)
    args = delta_inputs(k_dim)
    cu = lengths_to_cu_seqlens(LENGTHS).long()
    out, _ = chunk_gated_delta_rule(*args, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    want, _ = chunk_gated_delta_rule(*args, cu_seqlens=cu, use_qk_l2norm_in_kernel=True, backend="reference")
    assert len(of_kind(calls, "gdn")) == (1 if runs else 0)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_fla_key_dim_limit_kernel_raises(monkeypatch):
    calls = fakes.install(monkeypatch)
    with pytest.raises(ValueError, match=r"K=264 .*K <= 256.*backend='reference'"):
        chunk_gated_delta_rule(*delta_inputs(264), cu_seqlens=lengths_to_cu_seqlens(LENGTHS).long(),
                               backend="kernel")
    assert calls == []


def attention_inputs(d):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(13, 2, d, generator=g).to(torch.bfloat16).requires_grad_() for _ in range(3)]


@pytest.fixture
def both_kernels(monkeypatch):
    calls = fakes.install(monkeypatch)
    monkeypatch.setattr(tv, "on_cuda", lambda t: True)
    monkeypatch.setattr(tv, "load_upstream", lambda: fakes.fake_torch_varlen(calls))
    return calls


@pytest.mark.parametrize("d,kernel", [
    pytest.param(16, "torch_varlen", id="d16-torch"),
    pytest.param(12, "flash", id="d12-not-multiple-of-8-flash"),
    pytest.param(264, None, id="d264-reference"),
])
def test_attention_head_dim_limits_auto(both_kernels, d, kernel):
    q, k, v = attention_inputs(d)
    cu = lengths_to_cu_seqlens(LENGTHS)
    out = varlen_attention(q, k, v, cu, 7)
    want = varlen_attention(q, k, v, cu, 7, backend="reference")
    ran = [kind for kind, _ in both_kernels]
    assert ran == ([kernel] if kernel else [])
    torch.testing.assert_close(out, want, rtol=0, atol=1e-2)
    grad = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-2)


def test_attention_head_dim_limit_kernel_raises(both_kernels):
    q, k, v = attention_inputs(264)
    with pytest.raises(ValueError, match=r"head dim 264"):
        varlen_attention(q, k, v, lengths_to_cu_seqlens(LENGTHS), 7, backend="kernel")
    assert both_kernels == []


def test_the_fakes_refuse_past_the_limits():
    """Negative control: a call past a limit that reached the fakes would fail."""
    q, k, v = (t.detach() for t in attention_inputs(12))
    cu = lengths_to_cu_seqlens(LENGTHS + [0])
    with pytest.raises(AssertionError, match="multiple of 8"):
        fakes.fake_torch_varlen([])(q, k, v, cu, cu, 7, 7)
    q, k, v = (t.detach() for t in attention_inputs(264))
    with pytest.raises(AssertionError, match="at most 256"):
        fakes.fake_flash([])(q, k, v, cu, cu, 7, 7)
    with pytest.raises(AssertionError, match="larger than 256"):
        fakes.fake_fla([])("gdn")(*delta_inputs(264))
    assert dispatch.BACKENDS
