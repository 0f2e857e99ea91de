"""Packed-sequence ops: each keeps the signature of the upstream kernel it stands in for.

Every op runs an exact pure-PyTorch reference (any device, fp64 capable, differentiable) or the
upstream CUDA kernel, chosen by ``backend="auto" | "kernel" | "reference"``.
"""

from .attention import varlen_attention
from .causal_conv1d import causal_conv1d_fn
from .delta_rule import (
    chunk_gated_delta_product,
    chunk_gated_delta_rule,
    chunk_kda,
    gated_delta_product_step,
    gated_delta_rule_step,
    kda_step,
)
from .ssd import mamba_chunk_scan_combined

__all__ = ["causal_conv1d_fn", "chunk_gated_delta_product", "chunk_gated_delta_rule", "chunk_kda",
           "gated_delta_product_step", "gated_delta_rule_step", "kda_step", "mamba_chunk_scan_combined",
           "varlen_attention"]
