"""``GatedDeltaNetMixer``: fla's ``GatedDeltaNet`` (scalar decay per value head), packed.

    g = -exp(A_log) * softplus(a_proj(x) + dt_bias)      [B, T, HV]

Made of: everything but the gate lives in :mod:`.delta_base` (projections, short convs, scan call,
norm and out_proj, the cache); the scalar gate in :class:`.delta_base.ScalarGateMixer`, its
initialisation in :mod:`._init`; sizes in :class:`.config.GatedDeltaNetConfig`; the scan is
:func:`mixers.ops.chunk_gated_delta_rule`.
"""

from __future__ import annotations

from ..ops import chunk_gated_delta_rule
from .config import GatedDeltaNetConfig
from .delta_base import ScalarGateMixer


class GatedDeltaNetMixer(ScalarGateMixer):
    """Gated DeltaNet mixer: ``forward(hidden_states [B, T, D], packed_seq_params=None) -> [B, T, D]``.

    ``GatedDeltaNetMixer(512)`` derives every size from ``hidden_size`` (see
    :class:`GatedDeltaNetConfig`); ``backend`` is ``"auto"``, ``"kernel"`` or ``"reference"``.
    """

    CONFIG = GatedDeltaNetConfig
    KIND = "gdn"

    def _scan(self, q, k, v, g, beta, varlen):
        o, _ = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True,
                                      cu_seqlens=varlen, chunk_size=self.config.chunk_size, backend=self.backend)
        return o
