"""Per-document work on short token runs, batched by length.

    K = runs, n = tokens of one run (1 <= n <= chunk)

Per-document initial and final states touch, for every document, only the run of its tokens
inside one chunk. Those runs have very different lengths, so they are grouped into buckets of
similar length (the next power of two) and each bucket is one padded batched op: no loop over
documents, at most ``log2(chunk) + 1`` buckets, and at most 2x padding.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Bucket:
    """Runs of one length class.

    Attributes:
        ids: ``[k]`` which runs (indices into the caller's run list).
        index: ``[k, n]`` token positions; padding repeats the run's last token.
        valid: ``[k, n]`` True on real tokens.
    """

    ids: torch.Tensor
    index: torch.Tensor
    valid: torch.Tensor


def buckets(starts: torch.Tensor, counts: torch.Tensor) -> Iterator[Bucket]:
    """Buckets of the runs ``[starts[i], starts[i] + counts[i])`` with ``counts >= 1``.

    Runs with ``counts == 0`` are skipped.
    """
    if starts.numel() == 0:
        return
    width = torch.zeros_like(counts)
    nonzero = counts > 0
    width[nonzero] = 2 ** torch.ceil(torch.log2(counts[nonzero].to(torch.float64))).to(counts.dtype)
    for size in torch.unique(width[nonzero]).tolist():
        ids = torch.nonzero(width == size).reshape(-1)
        offs = torch.arange(size, device=starts.device)
        n = counts[ids].unsqueeze(1)
        valid = offs < n
        index = starts[ids].unsqueeze(1) + torch.minimum(offs, n - 1)
        yield Bucket(ids=ids, index=index, valid=valid)
