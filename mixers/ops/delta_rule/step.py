"""Token-step (recurrent) forms of the delta-rule ops, for decoding: state in, state out.

    N = sequences, H = key heads, HV = value heads, K, V = head dims, nh = householder steps

The maths the chunked ops are built on, one token at a time:

    S <- exp(g) * S;  S <- S + k (beta (v - S^T k))^T  (nh times for Gated DeltaProduct);  o = S^T (scale q)
"""

from __future__ import annotations

import torch

from ssm_pack.checks import check_tensor

from .l2norm import l2_normalize


def _prepare(q, k, scale, normalize, heads_v):
    if normalize:
        q, k = l2_normalize(q), l2_normalize(k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    groups = heads_v // q.shape[-2]
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=-2), k.repeat_interleave(groups, dim=-2)
    return q * scale, k


def _delta_update(state, k, v, beta):
    """``S + k (beta (v - S^T k))^T`` for ``state [N, HV, K, V]``, ``k [N, HV, K]``, ``v [N, HV, V]``."""
    pred = (state * k.unsqueeze(-1)).sum(-2)                                  # S^T k: [N, HV, V]
    return state + k.unsqueeze(-1) * (beta.unsqueeze(-1) * (v - pred)).unsqueeze(-2)


def _decay(state, g):
    """Row-wise decay ``exp(g) * S``: ``g`` ``[N, HV]`` (scalar) or ``[N, HV, K]`` (per channel)."""
    g = g.unsqueeze(-1) if g.dim() == 2 else g
    return state * torch.exp(g).unsqueeze(-1)


def _check_state(state, n, hv, kd, vd):
    check_tensor("state", state, ndim=4)
    if tuple(state.shape) != (n, hv, kd, vd):
        raise ValueError(f"state must be [N, HV, K, V] = {[n, hv, kd, vd]}, got {list(state.shape)}")


def gated_delta_rule_step(q, k, v, g, beta, state, *, scale=None, use_qk_l2norm_in_kernel=False):
    """One Gated DeltaNet token: q, k ``[N, H, K]``, v ``[N, HV, V]``, g, beta ``[N, HV]``,
    state ``[N, HV, K, V]`` -> ``(o [N, HV, V], state)``."""
    _check_state(state, q.shape[0], v.shape[1], q.shape[2], v.shape[2])
    q, k = _prepare(q, k, scale, use_qk_l2norm_in_kernel, v.shape[1])
    state = _delta_update(_decay(state, g), k, v, beta)
    return (state * q.unsqueeze(-1)).sum(-2), state


def kda_step(q, k, v, g, beta, state, *, scale=None, use_qk_l2norm_in_kernel=False):
    """One KDA token: like :func:`gated_delta_rule_step` with a per-channel g ``[N, HV, K]``."""
    return gated_delta_rule_step(q, k, v, g, beta, state, scale=scale,
                                 use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


def gated_delta_product_step(q, k, v, g, beta, state, *, scale=None, use_qk_l2norm_in_kernel=False):
    """One Gated DeltaProduct token: q ``[N, H, K]``, k ``[N, nh, H, K]``, v ``[N, nh, H, V]``,
    beta ``[N, nh, H]``, g ``[N, H]`` or ``None`` -> ``(o [N, H, V], state)``."""
    _check_state(state, q.shape[0], v.shape[2], q.shape[2], v.shape[3])
    q, k = _prepare(q, k, scale, use_qk_l2norm_in_kernel, q.shape[1])
    if g is not None:
        state = _decay(state, g)
    for j in range(k.shape[1]):
        state = _delta_update(state, k[:, j], v[:, j], beta[:, j])
    return (state * q.unsqueeze(-1)).sum(-2), state
