"""``rg_lru_update``: one RG-LRU decode step on a pool of per-slot states, in place.

    N = rows of this call (one token each), S = slots (rows of the state pool), D = channels

``state [S, D]`` is updated at the rows ``state_indices [N]`` names (row i without it); ``x,
gate_x, gate_a [N, D]``; ``recurrent_param [D]``. Each row continues its state (steps 2 and 4 of
:mod:`.naive`) unless ``continues`` (``[N]`` bool) says it starts a sequence (step 3). Returns
``out [N, D]`` in x's dtype; the stored state carries no autograd history and keeps its own dtype
(fp32 in a RecurrentGemma cache). Computed in fp32 for half inputs, fp64 for fp64.
"""

from __future__ import annotations

import torch

from ..common.autocast import outside_autocast
from ..common.chunks import compute_dtype
from ._validate import RGLRUStepCall, checked_update
from .gates import log_decay, normalised_input

__all__ = ["rg_lru_update"]


def _reference(call: RGLRUStepCall) -> torch.Tensor:
    state, indices = call.state, call.indices
    compute = compute_dtype(call.x.dtype)
    h = (state if indices is None else state.index_select(0, indices)).to(compute)
    log_a = log_decay(call.gate_a.to(compute), call.recurrent_param.to(compute), call.scale)
    reset = torch.zeros_like(h, dtype=torch.bool) if call.continues is None else ~call.continues[:, None]
    b = normalised_input(call.x.to(compute), call.gate_x.to(compute), log_a, reset)
    carried = torch.where(reset, torch.zeros((), dtype=compute, device=h.device), torch.exp(log_a) * h)
    h = carried + b
    new = h.detach().to(state.dtype)
    if indices is None:
        state.copy_(new)
    else:
        state.index_copy_(0, indices, new)
    return h.to(call.x.dtype)


@outside_autocast
def rg_lru_update(state, x, gate_x, gate_a, recurrent_param, *, scale=8.0, state_indices=None, continues=None,
                  backend="auto"):
    """One token per row of the RG-LRU; ``state`` updated in place (see the module docstring)."""
    call = checked_update(state, x, gate_x, gate_a, recurrent_param, scale=scale, state_indices=state_indices,
                          continues=continues, backend=backend)
    if call.backend == "kernel":
        raise ValueError("rg_lru_update: no upstream kernel computes the RG-LRU step (see docs/ops.md); use "
                         "backend='reference' (or 'auto', which picks it)")
    return _reference(call)
