"""``dt`` as the SSD recurrence reads it: ``clamp(softplus(dt + dt_bias), *dt_limit)``.

One function for every SSD path: the chunked scan (``dt [B, T, H]``, ``dt_bias [H]``), its
context-parallel form (:mod:`.cp`) and the decode step (:mod:`.update`, ``dt [N, H, P]``,
``dt_bias [H, P]``). ``compute`` is the dtype the caller computes in
(:func:`mixers.ops.common.chunks.compute_dtype` of ``x``: fp32 for half inputs, as the kernels do).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._validate import default_limit


def process_dt(dt, dt_bias, dt_softplus, dt_limit, compute: torch.dtype) -> torch.Tensor:
    """``dt`` in ``compute``, plus ``dt_bias`` (broadcast), softplus-ed if asked, clamped to a
    non-default ``dt_limit``."""
    dt = dt.to(compute)
    if dt_bias is not None:
        dt = dt + dt_bias.to(compute)
    if dt_softplus:
        dt = F.softplus(dt)
    if not default_limit(dt_limit):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    return dt
