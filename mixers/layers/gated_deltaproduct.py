"""``GatedDeltaProductMixer``: fla's ``GatedDeltaProduct`` (``num_householder`` delta steps per
token, one scalar decay per token), packed.

    nh = num_householder; k, v, beta: ``[B, T * nh, ...]`` (each token's sub-steps interleaved, fla's layout)
    g = -exp(A_log) * softplus(a_proj(x) + dt_bias)      [B, T, H]

Made of: everything but the gate lives in :mod:`.delta_base` (projections with ``nh`` steps per
token, short convs, scan call, norm and out_proj, the cache); the scalar gate in
:class:`.delta_base.ScalarGateMixer`; sizes in :class:`GatedDeltaProductConfig` below; the ops are
:func:`mixers.ops.chunk_gated_delta_product` and, decoding, :func:`mixers.ops.fused_recurrent_gated_delta_product`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ops import chunk_gated_delta_product, fused_recurrent_gated_delta_product
from .base import positive
from .delta_base import DeltaConfig, ScalarGateMixer


@dataclass(frozen=True)
class GatedDeltaProductConfig(DeltaConfig):
    """fla's ``GatedDeltaProduct``: ``num_householder`` delta steps per token."""

    num_householder: int = 2
    allow_neg_eigval: bool = True

    def __post_init__(self):
        super().__post_init__()
        positive("num_householder", self.num_householder)
        if self.num_v_heads != self.num_heads:
            raise ValueError("GatedDeltaProduct needs num_v_heads == num_heads")


class GatedDeltaProductMixer(ScalarGateMixer):
    """Gated DeltaProduct mixer: ``forward(hidden_states [B, T, D], packed_seq_params=None) -> [B, T, D]``.

    ``GatedDeltaProductMixer(512)`` derives every size from ``hidden_size`` (see
    :class:`GatedDeltaProductConfig`; two householder steps and negative eigenvalues by default).
    """

    CONFIG = GatedDeltaProductConfig
    CHUNK = staticmethod(chunk_gated_delta_product)
    STEP = staticmethod(fused_recurrent_gated_delta_product)

    def _op_args(self) -> tuple:
        return (self.config.num_householder,)
