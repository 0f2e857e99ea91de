"""What ``ssm-pack train`` costs: throughput at world 1 against world 2, checkpointing, restarts.

On the embedded corpus (standard-library docstrings), the built-in HybridLM, packs of
``--max-tokens``, ``--batch-packs`` packs per step, carried states off (so both worlds train the
same global batch the same way):

* tokens per second and padding, one process against ``torchrun --nproc-per-node 2`` (gloo, CPU),
  the two run in alternating rounds; each round's rate is the real tokens of the steps after the
  first divided by their time (``metrics.jsonl``), the best round is the headline, the per-round
  ratios are the spread. On 2 cores, 2 ranks share the cores the one process had to itself.
* the time of one checkpoint save against one training step (world 1, alternating, best of
  ``--rounds``);
* the time from a killed rank (``SSM_PACK_TRAIN_FAULT=kill@3:rank1``) to the first step of the
  run torchrun restarted (which resumes from the step-2 checkpoint).

    python -m benchmarks.bench_train [--max-tokens 1024] [--batch-packs 4] [--steps 8] [--rounds 3]

It prints; nothing is asserted. Benchmarks never run in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import BUSY, LoadMeter, machine, table

ROOT = Path(__file__).resolve().parents[1]


def _command(out: Path, ranks: int, args: list[str], restarts: int = 0) -> list[str]:
    launcher = [sys.executable, "-m", "mixers.training"]
    if ranks > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                    f"--max-restarts={restarts}", "-m", "mixers.training"]
    return [*launcher, f"--out_dir={out}", "--checkpoint.export=false", "--metrics.plot=false",
            "--metrics.tensorboard=false", "--data.carry=false", "--checkpoint.resume=never", *args]


def _run(out: Path, ranks: int, args: list[str], *, restarts: int = 0, env: dict | None = None) -> list[dict]:
    environment = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // ranks)))
    environment.update(env or {})
    subprocess.run(_command(out, ranks, args, restarts), cwd=ROOT, env=environment, check=True,
                   capture_output=True, text=True)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _rate(records: list[dict]) -> float:
    timed = records[1:]
    return sum(r["tokens"] for r in timed) / sum(r["step_s"] for r in timed)


def throughput(args: list[str], rounds: int) -> dict:
    rates = {1: [], 2: []}
    padding = {}
    meter = LoadMeter()
    before, started = meter.snapshot(), time.perf_counter()
    for _ in range(rounds):
        for ranks in (1, 2):
            with tempfile.TemporaryDirectory() as out:
                records = _run(Path(out), ranks, args)
            rates[ranks].append(_rate(records))
            padding[ranks] = statistics.fmean(r["padding"] for r in records)
    ratios = [b / a for a, b in zip(rates[1], rates[2])]
    load = max(0.0, LoadMeter.others(before, meter.snapshot()) / (time.perf_counter() - started))
    return {"rates": rates, "padding": padding, "ratios": ratios, "load": load}


def checkpoint_cost(args: list[str], rounds: int) -> tuple[float, float]:
    """Best seconds of one training step and of one checkpoint save, alternating (world 1)."""
    from mixers.training.config import load_config
    from mixers.training.train import Trainer
    with tempfile.TemporaryDirectory() as out:
        config = load_config(None, [f'out_dir="{out}"', "checkpoint.resume=\"never\"", "data.carry=false",
                                    *(a[2:] for a in args)])
        trainer = Trainer(config, stream=open(os.devnull, "w"))
        trainer.train_step()                                   # warm-up
        steps, saves = [], []
        for _ in range(rounds):
            start = time.perf_counter()
            trainer.train_step()
            steps.append(time.perf_counter() - start)
            start = time.perf_counter()
            trainer.save()
            saves.append(time.perf_counter() - start)
        trainer.close()
    return min(steps), min(saves)


def restart_time(args: list[str]) -> tuple[float, float]:
    """``(seconds from the kill to the first resumed step's start, that step's seconds)``."""
    with tempfile.TemporaryDirectory() as out:
        records = _run(Path(out), 2, [*args, "--checkpoint.every=2"], restarts=1,
                       env={"SSM_PACK_TRAIN_FAULT": "kill@3:rank1"})
        killed = json.loads((Path(out) / "fault-rank1.json").read_text())["wall"]
    first = next(r for r in records if r["step"] == 3)
    return first["wall"] - first["step_s"] - killed, first["step_s"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--batch-packs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    a = parser.parse_args(argv)
    args = [f"--data.max_tokens={a.max_tokens}", f"--data.batch_packs={a.batch_packs}", f"--train.steps={a.steps}"]
    print(f"bench_train: {machine()}")
    print(f"  HybridLM MGKPA hidden 64, {a.batch_packs} packs of {a.max_tokens} tokens per step, {a.steps} steps, "
          f"{a.rounds} alternating rounds")
    t = throughput(args, a.rounds)
    best1, best2 = max(t["rates"][1]), max(t["rates"][2])
    rows = [["world 1", f"{best1:,.0f}", f"{t['padding'][1]:.2%}", "1.00", ""],
            ["world 2 (dp 2, gloo)", f"{best2:,.0f}", f"{t['padding'][2]:.2%}", f"{best2 / best1:.2f}",
             f"{min(t['ratios']):.2f} / {statistics.median(t['ratios']):.2f} / {max(t['ratios']):.2f}"]]
    print(table(["run", "tokens/s (best)", "padding", "ratio to world 1", "per-round min / median / max"], rows))
    busy = " (BUSY: the figures above are not to be trusted)" if t["load"] > BUSY else ""
    print(f"  other processes kept {t['load']:.1f} cores busy on average while the rates were measured{busy}")
    step, save = checkpoint_cost(args, a.rounds)
    print(f"  checkpoint: one save {save * 1e3:.0f} ms against one step {step * 1e3:.0f} ms "
          f"({save / step:.2f} steps); at checkpoint.every=N it adds {save / step:.2f}/N of a step per step")
    gap, first = restart_time(args)
    print(f"  killed rank -> torchrun restart -> first resumed step starts after {gap:.1f} s "
          f"(that step took {first:.2f} s)")


if __name__ == "__main__":
    main()
