"""Kernel limits decided before any launch: outside a limit ``auto`` takes the next kernel of the
device policy (or the reference) and ``kernel`` raises ``ValueError`` naming the limit; the strict
fakes (``tests/support/fakes.py``) refuse what upstream refuses, so a call past a limit would fail."""

import pytest
import torch

from mixers.ops import chunk_gated_delta_rule, device_policy, dispatch, varlen_attention
from mixers.ops.attention import kernel_torch as tv
from mixers.ops.attention.choice import auto_choice
from mixers.report import attention_limit_lines
from ssm_pack import lengths_to_cu_seqlens
from ssm_pack.support import installed
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


# --------------------------------------------- compute capability, fp32, reasons: decided once, stated by the report
@pytest.fixture
def capability(monkeypatch):
    """Pretend the tensors' device has compute capability ``cap`` (read through device_policy, counted)."""
    reads = []

    def pretend(cap):
        device_policy.forget_capabilities()
        monkeypatch.setattr(device_policy, "read_capability", lambda device: reads.append(device) or cap)
        return reads
    yield pretend
    device_policy.forget_capabilities()


@pytest.mark.parametrize("cuda", [pytest.param(True, id="cuda-seen"), pytest.param(False, id="no-cuda")])
def test_the_driver_is_asked_for_a_cuda_device_only(monkeypatch, cuda):
    """``read_capability`` asks the driver for a CUDA device where torch sees CUDA, never for the host."""
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: asked.append(device) or (9, 0))
    assert device_policy.read_capability(torch.device("cuda", 1)) == ((9, 0) if cuda else None)
    assert device_policy.read_capability(torch.device("cpu")) is None
    assert asked == ([torch.device("cuda", 1)] if cuda else [])


@pytest.mark.parametrize("cap,kernel", [
    pytest.param((7, 5), None, id="sm75-reference"),
    pytest.param((8, 0), "torch_varlen", id="sm80-torch"),
    pytest.param((9, 0), "torch_varlen", id="sm90-torch"),
])
def test_attention_needs_sm80_auto(both_kernels, capability, cap, kernel):
    capability(cap)
    q, k, v = attention_inputs(16)
    cu = lengths_to_cu_seqlens(LENGTHS)
    out = varlen_attention(q, k, v, cu, 7)
    want = varlen_attention(q, k, v, cu, 7, backend="reference")
    assert [kind for kind, _ in both_kernels] == ([kernel] if kernel else [])
    torch.testing.assert_close(out, want, rtol=0, atol=1e-2)
    grad = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-2)


def test_attention_below_sm80_kernel_raises(both_kernels, capability):
    capability((7, 5))
    q, k, v = attention_inputs(16)
    with pytest.raises(ValueError, match=r"compute capability 7\.5 .*sm80"):
        varlen_attention(q, k, v, lengths_to_cu_seqlens(LENGTHS), 7, backend="kernel")
    assert both_kernels == []


def test_capability_is_read_once_per_device(both_kernels, capability):
    reads = capability((9, 0))
    q, k, v = attention_inputs(16)
    for _ in range(3):
        varlen_attention(q, k, v, lengths_to_cu_seqlens(LENGTHS), 7)
    # the policy reads once; the fakes check the device on every launch, as upstream does
    assert len(both_kernels) == 3 and reads == [q.device] * (1 + 3)


def test_the_fakes_refuse_below_sm80(capability):
    """Negative control: a call on an sm75 device that reached the fakes would fail."""
    capability((7, 5))
    q, k, v = (t.detach() for t in attention_inputs(16))
    cu = lengths_to_cu_seqlens(LENGTHS + [0])
    for fake in (fakes.fake_torch_varlen([]), fakes.fake_flash([])):
        with pytest.raises(AssertionError, match="Ampere"):
            fake(q, k, v, cu, cu, 7, 7)


def test_the_signature_is_read_once(monkeypatch):
    """varlen_attn's signature is a fact of the installed torch: no ``inspect`` per call."""
    calls = fakes.install(monkeypatch)
    fn = fakes.fake_torch_varlen(calls)
    monkeypatch.setattr(tv, "on_cuda", lambda t: True)
    monkeypatch.setattr(tv, "load_upstream", lambda: fn)
    signature, read = tv.inspect.signature, []
    monkeypatch.setattr(tv.inspect, "signature", lambda f: read.append(f) or signature(f))
    q, k, v = attention_inputs(16)
    for _ in range(4):
        varlen_attention(q, k, v, lengths_to_cu_seqlens(LENGTHS), 7)
    assert len(of_kind(calls, "torch_varlen")) == 4 and read == [fn]


def test_fp32_auto_takes_the_reference_and_kernel_names_the_dtype(both_kernels):
    q, k, v = (t.float() for t in attention_inputs(16))
    cu = lengths_to_cu_seqlens(LENGTHS)
    torch.testing.assert_close(varlen_attention(q, k, v, cu, 7), varlen_attention(q, k, v, cu, 7,
                                                                                   backend="reference"))
    assert both_kernels == []
    with pytest.raises(ValueError, match=r"dtype torch\.float32 \(flash-attn takes fp16 / bf16\)"):
        varlen_attention(q, k, v, cu, 7, backend="kernel")


@pytest.mark.parametrize("dtype,d,cap,kernel,reasons", [
    pytest.param(torch.bfloat16, 64, (9, 0), "torch_varlen", [], id="bf16-d64"),
    pytest.param(torch.bfloat16, 12, (9, 0), "flash_attn", ["varlen_attn cannot do head dim 12"], id="d12"),
    pytest.param(torch.bfloat16, 320, (9, 0), "reference", ["varlen_attn cannot do head dim 320",
                                                            "flash-attn cannot do head dim 320"], id="d320"),
    pytest.param(torch.float32, 64, (9, 0), "reference", ["varlen_attn cannot do dtype torch.float32",
                                                          "flash-attn cannot do dtype torch.float32"], id="fp32"),
    pytest.param(torch.float16, 64, (7, 5), "reference", ["varlen_attn cannot do compute capability 7.5",
                                                          "flash-attn cannot do compute capability 7.5"], id="sm75"),
])
def test_auto_choice_states_the_limit(both_kernels, capability, dtype, d, cap, kernel, reasons):
    capability(cap)
    got, why = auto_choice(dtype, d, "cuda")
    assert got == kernel and len(why) == len(reasons)
    for text, part in zip(why, reasons):
        assert part in text


def test_the_default_report_shows_each_attention_choice(both_kernels, capability, monkeypatch):
    # bf16 D=64/128: torch's varlen_attn; D=12 (not a multiple of 8): flash-attn; D=320 and fp32: the reference
    capability((9, 0))
    monkeypatch.setattr(installed.probe, "cuda_available", lambda: True)
    rows = [line.split()[:3] for line in attention_limit_lines()[1:]]
    assert rows == [["bfloat16", "D=64", "torch_varlen"], ["bfloat16", "D=128", "torch_varlen"],
                    ["bfloat16", "D=12", "flash_attn"], ["bfloat16", "D=320", "reference"],
                    ["float32", "D=128", "reference"]], rows


def _varlen_attn_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """The signature of torch 2.10's ``varlen_attn`` (no ``scale=``): only read, never called."""
    raise AssertionError("auto_choice must not launch a kernel")


@pytest.mark.parametrize("scale,kernel,reason", [
    pytest.param(None, "torch_varlen", None, id="default-scale"),
    pytest.param(64 ** -0.5, "torch_varlen", None, id="explicit-default-scale"),
    pytest.param(0.3, "flash_attn", "softmax_scale=0.3", id="scale-0.3"),
])
def test_auto_choice_weighs_the_given_scale(both_kernels, capability, monkeypatch, scale, kernel, reason):
    """A ``varlen_attn`` without ``scale=`` runs the default scale ``D ** -0.5`` only: any other scale
    passes it over for flash-attn, and the reason names that scale."""
    capability((9, 0))
    monkeypatch.setattr(tv, "load_upstream", lambda: _varlen_attn_2_10)
    got, why = auto_choice(torch.bfloat16, 64, "cuda", scale=scale)
    assert got == kernel, why
    assert (why == []) if reason is None else (len(why) == 1 and reason in why[0]), why


def test_auto_choice_without_varlen_attn_takes_flash_attn(both_kernels, capability, monkeypatch):
    """A torch without ``torch.nn.attention.varlen`` (before 2.10): flash-attn, and the reason says so."""
    capability((9, 0))
    monkeypatch.setattr(tv, "load_upstream", lambda: None)
    got, why = auto_choice(torch.bfloat16, 64, "cuda")
    assert got == "flash_attn" and len(why) == 1 and "has no varlen_attn this wrapper knows" in why[0], why


def test_the_report_states_the_limits(both_kernels, capability, monkeypatch):
    capability((9, 0))
    monkeypatch.setattr(installed.probe, "cuda_available", lambda: True)
    lines = attention_limit_lines(((torch.bfloat16, 128), (torch.bfloat16, 12), (torch.float32, 128)))
    assert lines[1].split() == ["bfloat16", "D=128", "torch_varlen"]
    assert lines[2].split()[:3] == ["bfloat16", "D=12", "flash_attn"] and "head dim 12" in lines[2]
    assert lines[3].split()[:3] == ["float32", "D=128", "reference"] and "dtype torch.float32" in lines[3]
    monkeypatch.setattr(installed.probe, "cuda_available", lambda: False)
    assert "no CUDA device" in attention_limit_lines()[1]
