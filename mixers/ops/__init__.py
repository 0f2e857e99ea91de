"""Packed-sequence ops: each keeps the signature of the upstream kernel it stands in for.

Every op runs an exact pure-PyTorch reference (any device, fp64 capable, differentiable) or the
upstream CUDA kernel, chosen by ``backend="auto" | "kernel" | "reference"``.
"""

from .causal_conv1d import causal_conv1d_fn
from .ssd import mamba_chunk_scan_combined

__all__ = ["causal_conv1d_fn", "mamba_chunk_scan_combined"]
