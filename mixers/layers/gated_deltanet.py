"""``GatedDeltaNetMixer``: fla's ``GatedDeltaNet`` (scalar decay per value head), packed.

    g = -exp(A_log) * softplus(a_proj(x) + dt_bias)      [B, T, HV]

Made of: everything but the gate lives in :mod:`.delta_base` (projections, short convs, scan call,
norm and out_proj, the cache); the scalar gate in :class:`.delta_base.ScalarGateMixer`, its
initialisation in :mod:`.blocks.init`; sizes in :class:`GatedDeltaNetConfig` below; the ops are
:func:`mixers.ops.chunk_gated_delta_rule` and, decoding, :func:`mixers.ops.fused_recurrent_gated_delta_rule`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ops import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from .delta_base import DeltaConfig, ScalarGateMixer


@dataclass(frozen=True)
class GatedDeltaNetConfig(DeltaConfig):
    """fla's ``GatedDeltaNet``: scalar decay per head, SiLU-gated output norm."""


class GatedDeltaNetMixer(ScalarGateMixer):
    """Gated DeltaNet mixer: ``forward(hidden_states [B, T, D], packed_seq_params=None) -> [B, T, D]``.

    ``GatedDeltaNetMixer(512)`` derives every size from ``hidden_size`` (see
    :class:`GatedDeltaNetConfig`); ``backend`` is ``"auto"``, ``"kernel"`` or ``"reference"``.
    """

    CONFIG = GatedDeltaNetConfig
    CHUNK = staticmethod(chunk_gated_delta_rule)
    STEP = staticmethod(fused_recurrent_gated_delta_rule)
