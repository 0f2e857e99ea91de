"""Exact packing for Hugging Face hybrid models: ``enable_packing(model)``.

    B = rows, T = tokens, D = hidden

Transformers' own torch paths cannot keep the documents of a ``DataCollatorWithFlattening`` batch
apart (the state of one document flows into the next). ``enable_packing`` swaps every
SSM / linear-attention layer that :mod:`mixers.checkpoints` reads (Mamba2 and the Mamba2 blocks
of Bamba / NemotronH / GraniteMoeHybrid / FalconH1 / Zamba2, the gated delta nets of Qwen3-Next /
Qwen3.5 / OLMo-hybrid, Kimi-Linear's KDA, the gated short conv of LFM2 / LFM3 / LFM2-MoE, the
Mamba-1 layers of Mamba / Falcon-Mamba / Jamba, RecurrentGemma's recurrent block, MiniMax's
lightning attention; the last two return a pair, and the swapped layer answers in kind) for our mixer holding
the same weights, and reads the boundaries the collator passes to the model (``cu_seq_lens_q`` /
``cu_seq_lens_k``, ``seq_idx``, ``position_ids`` restarts) once per forward, so every document
starts from a zero state. Attention layers stay Hugging Face's, and the model's ``attn_implementation`` is wrapped
(:mod:`.hf_attention`): a packed call attends within each
document whatever ``use_cache`` is; ``eager``, ``sdpa`` and ``flex_attention`` are wrapped, other
implementations are refused with the fix (models without attention, Mamba and Falcon-Mamba, have
none to wrap). A packed batch must not also carry an ``attention_mask``
with padding (refused before any layer runs); an unpacked padded batch runs as packed rows.

The patched model's ``state_dict`` keeps Hugging Face's names and layout (a ``save_pretrained``
checkpoint loads into the unpatched model), and ``load_state_dict`` accepts them and reports
missing, unexpected and mis-shaped keys in those names (:mod:`.hf_state_dict`). Decoding with a
cache (``generate``) needs Hugging Face's layers back: ``disable_packing(model)``.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn

from ssm_pack import PackedSeqParams, VarlenBatch

from ..checkpoints import SOURCES, from_module, source_of
from ..checkpoints.convert import to_module
from .hf_attention import attach, attention_modules, check_implementation, detach, set_packed_call
from .hf_state_dict import check_whole_load, load_upstream, save_upstream

_BOUNDARY_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx", "position_ids")
_LENGTH_KEYS = ("input_ids", "inputs_embeds", "labels")
_CACHE_KEYS = ("cache", "cache_params", "past_key_values")


def _hf_classes() -> set[str]:
    """The Hugging Face layer classes a registered mixer's converter reads (``"transformers:Name"``)."""
    return {c for s in SOURCES.values() for c in s.classes if c.startswith("transformers:")}


class _Batch:
    """The current forward's packing, resolved once per model call by the pre-forward hook (every
    swapped layer reads the same :class:`ssm_pack.VarlenBatch`)."""

    def __init__(self):
        self.params: VarlenBatch | None = None


def _position_resets(position_ids: torch.Tensor) -> int:
    return int((position_ids[..., 1:] <= position_ids[..., :-1]).sum())


def packing_from_model_kwargs(kwargs: dict) -> PackedSeqParams | None:
    """:class:`PackedSeqParams` for a model call's keyword arguments, or ``None`` when the batch is
    not packed (no explicit boundaries and no ``position_ids`` restart)."""
    batch = {k: kwargs[k] for k in _BOUNDARY_KEYS + _LENGTH_KEYS if kwargs.get(k) is not None}
    position_ids = batch.get("position_ids")
    if position_ids is not None and position_ids.dim() == 3:          # MRoPE: the temporal plane
        position_ids = batch["position_ids"] = position_ids[0]
    tokens = next((batch[k] for k in ("input_ids", "inputs_embeds") if k in batch), None)
    if position_ids is not None and tokens is not None:
        length = tokens.shape[-2] if tokens.dim() == 3 and tokens.is_floating_point() else tokens.shape[-1]
        if position_ids.shape[-1] != length:
            raise ValueError(f"position_ids covers {position_ids.shape[-1]} tokens but the input has {length}; "
                             "give one position per input token")
    explicit = "cu_seq_lens_q" in batch or "seq_idx" in batch
    resets = _position_resets(position_ids) if position_ids is not None else 0
    if not explicit and resets == 0:
        return None
    rows = next((v.shape[0] for k, v in batch.items() if k in ("input_ids", "inputs_embeds", "position_ids")), 1)
    if rows != 1:
        raise ValueError(f"packed batches must be one row [1, T] (DataCollatorWithFlattening), got {rows} rows "
                         "whose position_ids restart; flatten them into one row")
    _check_same_keys(batch)
    params = PackedSeqParams.from_hf_batch(batch)
    documents = params.cu_seqlens_q.numel() - 1
    if not explicit and documents != resets + 1:
        raise ValueError(f"position_ids restart {resets} times but only {documents} documents were found from "
                         "them; pass cu_seq_lens_q (DataCollatorWithFlattening(return_flash_attn_kwargs=True))")
    return params


def _check_same_keys(batch: dict) -> None:
    """A packed training call attends within each document: ``cu_seq_lens_k`` must be ``cu_seq_lens_q``."""
    if "cu_seq_lens_q" not in batch or "cu_seq_lens_k" not in batch:
        return
    q, k = (torch.as_tensor(batch[key]).tolist() for key in ("cu_seq_lens_q", "cu_seq_lens_k"))
    if q != k:
        raise ValueError(f"cu_seq_lens_k={k} differs from cu_seq_lens_q={q}: a packed training call attends within "
                         "each document (self-attention), so both must describe the same documents; pass "
                         "cu_seq_lens_k equal to cu_seq_lens_q (or leave it out)")


class PackedMixer(nn.Module):
    """Stands in for one Hugging Face mixer: same call (``hidden_states [B, T, D]``, a cache,
    ``attention_mask [B, T]``, extra keywords), runs our mixer with the current batch's packing.

    A padded batch (``attention_mask`` with zeros) runs as one packed row of its real tokens, so
    padding, left or right, never reaches a real token; padded positions return zeros.
    """

    def __init__(self, mixer: nn.Module, original: nn.Module, batch: _Batch):
        super().__init__()
        self.mixer = mixer
        self.source = source_of(original).name
        self._pair = source_of(original).returns_pair     # MiniMax's and RecurrentGemma's layers return pairs
        self.layer_idx = getattr(original, "layer_idx", None)
        buffers = {name: b.detach().clone() for name, b in original.named_buffers()}
        self._original = (original.to("meta"), buffers)   # the HF layer without its weights' storage
        self._batch = batch
        self._caches = weakref.WeakSet()               # caches this layer ran with but did not fill
        self._name_hooks = ()
        self.use_upstream_names(True)

    def use_upstream_names(self, upstream: bool) -> None:
        """``state_dict`` / ``load_state_dict`` in the Hugging Face layer's keys (the default) or in
        ours (``<layer>.mixer.*``, every key a parameter's path)."""
        for hook in self._name_hooks:
            hook.remove()
        self._name_hooks = ((self.register_state_dict_post_hook(save_upstream),
                             self.register_load_state_dict_pre_hook(load_upstream)) if upstream else ())

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        cache = next((kwargs[k] for k in _CACHE_KEYS if kwargs.get(k) is not None), args[0] if args else None)
        if cache is not None:
            if cache in self._caches:
                raise RuntimeError(f"{type(self._original[0]).__name__} (layer {self.layer_idx}) was replaced by "
                                   "mixers.integrations.transformers.enable_packing, which does not decode with "
                                   "a cache; call disable_packing(model) before generate()")
            self._caches.add(cache)
        params = self._batch.params
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)   # (cache, mask) positionally
        if params is None and _has_padding(mask):       # packed + padding: refused by the model's hook
            out = self._padded(hidden_states, mask.bool())
        else:
            out = self.mixer(hidden_states, packed_seq_params=params)
        return (out, None) if self._pair else out

    def _padded(self, hidden_states: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        params = PackedSeqParams.from_lengths(keep.sum(1))
        out = self.mixer(hidden_states[keep].unsqueeze(0), packed_seq_params=params)[0]
        full = out.new_zeros(*keep.shape, out.shape[-1])
        full[keep] = out
        return full


def _has_padding(mask) -> bool:
    return isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.all())


def _resolve(params: PackedSeqParams, kwargs: dict) -> VarlenBatch:
    """The call's metadata, built once on the tokens' device for all swapped layers."""
    tokens = next(kwargs[k] for k in ("input_ids", "inputs_embeds", "position_ids", "labels")
                  if kwargs.get(k) is not None)
    return VarlenBatch.build(params, tokens.shape[-2] if tokens.dim() == 3 and tokens.is_floating_point()
                             else tokens.shape[-1], device=tokens.device)


def _hf_mixers(model: nn.Module):
    """(parent, attribute, module) for every layer a converter reads."""
    classes = _hf_classes()
    for parent in model.modules():
        for attr, child in parent.named_children():
            key = f"{type(child).__module__.split('.')[0]}:{type(child).__name__}"
            if key in classes:
                yield parent, attr, child


def enable_packing(model: nn.Module, *, backend: str = "auto") -> nn.Module:
    """Swap the SSM / linear-attention layers of the Hugging Face model ``model`` for ours (same
    weights, in place) and read each call's ``DataCollatorWithFlattening`` boundaries.

    Call the returned model (the same object) the way Hugging Face's ``Trainer`` does:
    ``model(**batch)``. Raises ``ValueError`` when the model has no layer a converter reads, when
    a layer uses an option our mixers cannot represent, or when its attention runs an
    ``attn_implementation`` packed attention cannot replace (``flash_attention_*``, ``paged|*``,
    hub kernels: load the model with ``attn_implementation="sdpa"``); nothing is changed then.
    A later packed call with a padding ``attention_mask`` raises ``ValueError`` before any layer runs.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (a transformers model), got {type(model).__name__}")
    if getattr(model, "_ssm_pack_packing", None) is not None:
        raise ValueError("enable_packing(model) was already called on this model")
    found = list(_hf_mixers(model))
    if not found:
        raise ValueError(f"{type(model).__name__} has no layer enable_packing converts; it reads "
                         f"{sorted(c.split(':')[1] for c in _hf_classes())}")
    attention = attention_modules(model, skip=[child for _, _, child in found])
    implementation = check_implementation(model, attention)
    converted = [from_module(child, backend=backend) for _, _, child in found]      # all or nothing
    batch = _Batch()
    for (parent, attr, child), mixer in zip(found, converted):
        mixer.train(child.training)
        setattr(parent, attr, PackedMixer(mixer, child, batch))
    if implementation is not None:
        attach(model, attention, implementation, batch)

    hooks = (model.register_forward_pre_hook(_read_boundaries, with_kwargs=True),
             model.register_forward_hook(_end_call, always_call=True),
             model.register_load_state_dict_pre_hook(check_whole_load(PackedMixer)))
    model._ssm_pack_packing = (batch, hooks, implementation)
    return model


@contextlib.contextmanager
def native_names(model: nn.Module):
    """Inside the block the patched ``model``'s ``state_dict`` / ``load_state_dict`` use its module
    paths (a swapped layer's weights under ``<layer>.mixer.``), which is what
    ``torch.distributed.checkpoint`` and FSDP2's state-dict helpers need: every key names a
    parameter. Outside it, Hugging Face's names and layout, as :func:`enable_packing` documents."""
    state = getattr(model, "_ssm_pack_packing", None)
    if state is None:
        raise ValueError("enable_packing(model) was not called on this model")
    swapped = [m for m in model.modules() if isinstance(m, PackedMixer)]
    batch, hooks, implementation = state
    hooks[2].remove()                                  # the whole-load check reads Hugging Face's names
    for module in swapped:
        module.use_upstream_names(False)
    try:
        yield model
    finally:
        for module in swapped:
            module.use_upstream_names(True)
        check = model.register_load_state_dict_pre_hook(check_whole_load(PackedMixer))
        model._ssm_pack_packing = (batch, (hooks[0], hooks[1], check), implementation)


def _read_boundaries(model: nn.Module, args, kwargs):
    """Forward pre-hook of a patched model: the call's packing, for every swapped layer. It reads
    the model's own ``_Batch`` (not a closure's), so a deep copy packs with its own."""
    params = packing_from_model_kwargs(kwargs)
    mask = kwargs.get("attention_mask")
    if params is not None and mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            raise ValueError(f"a packed batch (position_ids restarts / cu_seq_lens / seq_idx) must not carry a "
                             f"4D attention_mask or BlockMask (got {type(mask).__name__} of shape "
                             f"{list(getattr(mask, 'shape', []))}): packed attention keeps each document's own "
                             "causal mask; drop attention_mask, or call disable_packing(model) for a custom mask")
        if _has_padding(mask):
            raise ValueError("a packed batch (position_ids restarts / cu_seq_lens / seq_idx) must not also carry "
                             "an attention_mask with padding: packing already drops the padding; pass one of "
                             "them (DataCollatorWithFlattening's batch without attention_mask)")
    model._ssm_pack_packing[0].params = None if params is None else _resolve(params, kwargs)
    set_packed_call(params is not None)


def _end_call(model, args, output):
    set_packed_call(False)


def disable_packing(model: nn.Module) -> nn.Module:
    """Put Hugging Face's layers back, holding the current (e.g. fine-tuned) weights."""
    state = getattr(model, "_ssm_pack_packing", None)
    if state is None:
        raise ValueError("enable_packing(model) was not called on this model")
    for parent in model.modules():
        for attr, child in list(parent.named_children()):
            if isinstance(child, PackedMixer):
                original, buffers = child._original
                original.to_empty(device=next(child.mixer.parameters()).device)
                with torch.no_grad():
                    for name, value in buffers.items():
                        original.get_buffer(name).copy_(value)
                setattr(parent, attr, to_module(child.mixer, original).train(child.training))
    for hook in state[1]:
        hook.remove()
    if state[2] is not None:
        detach(model, state[2])
    model._ssm_pack_packing = None
    return model
