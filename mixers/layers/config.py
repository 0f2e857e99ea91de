"""The mixers' configs, importable from one module (each is defined beside its mixer: a new
mixer's config lives in its own layer file).

Typed, frozen dataclasses: every size derived from ``hidden_size`` unless given. Defaults follow
the upstream layers (mamba-ssm's ``Mamba2``, fla's ``GatedDeltaNet``, ``KimiDeltaAttention``,
``GatedDeltaProduct``), with head dims of 64 so that small models stay cheap on a CPU.
"""

from .attention import AttentionConfig
from .delta_base import DeltaConfig
from .gated_deltanet import GatedDeltaNetConfig
from .gated_deltaproduct import GatedDeltaProductConfig
from .gated_short_conv import GatedShortConvConfig
from .kda import KDAConfig
from .lightning import LightningConfig
from .mamba1 import Mamba1Config
from .mamba2 import Mamba2Config
from .rg_lru import RGLRUConfig

__all__ = ["AttentionConfig", "DeltaConfig", "GatedDeltaNetConfig", "GatedDeltaProductConfig", "GatedShortConvConfig",
           "KDAConfig", "LightningConfig", "Mamba1Config", "Mamba2Config", "RGLRUConfig"]
