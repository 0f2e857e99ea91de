"""The demo's steps: plan packs, train, compare packed and padded throughput, check for leaks.

    T = tokens of one pack, B = documents of a padded batch, S = its row length
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch
from torch import nn

from ssm_pack import PackedSeqParams, plan_packs
from ssm_pack.testing import assert_no_cross_document_leakage

from ..model import IGNORE_INDEX, HybridLM


@dataclass
class Batch:
    """One pack: ``input_ids [1, T]``, its ``labels [1, T]`` (``-100`` on alignment padding) and
    metadata, plus the same documents right-padded to ``[B, S]`` rows of the plan's
    ``padded_row_length`` (the longest document of the corpus)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    params: PackedSeqParams
    padded_ids: torch.Tensor
    padded_labels: torch.Tensor
    real_tokens: int


def _layout(documents: list[bytes], starts: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, labels)`` ``[len(documents), width]`` rows or, with ``starts``, one packed row:
    document ``i`` at ``starts[i]`` (row ``i`` when ``starts`` is empty); ``-100`` labels elsewhere."""
    rows = 1 if starts else len(documents)
    ids = torch.zeros(rows, width, dtype=torch.long)
    labels = torch.full((rows, width), IGNORE_INDEX, dtype=torch.long)
    for i, doc in enumerate(documents):
        row, start = (0, starts[i]) if starts else (i, 0)
        tokens = torch.tensor(list(doc), dtype=torch.long)
        ids[row, start:start + len(tokens)] = tokens
        labels[row, start:start + len(tokens)] = tokens
    return ids, labels


def make_batches(documents: list[bytes], max_tokens: int, align_to: int, device) -> tuple[list[Batch], object]:
    """Plan packs of at most ``max_tokens`` (first-fit-decreasing) and build every batch."""
    plan = plan_packs([len(d) for d in documents], max_tokens, align_to=align_to)
    batches = []
    for i, pack in enumerate(plan.packs):
        params = plan.packed_seq_params(i, fixed_length=False)
        docs = [documents[d] for d in pack]
        ids, labels = _layout(docs, params.cu_seqlens.tolist()[:-1], params.total_tokens)
        # the padded batch the plan's padding figure describes
        padded_ids, padded_labels = _layout(docs, [], plan.padded_row_length)
        batches.append(Batch(ids.to(device), labels.to(device), _to(params, device), padded_ids.to(device),
                             padded_labels.to(device), sum(len(d) for d in docs)))
    return batches, plan


def _to(params: PackedSeqParams, device) -> PackedSeqParams:
    moved = {name: getattr(params, name).to(device) for name in
             ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "seq_idx")
             if getattr(params, name) is not None}
    return params.replace(**moved)


def progress(step: int, total: int, loss: float, tokens_per_s: float, width: int = 28) -> None:
    """A bar redrawn in place on a terminal; on a pipe or a log, a plain line every sixth of the run."""
    done = int(width * step / total)
    line = f"  [{'#' * done}{'.' * (width - done)}] step {step}/{total}  loss {loss:.3f}  {tokens_per_s:,.0f} tok/s"
    if sys.stderr.isatty():
        sys.stderr.write("\r" + line + ("\n" if step == total else ""))
    elif step == total or step % max(1, total // 6) == 0:
        sys.stderr.write(line + "\n")
    sys.stderr.flush()


def train(model: HybridLM, batches: list[Batch], steps: int, lr: float) -> list[float]:
    """``steps`` AdamW steps over the packs (cycled); returns the loss of every step."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    losses, seen, start = [], 0, time.perf_counter()
    for step in range(steps):
        batch = batches[step % len(batches)]
        loss = model(batch.input_ids, batch.params, labels=batch.labels)["loss"]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        if not torch.isfinite(loss):
            raise RuntimeError(f"the loss became {loss.item()} at step {step + 1}")
        losses.append(loss.item())
        seen += batch.real_tokens
        progress(step + 1, steps, losses[-1], seen / (time.perf_counter() - start))
    return losses


def throughput(model: HybridLM, batches: list[Batch], repeat: int, rounds: int = 3) -> dict[str, float]:
    """Real tokens / s of full training steps, packed vs padded, on the same documents.

    ``repeat`` packs spread over the plan (the first packs hold only the longest documents). Each
    pack runs packed then padded, alternating, ``rounds`` times; the fastest time of each is kept,
    so a burst of noise on a shared machine does not decide the ratio.
    """
    opt = torch.optim.SGD(model.parameters(), lr=0.0)     # a real step, without changing the model

    def timed(ids, params, labels) -> float:
        start = time.perf_counter()
        loss = model(ids, params, labels=labels)["loss"]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return time.perf_counter() - start

    spread = max(1, len(batches) // (repeat + 1))
    chosen = [batches[min(len(batches) - 1, spread * (i + 1))] for i in range(repeat)]
    best = {"packed": 0.0, "padded": 0.0}
    for b in chosen:
        runs = {"packed": lambda b=b: timed(b.input_ids, b.params, b.labels),
                "padded": lambda b=b: timed(b.padded_ids, None, b.padded_labels)}
        times = {mode: [] for mode in runs}
        for _ in range(rounds + 1):                            # the first round warms up
            for mode, fn in runs.items():
                times[mode].append(fn())
        for mode in runs:
            best[mode] += min(times[mode][1:])
    real = sum(b.real_tokens for b in chosen)
    return {mode: real / seconds for mode, seconds in best.items()}


class _Backbone(nn.Module):
    """The trained model from embeddings on, as the leakage checker wants it."""

    def __init__(self, model: HybridLM):
        super().__init__()
        self.model = model

    def forward(self, hidden_states, packed_seq_params=None):
        return self.model.backbone(hidden_states, packed_seq_params)


def leakage_check(model: HybridLM, documents: list[bytes], device) -> int:
    """Run :func:`ssm_pack.testing.assert_no_cross_document_leakage` on a packed batch of the model."""
    sample = documents[:4]
    params = PackedSeqParams.from_lengths([len(d) for d in sample], pad_to_multiple_of=8)
    ids, _ = _layout(sample, params.cu_seqlens.tolist()[:-1], params.total_tokens)
    with torch.no_grad():
        hidden = model.embed(ids.to(device)).float()
    return assert_no_cross_document_leakage(_Backbone(model).float(), hidden, _to(params, device))
