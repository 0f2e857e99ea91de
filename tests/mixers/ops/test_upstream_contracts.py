"""Upstream checks a GPU run would hit, caught on CPU: the strict fakes (``tests/support/fakes.py``,
``tests/support/decode_fakes.py``) refuse what upstream refuses, and the decode kernels (no backward)
never hand back a silently detached output."""

import pytest
import torch

import mixers.ops.ssd.update_kernel as ssd_update
from mixers.ops import (
    attention_with_kvcache,
    causal_conv1d_fn,
    causal_conv1d_update,
    chunk_gated_delta_rule,
    chunk_kda,
    dispatch,
    fused_recurrent_gated_delta_rule,
    fused_recurrent_kda,
    selective_state_update,
)
from tests.support import decode_fakes as fakes
from tests.support.fakes import of_kind

BF16 = torch.bfloat16


def conv_inputs(dtype=BF16):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, 20, generator=g).to(dtype)
    return x, torch.randn(16, 4, generator=g).to(dtype), torch.randn(16, generator=g).to(dtype)


def test_conv_initial_states_reach_causal_conv1d_in_x_dtype(monkeypatch):
    calls = fakes.install(monkeypatch)
    x, w, b = conv_inputs()
    init = torch.randn(1, 16, 3)                                   # fp32 states, bf16 activations
    seq_idx = torch.tensor([[0] * 8 + [1] * 12], dtype=torch.int32)
    out = causal_conv1d_fn(x, w, b, seq_idx=seq_idx, initial_states=init, activation="silu")
    ref = causal_conv1d_fn(x, w, b, seq_idx=seq_idx, initial_states=init.to(BF16), activation="silu",
                           backend="reference")
    assert of_kind(calls, "conv")[0]["initial_states"].dtype == BF16 and torch.equal(out, ref)


@pytest.mark.parametrize("seq_idx,normal", [
    pytest.param([3] * 6 + [7] * 6 + [3] * 8, [0] * 6 + [1] * 6 + [2] * 8, id="value-used-again"),
    pytest.param([2] * 10 + [1] * 10, [0] * 10 + [1] * 10, id="decreasing"),
    pytest.param([5] * 6 + [-1] * 2 + [5] * 12, [0] * 6 + [1] * 2 + [2] * 12, id="padding-between-one-value"),
    pytest.param([0] * 7 + [-3] * 3 + [4] * 10, [0] * 7 + [1] * 3 + [2] * 10, id="padding-its-own-segment"),
])
def test_conv_seq_idx_reaches_causal_conv1d_in_normal_form(monkeypatch, seq_idx, normal):
    calls = fakes.install(monkeypatch)
    x, w, b = conv_inputs(torch.float32)
    given = torch.tensor([seq_idx], dtype=torch.int64)
    out = causal_conv1d_fn(x, w, b, seq_idx=given)
    assert of_kind(calls, "conv")[0]["seq_idx"].tolist() == [normal]
    assert torch.equal(out, causal_conv1d_fn(x, w, b, seq_idx=given, backend="reference"))


def test_fake_conv_refuses_a_value_used_again():
    """Negative control: the strict fake would let no un-normalised seq_idx through."""
    x, w, b = conv_inputs(torch.float32)
    x = x.transpose(1, 2).contiguous().transpose(1, 2)
    bad = torch.tensor([[0] * 6 + [1] * 6 + [0] * 8], dtype=torch.int32)
    with pytest.raises(AssertionError, match="by value"):
        fakes.fakes.fake_conv([])(x, w, b, seq_idx=bad)


def ssu_inputs(requires_grad=False):
    g = torch.Generator().manual_seed(1)
    n, h, p, ns = 2, 3, 4, 8
    t = dict(state=torch.randn(n, h, p, ns, generator=g), x=torch.randn(n, h, p, generator=g),
             dt=torch.rand(n, h, p, generator=g), A=-torch.rand(h, p, ns, generator=g),
             B=torch.randn(n, 1, ns, generator=g), C=torch.randn(n, 1, ns, generator=g))
    if requires_grad:
        t["x"].requires_grad_(True)
    return t


def test_selective_state_update_without_d_passes_zeros(monkeypatch):
    calls = fakes.install(monkeypatch)
    t = ssu_inputs()
    ref_state = t["state"].clone()
    out = selective_state_update(**t, dt_softplus=True)
    ref = selective_state_update(ref_state, *(t[k] for k in "x dt A B C".split()), dt_softplus=True,
                                 backend="reference")
    assert len(of_kind(calls, "state_update")) == 1
    assert torch.allclose(out, ref) and torch.allclose(t["state"], ref_state)


def test_chunk_kda_hands_fla_fp32_initial_states_and_returns_fp32_final(monkeypatch):
    calls = fakes.install(monkeypatch)
    g = torch.Generator().manual_seed(2)
    q, k = (torch.randn(1, 10, 2, 8, generator=g).to(BF16) for _ in range(2))
    v = torch.randn(1, 10, 2, 8, generator=g).to(BF16)
    gate = -torch.rand(1, 10, 2, 8, generator=g).to(BF16)
    beta = torch.rand(1, 10, 2, generator=g).to(BF16)
    h0 = torch.randn(2, 2, 8, 8, generator=g).to(BF16)
    cu = torch.tensor([0, 4, 10])
    o, final = chunk_kda(q, k, v, gate, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    ref_o, ref_final = chunk_kda(q, k, v, gate, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                 backend="reference")
    assert len(of_kind(calls, "kda")) == 1 and final.dtype == ref_final.dtype == torch.float32
    assert torch.allclose(o.float(), ref_o.float(), atol=2e-2) and torch.allclose(final, ref_final, atol=2e-2)


def _decode_calls():
    """One call per decode kernel: ``(kind recorded by the fake, call(requires_grad, backend) -> output)``."""
    g = torch.Generator().manual_seed(3)

    def conv(rg, backend):
        x = torch.randn(2, 16, 1, generator=g).requires_grad_(rg)
        return causal_conv1d_update(x, torch.zeros(2, 16, 3), torch.randn(16, 4, generator=g), backend=backend)

    def ssu(rg, backend):
        return selective_state_update(**ssu_inputs(rg), backend=backend)

    def recurrent(op):
        def call(rg, backend):
            q, k, v = (torch.randn(2, 1, 2, 8, generator=g) for _ in range(3))
            gate = -torch.rand(2, 1, 2, *((8,) if op is fused_recurrent_kda else ()), generator=g)
            return op(q.requires_grad_(rg), k, v, g=gate, beta=torch.rand(2, 1, 2, generator=g), backend=backend)[0]
        return call

    def kvcache(rg, backend):
        q = torch.randn(2, 1, 2, 8, generator=g).to(BF16).requires_grad_(rg)
        cache = torch.randn(2, 6, 2, 8, generator=g).to(BF16)
        return attention_with_kvcache(q, cache, cache.clone(), cache_seqlens=torch.tensor([3, 5]), causal=True,
                                      backend=backend)

    return [pytest.param("conv_update", conv, id="causal_conv1d_update"),
            pytest.param("state_update", ssu, id="selective_state_update"),
            pytest.param("fused_recurrent_gdn", recurrent(fused_recurrent_gated_delta_rule), id="fused_recurrent_gdn"),
            pytest.param("fused_recurrent_kda", recurrent(fused_recurrent_kda), id="fused_recurrent_kda"),
            pytest.param("kvcache", kvcache, id="flash_attn_with_kvcache")]


@pytest.mark.parametrize("kind,call", _decode_calls())
def test_decode_kernels_never_return_a_detached_output(monkeypatch, kind, call):
    calls = fakes.install(monkeypatch)
    out = call(True, "auto")                                         # autograd records: the reference
    assert out.requires_grad and of_kind(calls, kind) == []
    with pytest.raises(ValueError, match="cannot do a backward pass"):
        call(True, "kernel")
    with torch.no_grad():                                            # nothing recorded: the kernel
        call(True, "auto")
    call(False, "auto")
    assert len(of_kind(calls, kind)) == 2


def test_calls_ask_for_the_release_of_their_call_form(monkeypatch):
    fakes.install(monkeypatch)
    asked = []
    monkeypatch.setattr(dispatch, "cached_support",
                        lambda name, features=(): asked.append((name, tuple(features))) or (True, None))
    with torch.no_grad():
        causal_conv1d_update(torch.randn(2, 16, 1), torch.zeros(2, 16, 3), torch.randn(16, 4))
        q, k = torch.randn(1, 6, 2, 8), torch.randn(1, 6, 2, 8)
        v, gate, beta = torch.randn(1, 6, 4, 8), -torch.rand(1, 6, 4), torch.rand(1, 6, 4)
        chunk_gated_delta_rule(q, k, v, gate, beta, cu_seqlens=torch.tensor([0, 2, 6]))
        fused_recurrent_gated_delta_rule(q[:, :1], k[:, :1], v[:, :1], g=gate[:, :1], beta=beta[:, :1])
    assert ("causal_conv1d", ("update_indices",)) in asked                      # 7 positional args: 1.5.0
    assert ("fla", ("varlen", "grouped_values")) in asked                        # HV > H: 0.5.0
    assert ("fla", ("fused_recurrent", "grouped_values")) in asked


def test_selective_state_update_without_indices_runs_on_the_2_0_signature(monkeypatch):
    """mamba-ssm 2.0.0's selective_state_update has no state_batch_indices: it is passed only when given."""
    fakes.install(monkeypatch)
    strict = fakes.fake_state_update([])

    def v2_0(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
        return strict(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus)

    monkeypatch.setattr(ssd_update, "load_upstream", lambda: v2_0)
    t = ssu_inputs()
    ref_state = t["state"].clone()
    out = selective_state_update(**t)
    ref = selective_state_update(ref_state, *(t[k] for k in "x dt A B C".split()), backend="reference")
    assert torch.allclose(out, ref) and torch.allclose(t["state"], ref_state)


@pytest.mark.parametrize("decode", [pytest.param(False, id="causal_conv1d_fn"),
                                    pytest.param(True, id="causal_conv1d_update")])
def test_causal_conv1d_gets_bias_in_weight_dtype(monkeypatch, decode):
    """csrc/causal_conv1d.cpp checks ``bias.scalar_type() == weight_type``; a user's fp32 bias with bf16 weights."""
    calls = fakes.install(monkeypatch)
    x, w, _ = conv_inputs()
    bias = torch.randn(16)
    if decode:
        x, state = x[..., :1].repeat(2, 1, 1), torch.zeros(2, 16, 3, dtype=BF16)
        with torch.no_grad():
            out = causal_conv1d_update(x, state.clone(), w, bias, "silu")
            ref = causal_conv1d_update(x, state.clone(), w, bias.to(BF16), "silu", backend="reference")
        assert len(of_kind(calls, "conv_update")) == 1
    else:
        seq_idx = torch.zeros(1, 20, dtype=torch.int32)
        out = causal_conv1d_fn(x, w, bias, seq_idx=seq_idx, activation="silu")
        ref = causal_conv1d_fn(x, w, bias.to(BF16), seq_idx=seq_idx, activation="silu", backend="reference")
        assert len(of_kind(calls, "conv")) == 1
    assert torch.equal(out, ref)


def test_fake_torch_varlen_is_strict_and_computes_the_reference():
    """The fake-device run's stand-in for PyTorch's varlen_attn (negative control and its own result)."""
    from mixers.ops import varlen_attention
    from tests.support.fakes import fake_torch_varlen
    g = torch.Generator().manual_seed(4)
    q, kv = torch.randn(12, 4, 8, generator=g).to(BF16), torch.randn(12, 2, 8, generator=g).to(BF16)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    attn = fake_torch_varlen([])
    with pytest.raises(AssertionError, match="enable_gqa"):
        attn(q, kv, kv, cu, cu, 7, 7, window_size=(-1, 0))
    out = attn(q, kv, kv, cu, cu, 7, 7, window_size=(-1, 0), enable_gqa=True)
    assert torch.equal(out, varlen_attention(q, kv, kv, cu, 7, causal=True, backend="reference"))
