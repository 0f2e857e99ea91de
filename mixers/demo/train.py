"""The demo's steps: stream packs, train with carried states, compare packed and padded throughput, check for leaks.

    T = tokens of one pack, B = documents of a padded batch, S = its row length
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch
from torch import nn

from ssm_pack import PackedSeqParams, pack_stream, plan_packs
from ssm_pack.testing import assert_no_cross_document_leakage

from ..model.carry import CarriedStates
from ..model.hybrid import IGNORE_INDEX, HybridLM


@dataclass
class Batch:
    """One pack of :func:`ssm_pack.pack_stream`: ``input_ids [1, T]``, ``labels [1, T]`` (``-100`` on
    padding and each piece's first token), its metadata and the whole pack dict (``targets``,
    ``documents``, ``continues`` / ``continued``: what :class:`mixers.model.carry.CarriedStates` reads),
    plus the same pieces right-padded to ``[B, S]`` rows, ``S`` the pack's longest piece (as a collator
    pads a batch to its longest sequence)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    params: PackedSeqParams
    pack: dict
    padded_ids: torch.Tensor
    padded_labels: torch.Tensor
    real_tokens: int


@dataclass
class StreamFigures:
    """What the stream did: documents, tokens, packs of exactly ``max_tokens``, padding both ways,
    and the documents longer than a pack (split, their pieces carried into the next packs)."""

    documents: int
    tokens: int
    packs: int
    max_tokens: int
    padded_tokens: int         # B * S summed over packs: one piece per row, rows of the pack's longest
    split_documents: int
    pieces_carried: int        # pieces that start from a carried state

    @property
    def padding_packed(self) -> float:
        return 1 - self.tokens / (self.packs * self.max_tokens)

    @property
    def padding_padded(self) -> float:
        return 1 - self.tokens / self.padded_tokens

    @property
    def padding_removed(self) -> float:
        return 1 - self.padding_packed / self.padding_padded

    def summary(self) -> str:
        return (f"{self.documents} documents, {self.tokens} tokens -> {self.packs} packs of {self.max_tokens} "
                f"(pack_stream, best-fit): padding {self.padding_padded:.1%} (padded batch) -> "
                f"{self.padding_packed:.1%} (packed), {self.padding_removed:.1%} of it removed")

    def carry(self) -> str:
        return (f"{self.split_documents} documents longer than a pack split; {self.pieces_carried} pieces start "
                "from the state their previous piece left (carried, detached)")


def _padded_rows(pieces: list[torch.Tensor], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, labels)`` ``[len(pieces), width]``: one piece per row, ``-100`` labels after it."""
    ids = torch.zeros(len(pieces), width, dtype=torch.long)
    labels = torch.full_like(ids, IGNORE_INDEX)
    for row, piece in enumerate(pieces):
        ids[row, :len(piece)] = piece
        labels[row, :len(piece)] = piece
    return ids, labels


def as_token_tensors(documents: list[bytes]) -> list[torch.Tensor]:
    return [torch.tensor(list(d), dtype=torch.long) for d in documents]


def _pieces(pack: dict) -> list[torch.Tensor]:
    """The pack's pieces' ids, from its row and its real and physical boundaries."""
    params = pack["packed_seq_params"]
    starts = (params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q).tolist()
    lengths = params.cu_seqlens_q.diff().tolist()
    row = pack["input_ids"][0]
    return [row[start:start + n] for start, n in zip(starts, lengths)]


def make_batches(documents: list[bytes], max_tokens: int, align_to: int, device) -> tuple[list[Batch], StreamFigures]:
    """Every pack of one epoch of ``pack_stream`` (documents longer than a pack carried), as batches."""
    stream = pack_stream(documents, max_tokens, align_to=align_to, split_long="carry")
    packs = list(stream)
    pieces = [_pieces(pack) for pack in packs]
    batches = []
    for pack, each in zip(packs, pieces):
        padded_ids, padded_labels = _padded_rows(each, max(map(len, each)))
        moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in pack.items()}
        moved["packed_seq_params"] = pack["packed_seq_params"].to(device)
        batches.append(Batch(moved["input_ids"], moved["labels"], moved["packed_seq_params"], moved,
                             padded_ids.to(device), padded_labels.to(device), sum(len(p) for p in each)))
    stats = stream.stats
    figures = StreamFigures(stats["documents"] - stats["empty_documents"], stats["real_tokens"], stats["packs"],
                            max_tokens, sum(b.padded_ids.numel() for b in batches), stats["split_documents"],
                            sum(bool(pack["continues"]) for pack in packs))
    return batches, figures


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
    """``steps`` AdamW steps over the packs in stream order (cycled: each cycle starts from reset
    states), a split document's pieces continuing from the carried states; returns every step's loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    ends = [int(offset) + length for b in batches
            for offset, length in zip(b.pack["offsets"], b.params.cu_seqlens_q.diff().tolist())]
    carry = CarriedStates(model, max_documents=max(len(b.pack["documents"]) for b in batches),
                          max_document_tokens=max(ends))     # attention keeps a whole document's keys
    losses, progress = [], Progress(steps)
    for step in range(steps):
        if step % len(batches) == 0:
            carry.reset()                                  # a new pass over the packs
        batch = batches[step % len(batches)]
        loss = carry(batch.pack)["loss"]
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

    ``repeat`` packs spread over the stream (the first packs hold only the longest documents). Each
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
    return assert_no_cross_document_leakage(_Backbone(model).float(), hidden, packed["packed_seq_params"].to(device))
