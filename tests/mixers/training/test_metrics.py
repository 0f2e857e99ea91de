"""Per-step metrics: the loss plot (both axes named, nothing cut off at the figure's edges) and a
resumed run's TensorBoard scalars, which read as one uninterrupted run."""

from __future__ import annotations

import io

import pytest

from mixers.training.metrics import Metrics


def _record(step: int, loss: float) -> dict:
    return {"step": step, "loss": loss, "lr": 1e-3, "grad_norm": 0.5, "tokens": 100_000,
            "tokens_total": 100_000 * step, "padding": 0.125, "docs_per_pack": 2.5, "carried": step % 2,
            "step_s": 0.1, "tokens_per_s": 1e6, "peak_mem_mb": 1.0, "wall": 0.1 * step}


def _run(out_dir, losses: dict[int, float], *, resume_step: int = 0, **kwargs) -> Metrics:
    metrics = Metrics(out_dir, total_steps=max(losses), resume_step=resume_step, stream=io.StringIO(), **kwargs)
    for step, loss in losses.items():
        metrics.log(_record(step, loss))
    return metrics


def test_the_loss_plot_names_its_axes_and_fits_its_figure(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure
    seen = []
    save = Figure.savefig

    def capture(fig, *args, **kwargs):
        renderer = fig.canvas.get_renderer()
        seen.append((fig.axes[0].get_xlabel(), fig.axes[0].get_ylabel(), fig.get_tightbbox(renderer).extents,
                     fig.bbox_inches.extents))
        return save(fig, *args, **kwargs)
    monkeypatch.setattr(Figure, "savefig", capture)
    path = _run(tmp_path, {1: 5.5, 2: 4.25, 3: 3.0, 4: 2.75}, tensorboard=False).close()
    assert path == tmp_path / "loss.png" and path.stat().st_size > 0, "close() writes the loss plot"
    ((xlabel, ylabel, drawn, figure),) = seen
    assert "tokens" in xlabel and "loss" in ylabel, f"the axes are named: x {xlabel!r}, y {ylabel!r}"
    assert all(drawn[:2] >= figure[:2]) and all(drawn[2:] <= figure[2:]), \
        f"labels, ticks or title cut off: drawn {drawn} outside the figure {figure} (inches)"


def test_a_resumed_run_replaces_the_tensorboard_steps_after_its_checkpoint(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    _run(tmp_path, {1: 5.0, 2: 4.0, 3: 3.0, 4: 2.0}, plot=False).close()            # stopped after step 4
    _run(tmp_path, {3: 3.5, 4: 2.5, 5: 1.5}, resume_step=2, plot=False).close()     # resumed from step 2
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    got = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert got == [(1, 5.0), (2, 4.0), (3, 3.5), (4, 2.5), (5, 1.5)], f"the loss read back: {got}"


def test_a_resumed_run_keeps_the_records_up_to_its_checkpoint_step(tmp_path):
    """``metrics.jsonl`` of a run resumed from its step-2 checkpoint: steps 1 and 2 of the first run
    (step 2 included: the checkpoint holds its update), then the resumed steps, once each."""
    import json
    _run(tmp_path, {1: 5.0, 2: 4.0, 3: 3.0, 4: 2.0}, tensorboard=False, plot=False).close()
    _run(tmp_path, {3: 3.5, 4: 2.5}, resume_step=2, tensorboard=False, plot=False).close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [(r["step"], r["loss"]) for r in map(json.loads, lines)] == [(1, 5.0), (2, 4.0), (3, 3.5), (4, 2.5)]


def test_a_rank_that_does_not_write_writes_nothing(tmp_path):
    """Every rank logs each step; only the active one (rank 0) writes: another rank creates no file
    and keeps no record, even when it logs and closes."""
    out = tmp_path / "run"
    metrics = _run(out, {1: 5.0, 2: 4.0}, active=False)
    assert metrics.records == [] and metrics.close() is None
    assert not out.exists()
