"""Which row of a state pool each row of a decode-step call updates (the ``*_indices`` argument).

    N = rows of the call, S = rows of the state pool
"""

from __future__ import annotations

import torch

from ssm_pack.checks import check_tensor, describe


def state_rows(indices, state: torch.Tensor, rows: int, device, *, state_name: str, indices_name: str):
    """``indices [N]`` as int64 on ``device``, or ``None`` when the pool has exactly the call's rows
    (row i updates state i). Raises ``ValueError`` naming the argument otherwise."""
    if indices is None:
        if state.shape[0] != rows:
            raise ValueError(f"{state_name} has {state.shape[0]} rows but x has {rows}; pass {indices_name} "
                             "to name each row's state")
        return None
    check_tensor(indices_name, indices, ndim=1, integer=True)
    if indices.shape[0] != rows:
        raise ValueError(f"{indices_name} must be [N] = [{rows}], got {describe(indices)}")
    return indices.to(device=device, dtype=torch.int64)
