"""``selective_scan_update``: one Mamba-1 decode step on a pool of per-slot states.

    N = rows of this call (one token each), S = slots (rows of the state pool), E = channels,
    Ns = state size

The recurrence of :func:`mixers.ops.selective_scan_fn` for one token per row, ``state [S, E, Ns]``
updated in place at the rows ``state_batch_indices [N]`` names (row i without it)::

    dt = softplus(dt + dt_bias);  h <- exp(dt A) h + dt B x;  out = C.h + D x;  out *= silu(z)

This is mamba-ssm's head-less ``selective_state_update(state [S, E, Ns], x [N, E], dt [N, E],
A [E, Ns], B [N, Ns], C [N, Ns], D [E], z [N, E], dt_bias [E], dt_softplus, state_batch_indices)``,
which :func:`mixers.ops.selective_state_update` already takes (its kernel and its reference): a
decode step has no document boundary to honour, so the upstream Triton kernel runs where it can.
"""

from __future__ import annotations

from ..ssd.update import selective_state_update

__all__ = ["selective_scan_update"]


def selective_scan_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                          state_batch_indices=None, *, backend="auto"):
    """One token per row; ``state [S, E, Ns]`` updated in place; returns ``out [N, E]``."""
    return selective_state_update(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
                                  state_batch_indices=state_batch_indices, backend=backend)
