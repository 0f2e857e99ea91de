"""Packed attention for Hugging Face attention layers, through transformers' ``AttentionInterface``.

    q [1, Hq, T, D], k / v [1, Hk, T, D|Dv]  ->  [1, T, Hq, Dv]   (Hugging Face's layout)

Why the interface and not a mask: Hugging Face derives a block-diagonal mask from ``position_ids``
only when the call has no cache (``use_cache`` defaults to True, so a plain ``model(**batch)``
builds one and its attention runs across documents), and a 4D mask handed in would have to match
each implementation's own mask format (additive float for eager, bool for sdpa, a ``BlockMask``
for flex). An attention function registered under its own name sees every attention call of the
model whatever the cache does, reads the boundaries the model call resolved (one
:class:`ssm_pack.VarlenBatch` shared with the swapped SSM layers) and runs
:func:`mixers.ops.varlen_attention` on them: per-document softmax, exact, and on CUDA
flash-attn's varlen kernel. A call without packing goes to the implementation the model was
loaded with, with the mask that implementation's own mask function built.

Wrapped implementations: ``eager``, ``sdpa``, ``flex_attention`` (registered as
``ssm_pack_<name>``). Others (``flash_attention_*``, ``paged|*``, hub kernels) are refused by
:func:`check_implementation` with the fix (load the model with ``attn_implementation="sdpa"``; a
packed call runs flash-attn's varlen kernel on CUDA anyway).
"""

from __future__ import annotations

import sys
import threading

import torch
from torch import nn

from ..ops.attention import varlen_attention

WRAPPED = ("eager", "sdpa", "flex_attention")
PREFIX = "ssm_pack_"
_BATCH = "_ssm_pack_batch"     # attribute of each wrapped attention module: the model's _Batch (copied with it)
_CALL = threading.local()                        # .packed: this thread runs a packed call of a patched model


def set_packed_call(packed: bool) -> None:
    """Set by the model's forward hooks: a packed call builds no attention mask (the packed
    attention does not read one; a ``[1, 1, T, T]`` mask is ``T * T`` bytes, and a flex
    ``BlockMask`` costs a compile on CPU)."""
    _CALL.packed = packed


def wrapped_name(implementation: str) -> str:
    return PREFIX + implementation


def attention_modules(model: nn.Module, skip=()) -> list[nn.Module]:
    """The modules of ``model`` whose class is a transformers attention layer, except those in
    ``skip`` (the linear-attention layers enable_packing swaps)."""
    skipped = {id(m) for m in skip}
    return [m for m in model.modules() if type(m).__module__.startswith("transformers.models.")
            and "Attention" in type(m).__name__ and id(m) not in skipped
            and not any("Attention" in type(c).__name__ for c in m.children())]


def check_implementation(model: nn.Module, attention: list[nn.Module]) -> str | None:
    """The implementation to wrap, ``None`` for a model without attention layers; ``ValueError``
    for one whose packed attention cannot be made exact."""
    if not attention:
        return None
    current = getattr(model.config, "_attn_implementation", None)
    if current is not None and current.startswith(PREFIX):
        current = current[len(PREFIX):]
    if current not in WRAPPED:
        raise ValueError(f"{type(model).__name__} runs attention with attn_implementation={current!r}, which "
                         f"enable_packing cannot make exact on packed batches; load the model with "
                         f"attn_implementation='sdpa' (or one of {list(WRAPPED)}): a packed call then runs "
                         "flash-attn's varlen kernel on CUDA")
    if hasattr(model, "_can_set_attn_implementation") and not model._can_set_attn_implementation():
        raise ValueError(f"{type(model).__name__}'s attention layers do not call transformers' AttentionInterface, "
                         "so enable_packing cannot keep packed documents apart in them; use a transformers version "
                         "whose modeling code does")
    return current


def attach(model: nn.Module, attention: list[nn.Module], implementation: str, batch) -> None:
    """Route ``model``'s attention through the packed wrapper of ``implementation``."""
    _register(implementation)
    for module in attention:
        setattr(module, _BATCH, batch)
    model.set_attn_implementation(wrapped_name(implementation))


def detach(model: nn.Module, implementation: str) -> None:
    model.set_attn_implementation(implementation)
    for module in model.modules():
        module.__dict__.pop(_BATCH, None)


def _register(implementation: str) -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    name = wrapped_name(implementation)
    if name in AttentionInterface._global_mapping:
        return
    original = None if implementation == "eager" else AttentionInterface._global_mapping[implementation]

    def packed_or_original(module, query, key, value, attention_mask, *args, **kwargs):
        batch = getattr(module, _BATCH, None)
        if batch is None:
            raise RuntimeError(f"{type(module).__name__} runs attn_implementation={name!r}, set by "
                               "mixers.integrations.transformers.enable_packing for another model; call "
                               "enable_packing on the model that holds this layer")
        if batch.params is None:
            forward = original or sys.modules[type(module).__module__].eager_attention_forward
            return forward(module, query, key, value, attention_mask, *args, **kwargs)
        return packed_attention(module, query, key, value, batch.params, *args, **kwargs)

    original_mask = ALL_MASK_ATTENTION_FUNCTIONS[implementation]

    def no_mask_when_packed(*args, **kwargs):
        return None if getattr(_CALL, "packed", False) else original_mask(*args, **kwargs)

    AttentionInterface.register(name, packed_or_original)
    AttentionMaskInterface.register(name, no_mask_when_packed)


def packed_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params,
                     dropout: float = 0.0, scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Attention within each document of ``params`` (a :class:`ssm_pack.VarlenBatch`); the
    attention mask Hugging Face built is not read (a packed call carries no padding)."""
    name = type(module).__name__
    if dropout:
        raise ValueError(f"{name} asks for attention dropout {dropout} on a packed batch, which enable_packing "
                         "does not implement; set config.attention_dropout = 0.0 or call model.eval()")
    for option in ("softcap", "s_aux"):
        if kwargs.get(option) is not None:
            raise ValueError(f"{name} passes {option}={kwargs[option]!r}, which packed attention does not "
                             "implement; disable_packing(model) to run this model")
    if query.shape[0] != 1 or key.shape[-2] != query.shape[-2]:
        raise ValueError(f"a packed batch must be one row without earlier cached tokens; {name} got queries "
                         f"{list(query.shape)} and keys {list(key.shape)} ([B, H, T, D]); call the model "
                         "without past_key_values")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))             # [T, H, D]
    dv, width = v.shape[-1], max(q.shape[-1], v.shape[-1])
    q, k, v = (nn.functional.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))   # MLA: Dv != D; zeros are exact
    window = kwargs.get("sliding_window")
    out = varlen_attention(q, k, v, params, causal=getattr(module, "is_causal", True),
                           softmax_scale=query.shape[-1] ** -0.5 if scaling is None else scaling,
                           window_size=None if window is None else (int(window) - 1, 0))
    return out[..., :dv].unsqueeze(0), None
