"""Packed-sequence ops: each keeps the signature of the upstream kernel it stands in for.

Every op folder holds ``naive.py``, the algorithm as its paper states it, one document at a time:
the specification the rest is tested against. A call runs either the torch backend
(``reference.py``: exact, any device, fp64 capable, differentiable; ``backend="reference"``) or the
upstream CUDA kernel (``kernel*.py``), chosen by ``backend="auto" | "kernel" | "reference"``
(:mod:`.dispatch`). The decode steps are ``update.py`` (with ``update_kernel.py``), context
parallelism ``cp.py``, the checks and the checked call record ``_validate.py``; the ``__init__`` of
a folder routes only. What the folders share: :mod:`.common`; CPU vs GPU computation shapes:
:mod:`.device_policy`.
"""

from .attention import varlen_attention
from .attention.segment import segment_attention
from .attention.update import attention_with_kvcache
from .causal_conv1d import causal_conv1d_fn
from .causal_conv1d.update import causal_conv1d_update
from .delta_rule import (
    chunk_gated_delta_product,
    chunk_gated_delta_rule,
    chunk_kda,
    gated_delta_product_step,
    gated_delta_rule_step,
    kda_step,
)
from .delta_rule.update import (
    fused_recurrent_gated_delta_product,
    fused_recurrent_gated_delta_rule,
    fused_recurrent_kda,
)
from .lightning import chunk_simple_gla
from .lightning.update import fused_recurrent_simple_gla
from .rg_lru import rg_lru
from .rg_lru.update import rg_lru_update
from .selective_scan import selective_scan_fn
from .selective_scan.update import selective_scan_update
from .ssd import mamba_chunk_scan_combined
from .ssd.update import selective_state_update

__all__ = ["attention_with_kvcache", "causal_conv1d_fn", "causal_conv1d_update", "chunk_gated_delta_product",
           "chunk_gated_delta_rule", "chunk_kda", "chunk_simple_gla", "fused_recurrent_gated_delta_product",
           "fused_recurrent_gated_delta_rule", "fused_recurrent_kda", "fused_recurrent_simple_gla",
           "gated_delta_product_step", "gated_delta_rule_step", "kda_step", "mamba_chunk_scan_combined", "rg_lru",
           "rg_lru_update", "segment_attention", "selective_scan_fn", "selective_scan_update",
           "selective_state_update", "varlen_attention"]
