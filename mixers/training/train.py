"""The training loop of ``ssm-pack train``: packs in, a trained hybrid and its checkpoints out.

    world = dp * cp ranks; B = data.batch_packs packs per step; T = data.max_tokens

One step: every rank takes its shards' next packs (:mod:`mixers.training.parallel`), counts the
targets of the whole global batch, runs each pack (its cp share under context parallelism, from
its carried states with ``data.carry``) and backpropagates ``loss_sum * world / targets``, so
the gradient is that of the mean cross-entropy over every target of the ``B`` packs, whatever the
world size; then clips, steps, logs, and checkpoints when due or when asked to stop (SIGTERM).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

from ssm_pack import balanced_bounds, shard_for_context_parallel
from ssm_pack.parallel.balance import mixer_weights

from ..model.hybrid import IGNORE_INDEX, next_token_targets
from .checkpoint import Checkpointer, read_extra
from .config import Config, check_config, config_to_dict
from .data import load_corpus
from .export import export_model
from .metrics import Metrics, peak_memory_mb
from .model import build_model, model_vocab, parameter_names, row_loss
from .parallel import World, checkpoint_blocks, compile_blocks, shard_model
from .shards import Shard

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FAULT_VARIABLE = "SSM_PACK_TRAIN_FAULT"     # tests: "kill@STEP[:rankR]" or "sigterm@STEP[:rankR]"
# keys a resumed run may change; any other difference from the checkpoint's config is refused
RESUMABLE_CHANGES = ("out_dir", "train.steps", "train.compile", "train.activation_checkpointing", "parallel.cp",
                     "checkpoint.", "metrics.")


def pack_targets(pack: dict, carried: bool) -> torch.Tensor:
    """The pack's next-token targets ``[1, T]`` as its loss reads them."""
    if carried:
        return pack["targets"]
    return next_token_targets(pack["labels"], pack["packed_seq_params"])


def step_loss(model, shard: Shard, pack: dict) -> torch.Tensor:
    """This rank's sum of cross-entropy over its part of ``pack`` (its cp share of the targets:
    ``pack["cp_shard"]``, set by :func:`cp_shard`)."""
    if shard.carry is not None:
        out = shard.carry(pack)
        return out["loss"] * (pack["targets"] != IGNORE_INDEX).sum()
    ids, labels, params = pack["input_ids"], pack["labels"], pack["packed_seq_params"]
    count = (pack_targets(pack, False) != IGNORE_INDEX).sum()
    if "cp_shard" in pack:
        start, end, params = pack["cp_shard"]
        ids, labels = ids[:, start:end], labels[:, start:end]
    return row_loss(model, ids, params, labels) * count


def cp_shard(pack: dict, world: World, weights: tuple[float, float] | None) -> dict:
    """``pack`` (on the host) with ``"cp_shard": (start, end, local params)`` of this cp rank, cut by
    :func:`ssm_pack.balanced_bounds` for the model's ``(linear, attention)`` work per token when
    ``weights`` are given (equal tokens otherwise); every rank of the cp group cuts the same row the
    same way. Done before the pack moves to the device, so no boundary is read back from it."""
    if world.cp == 1:
        return pack
    params = pack["packed_seq_params"]
    bounds = None
    if weights is not None:
        bounds = balanced_bounds(params, world.cp, linear=weights[0], attention=weights[1])
    start, end, local = shard_for_context_parallel(params, world.cp_rank, world.cp, bounds=bounds)
    local.cp_group = world.cp_group
    return {**pack, "cp_shard": (start, end, local)}


def _to(pack: dict, device) -> dict:
    moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in pack.items()}
    moved["packed_seq_params"] = pack["packed_seq_params"].to(device)
    if "cp_shard" in pack:
        start, end, local = pack["cp_shard"]
        moved["cp_shard"] = (start, end, local.to(device))
    return moved


def schedule(config: Config):
    """Linear warm-up over ``warmup_steps``, then cosine decay to a tenth of ``lr`` at ``steps``."""
    import math
    warm, total = config.train.warmup_steps, config.train.steps

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = min(1.0, (step - warm) / max(1, total - warm))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


class StopSignal:
    """SIGTERM sets a flag; the loop checkpoints at the end of the step and stops."""

    def __init__(self):
        self.raised = False
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.raised = True

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)


def _fault(step: int, rank: int, out_dir: str) -> None:
    """The test hook: kill this process or send it SIGTERM after ``step`` (first attempt only),
    writing the time to ``out_dir/fault-rank{rank}.json`` first (for the restart benchmark)."""
    spec = os.environ.get(FAULT_VARIABLE, "")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    what, _, where = spec.partition("@")
    at, _, who = where.partition(":rank")
    if int(at) == step and (not who or int(who) == rank):
        Path(out_dir, f"fault-rank{rank}.json").write_text(json.dumps({"step": step, "wall": time.time()}))
        os.kill(os.getpid(), signal.SIGKILL if what == "kill" else signal.SIGTERM)


def _resumable(saved: dict, current: dict, prefix: str = "") -> None:
    for key in sorted(set(saved) | set(current)):
        name = f"{prefix}{key}"
        if any(name == c or (c.endswith(".") and name.startswith(c)) for c in RESUMABLE_CHANGES):
            continue
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict) and key != "mixer_overrides":
            _resumable(a, b, f"{name}.")
        elif a != b:
            raise ValueError(f"the checkpoint was trained with {name}={a!r} but the config now says {b!r}; resume "
                             f"with the same {name}, or start a new run (checkpoint.resume=\"never\" or another "
                             "out_dir)")


class Trainer:
    """One run of ``ssm-pack train`` on this process (see the module docstring)."""

    def __init__(self, config: Config, *, stream=None):
        self.config, self.out = config, stream if stream is not None else sys.stdout
        self.world = World.from_environment(config.parallel.cp)
        check_config(config, world=self.world.world)               # before any process group starts
        self.corpus = load_corpus(config.data)
        vocab = model_vocab(config, self.corpus)
        self.world.start()
        self.dtype = DTYPES[config.train.dtype]
        self.model = build_model(config, vocab).to(self.world.device)
        if config.train.activation_checkpointing:
            checkpoint_blocks(self.model)
        if config.train.compile:
            compile_blocks(self.model)
        shard_model(self.model, self.world, self.dtype)
        t = config.train
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule(config))
        carry_dtype = self.dtype if self.world.distributed else torch.float32
        self.shards = [Shard(s, self.corpus, config, self.model, carry_dtype)
                       for s in self.world.shards(config.data.batch_packs)]
        self.checkpointer = Checkpointer(Path(config.out_dir) / "checkpoints", keep=config.checkpoint.keep,
                                         rank=self.world.rank, world=self.world.world)
        self.weights = None            # work per token, for balanced cp shards
        if config.parallel.balance and config.model.kind == "hybrid":
            self.weights = mixer_weights(config.model.pattern, config.model.hidden_size)
        self.step, self.tokens_total = 0, 0
        self.stop, self._stop_everywhere = None, False            # run() listens for SIGTERM
        self._resume()

    # ------------------------------------------------------------------ checkpoints
    def _resume(self) -> None:
        resume = self.config.checkpoint.resume
        path = None if resume == "never" else (self.checkpointer.latest() if resume == "auto" else Path(resume))
        if path is None:
            return
        _resumable(read_extra(path)["config"], config_to_dict(self.config))     # before any weight is read
        with parameter_names(self.model):
            extra, per_rank = self.checkpointer.load(path, self.model, self.optimizer, scheduler=self.scheduler)
        ranks = per_rank["by_rank"].values() if "by_rank" in per_rank else [per_rank]
        saved = {s: state for r in ranks for s, state in r["shards"].items()}
        for shard in self.shards:
            shard.load_state_dict(saved[shard.index])
        if "by_rank" not in per_rank:               # the same world: each rank its own generators back
            torch.set_rng_state(per_rank["rng"]["cpu"])
            if "cuda" in per_rank["rng"] and self.world.device.type == "cuda":
                torch.cuda.set_rng_state(per_rank["rng"]["cuda"], self.world.device)
        self.step, self.tokens_total = extra["step"], extra["tokens_total"]
        self._say(f"  resumed from {path} at step {self.step}")

    def save(self) -> Path:
        extra = {"step": self.step, "tokens_total": self.tokens_total, "config": config_to_dict(self.config),
                 "world": self.world.world}
        rng = {"cpu": torch.get_rng_state()}
        if self.world.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.world.device)
        per_rank = {"shards": {s.index: s.state_dict() for s in self.shards}, "rng": rng}
        with parameter_names(self.model):
            return self.checkpointer.save(self.step, self.model, self.optimizer, scheduler=self.scheduler,
                                          extra=extra, per_rank=per_rank)

    # ------------------------------------------------------------------ training
    def _say(self, text: str) -> None:
        if self.world.rank == 0:
            print(text, file=self.out, flush=True)

    def train_step(self) -> dict:
        """One optimizer step over the global batch; returns the step's metrics record."""
        started = time.perf_counter()
        packs = [_to(cp_shard(shard.next(), self.world, self.weights), self.world.device) for shard in self.shards]
        carried = self.config.data.carry
        local = torch.zeros(5, dtype=torch.float64, device=self.world.device)
        for pack in packs:   # targets, real tokens, documents, pieces starting from carried states (this rank's)
            local[0] += (pack_targets(pack, carried) != IGNORE_INDEX).sum()
            local[1] += pack["packed_seq_params"].cu_seqlens_q[-1]
            local[2] += pack["documents"].numel()
            local[3] += bool(pack["continues"]) and carried
        counts = self.world.all_sum(local) / self.world.cp
        targets = counts[0].clamp_min(1)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.world.device)
        for i, (shard, pack) in enumerate(zip(self.shards, packs)):
            if self.world.distributed:
                self.model.set_requires_gradient_sync(i == len(packs) - 1)
            with self._autocast():
                loss = step_loss(self.model, shard, pack)
            (loss * (self.world.world / targets)).backward()
            loss_sum += loss.detach().double()
        clip = self.config.train.grad_clip or float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        _fault(self.step, self.world.rank, self.config.out_dir)
        asked = float(self.stop is not None and self.stop.raised)         # SIGTERM here: every rank stops
        totals = self.world.all_sum(torch.stack([loss_sum, loss_sum.new_tensor(asked)]))
        tokens = int(counts[1])
        self.tokens_total += tokens
        seconds = time.perf_counter() - started
        batch = self.config.data.batch_packs
        record = {"step": self.step, "loss": float(totals[0] / targets), "lr": lr, "grad_norm": float(norm),
                  "tokens": tokens, "tokens_total": self.tokens_total,
                  "padding": 1 - tokens / (batch * self.config.data.max_tokens),
                  "docs_per_pack": float(counts[2]) / batch, "carried": int(counts[3]),
                  "step_s": seconds, "tokens_per_s": tokens / seconds, "peak_mem_mb": peak_memory_mb(self.world.device),
                  "wall": time.time()}
        self._stop_everywhere = bool(totals[1] > 0)
        return record

    def _autocast(self):
        if self.world.distributed or self.dtype == torch.float32:
            import contextlib
            return contextlib.nullcontext()
        return torch.autocast(self.world.device.type, dtype=self.dtype)

    def run(self) -> dict:
        """Train to ``train.steps``; returns ``{"step", "stopped", "checkpoint", "export", "plot"}``."""
        c = self.config
        metrics = Metrics(Path(c.out_dir), total_steps=c.train.steps, resume_step=self.step,
                          log_every=c.metrics.log_every, tensorboard=c.metrics.tensorboard, plot=c.metrics.plot,
                          active=self.world.rank == 0, stream=self.out)
        self._say(f"ssm-pack train: {c.model.pattern} hybrid, hidden {c.model.hidden_size}, {c.train.steps} steps, "
                  f"world {self.world.world} (dp {self.world.dp} x cp {self.world.cp}) on {self.world.device.type}")
        self._say(f"  corpus: {self.corpus.description}")
        self._say(f"  model:  {sum(p.numel() for p in self.model.parameters()) * self.world.world:,} parameters"
                  if self.world.distributed else
                  f"  model:  {sum(p.numel() for p in self.model.parameters()):,} parameters")
        self.stop = StopSignal()
        saved = None
        try:
            while self.step < c.train.steps:
                metrics.log(self.train_step())
                due = c.checkpoint.every and self.step % c.checkpoint.every == 0
                if due or self._stop_everywhere or self.step == c.train.steps:
                    saved = self.save()
                if self._stop_everywhere:
                    self._say(f"  stopped by SIGTERM after step {self.step}; checkpoint {saved}; run the same "
                              "command again to resume")
                    break
        finally:
            self.stop.restore()
        result = {"step": self.step, "stopped": self._stop_everywhere, "checkpoint": saved, "export": None,
                  "plot": None}
        if not self._stop_everywhere:
            if c.checkpoint.export:
                result["export"] = export_model(self.model, c, Path(c.out_dir) / "export", rank=self.world.rank)
            result["plot"] = metrics.close()
            self._say(f"  done: {self.step} steps, {self.tokens_total:,} tokens; metrics {metrics.path}"
                      + (f"; weights {result['export']}" if result["export"] else ""))
        return result

    def close(self) -> None:
        self.world.stop()


def train(config: Config, *, stream=None) -> dict:
    """Run ``config`` on this process (one of the ranks under torchrun); see :class:`Trainer`."""
    trainer = Trainer(config, stream=stream)
    try:
        return trainer.run()
    finally:
        trainer.close()


USAGE = """usage: ssm-pack train [--config FILE] [--section.key=value ...] [--keys]
       torchrun --nproc-per-node N [--max-restarts R] -m mixers.training [the same arguments]

Train a hybrid on packed documents: one process, or every rank under torchrun (FSDP2, context
parallelism with parallel.cp). With no config: the built-in HybridLM on the embedded corpus, about
a minute on a CPU. A rerun with the same out_dir resumes from its newest complete checkpoint.

  --config FILE        a TOML file; --section.key=value overrides any key (values are TOML)
  --keys               print every key with its type, default and meaning

Exit status: 0 trained; 2 the config, the data or the checkpoint was refused (nothing trained or
written); 143 stopped by SIGTERM after writing a checkpoint (run the same command to resume).
Docs: docs/training.md."""


def main(argv: list[str] | None = None) -> int:
    """``ssm-pack train``: see :data:`USAGE`."""
    from .config import keys_table, load_config, parse_overrides
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    if argv[:1] == ["--keys"]:
        print(keys_table(), end="")
        return 0
    try:
        path = None
        if "--config" in argv:
            i = argv.index("--config")
            if i + 1 >= len(argv):
                raise ValueError("--config needs a file: ssm-pack train --config run.toml")
            path, argv = argv[i + 1], argv[:i] + argv[i + 2:]
        trainer = Trainer(load_config(path, parse_overrides(argv)))
    except (ValueError, TypeError, ImportError) as err:      # refused before anything started
        print(f"ssm-pack train: error: {err}", file=sys.stderr)
        return 2
    try:
        result = trainer.run()
    finally:
        trainer.close()
    return 143 if result["stopped"] else 0
