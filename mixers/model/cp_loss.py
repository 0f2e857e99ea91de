"""The next-token loss of one row split over context-parallel ranks.

    P = ranks, r = this rank, T_r = this rank's tokens

Each rank holds ``[1, T_r]`` of the row. Two facts cross the rank boundary: the last token of a
rank whose segment continues on rank ``r + 1`` predicts that rank's first label
(:func:`continue_targets`), and the mean divides by the targets counted on every rank
(:func:`mean_share`), so the ranks' shares sum to the single-process mean and all-reduced
gradients match it. Both talk through :mod:`mixers.ops.common.cp_exchange` (counted as ``"loss"``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..ops.common.cp_exchange import count_sent, exchange


def _next_rank_first_label(run, labels: torch.Tensor) -> torch.Tensor | None:
    """The label of the next rank's first token when this rank's last segment continues there
    (``[1]``, else ``None``). No gradient."""
    lay, r = run.layout, run.rank
    if not any(lay.continues_in):
        return None
    sends = {r - 1: [labels[0, :1]]} if lay.continues_in[r] else {}
    recvs = {r + 1: [(1,)]} if lay.continues_out[r] else {}
    got = exchange(run, "loss", sends, recvs, labels.dtype, chained=False)
    return got[r + 1][0] if lay.continues_out[r] else None


def _sum_over_ranks(run, value: torch.Tensor) -> torch.Tensor:
    """``value`` summed over the CP group (no gradient)."""
    total = value.detach().clone()
    dist.all_reduce(total, group=run.group)
    count_sent("loss", "forward", total.numel() * total.element_size() * (run.layout.size - 1))
    return total


def continue_targets(run, targets: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token ``targets [1, T_r]`` with the last one set to the next rank's first label
    when the segment continues there (its -100 stays -100); one tiny exchange.

    Args:
        run: the forward's :class:`~ssm_pack.parallel.layout.ContextParallelRun` (``varlen.cp``).
        targets, labels: ``[1, T_r]`` this rank's targets and labels.
    """
    nxt = _next_rank_first_label(run, labels)
    if nxt is None:
        return targets
    return torch.cat([targets[:, :-1], nxt.to(targets.dtype).reshape(1, 1)], dim=1)


def mean_share(run, loss_sum: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
    """This rank's share of the row's mean: ``loss_sum`` (scalar) over the targets counted on
    every rank (``counted``: ``[...]`` bool of this rank's counted targets); zero (and a zero
    gradient) when no rank counts a target."""
    return loss_sum / _sum_over_ranks(run, counted.sum().to(torch.int64)).clamp_min(1).to(loss_sum.dtype)


__all__ = ["continue_targets", "mean_share"]
