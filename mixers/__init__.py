"""Mixer ops, layers and the model for packed hybrid models (see README).

The rooms, lowest first (an import only points down): :mod:`.ops` (one folder per op: spec, torch
backend, kernel dispatch), :mod:`.inference` (slot caches, continuous batching), :mod:`.layers`
(the mixers, their building blocks and the mixer registry), :mod:`.model` (``HybridLM`` and what
trains and serves it), then :mod:`.checkpoints` and :mod:`.integrations` (converters,
``enable_packing``), :mod:`.demo`, :mod:`.report` and :mod:`.cli` (the ``ssm-pack`` command).
"""

from .layers import (
    AttentionMixer,
    GatedDeltaNetMixer,
    GatedDeltaProductMixer,
    GatedShortConvMixer,
    KDAMixer,
    LightningMixer,
    Mamba1Mixer,
    Mamba2Mixer,
    RGLRUMixer,
)
from .model import HybridLM

__all__ = ["AttentionMixer", "GatedDeltaNetMixer", "GatedDeltaProductMixer", "GatedShortConvMixer", "HybridLM",
           "KDAMixer", "LightningMixer", "Mamba1Mixer", "Mamba2Mixer", "RGLRUMixer"]
