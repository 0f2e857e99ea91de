"""PyTorch's own varlen attention, ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2
inside torch: no flash-attn build needed), the first attention kernel on CUDA.

    T = packed tokens, Hq = query heads, Hk = key/value heads, D = head dim, N = documents

Its signature moved between releases, so the installed one is read (:func:`form_of`), never
assumed from a version number:

* torch 2.10: ``varlen_attn(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False,
  return_aux=None)``: no ``scale``, no window, ``Hq == Hk`` only;
* later releases: keyword-only ``scale=``, ``window_size=(left, right)`` (``(-1, 0)`` is
  causal, ``(W, 0)`` a causal sliding window; ``is_causal`` is gone) and then ``enable_gqa=``.

A form without ``enable_gqa`` gets ``k, v`` with their heads repeated to ``Hq`` (query head ``i``
reads key/value head ``i // (Hq / Hk)``, as flash-attn's GQA does); a form without windows or
without ``scale`` cannot run a sliding window or a non-default scale (:func:`unsupported_for` says
so, and ``auto`` takes the next kernel or the reference). Like flash-attn, the call gets
:attr:`ssm_pack.VarlenBatch.covering_cu_seqlens` (int32, a final boundary at T) and fp16 / bf16
tensors on a CUDA device; it is a CUDA C++ kernel, so the interpreter lane cannot run it.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch

from ..device_policy import attention_kernel_limit
from ._validate import AttentionCall
from .kernel import KERNEL_DTYPES


@dataclass(frozen=True)
class VarlenForm:
    """What an installed ``varlen_attn`` takes (keyword names of its signature)."""

    is_causal: bool        # is_causal= (torch 2.10)
    window: bool           # window_size=(left, right)
    gqa: bool              # enable_gqa=
    scale: bool            # scale=


def load_upstream():
    """The installed ``varlen_attn``, or ``None`` (torch before 2.10)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.lru_cache(maxsize=8)
def form_of(fn) -> VarlenForm | None:
    """The :class:`VarlenForm` of ``fn``'s signature, or ``None`` for a form that can express
    neither causal attention nor a window (not one ssm-pack knows). Read once per function (the
    signature is a fact of the installed torch; calls cost a cache lookup, never ``inspect``)."""
    params = inspect.signature(fn).parameters
    form = VarlenForm(is_causal="is_causal" in params, window="window_size" in params, gqa="enable_gqa" in params,
                      scale="scale" in params)
    return form if (form.is_causal or form.window) else None


def on_cuda(t) -> bool:
    """Whether ``t`` (a tensor or a device) really is on a CUDA device (not the interpreter lane's
    pretend device)."""
    return t.is_cuda if isinstance(t, torch.Tensor) else torch.device(t).type == "cuda"


def unsupported_for(dtype: torch.dtype, head_dim: int, device, causal: bool, window: tuple[int, int],
                    scale: float) -> str | None:
    """What ``varlen_attn`` cannot do for a call with these facts (``None``: it can)."""
    if not on_cuda(device):
        return "tensors off a CUDA device (PyTorch's varlen_attn is a CUDA kernel)"
    if dtype not in KERNEL_DTYPES:
        return f"dtype {dtype} (PyTorch's varlen_attn takes fp16 / bf16)"
    if head_dim % 8 or head_dim > 256:
        return f"head dim {head_dim} (PyTorch's varlen_attn takes multiples of 8 up to 256)"
    limit = attention_kernel_limit(device)
    if limit is not None:
        return limit
    fn = load_upstream()
    form = None if fn is None else form_of(fn)
    if form is None:
        return f"torch {torch.__version__} has no varlen_attn this wrapper knows (torch.nn.attention.varlen, >= 2.10)"
    left, right = window
    if not form.window and (left != -1 or (right != -1 and not causal)):
        return f"sliding window {window} (torch {torch.__version__}'s varlen_attn has no window_size=)"
    if not form.scale and scale != head_dim ** -0.5:
        return f"softmax_scale={scale} (torch {torch.__version__}'s varlen_attn has no scale=)"
    return None


def varlen_call(q, k, v, cu_q, cu_k, max_q: int, max_k: int, *, causal: bool, window: tuple[int, int],
                scale: float):
    """``varlen_attn`` in the installed form: ``q [Tq, Hq, D]`` over ``k, v [Tk, Hk, D]`` with int32
    boundaries ``cu_q`` / ``cu_k`` covering every token. With ``Tq < Tk`` in a document the causal mask
    aligns bottom-right (query i sees keys up to ``i + Tk - Tq``), as FlashAttention-2 (>= 2.1) does."""
    fn = load_upstream()
    form = form_of(fn)
    hq, hk = q.shape[1], k.shape[1]
    kwargs = {}
    if hq != hk:
        if form.gqa:
            kwargs["enable_gqa"] = True
        else:
            k, v = (t.repeat_interleave(hq // hk, dim=1) for t in (k, v))
    if form.scale:
        kwargs["scale"] = scale
    left, right = window
    if form.window:
        kwargs["window_size"] = (left, 0) if causal else (left, right)
    if form.is_causal:
        kwargs["is_causal"] = causal
    return fn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)


def torch_varlen_attention(call: AttentionCall):
    """``[T, Hq, D]`` attention inside each document through the installed ``varlen_attn``
    (:func:`unsupported_for` said it can)."""
    q = call.q
    cu = call.varlen.covering_cu_seqlens.to(device=q.device, dtype=torch.int32)
    return varlen_call(q, call.k, call.v, cu, cu, call.max_seqlen, call.max_seqlen, causal=call.causal,
                       window=call.window, scale=call.scale)
