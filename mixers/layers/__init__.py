"""Mixer layers for hybrid models, packed: ``forward(hidden_states [B, T, D], packed_seq_params=None)``."""

from .attention import AttentionMixer
from .config import AttentionConfig, GatedDeltaNetConfig, GatedDeltaProductConfig, KDAConfig, Mamba2Config
from .gated_deltanet import GatedDeltaNetMixer
from .gated_deltaproduct import GatedDeltaProductMixer
from .kda import KDAMixer
from .mamba2 import Mamba2Mixer
from .norm import GatedRMSNorm, RMSNorm

__all__ = ["AttentionConfig", "AttentionMixer", "GatedDeltaNetConfig", "GatedDeltaNetMixer", "GatedDeltaProductConfig",
           "GatedDeltaProductMixer", "GatedRMSNorm", "KDAConfig", "KDAMixer", "Mamba2Config", "Mamba2Mixer",
           "RMSNorm"]
