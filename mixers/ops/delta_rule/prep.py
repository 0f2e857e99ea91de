"""Everything a chunk needs that does not depend on the state entering it (steps 1-2 of
:mod:`.chunk`), for any batch of chunks at once.

    X = leading batch dims (rows, chunks), H = heads, L = chunk length, K, V = head dims,
    Kg = 1 (scalar gate) or K
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..chunks import floor_log_decay, same_segment_causal
from .gram import DecayedGrams


@dataclass
class ChunkPrep:
    """Per-chunk quantities; ``S`` below is the state entering the chunk.

    ``delta = U - w_read @ S`` (corrected values), ``o = q_read @ S + qk @ delta``,
    ``S' = kappa * S + k_out^T @ delta`` (``kappa`` scales the rows of ``S``).
    """

    G: torch.Tensor        # [X, H, L, Kg] segmented cumulative log-decay
    gate: torch.Tensor     # [X, H, L, Kg] per-token log-decays, floored (a reset -inf is finite)
    qk: torch.Tensor       # [X, H, L, L]
    W: torch.Tensor        # [X, H, L, K] (all tokens; per-document initial states use it)
    w_read: torch.Tensor   # [X, H, L, K] rows of the entering document only
    U: torch.Tensor        # [X, H, L, V]
    q_read: torch.Tensor   # [X, H, L, K] rows of the entering document only
    k_out: torch.Tensor    # [X, H, L, K] rows of the chunk's last document only
    kappa: torch.Tensor    # [X, H, Kg, 1] decay of the entering state (0 when its document ends inside)
    decay_in: torch.Tensor  # [X, H, L, Kg] exp(G)


def chunk_masks(seg: torch.Tensor, first_seg: torch.Tensor | None = None):
    """Masks of chunks ``seg [X, L]`` (``first_seg [X]``: segment of each entering state, default
    the segment of the token before the chunk, i.e. ``seg`` of the previous chunk's last token).

    Returns ``keep [X, L, L]`` (same segment, causal), ``reads [X, L]``, ``last [X, L]``,
    ``keep_state [X]``.
    """
    keep = same_segment_causal(seg)
    reads = seg == first_seg.unsqueeze(-1)
    return keep, reads, keep[..., -1, :], seg[..., -1] == first_seg


def chunk_prep(qc, kc, vc, gc, bc, seg, enter_seg) -> ChunkPrep:
    """Steps 1-2 for chunks ``qc, kc [X, H, L, K]``, ``vc [X, H, L, V]``, ``gc [X, H, L, Kg]``,
    ``bc [X, H, L]``, ``seg [X, L]``, ``enter_seg [X]``.

    Decays cover exactly their interval: ``exp(G)`` of a sum from the chunk (or document) start,
    products of ``exp(g)`` over ``(s, t]`` in the Gram matrices and over ``(t, L)`` for the
    leaving state; never an exponential of a difference of cumulative sums (see :mod:`.gram`).
    """
    lead = kc.shape[:-3]
    h, length, kd = kc.shape[-3:]
    keep, reads, last, keep_state = chunk_masks(seg, enter_seg)
    dtype = kc.dtype
    gc = floor_log_decay(gc)
    # segmented cumulative log-decay (a masked matmul: never sums over another document)
    G = keep.to(dtype).unsqueeze(-3) @ gc                                        # [X, H, L, Kg]
    segh = seg.unsqueeze(-2).expand(*lead, h, length).reshape(-1, length)
    kg = gc.shape[-1]
    qk, kk, tail = DecayedGrams.apply(qc.reshape(-1, length, kd), kc.reshape(-1, length, kd),
                                      G.reshape(-1, length, kg), segh, gc.reshape(-1, length, kg))
    qk, kk = qk.reshape(*lead, h, length, length), kk.reshape(*lead, h, length, length)
    tail = tail.reshape(*lead, h, length, kg)                        # exp(sum_(t, L) g), for the last document
    eye = torch.eye(length, dtype=dtype, device=kc.device)
    decay_in = torch.exp(G)
    # the WY representation: one unit-lower-triangular solve for keys and values
    system = eye + bc.unsqueeze(-1) * kk
    rhs = torch.cat([bc.unsqueeze(-1) * decay_in * kc, bc.unsqueeze(-1) * vc], dim=-1)
    wu = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    W, U = wu[..., :kd], wu[..., kd:]
    readf = reads.to(dtype).unsqueeze(-2).unsqueeze(-1)                           # [X, 1, L, 1]
    lastf = last.to(dtype).unsqueeze(-2).unsqueeze(-1)
    G_last = G[..., -1:, :]
    k_out = kc * tail * lastf
    kappa = keep_state.to(dtype).reshape(*lead, 1, 1, 1) * torch.exp(G_last).transpose(-1, -2)
    return ChunkPrep(G=G, gate=gc, qk=qk, W=W, w_read=readf * W, U=U, q_read=readf * qc * decay_in, k_out=k_out,
                     kappa=kappa, decay_in=decay_in)
