"""Fake upstream decode kernels for CPU tests: each asserts upstream's contract, records the call and
computes through ssm-pack's reference (in place where upstream is). ``install`` adds them to the
training kernels' fakes (``tests/support/fakes.py``).

None of the upstream decode kernels has a backward (fla's ``FusedRecurrentFunction.backward`` raises,
``fused_recurrent_kda`` is no autograd function, the CUDA C++ and Triton updates are plain calls), so
every fake computes under ``torch.no_grad()``: an output a wrapper handed back from one is detached,
as on a GPU."""

from __future__ import annotations

import torch

import mixers.ops.attention.update_kernel as kvcache_kernel
import mixers.ops.causal_conv1d.update_kernel as conv_update
import mixers.ops.delta_rule.update_kernel as recurrent_kernel
import mixers.ops.ssd.update_kernel as ssd_update
from mixers.ops import (
    attention_with_kvcache,
    causal_conv1d_update,
    chunk_gated_delta_rule,
    chunk_kda,
    selective_state_update,
)
from tests.support import fakes

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def fake_conv_update(calls):
    """causal-conv1d's ``causal_conv1d_update`` (csrc/causal_conv1d.cpp; the 7-argument form of 1.5.0+)."""
    def update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None, conv_state_indices=None):
        assert x.dim() == 3 and x.dtype in KERNEL_DTYPES and conv_state.dtype == x.dtype, "conv_state dtype"
        assert weight.dtype in KERNEL_DTYPES and tuple(weight.shape) == (x.shape[1], weight.shape[1])
        assert 2 <= weight.shape[1] <= 4 and weight.is_contiguous() and conv_state.shape[2] >= weight.shape[1] - 1
        assert cache_seqlens is None and activation in (None, "silu", "swish")
        assert bias is None or (bias.dtype == weight.dtype and bias.stride(-1) == 1), "bias dtype == weight dtype"
        if conv_state_indices is not None:
            assert conv_state_indices.dtype == torch.int32 and conv_state_indices.stride(0) == 1
            assert tuple(conv_state_indices.shape) == (x.shape[0],)
        calls.append(("conv_update", conv_state_indices))
        with torch.no_grad():
            return causal_conv1d_update(x, conv_state, weight, bias, activation,
                                        conv_state_indices=conv_state_indices, backend="reference")
    return update


def fake_fla_conv_update(calls):
    """fla's update (fla/modules/causal_conv1d, 0.6.0): ``x [N, D]``, a contiguous ``[N, D, W]`` cache
    updated in place, no indices."""
    def update(x, cache, residual=None, weight=None, bias=None, activation=None):
        n, d = x.shape
        assert residual is None and cache.is_contiguous() and tuple(cache.shape) == (n, d, weight.shape[1])
        calls.append(("fla_conv_update", cache.shape))
        state = cache[..., 1:].clone()
        with torch.no_grad():
            out = causal_conv1d_update(x, state, weight, bias, activation, backend="reference")
        cache.copy_(torch.cat([cache[..., 1:2].new_full((n, d, 1), float("nan")), state], dim=2))
        return out, cache
    return update


def fake_state_update(calls):
    """mamba-ssm's ``selective_state_update`` (mamba_ssm/ops/triton/selective_state_update.py, 2.3.2.post1)."""
    def update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False, state_batch_indices=None):
        # mamba_ssm/ops/triton/selective_state_update.py: `*(dt_bias.stride(0), ...) if dt_bias is not None
        # else 0` and the same for D unpack an int when either is None (TypeError upstream)
        assert x.dtype in KERNEL_DTYPES and state.dim() == 4 and dt_bias is not None, "it reads dt_bias.stride(-1)"
        assert D is not None, "it reads D.stride() unconditionally"
        assert tuple(D.shape) == tuple(x.shape[1:]) and tuple(dt_bias.shape) == tuple(x.shape[1:])
        if state_batch_indices is not None:
            assert state_batch_indices.dtype == torch.int32 and state_batch_indices.is_contiguous()
            assert bool((state_batch_indices >= 0).all()), "ssm-pack never passes padding rows"
        calls.append(("state_update", state_batch_indices))
        with torch.no_grad():
            return selective_state_update(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
                                          state_batch_indices=state_batch_indices, backend="reference")
    return update


def fake_fused_recurrent(calls):
    """fla's ``fused_recurrent_gated_delta_rule`` / ``fused_recurrent_kda`` (fla/ops/gated_delta_rule/
    fused_recurrent.py, fla/ops/kda/fused_recurrent.py, 0.6.0): keyword arguments after ``v``."""
    def make(kind):
        chunk = chunk_kda if kind == "kda" else chunk_gated_delta_rule

        def op(q, k, v, *, g=None, beta=None, scale=None, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, cu_seqlens=None):
            assert q.dtype in KERNEL_DTYPES and cu_seqlens is None and g is not None and beta is not None
            if initial_state is not None:
                assert initial_state.shape[0] == q.shape[0], "one initial state per row"
            calls.append((f"fused_recurrent_{'kda' if kind == 'kda' else 'gdn'}", q.shape))
            with torch.no_grad():
                return chunk(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                             output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                             backend="reference")
        return op
    return make


def fake_kvcache(calls):
    """flash-attn's ``flash_attn_with_kvcache`` (csrc/flash_attn/flash_api.cpp, ``mha_fwd_kvcache``)."""
    def attend(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, cache_batch_idx=None, softmax_scale=None,
               causal=False, window_size=(-1, -1)):
        assert q.dtype in (torch.float16, torch.bfloat16) and k_cache.dtype == q.dtype and v_cache.dtype == q.dtype
        assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
        assert cache_seqlens.dtype == torch.int32 and cache_seqlens.is_contiguous()
        assert cache_batch_idx is None or (cache_batch_idx.dtype == torch.int32 and cache_batch_idx.is_contiguous())
        calls.append(("kvcache", k is not None))
        with torch.no_grad():
            return attention_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=cache_seqlens,
                                          cache_batch_idx=cache_batch_idx, softmax_scale=softmax_scale, causal=causal,
                                          window_size=window_size, backend="reference")
    return attend


def install(monkeypatch, supported=True, calls=None):
    """Pretend CUDA, install the training and decode fakes; returns the recorded calls (``calls`` when given)."""
    calls = fakes.install(monkeypatch, supported=supported, calls=calls)
    monkeypatch.setattr(conv_update, "load_causal_conv1d", lambda: fake_conv_update(calls))
    monkeypatch.setattr(conv_update, "load_fla", lambda: fake_fla_conv_update(calls))
    monkeypatch.setattr(ssd_update, "load_upstream", lambda: fake_state_update(calls))
    monkeypatch.setattr(recurrent_kernel, "load_upstream", fake_fused_recurrent(calls))
    monkeypatch.setattr(kvcache_kernel, "load_upstream", lambda: fake_kvcache(calls))
    return calls
