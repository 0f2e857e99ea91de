"""Chunked SSD scan (Mamba2) with document resets inside the chunks, pure PyTorch.

    B = rows, T = tokens, H = heads, P = head dim, G = groups (dividing H), N = state size,
    C = chunks, L = chunk length, R = H // G heads per group

The recurrence per head is ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T``, ``y_t = h_t C_t``,
restarted at every segment (document). Chunked as in the SSD paper, with the segment ids
carried into every step:

1. segmented cumulative decay inside each chunk (a masked matmul, so it never sums over
   another document's ``dt``);
2. intra-chunk output: ``(C B^T) * exp(segsum)`` masked to same-segment causal pairs;
3. chunk states: what each chunk's last segment accumulates inside the chunk;
4. state passing over chunks: a chunk keeps the entering state only if its last token still
   belongs to the entering state's segment;
5. inter-chunk output: the entering state read by the tokens of its own segment only.

Every mask is applied before ``exp`` (``-inf``) or with ``torch.where``, so a decay across a
boundary is exactly 0 and no value of another document ever enters a sum. Steps 2-5 run in
one autograd function over blocks of chunks (:mod:`.chunk_scan`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..chunks import entering_segments, pad_tokens, same_segment_causal
from .chunk_scan import SSDChunkScan


@dataclass
class Chunked:
    """Intermediates kept for per-document states."""

    a_cs: torch.Tensor       # [B, C, L, H] segmented cumulative log-decay
    seg: torch.Tensor        # [B, C, L] segment id
    enter_seg: torch.Tensor  # [B, C] segment of each chunk's entering state
    h_enter: torch.Tensor    # [B, C, H, P, N] state entering each chunk
    h_final: torch.Tensor    # [B, H, P, N] state after the last chunk (the row's last segment)
    chunk: int


def ssd_chunked_reference(x, dt, A, Bm, Cm, seg_id, chunk_size: int, initial_state=None,
                          extra_states=None, D=None, z=None) -> tuple[torch.Tensor, Chunked]:
    """Chunked SSD scan: ``out = (y + D x) * silu(z)`` (``D``, ``z`` optional).

    Args:
        x: ``[B, T, H, P]``; dt: ``[B, T, H]`` (already biased, softplus-ed, clamped);
        A: ``[H]``; Bm, Cm: ``[B, T, G, N]``; seg_id: ``[B, T]`` segment ids.
        initial_state: ``[B, H, P, N]`` state entering chunk 0 (the row's first segment).
        extra_states: optional callable ``(a_cs, seg) -> [B, C, H, P, N]`` whose result is
            added to each chunk's state before passing (per-document initial states of
            documents starting inside a chunk, see :mod:`.varlen_states`).
        D: ``[H]`` or ``[H, P]`` skip; z: ``[B, T, H, P]`` gate.

    Returns ``out`` ``[B, T, H, P]`` and the :class:`Chunked` intermediates.
    """
    b, t, h, p = x.shape
    n = Bm.shape[3]
    L = chunk_size
    pad = (-t) % L
    # neutral padding: dt = 0 (no decay, no input), same segment as the last token
    x, dt, Bm, Cm = (pad_tokens(t_, pad) for t_ in (x, dt, Bm, Cm))
    z = None if z is None else pad_tokens(z, pad)
    seg = pad_tokens(seg_id, pad, repeat_last=True)
    c = (t + pad) // L
    seg = seg.reshape(b, c, L)
    keep = same_segment_causal(seg)                                              # [b, c, l, s]
    # 1. segmented cumulative log-decay (a masked matmul: never sums over another segment)
    a_cs = keep.to(dt.dtype) @ (dt * A).reshape(b, c, L, h)                       # [b, c, L, h]
    # which tokens feed the chunk state, and which read the entering state
    enter_seg = entering_segments(seg)                                           # [b, c]
    reads = seg == enter_seg.unsqueeze(-1)                                        # [b, c, L]
    keep_state = seg[:, :, -1] == enter_seg                                      # [b, c]
    extra = None if extra_states is None else extra_states(a_cs, seg)
    h0 = x.new_zeros(b, h, p, n) if initial_state is None else initial_state.to(x.dtype)
    # 2.-5. intra-chunk output, chunk states, state passing, entering-state read
    out, h_enter, h_final = SSDChunkScan.apply(
        x.contiguous(), dt.contiguous(), a_cs.reshape(b, c * L, h), Bm.contiguous(), Cm.contiguous(),
        keep.reshape(b * c, L, L), keep[:, :, -1, :].reshape(b * c, L), reads.reshape(b * c, L),
        keep_state, h0, extra, D, None if z is None else z.contiguous(), L)
    return out[:, :t], Chunked(a_cs=a_cs, seg=seg, enter_seg=enter_seg, h_enter=h_enter, h_final=h_final,
                               chunk=L)
