"""Inference: per-slot caches, decode steps and continuous batching.

    S = slots (``max_batch_size``), N = documents / rows of one call

A cache is a pool of per-sequence **slots** (mamba-ssm's ``allocate_inference_cache``, Megatron's
``batch_indices``, vLLM / SGLang's slot-indexed state pools): a packed prefill writes each
document's final conv and recurrent state (and, for attention, its keys and values) into its
slot; decoding reads and updates slots by index; a chunked prefill continues a slot.

* :class:`SlotTable` / :class:`SlotBatch` (:mod:`.slots`): tokens per slot, one call's slots
  validated and resolved once;
* :class:`LayerCache` (:mod:`.layer_cache`): one mixer's per-slot states;
* :class:`InferenceCache` (:mod:`.cache`): a model's, every mixer's slots together;
* :func:`generate` / :class:`ContinuousBatcher` (:mod:`.generate`): continuous batching;
* :func:`check_against_recompute` (:mod:`.recompute`): cached decoding vs a full forward.

This package imports torch and ``ssm_pack`` only: the layers (their step logic lives next to
each mixer, in its layer file and ``mixers/layers/cached.py``) and the model build on it.
"""

from .cache import InferenceCache
from .generate import ContinuousBatcher, generate
from .layer_cache import LayerCache
from .recompute import check_against_recompute
from .slots import SlotBatch, SlotTable

__all__ = ["ContinuousBatcher", "InferenceCache", "LayerCache", "SlotBatch", "SlotTable", "check_against_recompute",
           "generate"]
