"""Mixer ops and layers for packed hybrid models (see README).

``mixers.ops``: the ops (reference + kernel dispatch); ``mixers.layers``: the mixer layers.
"""

from .layers import AttentionMixer, GatedDeltaNetMixer, GatedDeltaProductMixer, KDAMixer, Mamba2Mixer

__all__ = ["AttentionMixer", "GatedDeltaNetMixer", "GatedDeltaProductMixer", "KDAMixer", "Mamba2Mixer"]
