"""Mixer layers for hybrid models, packed: ``forward(hidden_states [B, T, D], packed_seq_params=None)``.

One file per mixer, holding its config and its layer (:mod:`.mamba2`, :mod:`.gated_deltanet`,
:mod:`.kda`, :mod:`.gated_deltaproduct`, :mod:`.attention`, :mod:`.gated_short_conv`,
:mod:`.mamba1`, :mod:`.rg_lru`, :mod:`.lightning`; the three delta-rule mixers share
:mod:`.delta_base`); what every mixer shares in :mod:`.base` (constructor, kernel plan, metadata)
and :mod:`.cached` (the cached forward); the building blocks in :mod:`.blocks`; the mixer
registry (letters, Hugging Face layers, caches, converters) in :mod:`.registry`.
"""

from .attention import AttentionConfig, AttentionMixer
from .blocks.norm import GatedRMSNorm, RMSNorm
from .gated_deltanet import GatedDeltaNetConfig, GatedDeltaNetMixer
from .gated_deltaproduct import GatedDeltaProductConfig, GatedDeltaProductMixer
from .gated_short_conv import GatedShortConvConfig, GatedShortConvMixer
from .kda import KDAConfig, KDAMixer
from .lightning import LightningConfig, LightningMixer
from .mamba1 import Mamba1Config, Mamba1Mixer
from .mamba2 import Mamba2Config, Mamba2Mixer
from .rg_lru import RGLRUConfig, RGLRUMixer

__all__ = ["AttentionConfig", "AttentionMixer", "GatedDeltaNetConfig", "GatedDeltaNetMixer", "GatedDeltaProductConfig",
           "GatedDeltaProductMixer", "GatedRMSNorm", "GatedShortConvConfig", "GatedShortConvMixer", "KDAConfig",
           "KDAMixer", "LightningConfig", "LightningMixer", "Mamba1Config", "Mamba1Mixer", "Mamba2Config",
           "Mamba2Mixer", "RGLRUConfig", "RGLRUMixer", "RMSNorm"]
