"""Mixer ops and layers for packed hybrid models (see README).

``mixers.ops``: the ops (reference + kernel dispatch); ``mixers.layers``: the mixer layers.
"""

from .layers import AttentionMixer, GatedDeltaNetMixer, GatedDeltaProductMixer, KDAMixer, Mamba2Mixer
from .model import HybridLM

__all__ = ["AttentionMixer", "GatedDeltaNetMixer", "GatedDeltaProductMixer", "HybridLM", "KDAMixer", "Mamba2Mixer"]
