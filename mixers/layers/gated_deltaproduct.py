"""``GatedDeltaProductMixer``: fla's ``GatedDeltaProduct`` (``num_householder`` delta steps per
token, one scalar decay per token), packed.

    k, v, beta: ``[B, T * nh, ...]`` (each token's sub-steps interleaved, fla's layout)
    g = -exp(A_log) * softplus(a_proj(x) + dt_bias)      [B, T, H]

Made of: everything but the gate lives in :mod:`.delta_base` (projections with ``nh`` steps per
token, short convs, scan call, norm and out_proj, the cache); the scalar gate in
:class:`.delta_base.ScalarGateMixer`; sizes in :class:`.config.GatedDeltaProductConfig`; the
scan is :func:`mixers.ops.chunk_gated_delta_product`.
"""

from __future__ import annotations

from ..ops import chunk_gated_delta_product
from .config import GatedDeltaProductConfig
from .delta_base import ScalarGateMixer


class GatedDeltaProductMixer(ScalarGateMixer):
    """Gated DeltaProduct mixer: ``forward(hidden_states [B, T, D], packed_seq_params=None) -> [B, T, D]``.

    ``GatedDeltaProductMixer(512)`` derives every size from ``hidden_size`` (see
    :class:`GatedDeltaProductConfig`; two householder steps and negative eigenvalues by default).
    """

    CONFIG = GatedDeltaProductConfig
    KIND = "gdp"

    def _scan(self, q, k, v, g, beta, varlen):
        o, _ = chunk_gated_delta_product(q, k, v, g, beta, self.config.num_householder,
                                         use_qk_l2norm_in_kernel=True, cu_seqlens=varlen,
                                         chunk_size=self.config.chunk_size, backend=self.backend)
        return o
