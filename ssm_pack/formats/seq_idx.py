"""Per-token document index (``seq_idx``) from document boundaries, Megatron-core semantics.

    T = total tokens the kernel sees, N = documents

``seq_idx`` is what ``causal_conv1d_fn(seq_idx=...)`` and Mamba's SSD scan consume: an int32
``[1, T]`` tensor holding, for each token of the physical (padded) layout, the index of its
document. Tokens after the last boundary form one extra document (index N), so every token is
covered; when ``cu_seqlens[-1] == T`` there is no extra index. Empty documents (equal
neighbouring offsets) occupy no token, so the index simply skips them.
"""

from __future__ import annotations

import torch

try:  # optional: numpy's repeat is the fastest CPU fill; the torch path below is equivalent
    import numpy as _np
except ImportError:  # pragma: no cover - numpy-less installs
    _np = None

from ..checks import check_boundaries, check_int


def get_cu_seqlens(packed_seq_params) -> torch.Tensor:
    """The boundaries a kernel must use: ``cu_seqlens_q_padded`` when set, else ``cu_seqlens_q``.

    Kernels index the physical layout, and with per-document padding (context parallelism,
    block alignment) that layout is described by the padded offsets.
    """
    padded = getattr(packed_seq_params, "cu_seqlens_q_padded", None)
    if padded is not None:
        return padded
    plain = getattr(packed_seq_params, "cu_seqlens_q", None)
    if plain is None:
        raise ValueError("packed_seq_params has neither cu_seqlens_q_padded nor cu_seqlens_q; "
                         "build it with PackedSeqParams.from_lengths(...) or from_cu_seqlens(...)")
    return plain


def seq_idx_from_cu_seqlens(cu_seqlens: torch.Tensor, total_tokens: int, *, validate: bool = True) -> torch.Tensor:
    """``[1, total_tokens]`` int32 document index per token for boundaries ``cu_seqlens``.

    One write pass, no loop over documents and no host synchronisation: every document index
    (plus one for the tail) is repeated by its length, with the output size known up front.
    Requires ``cu_seqlens[-1] <= total_tokens``: checked on CPU unless ``validate=False`` (then
    no value is read at all); on an accelerator an asynchronous device assertion guards it.
    """
    total_tokens = check_int("total_tokens", total_tokens, minimum=0)
    on_cpu = cu_seqlens.device.type == "cpu"
    check_boundaries("cu_seqlens", cu_seqlens, values=on_cpu and validate)
    if on_cpu and validate:
        last = int(cu_seqlens[-1])
        if last > total_tokens:
            raise ValueError(f"total_tokens={total_tokens} is smaller than the last boundary "
                             f"cu_seqlens[-1]={last}; pass the length the kernel really sees")
        if _np is not None:
            return _seq_idx_numpy(cu_seqlens, total_tokens)
    elif not on_cpu:  # pragma: no cover - accelerator only
        torch._assert_async(cu_seqlens[-1] <= total_tokens, "cu_seqlens[-1] > total_tokens")
    marks = torch.zeros(total_tokens + 1, dtype=torch.int32, device=cu_seqlens.device)
    ends = cu_seqlens[1:].to(torch.int64)
    marks.index_add_(0, ends, torch.ones_like(ends, dtype=torch.int32))  # +1 after every document
    return marks[:total_tokens].cumsum_(0).unsqueeze(0)


def seq_idx_of_checked(cu_seqlens: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """:func:`seq_idx_from_cu_seqlens` for boundaries the caller has just checked (with their
    values: a validating :class:`~ssm_pack.PackedSeqParams`), without checking them again."""
    if cu_seqlens.device.type == "cpu" and _np is not None:
        return _seq_idx_numpy(cu_seqlens, total_tokens)
    return seq_idx_from_cu_seqlens(cu_seqlens, total_tokens, validate=False)   # an accelerator keeps its async assert


def _seq_idx_numpy(cu_seqlens: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """CPU fast path: one ``numpy.repeat`` (a fill per document, no scan over the tokens)."""
    bounds = _np.append(cu_seqlens.numpy().astype(_np.int64), total_tokens)
    index = _np.arange(bounds.size - 1, dtype=_np.int32)
    return torch.from_numpy(_np.repeat(index, _np.diff(bounds))).unsqueeze(0)


def renumber_seq_idx(seq_idx: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` int32 contiguous: per row 0 for the first run of ``seq_idx``, +1 at every change of
    value, so every run (a negative padding run included) gets a value of its own, larger than any
    before it. This is the form a kernel comparing ``seq_idx`` by value reads as ssm-pack means it
    (causal-conv1d). Torch ops only: nothing is read on the host."""
    changed = (seq_idx[:, 1:] != seq_idx[:, :-1]).to(torch.int32)
    return torch.cat([torch.zeros_like(changed[:, :1]), changed.cumsum(1, dtype=torch.int32)], dim=1).contiguous()
