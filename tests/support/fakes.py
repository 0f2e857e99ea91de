"""Fake upstream kernels for CPU tests: each asserts upstream's input contract, records the call
as ``(kind, what it was given)`` in a shared list, and computes through ssm-pack's reference."""

from __future__ import annotations

import contextlib
from collections import deque

import torch

import mixers.ops.attention.kernel as attn_kernel
import mixers.ops.causal_conv1d.kernel as conv_kernel
import mixers.ops.causal_conv1d.kernel_fla as fla_conv_kernel
import mixers.ops.delta_rule.kernel as fla_kernel
import mixers.ops.lightning.kernel as simple_gla_kernel
import mixers.ops.ssd.kernel as ssd_kernel
from mixers.ops import (
    causal_conv1d_fn,
    chunk_gated_delta_product,
    chunk_gated_delta_rule,
    chunk_kda,
    device_policy,
    dispatch,
    mamba_chunk_scan_combined,
    varlen_attention,
)
from mixers.ops.lightning.naive import simple_gla_naive
from mixers.ops.rg_lru import kernel as hgrn_kernel

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _runs_read_apart(seq_idx) -> bool:
    """Whether causal-conv1d's by-value window compare reads ``seq_idx [B, T]`` as ssm-pack means it:
    per row the first segment is 0 and every later non-negative run has a larger value than any before
    (a reused value would join two segments inside the window)."""
    for row in seq_idx.tolist():
        seen = -1
        for i, v in enumerate(row):
            if i == 0 and v >= 0 and v != 0:
                return False
            if v >= 0 and (i == 0 or v != row[i - 1]):
                if v <= seen:
                    return False
                seen = v
    return True


def assert_tokens(t: int, kernel: str):
    """No kernel here is launched with T == 0: the CUDA launches (causal-conv1d's
    ``dim3 grid(batch, n_chunks_L, ...)``, csrc/causal_conv1d_fwd.cu; flash-attn's) fail with an invalid
    configuration, and a Triton launcher skips a grid with a zero dimension, leaving every output it
    allocated with ``torch.empty`` (final states included) uninitialised (mamba-ssm, fla)."""
    assert t > 0, f"{kernel}: a launch over T = 0 tokens (a grid with a zero dimension)"


def assert_vector_aligned(name, t):
    """causal-conv1d's channel-last kernels (csrc/causal_conv1d_fwd.cu, _bwd.cu, 1.6.1) move whole 16-byte
    vectors of channels (``vec_t``, 8 bf16 / 4 fp32 elements) from ``data_ptr + b * stride(0) + t * stride(2)``
    and no TORCH_CHECK looks at the pointer: a view starting mid-vector (a channel slice at an odd offset)
    stops the device with a misaligned address."""
    assert t.data_ptr() % 16 == 0, f"{name} starts {t.data_ptr() % 16} bytes into a 16-byte vector " \
        f"(storage offset {t.storage_offset()}): the kernel's vector loads fault on a misaligned address"


def _dout_as_read(dout):
    """causal_conv1d.cpp ``causal_conv1d_bwd`` on a channel-last ``x``: ``dout`` made channel-last when its
    ``stride(1) != 1``, then TORCH_CHECKed (strides multiples of 8) and read in 16-byte vectors."""
    if dout.stride(1) != 1:
        dout = dout.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert dout.stride(2) % 8 == 0 and dout.stride(0) % 8 == 0, \
        f"causal_conv1d with channel last layout requires strides (dout.stride(0) and dout.stride(2)) to be " \
        f"multiples of 8, got {dout.stride()}"
    assert_vector_aligned("dout", dout)
    return dout


def _conv_by_value(x, weight, bias, seq_idx, initial_states, silu):
    """What causal-conv1d's backward differentiates (csrc/causal_conv1d_bwd.cu, the ``kHasSeqIdx``
    path, causal-conv1d 1.6.1): every output ``t`` (padding included: no ``seq_idx < 0`` test)
    recomputed as ``bias + sum_w [seq_idx[t - J + w] == seq_idx[t]] weight[w] x[t - J + w]``, the
    SiLU derivative taken at it, ``dbias`` summed over every token. The row's initial state sits
    before token 0 with the first token's id (it feeds the row's first segment, the 1.7.0 feature)."""
    b, d, _ = x.shape
    state_len = weight.shape[1] - 1
    before = x.new_zeros(b, d, state_len) if initial_states is None else initial_states.float()
    xp = torch.cat([before, x.float()], dim=2)                                # [B, D, J + T]
    ids = torch.cat([seq_idx[:, :1].expand(b, state_len), seq_idx], dim=1)   # [B, J + T]
    same = ids.unfold(1, state_len + 1, 1) == seq_idx.unsqueeze(-1)           # [B, T, W]
    out = (xp.unfold(2, state_len + 1, 1) * same.unsqueeze(1) * weight.float()[None, :, None]).sum(-1)
    if bias is not None:
        out = out + bias.float()[None, :, None]
    return torch.nn.functional.silu(out) if silu else out


class _UpstreamConv(torch.autograd.Function):
    """Forward as causal-conv1d computes it (through the reference: padding outputs are 0), backward
    as its kernel does (:func:`_conv_by_value`): the cotangent at padding is not dropped, so ``dx``
    at padding, ``dweight`` and ``dbias`` take it in, as on a GPU."""

    @staticmethod
    def forward(ctx, x, weight, bias, initial_states, seq_idx, activation):
        ctx.save_for_backward(x, weight, bias, initial_states, seq_idx)
        ctx.silu = activation is not None
        return causal_conv1d_fn(x, weight, bias, seq_idx=seq_idx, initial_states=initial_states,
                                activation=activation, backend="reference")

    @staticmethod
    def backward(ctx, dout):
        x, weight, bias, initial_states, seq_idx = ctx.saved_tensors
        dout = _dout_as_read(dout)
        inputs = [t for t in (x, weight, bias, initial_states) if t is not None]
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(True) for t in inputs]
            it = iter(leaves)
            args = [next(it) if t is not None else None for t in (x, weight, bias, initial_states)]
            out = _conv_by_value(*args[:3], seq_idx, args[3], ctx.silu)
            grads = iter(torch.autograd.grad(out, leaves, dout.float()))
        return tuple(None if t is None else next(grads).to(t.dtype) for t in (x, weight, bias, initial_states)) \
            + (None, None)


def fake_conv(calls):
    """causal-conv1d's ``causal_conv1d_fn`` with ``seq_idx``: checks of csrc/causal_conv1d.cpp
    (``causal_conv1d_fwd``) and causal_conv1d/causal_conv1d_interface.py; the by-value compare of
    csrc/causal_conv1d_fwd.cu; the backward of csrc/causal_conv1d_bwd.cu (:class:`_UpstreamConv`)."""
    def conv(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
             final_states_out=None, activation=None):
        b, d, t = x.shape
        width = weight.shape[1]
        assert_tokens(t, "causal-conv1d")
        assert x.dtype in KERNEL_DTYPES and weight.dtype in KERNEL_DTYPES
        assert x.stride(2) == 1 or x.stride(1) == 1                               # causal_conv1d.cpp
        assert x.stride(1) == 1 and x.stride(2) > 1, "seq_idx is only supported for channel last layout"
        assert d % 8 == 0 and x.stride(0) % 8 == 0 and x.stride(2) % 8 == 0
        assert_vector_aligned("x", x)
        assert 2 <= width <= 4 and weight.is_contiguous()
        assert bias is None or (bias.dtype == weight.dtype and bias.stride(-1) == 1), "bias dtype == weight dtype"
        assert seq_idx is not None and seq_idx.dtype == torch.int32 and seq_idx.is_contiguous()
        assert seq_idx.device == x.device and tuple(seq_idx.shape) == (b, t)
        assert _runs_read_apart(seq_idx), f"the kernel compares seq_idx by value; got {seq_idx.tolist()}"
        assert not return_final_states and final_states_out is None, "no final states together with seq_idx"
        if initial_states is not None:
            assert initial_states.dtype == x.dtype, "initial_states.scalar_type() == input_type"
            assert tuple(initial_states.shape) == (b, d, width - 1) and initial_states.stride(1) == 1
            assert_vector_aligned("initial_states", initial_states)
        assert activation in (None, "silu", "swish")
        calls.append(("conv", dict(seq_idx=seq_idx, initial_states=initial_states)))
        return _UpstreamConv.apply(x, weight, bias, initial_states, seq_idx, activation)
    return conv


def fake_conv_states(calls):
    """causal-conv1d's ``causal_conv1d_varlen_states`` (causal_conv1d/causal_conv1d_varlen.py): ``x [T, D]``,
    the last ``state_len`` inputs of each document."""
    def states(x, cu_seqlens, state_len):
        assert_tokens(x.shape[0], "causal_conv1d_varlen_states")
        assert x.dim() == 2 and cu_seqlens.dtype == torch.int32 and cu_seqlens.is_contiguous()
        calls.append(("states", cu_seqlens))
        out = x.new_zeros(cu_seqlens.numel() - 1, x.shape[1], state_len)
        for i, (s, e) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
            n = min(state_len, e - s)
            if n:
                out[i, :, state_len - n:] = x[e - n:e].t()
        return out
    return states


def upstream_host_work(fn, *args, around=None, **kwargs):
    """``fn(*args, **kwargs)``: work a fake does the way upstream does it (its host reads are upstream's,
    which the sync census counts: ``around`` is the census's context that counts them)."""
    with around() if around is not None else contextlib.nullcontext():
        return fn(*args, **kwargs)


FLA_CONV_CHUNK = 64                 # fla/modules/causal_conv1d/ops.py (0.6.0): CausalConv1dFunction's chunk_size
_FLA_INDEX_CACHE: deque = deque(maxlen=4)    # fla/utils/decorators.py tensor_cache (0.6.0): 4 calls, by identity


def fla_chunk_indices(cu_seqlens, chunk_size, *, cached=True):
    """fla's ``prepare_chunk_indices`` (fla/ops/utils/index.py, 0.6.0) as upstream runs it: ``[NT, 2]``
    (sequence, chunk within it) in ``cu_seqlens``' dtype, memoized by the identity of its arguments
    (the last 4 calls), built by ``repeat_interleave`` without ``output_size`` (two host reads on a GPU)."""
    for cu, size, out in _FLA_INDEX_CACHE if cached else ():
        if cu is cu_seqlens and size == chunk_size:
            return out
    counts = (cu_seqlens[1:] - cu_seqlens[:-1] + chunk_size - 1).div(chunk_size, rounding_mode="floor")
    seg = torch.repeat_interleave(torch.arange(counts.numel(), dtype=counts.dtype, device=counts.device), counts)
    start = torch.cat([counts.new_zeros(1), counts.cumsum(0)[:-1]])
    out = torch.stack([seg, torch.arange(seg.numel(), dtype=counts.dtype, device=counts.device) - start[seg]], 1)
    out = out.to(cu_seqlens)
    if cached:
        _FLA_INDEX_CACHE.append((cu_seqlens, chunk_size, out))
    return out


def fake_fla_conv(calls):
    """fla's Triton ``causal_conv1d`` (fla/modules/causal_conv1d, 0.6.0): one varlen row, boundaries
    ending at T, ``[N, D, W]`` states; ``chunk_indices`` (the kernel's grid: a wrong one leaves chunks
    uncomputed) must be what fla would build, else fla builds them itself (:func:`fla_chunk_indices`).

    Slot 0 of the final states (the input that just left the window) is NaN here, so a wrapper
    that read it instead of dropping it would fail every comparison."""
    def conv(x, weight, bias=None, residual=None, initial_state=None, output_final_state=False, activation=None,
             backend="triton", cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None):
        _, t, d = x.shape
        assert_tokens(t, "fla's causal_conv1d")
        assert x.dim() == 3 and x.shape[0] == 1 and x.dtype in KERNEL_DTYPES and residual is None
        assert backend == "triton", "ssm-pack must never route fla to its own causal-conv1d backend"
        assert cu_seqlens is not None and cu_seqlens.dtype == torch.int64 and int(cu_seqlens[0]) == 0
        assert int(cu_seqlens[-1]) == t, "fla leaves tokens after cu_seqlens[-1] uncomputed"
        assert bool((cu_seqlens[1:] > cu_seqlens[:-1]).all()), "segments are never empty"
        assert cu_seqlens_cpu is None or torch.equal(cu_seqlens_cpu.cpu(), cu_seqlens.cpu())
        if chunk_indices is None:
            upstream_host_work(fla_chunk_indices, cu_seqlens, FLA_CONV_CHUNK)
        else:
            assert chunk_indices.device == x.device and chunk_indices.is_contiguous()
            assert chunk_indices.dtype in (torch.int32, torch.int64) and chunk_indices.dim() == 2
            assert torch.equal(chunk_indices.to(torch.int64),
                               fla_chunk_indices(cu_seqlens, FLA_CONV_CHUNK, cached=False)), "wrong chunk_indices"
        n, width = cu_seqlens.numel() - 1, weight.shape[1]
        assert tuple(weight.shape) == (d, width) and activation in (None, "silu", "swish")
        init = None
        if initial_state is not None:
            assert tuple(initial_state.shape) == (n, d, width) and bool((initial_state[..., 0] == 0).all())
            init = initial_state[..., 1:]
        calls.append(("fla_conv", dict(cu_seqlens=cu_seqlens, initial_state=initial_state,
                                       chunk_indices=chunk_indices)))
        out = causal_conv1d_fn(x.transpose(1, 2), weight, bias, initial_states=init, activation=activation,
                               return_final_states=output_final_state, cu_seqlens=cu_seqlens, backend="reference")
        if not output_final_state:
            return out.transpose(1, 2).contiguous(), None
        y, final = out
        nan = final.new_full((n, d, 1), float("nan"))
        return y.transpose(1, 2).contiguous(), torch.cat([nan, final], dim=2)
    return conv


class _VarlenStatesNoBackward(torch.autograd.Function):
    """``MambaChunkScanCombinedFn.backward`` asserts ``not ctx.return_varlen_states``: a call that returned
    varlen states has no backward."""

    @staticmethod
    def forward(ctx, *tensors):
        return tuple(t.clone() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        raise AssertionError("return_varlen_states is not supported in backward")


def fake_ssd(calls):
    """mamba-ssm's ``mamba_chunk_scan_combined`` (mamba_ssm/ops/triton/ssd_combined.py): the signature and
    returns of 2.2.5, the training minimum (unchanged up to 2.3.2.post1); the shape asserts of
    ``_mamba_chunk_scan_combined_fwd``; every pointer on ``x``'s device (Triton). Two limits upstream
    has with varlen states: ``chunk_state_varlen`` (ssd_chunk_state.py) never reads ``initial_states``,
    so the first document's state would miss it (refused here), and the backward asserts."""
    def scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
             cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False,
             return_varlen_states=False):
        batch, seqlen, nheads, headdim = x.shape
        assert_tokens(seqlen, "mamba_chunk_scan_combined")
        assert x.dtype in KERNEL_DTYPES and nheads % B.shape[2] == 0
        assert tuple(dt.shape) == (batch, seqlen, nheads) and tuple(A.shape) == (nheads,)
        assert tuple(B.shape[:2]) == (batch, seqlen) and C.shape == B.shape
        assert z is None or z.shape == x.shape
        assert D is None or tuple(D.shape) in ((nheads, headdim), (nheads,))
        assert seq_idx is not None and seq_idx.dtype == torch.int32 and seq_idx.is_contiguous()
        assert tuple(seq_idx.shape) == tuple(x.shape[:2]) and seq_idx.device == x.device
        assert (cu_seqlens is not None) == return_varlen_states
        if cu_seqlens is not None:
            assert cu_seqlens.dtype == torch.int32 and cu_seqlens.is_contiguous() and batch == 1
            assert cu_seqlens.device == x.device
        if initial_states is not None:
            assert tuple(initial_states.shape) == (batch, nheads, headdim, B.shape[-1]), "per-row initial states only"
            assert cu_seqlens is None, "chunk_state_varlen does not read initial_states"
        calls.append(("ssd", dict(seq_idx=seq_idx, cu_seqlens=cu_seqlens)))
        # with cu_seqlens the reference reads the boundaries from it (seq_idx is canonical, 0, 1, ...)
        result = mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias,
                                         initial_states=initial_states,
                                         seq_idx=None if cu_seqlens is not None else seq_idx, cu_seqlens=cu_seqlens,
                                         dt_softplus=dt_softplus, dt_limit=dt_limit,
                                         return_final_states=return_final_states,
                                         return_varlen_states=return_varlen_states, backend="reference")
        if return_varlen_states and torch.is_grad_enabled():
            return _VarlenStatesNoBackward.apply(*result)
        return result
    return scan


def fake_ssd_2_2_0(calls):
    """mamba-ssm 2.2.0's ``mamba_chunk_scan_combined`` (mamba_ssm/ops/triton/ssd_combined.py, v2.2.0): the
    2.2.x signature (16 inputs to ``MambaChunkScanCombinedFn.forward``), whose backward returns 14 gradients,
    so autograd raises at the first backward. Its forward is right (the reference computes it)."""
    class Scan2_2_0(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                    seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                    return_final_states=False, return_varlen_states=False):
            calls.append(("ssd_2_2_0", dict(seq_idx=seq_idx)))
            return mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias,
                                             seq_idx=seq_idx, dt_softplus=dt_softplus, dt_limit=dt_limit,
                                             backend="reference")

        @staticmethod
        def backward(ctx, dout, *args):
            none = None
            return (dout, none, none, none, none, none, none, none, none, none, none, none, none, none)   # 14

    def scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
             cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False,
             return_varlen_states=False):
        assert not return_final_states and not return_varlen_states, "this fake returns the output only"
        return Scan2_2_0.apply(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens,
                               dt_softplus, dt_limit, return_final_states, return_varlen_states)
    return scan


def fake_fla(calls):
    """fla's ``chunk_gated_delta_rule`` / ``chunk_kda`` / ``chunk_gated_delta_product`` (fla/ops/*/chunk.py,
    0.6.0): varlen on one row with int64 boundaries, fp32 KDA states, no fp32 Gated DeltaProduct."""
    ours = {"gdn": chunk_gated_delta_rule, "kda": chunk_kda, "gdp": chunk_gated_delta_product}

    def make(kind):
        def op(q, k, v, g, beta, *args, scale=None, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, cu_seqlens=None, num_householder=None):
            assert_tokens(q.shape[1], f"fla's {kind}")
            if cu_seqlens is not None:
                assert q.shape[0] == 1 and cu_seqlens.dtype == torch.int64
                assert int(cu_seqlens[-1]) == q.shape[1], "fla needs cu_seqlens[-1] == T"
                lengths = cu_seqlens[1:] - cu_seqlens[:-1]
                empty = lengths == 0
                # fla < 0.6 shifts every later document's index after an empty one: empties go last
                assert not bool((empty[:-1] & ~empty[1:]).any()), "empty documents must come after the others"
            if initial_state is not None:
                docs = cu_seqlens.numel() - 1 if cu_seqlens is not None else q.shape[0]
                assert tuple(initial_state.shape) == (docs, v.shape[2], k.shape[-1], v.shape[-1])
            if kind == "gdp":                                  # fla/ops/gated_delta_product/chunk.py
                assert q.dtype != torch.float32, "ChunkGatedDeltaProductFunction does not support float32"
            if kind == "kda" and initial_state is not None:   # fla/ops/kda/chunk.py
                assert initial_state.dtype == torch.float32, "initial_state must be in float32."
            assert q.shape == k.shape or kind == "gdp", "q and k must have the same shape"
            # fla/ops/common/chunk_delta_h.py, fla/ops/kda/chunk.py, gated_delta_product/chunk_deltaproduct_h.py
            assert k.shape[-1] <= 256, "current kernel does not support head dimension larger than 256."
            assert v.shape[2] % q.shape[2] == 0, "num_v_heads must be divisible by num_qk_heads"
            calls.append((kind, cu_seqlens))
            extra = (num_householder,) if kind == "gdp" else ()
            return ours[kind](q, k, v, g, beta, *extra, scale=scale, initial_state=initial_state,
                              output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                              cu_seqlens=cu_seqlens, backend="reference")
        return op
    return make


def fake_simple_gla(calls):
    """fla's ``chunk_simple_gla`` (fla/ops/simple_gla/chunk.py, 0.6.0): its signature (``state_v_first``
    between ``output_final_state`` and ``cu_seqlens``), ``[B, T, H, ...]`` inputs (``head_first`` is
    refused), fp32 / fp16 / bf16 (Triton's dots), even K and V for 16-bit inputs (``chunk_bwd_dv``), one
    row with int64 ``cu_seqlens`` ending at T (tokens after the last boundary stay uncomputed), one
    initial state per document, ``chunk_size`` a power of two; fp32 final states and ``dh0``; no gradient
    for ``g_gamma`` (``ChunkSimpleGLAFunction.backward`` returns ``None`` for it).

    Computed by ssm-pack's spec (:func:`mixers.ops.lightning.naive.simple_gla_naive`) in fp64, rounded to
    the dtypes fla returns. Records ``("simple_gla", {cu_seqlens, initial_state, g_gamma, scale})``."""
    def op(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, output_final_state=False,
           state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):
        assert "head_first" not in kwargs, "head_first has been removed. Inputs must be in `[B, T, H, ...]` format."
        chunk_size = kwargs.pop("chunk_size", None)
        assert not kwargs, f"unexpected arguments {sorted(kwargs)}"
        assert chunk_size is None or chunk_size == 2 ** (chunk_size.bit_length() - 1), "chunk_size: a power of 2"
        b, t, h, kd = q.shape
        vd = v.shape[-1]
        assert_tokens(t, "fla's chunk_simple_gla")
        assert q.dtype in KERNEL_DTYPES and k.dtype == q.dtype and v.dtype == q.dtype
        assert tuple(k.shape) == (b, t, h, kd) and tuple(v.shape[:3]) == (b, t, h)
        if q.dtype != torch.float32:            # fla/ops/common/chunk_o.py chunk_bwd_dv
            assert kd % 2 == 0 and vd % 2 == 0, f"chunk_bwd_dv requires even K and V for {q.dtype}"
        assert g is None and g_gamma is not None, "ssm-pack passes the per-head decay g_gamma only"
        assert tuple(g_gamma.shape) == (h,) and g_gamma.dtype == torch.float32 and g_gamma.device == q.device
        assert state_v_first is False
        assert isinstance(scale, float), "ssm-pack passes the scale it resolved"
        docs = b
        if cu_seqlens is not None:
            assert b == 1, f"The batch size is expected to be 1 rather than {b} when using `cu_seqlens`."
            assert isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dtype == torch.int64
            assert cu_seqlens.device == q.device and cu_seqlens.dim() == 1 and int(cu_seqlens[0]) == 0
            assert int(cu_seqlens[-1]) == t, "fla leaves tokens after cu_seqlens[-1] uncomputed"
            docs = cu_seqlens.numel() - 1
            if cu_seqlens_cpu is None:              # fla/ops/utils/index.py prepare_chunk_indices: host reads
                upstream_host_work(fla_chunk_indices, cu_seqlens, 64)
            else:
                assert cu_seqlens_cpu.device.type == "cpu" and torch.equal(cu_seqlens_cpu, cu_seqlens.cpu())
        if initial_state is not None:
            assert tuple(initial_state.shape) == (docs, h, kd, vd), \
                f"initial_state must be [N, H, K, V] = {[docs, h, kd, vd]}, got {list(initial_state.shape)}"
        calls.append(("simple_gla", dict(cu_seqlens=cu_seqlens, initial_state=initial_state, g_gamma=g_gamma,
                                         scale=scale)))
        init = None if initial_state is None else initial_state.double()
        o, final = simple_gla_naive(q.double(), k.double(), v.double(), g_gamma.detach().double(), scale=scale,
                                    initial_state=init, output_final_state=output_final_state,
                                    cu_seqlens=cu_seqlens)
        return o.to(q.dtype), (final.float() if final is not None else None)
    return op


def _hgrn_by_definition(x, g, h0, bounds):
    """``h_t = exp(g_t) * h_{t-1} + x_t`` over each ``(row, start, end)`` of ``bounds`` from its row of
    ``h0`` (zero without one), token by token: ``(out [B, T, D], finals [len(bounds), D])`` in the working
    dtype (fp32, as fla accumulates; fp64 for fp64, so tests of the wrapper can be exact)."""
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    xs, gs = x.to(work), g.to(work)
    rows = [[] for _ in range(x.shape[0])]
    finals = []
    for n, (row, start, end) in enumerate(bounds):
        h = h0[n].to(work) if h0 is not None else xs.new_zeros(x.shape[-1])
        for t in range(start, end):
            h = torch.exp(gs[row, t]) * h + xs[row, t]
            rows[row].append(h)
        finals.append(h)
    out = torch.stack([torch.stack(r) for r in rows])
    return out, torch.stack(finals)


def fake_fla_hgrn(calls):
    """fla's ``fused_recurrent_hgrn`` (fla/ops/hgrn/fused_recurrent.py, 0.6.0): ``ValueError`` for ``B != 1``
    with ``cu_seqlens`` and for ``initial_state`` rows other than the documents'; its varlen grid runs one
    program per document over ``cu_seqlens`` alone (the tokens after ``cu_seqlens[-1]`` would stay
    ``torch.empty``); the output and the final state in ``x``'s dtype."""
    def fused_recurrent_hgrn(x, g, initial_state=None, output_final_state=False, cu_seqlens=None):
        if cu_seqlens is not None:
            if x.shape[0] != 1:
                raise ValueError(f"The batch size is expected to be 1 rather than {x.shape[0]} when using "
                                 "`cu_seqlens`.")
            if initial_state is not None and initial_state.shape[0] != len(cu_seqlens) - 1:
                raise ValueError(f"The number of initial states is expected to be equal to the number of input "
                                 f"sequences, i.e., {len(cu_seqlens) - 1} rather than {initial_state.shape[0]}.")
        batch, length, width = x.shape
        assert_tokens(length, "fused_recurrent_hgrn")
        assert g.shape == x.shape and g.dtype == x.dtype and g.device == x.device, "x and g: one [B, T, D] layout"
        if cu_seqlens is None:
            bounds = [(row, 0, length) for row in range(batch)]
        else:
            assert cu_seqlens.dtype == torch.int64 and cu_seqlens.dim() == 1 and cu_seqlens.device == x.device
            cu = cu_seqlens.tolist()
            assert cu[0] == 0 and all(a <= b for a, b in zip(cu, cu[1:])), f"cu_seqlens must rise from 0: {cu}"
            assert cu[-1] == length, f"tokens {cu[-1]}..{length} are in no document: their output stays torch.empty"
            bounds = [(0, a, b) for a, b in zip(cu, cu[1:])]
        if initial_state is not None:
            assert tuple(initial_state.shape) == (len(bounds), width) and initial_state.device == x.device
        calls.append(("hgrn", dict(x=x, g=g, initial_state=initial_state, cu_seqlens=cu_seqlens,
                                   output_final_state=output_final_state)))
        out, finals = _hgrn_by_definition(x, g, initial_state, bounds)
        return out.to(x.dtype), (finals.to(x.dtype) if output_final_state else None)
    return fused_recurrent_hgrn


def _assert_ampere(t):
    """flash-attn csrc/flash_attn/flash_api.cpp (2.x, and aten's copy behind ``varlen_attn``): sm80+ only.
    The device's capability as :func:`mixers.ops.device_policy.read_capability` reports it (tests pretend)."""
    capability = device_policy.read_capability(t.device)
    assert capability is None or tuple(capability) >= (8, 0), "FlashAttention only supports Ampere GPUs or newer."


def _assert_boundaries(q, k, cu_q, cu_k):
    """int32 contiguous boundaries covering every query and every key, one document count."""
    assert cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32 and cu_q.is_contiguous() and cu_k.is_contiguous()
    assert cu_q.shape == cu_k.shape and int(cu_q[-1]) == q.shape[0] and int(cu_k[-1]) == k.shape[0]


def attend(q, k, v, cu_q, cu_k, max_q, causal, window, scale):
    """What the kernels compute: each document's queries over its keys; with fewer queries than keys the
    causal mask and the window align bottom-right (query i sits at key position ``i + Tk - Tq``, flash-attn
    >= 2.1). Equal boundaries go through ssm-pack's reference; others through a plain per-document softmax."""
    left, right = (-1, -1) if window is None else window
    if torch.equal(cu_q, cu_k):
        return varlen_attention(q, k, v, cu_q, max_q, causal=causal, window_size=None if left == -1 else window,
                                softmax_scale=scale, backend="reference")
    groups = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    outs = []
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for qa, qb, ka, kb in zip(bq[:-1], bq[1:], bk[:-1], bk[1:]):
        qi, ki, vi = q[qa:qb].float(), k[ka:kb].float(), v[ka:kb].float()
        pos = torch.arange(qb - qa)[:, None] + (kb - ka) - (qb - qa)
        key = torch.arange(kb - ka)[None, :]
        keep = (key <= pos) if causal else torch.ones_like(key <= pos)
        if left >= 0:
            keep &= key >= pos - left
        if right >= 0 and not causal:
            keep &= key <= pos + right
        scores = torch.einsum("qhd,khd->hqk", qi, ki.repeat_interleave(groups, dim=1)) * scale
        probs = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, vi.repeat_interleave(groups, dim=1)).to(q.dtype))
    return torch.cat(outs)


def fake_flash(calls):
    """flash-attn's ``flash_attn_varlen_func`` (csrc/flash_attn/flash_api.cpp, ``mha_varlen_fwd``): fp16 /
    bf16 with one dtype, the last dimension contiguous, int32 contiguous boundaries, sm80+."""
    def flash(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False, window_size=(-1, -1)):
        assert_tokens(q.shape[0], "flash_attn_varlen_func")
        assert q.dtype in (torch.float16, torch.bfloat16) and cu_q.dtype == torch.int32
        assert k.dtype == q.dtype and v.dtype == q.dtype, "query and key must have the same dtype"
        assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1, "last dimension must be contiguous"
        _assert_boundaries(q, k, cu_q, cu_k)
        assert q.shape[-1] <= 256, "FlashAttention forward only supports head dimension at most 256"
        _assert_ampere(q)
        calls.append(("flash", cu_q) if torch.equal(cu_q, cu_k) else ("flash", (cu_q, cu_k)))
        return attend(q, k, v, cu_q, cu_k, max_q, causal, window_size, softmax_scale)
    return flash


def fake_torch_varlen(calls):
    """PyTorch's ``varlen_attn`` in its keyword form (torch/nn/attention/varlen.py, torch 2.13): the checks of
    aten's flash forward (fp16 / bf16, one dtype, contiguous last dim, int32 boundaries covering every
    token, sm80+), ``Hq == Hk`` unless ``enable_gqa``, a window as ``(left, right)``."""
    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                    window_size=(-1, -1), enable_gqa=False):
        assert_tokens(query.shape[0], "varlen_attn")
        assert query.dtype in (torch.float16, torch.bfloat16) and key.dtype == value.dtype == query.dtype
        assert query.stride(-1) == 1 and key.stride(-1) == 1 and value.stride(-1) == 1
        assert cu_seq_k is not None and return_aux is None
        _assert_boundaries(query, key, cu_seq_q, cu_seq_k)
        assert enable_gqa or query.shape[1] == key.shape[1], "Hq != Hk needs enable_gqa=True"
        assert isinstance(window_size, tuple) and len(window_size) == 2
        # aten's flash forward (sdp_utils): head dim a multiple of 8, at most 256
        assert query.shape[-1] % 8 == 0 and query.shape[-1] <= 256, "head dim: multiple of 8 up to 256"
        _assert_ampere(query)
        calls.append(("torch_varlen", cu_seq_q) if torch.equal(cu_seq_q, cu_seq_k)
                     else ("torch_varlen", (cu_seq_q, cu_seq_k)))
        left, right = window_size
        return attend(query, key, value, cu_seq_q, cu_seq_k, max_q, right == 0, window_size, scale)
    return varlen_attn


def of_kind(calls, kind: str) -> list:
    """What the fakes of ``kind`` were given, call by call."""
    return [given for k, given in calls if k == kind]


def install(monkeypatch, supported=True, calls=None):
    """Pretend CUDA and install every fake; returns the list of recorded calls (``calls`` when given)."""
    calls = [] if calls is None else calls
    monkeypatch.setattr(dispatch, "is_cuda", lambda t: True)
    monkeypatch.setattr(dispatch, "cached_support",
                        lambda name, features=(): (True, None) if supported else (False, f"{name} is not installed"))
    # ``features`` may hold requirements.BACKWARD (autograd records): the installed fakes have right backwards
    monkeypatch.setattr(conv_kernel, "load_upstream", lambda: (fake_conv(calls), None))
    monkeypatch.setattr(fla_conv_kernel, "load_upstream", lambda: fake_fla_conv(calls))
    monkeypatch.setattr(ssd_kernel, "load_upstream", lambda: fake_ssd(calls))
    monkeypatch.setattr(fla_kernel, "load_upstream", fake_fla(calls))
    monkeypatch.setattr(simple_gla_kernel, "load_upstream", lambda: fake_simple_gla(calls))
    monkeypatch.setattr(hgrn_kernel, "load_upstream", lambda: fake_fla_hgrn(calls))
    monkeypatch.setattr(attn_kernel, "load_upstream", lambda: fake_flash(calls))
    return calls
