"""Conversions between the packed representations (see docs/packing.md).

    B = rows of a padded batch, S = padded row length, N = documents, T = packed tokens

Every function is vectorised (no loop over documents or tokens) and returns int32 boundaries
(``cu_seqlens``) and int64 positions, the dtypes the kernels and Hugging Face expect.
"""

from __future__ import annotations

import torch

from ..checks import as_boundaries, as_index_tensor, check_boundaries, check_int, check_lengths, check_tensor
from .consistency import check_within_int32
from .seq_idx import _np, seq_idx_from_cu_seqlens


def lengths_to_cu_seqlens(lengths, *, device=None) -> torch.Tensor:
    """``[N]`` lengths -> ``[N+1]`` int32 offsets starting at 0."""
    lengths = as_index_tensor("lengths", lengths, device=device)
    check_lengths("lengths", lengths)
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    cu[1:] = torch.cumsum(lengths, 0)
    if lengths.numel():
        check_within_int32(f"lengths (sum of {lengths.numel()} documents)", int(cu[-1]))
    return cu.to(torch.int32)


def cu_seqlens_to_lengths(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``[N+1]`` offsets -> ``[N]`` lengths (same dtype)."""
    check_boundaries("cu_seqlens", cu_seqlens)
    return cu_seqlens[1:] - cu_seqlens[:-1]


def round_up_lengths(lengths, multiple: int) -> torch.Tensor:
    """Each length rounded up to a multiple of ``multiple`` (0 stays 0)."""
    multiple = check_int("pad_to_multiple_of", multiple, minimum=1)
    lengths = as_index_tensor("lengths", lengths)
    check_lengths("lengths", lengths)
    return (lengths + (multiple - 1)) // multiple * multiple


def max_seqlen_from_cu_seqlens(cu_seqlens: torch.Tensor, total_tokens: int | None = None) -> int:
    """The longest document of ``cu_seqlens`` (0 when there is none), the ``max_seqlen`` that
    varlen attention kernels want. With ``total_tokens > cu_seqlens[-1]`` the tail counts as
    one more document, as it does in ``seq_idx``. Reads the values (synchronises on a GPU).
    """
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0
    if total_tokens is not None and cu_seqlens.numel():
        longest = max(longest, total_tokens - int(cu_seqlens[-1]))
    return longest


def cu_seqlens_from_seq_idx(seq_idx: torch.Tensor, *, num_docs: int | None = None) -> torch.Tensor:
    """Boundaries from a non-decreasing per-token document index ``[T]`` or ``[1, T]``.

    Skipped indices come back as empty documents (``[0, 0, 2]`` -> ``[0, 2, 2, 3]``);
    ``num_docs`` adds trailing empty documents that the index cannot show. Document ``i``
    starts at the first token whose index is ``>= i``. On CPU: one pass finds the tokens where
    the index changes (which also proves it never decreases: it is constant in between), each
    change starting the documents it steps over; elsewhere a binary search per document.
    """
    check_tensor("seq_idx", seq_idx, ndim=(1, 2), integer=True)
    if seq_idx.dim() == 2:
        if seq_idx.shape[0] != 1:
            raise ValueError(f"seq_idx must be [1, T] (one packed row), got shape {tuple(seq_idx.shape)}")
        seq_idx = seq_idx[0]
    if not seq_idx.numel():
        n = 0 if num_docs is None else check_int("num_docs", num_docs, minimum=0)
        return torch.zeros(n + 1, dtype=torch.int32, device=seq_idx.device)
    first = int(seq_idx[0])
    if first < 0:
        raise ValueError(f"seq_idx must be >= 0, got {first}")
    if seq_idx.device.type == "cpu" and _np is not None:
        return _cu_from_changes(seq_idx.numpy(), first, num_docs)
    if bool((seq_idx[1:] < seq_idx[:-1]).any()):
        raise ValueError(_DECREASING)
    n = _num_docs(int(seq_idx[-1]) + 1, num_docs)
    probes = torch.arange(n + 1, dtype=seq_idx.dtype, device=seq_idx.device)
    return torch.searchsorted(seq_idx.contiguous(), probes).to(torch.int32)


_DECREASING = "seq_idx must be non-decreasing along the row (one index per document, documents in order)"


def _num_docs(seen: int, num_docs: int | None) -> int:
    """How many documents the boundaries describe: those the index shows, or ``num_docs`` (not fewer)."""
    return seen if num_docs is None else check_int("num_docs", num_docs, minimum=seen)


def _cu_from_changes(a, first: int, num_docs: int | None) -> torch.Tensor:
    """CPU path of :func:`cu_seqlens_from_seq_idx` for the numpy array ``a`` (``a[0] = first``):
    documents ``0 .. first`` start at token 0; a change from ``x`` to ``y`` at token ``s`` starts
    documents ``x + 1 .. y`` there; the documents after the last index start at ``T``."""
    change = _np.flatnonzero(a[1:] != a[:-1]) + 1                          # tokens where the index changes
    steps = a[change].astype(_np.int64) - a[change - 1]
    if steps.size and steps.min() < 0:
        raise ValueError(_DECREASING)
    last = int(a[-1])
    cu = _np.empty(_num_docs(last + 1, num_docs) + 1, dtype=_np.int32)
    cu[:first + 1] = 0
    cu[first + 1:last + 1] = _np.repeat(change.astype(_np.int32), steps)     # documents first + 1 .. last
    cu[last + 1:] = a.size
    return torch.from_numpy(cu)


def position_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, total_tokens: int | None = None
                                 ) -> torch.Tensor:
    """``[1, T]`` int64 positions restarting at 0 at every document (and at the tail).

    One cumulative sum: every step adds 1, except that the end of each document subtracts
    its length, bringing the next position back to 0. The steps get one slot past the last
    token, where documents ending at the last token subtract theirs (no masking of the ends).
    """
    check_boundaries("cu_seqlens", cu_seqlens)
    last = int(cu_seqlens[-1])
    total = last if total_tokens is None else check_int("total_tokens", total_tokens, minimum=last)
    steps = torch.ones(total + 1, dtype=torch.int64, device=cu_seqlens.device)
    bounds = cu_seqlens.to(torch.int64)
    steps.scatter_add_(0, bounds[1:], bounds[:-1] - bounds[1:])   # empty documents add 0
    steps[0] = 0
    return steps[:total].cumsum_(0).unsqueeze(0)


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Boundaries at every position reset (a 0) and at every row start of ``[B, S]``.

    MRoPE ``[3, B, S]`` positions use their first (temporal) plane, which restarts at 0 at
    every document like plain positions do. Rows are flattened in order (``B * S`` tokens).
    """
    check_tensor("position_ids", position_ids, ndim=(1, 2, 3), integer=True)
    if position_ids.dim() == 3:
        if position_ids.shape[0] != 3:
            raise ValueError(f"3-D position_ids must be MRoPE [3, B, S], got shape {tuple(position_ids.shape)}")
        position_ids = position_ids[0]
    if position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0)
    rows, cols = position_ids.shape
    if rows * cols == 0:
        raise ValueError(f"position_ids must hold at least one token, got shape {tuple(position_ids.shape)}")
    starts = position_ids == 0
    starts[:, 0] = True
    return _cu_seqlens_from_starts(starts)


def _cu_seqlens_from_starts(starts: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` (or ``[T]``) bool map of segment starts -> ``[N+1]`` int32 boundaries over the
    flattened tokens: the offset of every ``True``, then ``B * S``. The caller marks token 0."""
    assert starts.dtype == torch.bool, starts.dtype
    if starts.device.type == "cpu" and _np is not None:   # flatnonzero is the faster on CPU
        offsets = torch.from_numpy(_np.flatnonzero(starts.numpy()).astype(_np.int32))
    else:
        offsets = torch.nonzero(starts.reshape(-1)).reshape(-1).to(torch.int32)
    end = torch.tensor([starts.numel()], dtype=torch.int32, device=starts.device)
    return torch.cat([offsets, end])


def lengths_from_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` right-padded 0/1 mask -> ``[B]`` int64 lengths (checks it is right-padded)."""
    check_tensor("attention_mask", attention_mask, ndim=2)
    if attention_mask.is_floating_point() or attention_mask.is_complex():
        bad = (attention_mask != 0) & (attention_mask != 1)
        if bool(bad.any()):
            raise ValueError("attention_mask must hold only 0 and 1, got "
                             f"{attention_mask[bad][0].item()}")
    keep = attention_mask != 0
    lengths = keep.sum(1)
    cols = torch.arange(keep.shape[1], device=keep.device)
    expected = cols.unsqueeze(0) < lengths.unsqueeze(1)
    if not torch.equal(expected, keep):
        row = int(torch.nonzero((expected != keep).any(1))[0, 0])
        raise ValueError(f"attention_mask must be right-padded (ones then zeros) but row {row} is not; "
                         "left-padded batches must be flipped or repacked first")
    return lengths.to(torch.int64)


def attention_mask_from_lengths(lengths, max_length: int | None = None) -> torch.Tensor:
    """``[B]`` lengths -> ``[B, S]`` bool right-padded mask (``S`` defaults to the longest)."""
    lengths = as_index_tensor("lengths", lengths)
    check_lengths("lengths", lengths)
    longest = int(lengths.max()) if lengths.numel() else 0
    width = longest if max_length is None else check_int("max_length", max_length, minimum=longest)
    return torch.arange(width, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)


def _gather_index(lengths: torch.Tensor, row_stride: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Flat ``[B * S]`` indices of the first ``lengths[i]`` tokens of row ``rows[i]`` (default
    ``i``), concatenated in that order."""
    cu = lengths_to_cu_seqlens(lengths)
    total = int(cu[-1])
    seq = seq_idx_from_cu_seqlens(cu, total)[0].to(torch.int64)
    within = torch.arange(total, device=lengths.device) - cu.to(torch.int64)[seq]
    return (seq if rows is None else rows[seq]) * row_stride + within


def pack_padded(x: torch.Tensor, lengths) -> torch.Tensor:
    """Right-padded ``[B, S, ...]`` -> packed ``[1, T, ...]`` holding each row's first ``lengths[b]``."""
    check_tensor("x", x)
    if x.dim() < 2:
        raise ValueError(f"x must be [B, S, ...], got shape {tuple(x.shape)}")
    lengths = as_index_tensor("lengths", lengths, device=x.device)
    check_lengths("lengths", lengths)
    if lengths.numel() != x.shape[0]:
        raise ValueError(f"lengths must have one entry per row of x ({x.shape[0]}), got {lengths.numel()}")
    if lengths.numel() and int(lengths.max()) > x.shape[1]:
        raise ValueError(f"lengths must be <= the row length {x.shape[1]}, got {int(lengths.max())}")
    index = _gather_index(lengths, x.shape[1])
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]).index_select(0, index).unsqueeze(0)


def unpack_to_padded(x: torch.Tensor, cu_seqlens: torch.Tensor, max_length: int | None = None,
                     padding_value: float = 0.0) -> torch.Tensor:
    """Packed ``[1, T, ...]`` -> right-padded ``[N, S, ...]`` (inverse of :func:`pack_padded`)."""
    check_tensor("x", x)
    if x.dim() < 2 or x.shape[0] != 1:
        raise ValueError(f"x must be packed [1, T, ...], got shape {tuple(x.shape)}")
    lengths = cu_seqlens_to_lengths(cu_seqlens).to(torch.int64)
    if int(cu_seqlens[-1]) > x.shape[1]:
        raise ValueError(f"cu_seqlens[-1]={int(cu_seqlens[-1])} is beyond the {x.shape[1]} tokens of x")
    longest = int(lengths.max()) if lengths.numel() else 0
    width = longest if max_length is None else check_int("max_length", max_length, minimum=longest)
    out = x.new_full((lengths.numel() * width, *x.shape[2:]), padding_value)
    index = _gather_index(lengths.to(x.device), width)
    out = out.index_copy(0, index, x[0, : index.numel()])
    return out.reshape(lengths.numel(), width, *x.shape[2:])


def as_cu_seqlens(name: str, value) -> torch.Tensor:
    """Accept a tensor, a list or a numpy array of offsets; return validated int32 boundaries."""
    value = as_boundaries(name, value)
    check_boundaries(name, value)
    if value.dtype != torch.int32:
        if value.numel():
            check_within_int32(f"{name}[-1]", int(value[-1]), "tokens")
        value = value.to(torch.int32)
    return value


__all__ = [
    "as_cu_seqlens", "attention_mask_from_lengths", "cu_seqlens_from_position_ids",
    "cu_seqlens_from_seq_idx", "cu_seqlens_to_lengths", "lengths_from_attention_mask",
    "lengths_to_cu_seqlens", "max_seqlen_from_cu_seqlens", "pack_padded",
    "position_ids_from_cu_seqlens", "round_up_lengths", "unpack_to_padded",
]
