"""Per-step metrics of ``ssm-pack train``: a JSONL file, a progress line, TensorBoard and a plot.

Every record is one optimizer step. ``DETERMINISTIC`` fields depend only on the data, the model
and the config (a resumed run reproduces them bitwise); ``TIMING`` fields depend on the machine.
Only rank 0 writes.
"""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from pathlib import Path

import torch

DETERMINISTIC = ("step", "loss", "lr", "grad_norm", "tokens", "tokens_total", "padding", "docs_per_pack",
                 "carried")
TIMING = ("step_s", "tokens_per_s", "peak_mem_mb", "wall")


def peak_memory_mb(device: torch.device) -> float:
    """The process's peak memory: the CUDA allocator's on a GPU, the resident set on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024       # Linux reports KiB


def read_records(path: Path, *, upto: int | None = None) -> list[dict]:
    """The records of a metrics file (those with ``step <= upto`` when given)."""
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if upto is None or r["step"] <= upto]


class Metrics:
    """``log(record)`` once per step (rank 0 writes, other ranks ignore it); ``close()`` at the end.

    Args:
        out_dir: where ``metrics.jsonl``, ``tensorboard/`` and ``loss.png`` go.
        total_steps: for the progress bar.
        resume_step: records after this step (from a run that stopped before its next
            checkpoint) are dropped, so the file reads as one uninterrupted run.
        log_every: steps per progress line (on a pipe; a terminal redraws every step).
        tensorboard / plot: write them when the packages are installed.
        active: this rank writes (rank 0).
    """

    def __init__(self, out_dir: Path, *, total_steps: int, resume_step: int = 0, log_every: int = 1,
                 tensorboard: bool = True, plot: bool = True, active: bool = True, stream=None):
        self.out_dir, self.total, self.log_every, self.active = Path(out_dir), total_steps, log_every, active
        self.path = self.out_dir / "metrics.jsonl"
        self.stream = sys.stdout if stream is None else stream
        self.plot_wanted, self.writer = plot, None
        self.records: list[dict] = []
        if not active:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.records = read_records(self.path, upto=resume_step)
        self.path.write_text("".join(json.dumps(r) + "\n" for r in self.records))
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:          # tensorboard is optional
                SummaryWriter = None
            if SummaryWriter is not None:
                self.writer = SummaryWriter(str(self.out_dir / "tensorboard"), purge_step=resume_step + 1)
        self._started = time.perf_counter()

    def log(self, record: dict) -> None:
        if not self.active:
            return
        self.records.append(record)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self.writer.add_scalar(f"train/{key}", value, record["step"])
        self._progress(record)

    def _progress(self, r: dict) -> None:
        step, width = r["step"], 24
        done = int(width * step / self.total)
        line = (f"  [{'#' * done}{'.' * (width - done)}] step {step}/{self.total}  loss {r['loss']:.4f}  "
                f"lr {r['lr']:.2e}  |g| {r['grad_norm']:.3f}  {r['tokens_per_s']:,.0f} tok/s  "
                f"pad {r['padding']:.1%}  docs/pack {r['docs_per_pack']:.1f}  carried {r['carried']}")
        if self.stream.isatty():
            self.stream.write("\r" + line + ("\n" if step == self.total else ""))
        elif step % self.log_every == 0 or step == self.total:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> Path | None:
        """Flush TensorBoard; plot loss against tokens (returns the plot's path, or ``None``)."""
        if not self.active:
            return None
        if self.writer is not None:
            self.writer.close()
        if not (self.plot_wanted and self.records):
            return None
        try:
            import matplotlib
        except ImportError:               # the plot is optional
            return None
        matplotlib.use("Agg")
        from matplotlib import pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot([r["tokens_total"] for r in self.records], [r["loss"] for r in self.records])
        ax.set_xlabel("tokens trained on")
        ax.set_ylabel("loss (mean cross-entropy, nats)")
        ax.set_title("ssm-pack train")
        fig.tight_layout()
        path = self.out_dir / "loss.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path
