"""Checkpointer: sharded DCP checkpoints that are complete or absent, and load at another world size.

World 1 (no process group): a save after 2 AdamW steps loads into a fresh model bitwise (parameters,
optimizer and scheduler states, then one more step); ``keep`` prunes; a crash mid-save leaves the
previous checkpoint as the latest; damaged or foreign checkpoints are refused naming the file.
World 2 (gloo, FSDP2 ``fully_shard`` on a 1-D mesh): a world-2 checkpoint loads at world 1 into a
plain model and a world-1 checkpoint loads at world 2, every full tensor bitwise equal.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from mixers import HybridLM
from mixers.training import checkpoint as ckpt
from mixers.training.checkpoint import Checkpointer
from ssm_pack import PackedSeqParams

SMALL = {"M": {"head_dim": 16, "state_size": 8, "chunk_size": 16}, "G": {"head_dim": 8, "chunk_size": 16},
         "K": {"head_dim": 8, "chunk_size": 16}, "P": {"head_dim": 8, "chunk_size": 16}, "A": {"head_dim": 8}}
VOCAB, HIDDEN, T, LENGTHS = 64, 32, 20, [7, 9, 4]


def _model(pattern="MGKPA", seed=0, hidden=HIDDEN):
    torch.manual_seed(seed)
    return HybridLM(VOCAB, hidden, pattern, mixer_overrides=SMALL).double()


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _train(model, opt, steps, *, sched=None, first=0, rank=0):
    for step in range(first, first + steps):
        g = torch.Generator().manual_seed(1000 * rank + step)
        ids = torch.randint(0, VOCAB, (1, T), generator=g)
        params = PackedSeqParams.from_lengths(LENGTHS, total_tokens=T)
        model(ids, packed_seq_params=params, labels=ids)["loss"].backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()


def _full(model, opt) -> dict:
    """Full parameters and AdamW states by parameter name (``full_tensor()`` of DTensors: collective)."""
    def full(t):
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
    out = {f"param.{n}": full(p) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for key, value in opt.state.get(p, {}).items():     # .get: opt.state is a defaultdict
            out[f"optim.{n}.{key}"] = full(value)
    return out


def _equal(got: dict, want: dict) -> list:
    """Names that differ (any bit), or that one side lacks."""
    return sorted(set(got) ^ set(want)) + [n for n in sorted(set(got) & set(want)) if not torch.equal(got[n], want[n])]


def _rng(step):
    return torch.Generator().manual_seed(step).get_state()


def _run(tmp_path, keep=2, steps=(2,)):
    model = _model()
    opt = _optimizer(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    saver = Checkpointer(tmp_path / "checkpoints", keep=keep)
    done = 0
    for step in steps:
        _train(model, opt, step - done, sched=sched, first=done)
        done = step
        saver.save(step, model, opt, scheduler=sched, extra={"step": step, "config": {"lr": 1e-2}},
                   per_rank={"rng": _rng(step), "stream": {"shard": 0, "offset": step}})
    return model, opt, sched, saver


# ----------------------------------------------------------------- world 1
def test_round_trip_is_bitwise_and_training_continues_identically(tmp_path):
    model, opt, sched, saver = _run(tmp_path)
    fresh = _model(seed=1)
    fresh_opt = _optimizer(fresh)
    fresh_sched = torch.optim.lr_scheduler.LambdaLR(fresh_opt, lambda s: 1.0 / (1 + s))
    assert _equal(_full(fresh, fresh_opt), _full(model, opt))             # different before the load
    extra, per_rank = saver.load(saver.latest(), fresh, fresh_opt, scheduler=fresh_sched)
    assert _equal(_full(fresh, fresh_opt), _full(model, opt)) == []
    assert fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert fresh_sched.state_dict() == sched.state_dict()
    assert extra == {"step": 2, "config": {"lr": 1e-2}}
    assert per_rank["stream"] == {"shard": 0, "offset": 2} and torch.equal(per_rank["rng"], _rng(2))
    _train(model, opt, 1, sched=sched, first=2)
    _train(fresh, fresh_opt, 1, sched=fresh_sched, first=2)
    assert _equal(_full(fresh, fresh_opt), _full(model, opt)) == []


def test_keep_leaves_the_newest_complete_checkpoints(tmp_path):
    _, _, _, saver = _run(tmp_path, keep=2, steps=(1, 2, 3))
    assert sorted(p.name for p in saver.directory.iterdir()) == ["step-00000002", "step-00000003"]
    assert saver.latest() == saver.directory / "step-00000003"
    manifest = json.loads((saver.latest() / "COMPLETE").read_text())
    assert manifest["step"] == 3 and manifest["world"] == 1 and manifest["format"] == ckpt.FORMAT
    assert {"extra.pt", "scheduler.pt", "rank-00000.pt", ".metadata"} <= set(manifest["files"])


def test_saving_the_same_step_again_replaces_it(tmp_path):
    model, opt, sched, saver = _run(tmp_path, keep=2, steps=(1, 2))
    first = json.loads((saver.latest() / "COMPLETE").read_text())
    saver.save(2, model, opt, scheduler=sched, extra={"again": True})
    assert sorted(p.name for p in saver.directory.iterdir()) == ["step-00000001", "step-00000002"]
    assert json.loads((saver.latest() / "COMPLETE").read_text())["files"] != first["files"]
    fresh = _model(seed=1)
    assert saver.load(saver.latest(), fresh, _optimizer(fresh))[0] == {"again": True}


@pytest.mark.parametrize("where, leftover", [
    pytest.param("_files", "step-00000002.partial", id="after-the-dcp-write-before-the-rename"),
    pytest.param("_write_marker", "step-00000002", id="after-the-rename-before-the-marker")])
def test_a_crash_mid_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch, where, leftover):
    model, opt, sched, saver = _run(tmp_path, steps=(1,))

    def crash(*args, **kwargs):
        raise RuntimeError("killed mid-save")
    original = getattr(ckpt, where)
    monkeypatch.setattr(ckpt, where, crash)
    _train(model, opt, 1, first=1)
    with pytest.raises(RuntimeError, match="killed mid-save"):
        saver.save(2, model, opt, scheduler=sched)
    assert (saver.directory / leftover).is_dir()
    assert saver.latest() == saver.directory / "step-00000001"
    with pytest.raises(ValueError, match="COMPLETE"):
        saver.load(saver.directory / leftover, _model(), _optimizer(_model()))
    monkeypatch.setattr(ckpt, where, original)
    saver.save(3, model, opt, scheduler=sched)
    assert sorted(p.name for p in saver.directory.iterdir()) == ["step-00000001", "step-00000003"]


def _damage(path, how):
    if how == "truncated":
        data = (path / "__0_0.distcp").read_bytes()
        (path / "__0_0.distcp").write_bytes(data[:-1])
        return r"__0_0\.distcp.*bytes"
    if how == "missing-file":
        (path / "extra.pt").unlink()
        return r"extra\.pt.*is missing"
    if how == "no-marker":
        (path / "COMPLETE").unlink()
        return r"COMPLETE.*is missing"
    if how == "other-format":
        manifest = json.loads((path / "COMPLETE").read_text())
        (path / "COMPLETE").write_text(json.dumps(dict(manifest, format=ckpt.FORMAT + 1)))
        return r"COMPLETE.*format 2"
    raise AssertionError(how)


@pytest.mark.parametrize("how", [pytest.param(h, id=h) for h in ("truncated", "missing-file", "no-marker",
                                                                  "other-format")])
def test_damaged_checkpoints_are_refused_naming_the_file(tmp_path, how):
    _, _, _, saver = _run(tmp_path)
    path = saver.latest()
    message = _damage(path, how)
    assert saver.latest() is None
    model = _model(seed=1)
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        saver.load(path, model, _optimizer(model))
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())


@pytest.mark.parametrize("text, shown", [pytest.param("[2]", r"\[2\]", id="a-list"),
                                         pytest.param("2", "2", id="a-number")])
def test_a_manifest_that_is_not_a_table_is_refused(tmp_path, text, shown):
    saver = Checkpointer(tmp_path / "checkpoints", keep=1)
    path = saver.directory / "step-00000001"
    path.mkdir(parents=True)
    (path / "COMPLETE").write_text(text)
    assert saver.latest() is None
    with pytest.raises(ValueError, match=rf"COMPLETE.*has checkpoint format {shown} but this version reads"):
        ckpt.read_manifest(path)


def test_step_0_saves_and_a_scheduler_absent_from_it_is_refused(tmp_path):
    """A folder not made yet holds no checkpoint; step 0 (before any update) is a checkpoint; loading
    it with a scheduler it was saved without is refused before any weight is written."""
    saver = Checkpointer(tmp_path / "checkpoints", keep=1)
    assert saver.latest() is None, "a checkpoints folder not made yet holds no checkpoint"
    model = _model("MA")
    saver.save(0, model, _optimizer(model), extra={"step": 0})
    assert saver.latest() == saver.directory / "step-00000000"
    fresh = _model("MA", seed=1)
    opt = _optimizer(fresh)
    before = {n: p.clone() for n, p in fresh.state_dict().items()}
    with pytest.raises(ValueError, match=r"scheduler\.pt' is missing: the checkpoint was saved without a scheduler"):
        saver.load(saver.latest(), fresh, opt, scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    assert all(torch.equal(before[n], p) for n, p in fresh.state_dict().items()), "weights written before refusing"
    assert saver.load(saver.latest(), fresh, _optimizer(fresh))[0] == {"step": 0}


def _touched(model):
    opt = _optimizer(model)
    for p in model.parameters():
        opt.state[p]                      # a defaultdict: empty entries, so no state is made for the load
    return opt


@pytest.mark.parametrize("what, message", [
    pytest.param("not-a-checkpoint", "is not a directory", id="not-a-checkpoint"),
    pytest.param("parent", "COMPLETE.*is missing", id="the-checkpoints-folder"),
    pytest.param("MGKP", "holds model key 'blocks.4", id="foreign-model-fewer-blocks"),
    pytest.param("MGKPAA", "holds no model key 'blocks.5", id="foreign-model-more-blocks"),
    pytest.param("hidden", "holds 'embed.weight' of shape", id="foreign-model-sizes"),
    pytest.param("sgd", "holds no optimizer entry 'param_groups.*momentum", id="foreign-optimizer"),
    pytest.param("touched", "holds optimizer entry 'state.*that the optimizer lacks", id="optimizer-state-touched")])
def test_foreign_models_and_paths_are_refused(tmp_path, what, message):
    _, _, _, saver = _run(tmp_path)
    path = {"not-a-checkpoint": tmp_path / "nothing", "parent": saver.directory}.get(what, saver.latest())
    model = _model(hidden=48) if what == "hidden" else _model(what if what.isupper() else "MGKPA", seed=1)
    opt = {"sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1), "touched": _touched}.get(what, _optimizer)(model)
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        saver.load(path, model, opt)
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())


@pytest.mark.parametrize("kwargs, message", [
    pytest.param({"keep": 0}, "keep must be an int >= 1", id="keep-0"),
    pytest.param({"keep": True}, "keep must be an int", id="keep-bool"),
    pytest.param({"keep": 1, "world": 2, "rank": 1}, "needs an initialised process group", id="world-2-alone"),
    pytest.param({"keep": 1, "rank": 1}, "rank must be in 0..0", id="rank-out-of-range")])
def test_bad_arguments_are_refused(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        Checkpointer(tmp_path, **kwargs)
    assert not any(tmp_path.iterdir())


# ----------------------------------------------------------------- world 2 (FSDP2 over gloo)
def _rank_main(rank: int, port: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tests.context_parallel.worker import gloo_rank
    with gloo_rank(rank, 2, port, os.path.join(root, f"rank{rank}.err")):
        mesh = init_device_mesh("cpu", (2,))
        model = _model()
        fully_shard(model, mesh=mesh)
        opt = _optimizer(model)
        _train(model, opt, 2, rank=rank)
        saver = Checkpointer(os.path.join(root, "world2"), keep=1, rank=rank, world=2)
        saver.save(2, model, opt, extra={"step": 2}, per_rank={"rank": rank})
        saved = _full(model, opt)
        fresh = _model(seed=1)
        fully_shard(fresh, mesh=mesh)
        fresh_opt = _optimizer(fresh)
        before = _full(fresh, fresh_opt)
        loader = Checkpointer(os.path.join(root, "world1"), keep=1, rank=rank, world=2)
        extra, per_rank = loader.load(loader.latest(), fresh, fresh_opt)
        result = {"saved": saved, "before": before, "loaded": _full(fresh, fresh_opt), "extra": extra,
                  "per_rank": per_rank}
        again = _model(seed=2)                               # the world-2 checkpoint at world 2: a resume
        fully_shard(again, mesh=mesh)
        again_opt = _optimizer(again)
        _, result["same_world_per_rank"] = saver.load(saver.latest(), again, again_opt)
        result["same_world"] = _full(again, again_opt)
        torch.save(result, os.path.join(root, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    from tests.context_parallel.worker import spawned_results
    root = tmp_path_factory.mktemp("ckpt")
    model = _model()
    opt = _optimizer(model)
    _train(model, opt, 2)
    Checkpointer(root / "world1", keep=1).save(2, model, opt, extra={"step": 2}, per_rank={"rank": 0})
    want1 = _full(model, opt)
    return root, want1, spawned_results(_rank_main, root)


def test_world2_fsdp_checkpoint_loads_at_world1(world2):
    root, _, ranks = world2
    assert _equal(ranks[0]["saved"], ranks[1]["saved"]) == []            # full_tensor() agrees on both ranks
    saver = Checkpointer(root / "world2", keep=1)
    manifest = json.loads((saver.latest() / "COMPLETE").read_text())
    assert manifest["world"] == 2 and manifest["step"] == 2
    assert {"__0_0.distcp", "__1_0.distcp", "rank-00000.pt", "rank-00001.pt", "extra.pt"} <= set(manifest["files"])
    model = _model(seed=1)
    opt = _optimizer(model)
    assert _equal(_full(model, opt), ranks[0]["saved"])                  # different before the load
    extra, per_rank = saver.load(saver.latest(), model, opt)
    assert _equal(_full(model, opt), ranks[0]["saved"]) == []
    assert extra == {"step": 2} and per_rank == {"by_rank": {0: {"rank": 0}, 1: {"rank": 1}}}


def test_world2_checkpoint_resumes_at_world2(world2):
    _, _, ranks = world2
    for r, rank in enumerate(ranks):
        assert _equal(rank["same_world"], rank["saved"]) == []
        assert rank["same_world_per_rank"] == {"rank": r}                # this rank's own dict


def test_world1_checkpoint_loads_at_world2_under_fsdp(world2):
    _, want1, ranks = world2
    for rank in ranks:
        assert _equal(rank["before"], want1)                              # different before the load
        assert _equal(rank["loaded"], want1) == []
        assert rank["extra"] == {"step": 2} and rank["per_rank"] == {"by_rank": {0: {"rank": 0}}}


def _late_rank_main(rank: int, port: int, root: str) -> None:
    """Rank 1 writes its per-rank file a second late; every rank then reads the checkpoint it saved."""
    import time

    from tests.context_parallel.worker import gloo_rank
    with gloo_rank(rank, 2, port, os.path.join(root, f"rank{rank}.err")):
        if rank == 1:
            save = torch.save

            def late_save(obj, f, *args, **kwargs):
                if str(f).endswith("rank-00001.pt"):
                    time.sleep(1.0)
                return save(obj, f, *args, **kwargs)
            torch.save = late_save
        model = _model(pattern="MG")
        opt = _optimizer(model)
        _train(model, opt, 1)
        saver = Checkpointer(os.path.join(root, "late"), keep=1, rank=rank, world=2)
        returned = saver.save(1, model, opt, extra={"step": 1}, per_rank={"rank": rank})
        latest = saver.latest()
        result = {"returned": str(returned), "latest": str(latest),
                  "files": json.loads((latest / "COMPLETE").read_text())["files"] if latest else []}
        torch.save(result, os.path.join(root, f"rank{rank}.pt"))


def test_world2_save_returns_once_every_rank_has_written(tmp_path):
    """A rank that writes its files late still lands in the checkpoint, and no rank returns from
    save before the checkpoint is complete."""
    from tests.context_parallel.worker import spawned_results
    for rank, result in enumerate(spawned_results(_late_rank_main, tmp_path)):
        assert result["latest"] == result["returned"], f"rank {rank} returned before its checkpoint was complete"
        assert {"rank-00000.pt", "rank-00001.pt"} <= set(result["files"]), f"rank {rank}: {result['files']}"
