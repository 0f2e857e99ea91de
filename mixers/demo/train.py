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
    metadata, laid out by :meth:`ssm_pack.PackPlan.assemble`, plus the same documents right-padded
    to ``[B, S]`` rows of the plan's ``padded_row_length`` (the longest document of the corpus)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    params: PackedSeqParams
    padded_ids: torch.Tensor
    padded_labels: torch.Tensor
    real_tokens: int


def _padded_rows(documents: list[torch.Tensor], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, labels)`` ``[len(documents), width]``: one document per row, ``-100`` labels after it."""
    ids = torch.zeros(len(documents), width, dtype=torch.long)
    labels = torch.full_like(ids, IGNORE_INDEX)
    for row, doc in enumerate(documents):
        ids[row, :len(doc)] = doc
        labels[row, :len(doc)] = doc
    return ids, labels


def as_token_tensors(documents: list[bytes]) -> list[torch.Tensor]:
    return [torch.tensor(list(d), dtype=torch.long) for d in documents]


def make_batches(documents: list[bytes], max_tokens: int, align_to: int, device) -> tuple[list[Batch], object]:
    """Plan packs of at most ``max_tokens`` (first-fit-decreasing) and build every batch."""
    plan = plan_packs([len(d) for d in documents], max_tokens, align_to=align_to)
    tokens = as_token_tensors(documents)
    batches = []
    for i, pack in enumerate(plan.packs):
        packed = plan.assemble(i, tokens, labels=tokens, fixed_length=False)
        # the padded batch the plan's padding figure describes
        padded_ids, padded_labels = _padded_rows([tokens[d] for d in pack], plan.padded_row_length)
        batches.append(Batch(packed["input_ids"].to(device), packed["labels"].to(device),
                             _to(packed["packed_seq_params"], device), padded_ids.to(device),
                             padded_labels.to(device), sum(len(tokens[d]) for d in pack)))
    return batches, plan


def _to(params: PackedSeqParams, device) -> PackedSeqParams:
    moved = {name: getattr(params, name).to(device) for name in
             ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "seq_idx")
             if getattr(params, name) is not None}
    return params.replace(**moved)


class Progress:
    """The training loop's progress: a bar redrawn in place on a terminal, a plain line every
    sixth of the run on a pipe or a log, both on stdout (with the rest of the demo's output).

    Every number is over the recent ``window`` steps only (the steps since the previous line), so
    the first steps' warm-up does not drag the rate down for the rest of the run: ``loss`` is their
    mean training loss and ``tok/s`` their real (non-padding) tokens per second of wall time.
    """

    def __init__(self, total: int, stream=None, clock=time.perf_counter, width: int = 28):
        self.total, self.width, self.clock = total, width, clock
        self.stream = sys.stdout if stream is None else stream
        self.window = max(1, total // 6)
        self.steps: list[tuple[float, float, int]] = []            # (end time, loss, real tokens) per step
        self.started = clock()

    def legend(self) -> str:
        return (f"  training: loss = mean cross-entropy (nats per byte), tok/s = real tokens per second, "
                f"both over the last {self.window} step{'s' * (self.window > 1)}")

    def rate(self) -> tuple[float, float]:
        """``(mean loss, tokens / s)`` of the last ``window`` steps."""
        recent = self.steps[-self.window:]
        first = len(self.steps) - len(recent)
        start = self.steps[first - 1][0] if first > 0 else self.started
        seconds = max(recent[-1][0] - start, 1e-9)
        return sum(r[1] for r in recent) / len(recent), sum(r[2] for r in recent) / seconds

    def step(self, loss: float, tokens: int) -> None:
        self.steps.append((self.clock(), loss, tokens))
        if len(self.steps) == 1:
            self.stream.write(self.legend() + "\n")
        step = len(self.steps)
        mean_loss, rate = self.rate()
        done = int(self.width * step / self.total)
        line = (f"  [{'#' * done}{'.' * (self.width - done)}] step {step}/{self.total}  loss {mean_loss:.3f}  "
                f"{rate:,.0f} tok/s")
        if self.stream.isatty():
            self.stream.write("\r" + line + ("\n" if step == self.total else ""))
        elif step == self.total or step % self.window == 0:
            self.stream.write(line + "\n")
        self.stream.flush()


def train(model: HybridLM, batches: list[Batch], steps: int, lr: float) -> list[float]:
    """``steps`` AdamW steps over the packs (cycled); returns the loss of every step."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    losses, progress = [], Progress(steps)
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
        progress.step(losses[-1], batch.real_tokens)
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


def leakage_check(model: HybridLM, documents: list[bytes], device, align_to: int = 8) -> int:
    """Run :func:`ssm_pack.testing.assert_no_cross_document_leakage` on a packed batch of the model."""
    sample = as_token_tensors(documents[:4])
    plan = plan_packs([len(d) for d in sample], sum(len(d) + align_to for d in sample), align_to=align_to)
    packed = plan.assemble(0, sample, fixed_length=False)
    with torch.no_grad():
        hidden = model.embed(packed["input_ids"].to(device)).float()
    return assert_no_cross_document_leakage(_Backbone(model).float(), hidden, _to(packed["packed_seq_params"], device))
