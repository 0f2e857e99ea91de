"""The next-token loss every training path of the model shares (``HybridLM``, ``CarriedStates``, CP).

    N = positions, V = vocabulary

The mean cross-entropy over the counted targets (those that are not ``-100``); with none (a
padding pack, a row whose labels are all ignored) it is zero with a zero gradient, as the
token-normalised losses of large trainers are, never NaN. Under context parallelism the mean
divides by the targets counted on every rank (:func:`mixers.model.cp_loss.mean_share`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..layers.blocks.norm import upcast
from .cp_loss import mean_share

IGNORE_INDEX = -100


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor, cp=None) -> torch.Tensor:
    """Scalar mean cross-entropy of ``logits [..., V]`` on ``targets [...]`` (already shifted;
    ``-100`` ignored), computed in fp32 at least; ``cp``: the forward's context-parallel run, if any.
    Reads no value (no host synchronisation)."""
    flat = upcast(logits).reshape(-1, logits.shape[-1])
    flat_targets = targets.reshape(-1).long()
    total = F.cross_entropy(flat, flat_targets, ignore_index=IGNORE_INDEX, reduction="sum")
    counted = flat_targets != IGNORE_INDEX
    if cp is not None:
        return mean_share(cp, total, counted)
    return total / counted.sum().clamp_min(1).to(total.dtype)


__all__ = ["IGNORE_INDEX", "next_token_loss"]
