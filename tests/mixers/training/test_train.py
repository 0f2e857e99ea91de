"""``ssm-pack train`` end to end: the same global batch at every world size, exact resume after
SIGTERM or a killed rank, a checkpoint resharded to another world size, refusals before any
process group starts.

Runs are real processes: ``python -m mixers.training`` for one process and ``torchrun`` (gloo,
CPU) for 2 and 4 ranks, on the embedded corpus with a small model and short packs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.child_env import child_env

ROOT = Path(__file__).resolve().parents[3]
SMALL = ["--model.hidden_size=32", "--data.max_tokens=256", "--data.batch_packs=4", "--train.steps=5",
         "--train.warmup_steps=2", "--train.lr=1e-2", "--checkpoint.export=false", "--metrics.plot=false",
         "--metrics.tensorboard=false"]
NO_CARRY = ["--data.carry=false"]
# fp32 loss curves against one process: |loss - loss_1| / loss_1 per step. The sums over ranks and
# over cp shares are taken in other orders than one process takes them: rounding only.
TOLERANCE = {"dp2": 2e-6, "cp2": 2e-6, "dp2xcp2": 2e-6}


def _env(**extra) -> dict:
    env = child_env(ROOT, OMP_NUM_THREADS="1")
    env.pop("SSM_PACK_TRAIN_FAULT", None)
    env.update(extra)
    return env


def _run(out: Path, args: list[str], *, ranks: int = 1, env: dict | None = None, restarts: int = 0,
         check: bool = True) -> subprocess.CompletedProcess:
    """One training run into ``out`` (a process, or ``ranks`` processes under torchrun)."""
    command = [sys.executable, "-m", "mixers.training", f"--out_dir={out}", *SMALL, *args]
    if ranks > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                   f"--max-restarts={restarts}", "-m", "mixers.training", f"--out_dir={out}", *SMALL, *args]
    done = subprocess.run(command, cwd=ROOT, env=env or _env(), capture_output=True, text=True, timeout=600)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(command)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


DETERMINISTIC = ("step", "loss", "lr", "grad_norm", "tokens", "tokens_total", "padding", "docs_per_pack", "carried")


def _deterministic(out: Path) -> list[tuple]:
    return [tuple(r[k] for k in DETERMINISTIC) for r in _records(out)]


def _final_state(out: Path) -> tuple[dict, dict]:
    """The last checkpoint's model and optimizer state, loaded at world 1."""
    from mixers import HybridLM
    from mixers.training.checkpoint import Checkpointer
    checkpointer = Checkpointer(out / "checkpoints", keep=1)
    model = HybridLM(256, 32, "MGKPA")
    optimizer = torch.optim.AdamW(model.parameters())
    checkpointer.load(checkpointer.latest(), model, optimizer)
    return model.state_dict(), optimizer.state_dict()["state"]


def _assert_bitwise(a: Path, b: Path) -> None:
    assert _deterministic(a) == _deterministic(b)
    (model_a, opt_a), (model_b, opt_b) = _final_state(a), _final_state(b)
    assert model_a.keys() == model_b.keys()
    for name in model_a:
        assert torch.equal(model_a[name], model_b[name]), name
    for index in opt_a:
        for key in opt_a[index]:
            assert torch.equal(opt_a[index][key], opt_b[index][key]), (index, key)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("world1")
    _run(out, NO_CARRY)
    return out


@pytest.mark.parametrize("name, ranks, args", [
    pytest.param("dp2", 2, [], id="world2-dp2"),
    pytest.param("cp2", 2, ["--parallel.cp=2"], id="world2-cp2-balanced"),
    pytest.param("cp2", 2, ["--parallel.cp=2", "--parallel.balance=false"], id="world2-cp2-even-tokens"),
    pytest.param("dp2xcp2", 4, ["--parallel.cp=2"], id="world4-dp2xcp2"),
])
def test_every_world_size_trains_the_same_global_batch(one_process, tmp_path, name, ranks, args):
    _run(tmp_path, NO_CARRY + args, ranks=ranks)
    want, got = _records(one_process), _records(tmp_path)
    assert [r["tokens"] for r in got] == [r["tokens"] for r in want]          # the same packs
    worst = max(abs(g["loss"] - w["loss"]) / w["loss"] for g, w in zip(got, want, strict=True))
    assert worst <= TOLERANCE[name], worst
    assert want[-1]["loss"] < want[0]["loss"]                                 # it trains


def test_a_run_stopped_by_sigterm_resumes_bitwise(tmp_path):
    """Carried states on (the default): the stream, the carried states and the optimizer resume."""
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    _run(whole, [])
    stop_at = 1 + int(torch.randint(0, 3, (1,), generator=torch.Generator().manual_seed(7)))
    stopped = _run(parts, [], env=_env(SSM_PACK_TRAIN_FAULT=f"sigterm@{stop_at}"), check=False)
    assert stopped.returncode == 143, stopped.stdout + stopped.stderr
    assert f"stopped by SIGTERM after step {stop_at}" in stopped.stdout
    assert len(_records(parts)) == stop_at
    resumed = _run(parts, [])
    assert "resumed from" in resumed.stdout and f"at step {stop_at}" in resumed.stdout
    _assert_bitwise(whole, parts)


def test_a_killed_rank_is_restarted_by_torchrun_and_resumes_bitwise(tmp_path):
    whole, faulty = tmp_path / "whole", tmp_path / "faulty"
    _run(whole, ["--checkpoint.every=2"], ranks=2)
    done = _run(faulty, ["--checkpoint.every=2"], ranks=2, restarts=1,
                env=_env(SSM_PACK_TRAIN_FAULT="kill@3:rank1"))
    assert "resumed from" in done.stdout and "at step 2" in done.stdout, done.stdout
    _assert_bitwise(whole, faulty)


def test_a_checkpoint_saved_at_world_4_resumes_at_world_2(one_process, tmp_path):
    """dp 2 x cp 2 stopped after step 2, resumed as dp 2: the loss curve of one process."""
    stopped = _run(tmp_path, NO_CARRY + ["--parallel.cp=2"], ranks=4, check=False,
                   env=_env(SSM_PACK_TRAIN_FAULT="sigterm@2:rank0"))
    assert stopped.returncode != 0 and len(_records(tmp_path)) == 2
    _run(tmp_path, NO_CARRY, ranks=2)
    want, got = _records(one_process), _records(tmp_path)
    worst = max(abs(g["loss"] - w["loss"]) / w["loss"] for g, w in zip(got, want, strict=True))
    assert worst <= TOLERANCE["dp2xcp2"], worst


def test_a_resume_with_another_model_is_refused(tmp_path):
    _run(tmp_path, NO_CARRY + ["--train.steps=1"])
    refused = _run(tmp_path, NO_CARRY + ["--model.pattern=MGA"], check=False)
    assert refused.returncode != 0
    assert "model.pattern='MGKPA'" in refused.stderr and "checkpoint.resume" in refused.stderr


def test_a_cp_degree_that_does_not_divide_the_world_is_refused_before_any_process_group(monkeypatch, tmp_path):
    from mixers.training.config import load_config
    from mixers.training.train import Trainer
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    config = load_config(None, [f"out_dir={str(tmp_path)!r}".replace("'", '"'), "parallel.cp=3"])
    with pytest.raises(ValueError, match="cp=3"):
        Trainer(config)
    assert not torch.distributed.is_initialized()


def _in_process(out: Path, *overrides: str) -> dict:
    from mixers.training.config import load_config
    from mixers.training.train import train
    config = load_config(None, [f'out_dir="{out}"', *(a[2:] for a in SMALL), *overrides])
    return train(config, stream=open(os.devnull, "w"))


def test_activation_checkpointing_changes_no_number(tmp_path):
    _in_process(tmp_path / "plain", "data.carry=false", "train.steps=3")
    _in_process(tmp_path / "recomputed", "data.carry=false", "train.steps=3", "train.activation_checkpointing=true")
    assert _deterministic(tmp_path / "plain") == _deterministic(tmp_path / "recomputed")


def test_initial_weights_from_an_export(tmp_path):
    trained = _in_process(tmp_path / "a", "data.carry=false", "train.steps=4", "checkpoint.export=true")
    weights = str(trained["export"] / "model.safetensors")
    _in_process(tmp_path / "b", "data.carry=false", "train.steps=1", f'model.init_from="{weights}"')
    _in_process(tmp_path / "c", "data.carry=false", "train.steps=1")
    (warm,), (cold,) = _records(tmp_path / "b"), _records(tmp_path / "c")
    assert warm["loss"] < cold["loss"] - 0.1            # the same first batch, trained weights
    with pytest.raises(ValueError, match="model.init_from=.*does not fit this model"):
        _in_process(tmp_path / "d", "data.carry=false", "train.steps=1", f'model.init_from="{weights}"',
                    'model.pattern="MGA"')


def test_bfloat16_with_carried_states_under_fsdp2(tmp_path):
    """FSDP2's mixed precision at world 2 (parameters cast to bf16, inputs left alone: the carried
    states' slots must stay the objects CarriedStates resolved) against autocast in one process."""
    _run(tmp_path / "one", ["--train.dtype=bfloat16", "--train.steps=3"])
    _run(tmp_path / "two", ["--train.dtype=bfloat16", "--train.steps=3"], ranks=2)
    want, got = _records(tmp_path / "one"), _records(tmp_path / "two")
    assert [r["carried"] for r in got] == [r["carried"] for r in want] and got[-1]["carried"] > 0
    worst = max(abs(g["loss"] - w["loss"]) / w["loss"] for g, w in zip(got, want, strict=True))
    assert worst <= 2e-2, worst          # bf16: FSDP2 casts parameters, autocast casts each op's inputs


@pytest.mark.parametrize("argv, fragment", [
    pytest.param(["--train.stepz=3"], "did you mean 'train.steps'", id="unknown-key"),
    pytest.param(["--config"], "--config needs a file", id="config-without-file"),
    pytest.param(["--config", "nowhere.toml"], "nowhere.toml", id="missing-config"),
    pytest.param(["--data.batch_packs=0"], "data.batch_packs=0 must be >= 1", id="bad-value"),
])
def test_the_command_refuses_a_bad_config_with_status_2_and_no_traceback(argv, fragment, capsys):
    from mixers.training.train import main
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("ssm-pack train: error: ") and fragment in err and "Traceback" not in err


def test_the_command_prints_its_usage_and_its_keys(capsys):
    from mixers.cli import main as cli
    from mixers.training.config import keys_table
    assert cli(["train", "--help"]) == 0 and "torchrun --nproc-per-node N" in capsys.readouterr().out
    assert cli(["train", "--keys"]) == 0 and capsys.readouterr().out == keys_table()


def _config(out: Path, *overrides: str):
    from mixers.training.config import load_config
    return load_config(None, [f'out_dir="{out}"', *(a[2:] for a in SMALL), *overrides])


@pytest.mark.parametrize("warmup, steps", [pytest.param(2, 10, id="warmup2-steps10"),
                                           pytest.param(3, 7, id="warmup3-steps7")])
def test_the_learning_rate_warms_up_linearly_then_decays_by_a_cosine_to_a_tenth(tmp_path, warmup, steps):
    import math

    from mixers.training.train import schedule
    factor = schedule(_config(tmp_path, f"train.warmup_steps={warmup}", f"train.steps={steps}"))
    assert [factor(s) for s in range(warmup)] == pytest.approx([(s + 1) / warmup for s in range(warmup)])
    assert factor(warmup) == pytest.approx(1.0), "the peak learning rate right after the warm-up"
    middle = warmup + (steps - warmup) / 2
    assert factor(middle) == pytest.approx(0.55), "half way down the cosine: (1 + 0.1) / 2"
    assert factor(steps) == pytest.approx(0.1) and factor(steps + 5) == pytest.approx(0.1), "a tenth of lr at the end"
    for s in range(warmup, steps + 1):
        want = 0.1 + 0.45 * (1 + math.cos(math.pi * (s - warmup) / (steps - warmup)))
        assert factor(s) == pytest.approx(want), s


@pytest.mark.parametrize("spec, fires", [
    pytest.param("sigterm@2", {(2, 0): signal.SIGTERM, (2, 1): signal.SIGTERM}, id="sigterm-every-rank"),
    pytest.param("kill@3:rank1", {(3, 1): signal.SIGKILL}, id="kill-rank1"),
])
def test_the_fault_hook_fires_only_at_its_step_and_rank(monkeypatch, tmp_path, spec, fires):
    from mixers.training import train as train_module
    sent = {}
    monkeypatch.setenv("SSM_PACK_TRAIN_FAULT", spec)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setattr(train_module.os, "kill", lambda pid, sig: sent.setdefault(key, sig))
    for key in [(step, rank) for step in range(1, 5) for rank in range(2)]:
        train_module._fault(key[0], key[1], str(tmp_path))
    assert sent == fires, f"{spec} must fire at (step, rank) {sorted(fires)} only, fired at {sorted(sent)}"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"fault-rank{r}.json" for _, r in fires)


def test_a_resume_may_change_the_steps_the_out_dir_and_the_logging(tmp_path):
    """Resumed from another run's checkpoint into a new out_dir, for more steps and another
    log_every: allowed, and the run goes on from the checkpoint's step."""
    import io
    first = _in_process(tmp_path / "first", "data.carry=false", "train.steps=1")
    stream = io.StringIO()
    from mixers.training.train import train
    config = _config(tmp_path / "second", "data.carry=false", "train.steps=2", "metrics.log_every=2",
                     f'checkpoint.resume="{first["checkpoint"]}"')
    done = train(config, stream=stream)
    assert done["step"] == 2 and not done["stopped"], done
    assert f"resumed from {first['checkpoint']} at step 1" in stream.getvalue(), stream.getvalue()
    assert [r["step"] for r in _records(tmp_path / "second")] == [2]


def test_the_logged_loss_is_the_mean_cross_entropy_over_every_target_of_the_batch(tmp_path):
    """Step 1's loss against the model's own loss of each of the B packs (before any update),
    weighted by each pack's targets."""
    from mixers.model.hybrid import IGNORE_INDEX, next_token_targets
    from mixers.training.train import Trainer
    trainer = Trainer(_config(tmp_path / "run", "data.carry=false", "train.steps=1"))
    reference = Trainer(_config(tmp_path / "reference", "data.carry=false", "train.steps=1"))
    try:
        total, targets, tokens = 0.0, 0, 0
        with torch.no_grad():
            for shard in reference.shards:
                pack = shard.next()
                params = pack["packed_seq_params"]
                count = int((next_token_targets(pack["labels"], params) != IGNORE_INDEX).sum())
                mean = reference.model(pack["input_ids"], params, labels=pack["labels"])["loss"]
                total, targets = total + float(mean) * count, targets + count
                tokens += int(params.cu_seqlens_q[-1])
        assert targets < tokens, "each document's last token has no target"
        record = trainer.train_step()
        assert record["loss"] == pytest.approx(total / targets, rel=1e-5), (record["loss"], total / targets)
    finally:
        trainer.close()
        reference.close()


@pytest.mark.parametrize("cp_rank", [pytest.param(0, id="cp-rank0"), pytest.param(1, id="cp-rank1")])
def test_a_cp_share_balances_the_models_linear_and_attention_work(cp_rank):
    """With the model's (linear, attention) work per token the cut follows both: a long document
    first (its late tokens read many keys) moves the cut left of the token-balanced one."""
    from mixers.training.parallel import World
    from mixers.training.train import cp_shard
    from ssm_pack import PackedSeqParams, balanced_bounds
    from ssm_pack.parallel.balance import mixer_weights
    params = PackedSeqParams.from_lengths([300, 37, 80, 93], total_tokens=512)
    pack = {"input_ids": torch.zeros(1, 512, dtype=torch.long), "packed_seq_params": params}
    world = World(rank=cp_rank, world=2, local_rank=cp_rank, cp=2, device=torch.device("cpu"))
    linear, attention = weights = mixer_weights("MGKPA", 32)
    want = balanced_bounds(params, 2, linear=linear, attention=attention)
    assert want != balanced_bounds(params, 2) and want != balanced_bounds(params, 2, linear=attention,
                                                                          attention=attention)
    start, end, _ = cp_shard(pack, world, weights)["cp_shard"]
    assert (start, end) == (want[cp_rank], want[cp_rank + 1]), f"cp rank {cp_rank}: {(start, end)} not of {want}"
