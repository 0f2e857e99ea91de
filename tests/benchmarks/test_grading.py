"""The benchmark grading rules (benchmarks.common): a figure whose repeats disagree, that is
impossible, or that was measured on a busy machine is UNSTABLE and rerun, never PASS or MISS.
No timing here: the rounds are given (and the timed training step is checked without timing it)."""

from __future__ import annotations

import resource

import pytest
import torch

from benchmarks.common import (
    BUSY,
    Possible,
    Result,
    Timings,
    alternate,
    ratio_result,
    results_table,
    settle,
    training_step,
)


def timings(ours, other, others=None):
    return Timings({"ours": ours, "other": other}, others or {})


@pytest.mark.parametrize("ours, other, verdict", [
    pytest.param([1.0, 1.02, 1.01], [3.0, 3.05, 3.1], True, id="steady-pass"),
    pytest.param([1.0, 1.02, 1.01], [1.5, 1.52, 1.49], False, id="steady-miss"),
])
def test_steady_rounds_are_graded(ours, other, verdict):
    r = ratio_result("g", "m", timings(ours, other), "ours", "other", 2.0)
    assert r.unstable is None and r.passed is verdict
    assert r.ratio == pytest.approx(min(other) / min(ours))
    assert r.rounds == pytest.approx([b / a for a, b in zip(ours, other)])


def test_repeats_that_disagree_are_unstable():
    # best ratio 3.0 (one lucky round), median 1.5: they differ by 50%
    r = ratio_result("g", "m", timings([1.0, 2.0, 2.0], [3.0, 3.0, 3.0]), "ours", "other", 2.0)
    assert r.unstable is not None and "median" in r.unstable and r.passed is None
    assert "UNSTABLE" in r.row()[4]


def test_best_and_median_straddling_the_target_are_unstable():
    r = ratio_result("g", "m", timings([1.0, 1.1, 1.1], [2.1, 2.1, 2.1]), "ours", "other", 2.0)
    assert r.ratio > 2.0 > r.median
    assert r.unstable is not None and "straddle" in r.unstable and r.passed is None


def test_impossible_figures_are_unstable():
    # forward + backward 20x faster than the forward alone: the case a busy machine once graded PASS
    r = ratio_result("g", "fwd+bwd vs fwd", timings([0.05, 0.05, 0.05], [1.0, 1.0, 1.0]), "ours", "other", 3.5,
                     False, possible=Possible(1.0, None, "forward + backward contains the forward"))
    assert r.unstable is not None and r.unstable.startswith("impossible") and r.passed is None


def test_a_busy_machine_makes_a_figure_unstable():
    busy = {"ours": [BUSY * 2.0] * 3, "other": [BUSY * 6.0] * 3}         # cores x seconds of the runs
    r = ratio_result("g", "m", timings([2.0] * 3, [6.0] * 3, busy), "ours", "other", 2.0)
    assert r.load == pytest.approx(BUSY) and r.unstable is None       # at the threshold: still graded
    quiet = ratio_result("g", "m", timings([2.0] * 3, [6.0] * 3, {"ours": [0.0] * 3, "other": [0.0] * 3}),
                         "ours", "other", 2.0)
    assert quiet.unstable is None and quiet.passed is True
    twice = {"ours": [BUSY * 4.0] * 3, "other": [BUSY * 12.0] * 3}
    r = ratio_result("g", "m", timings([2.0] * 3, [6.0] * 3, twice), "ours", "other", 2.0)
    assert r.unstable is not None and "busy" in r.unstable


def test_load_of_runs_too_short_to_tell_is_not_stated():
    """Ticks of 10 ms cannot measure the load of 1 ms runs: no load, no verdict from it."""
    r = ratio_result("g", "m", timings([0.001] * 3, [0.003] * 3, {"ours": [0.01] * 3, "other": [0.01] * 3}),
                     "ours", "other", 2.0)
    assert r.load is None and r.unstable is None


def test_settle_reruns_only_until_stable_and_keeps_the_first_stable_attempt():
    calls = []
    attempts = [timings([1.0, 2.0, 2.0], [3.0] * 3), timings([1.0] * 3, [3.0] * 3), timings([1.0] * 3, [1.0] * 3)]

    def run():
        t = attempts[len(calls)]
        calls.append(1)
        return [ratio_result("g", "m", t, "ours", "other", 2.0)]
    (r,) = settle(run)
    assert len(calls) == 2 and r.attempts == 2 and r.passed is True


def test_settle_reports_a_figure_that_never_settles_as_unstable():
    logged = []

    def run():
        return [ratio_result("g", "m", timings([1.0, 2.0, 2.0], [3.0] * 3), "ours", "other", 2.0)]
    (r,) = settle(run, retries=2, log=logged.append)
    assert r.unstable is not None and r.attempts == 3 and len(logged) == 2


def test_a_result_without_rounds_is_graded_on_its_one_value():
    r = Result("g", "m", 1.0, 2.0, 2.0, 1.5)
    assert r.unstable is None and r.passed is True and r.spread() == "(one measurement)"


def test_roofline_fraction_comes_from_the_same_rounds_and_cannot_exceed_the_matmul():
    from benchmarks.common import ROOFLINE, roofline_result
    mm = 2 * ROOFLINE ** 3
    t = Timings({"ours": [2.0, 2.0, 2.1], "matmul": [1.0, 1.0, 1.05]})
    r = roofline_result("g", "m", t, "ours", flops=mm * 0.8, target=0.3)       # 0.8 of a matmul in twice its time
    assert r.ratio == pytest.approx(0.4) and r.passed is True and r.unit == "GFLOP/s"
    same = Timings({"ours": [1.0] * 3, "matmul": [1.0] * 3})
    fast = roofline_result("g", "m", same, "ours", flops=mm * 2, target=0.3)      # twice a matmul's rate
    assert fast.unstable is not None and fast.unstable.startswith("impossible") and fast.passed is None


@pytest.mark.parametrize("unit", ["s", "us/token"])
def test_a_figure_not_measured_is_a_row_that_says_why(unit):
    """A missing peer, a skipped size or a compiler failure: one row with the reason, no grade
    (the table used to fail formatting ``None`` as milliseconds)."""
    r = Result("g", "peer not measured", float("nan"), None, float("nan"), unit=unit, note="not installed")
    assert r.passed is None
    assert r.row() == ["peer not measured", "-", "-", "-", "not installed", "-"]
    assert "not installed" in results_table([r])


def test_scaling_cpu_split_is_not_graded_and_reads_the_fewest_seconds():
    """bench_scaling's user / system CPU row: the least user CPU per token of the timed calls at each
    size, and the smallest system share of a step; printed, never graded."""
    from benchmarks.bench_scaling import GRADED, cpu_split
    small, large = GRADED
    r = cpu_split("L", "default allocator", [(small * 2e-6, 0.0), (small * 1e-6, 0.0)],
                  [(large * 1.1e-6, large * 0.5e-6), (large * 1.05e-6, large * 0.3e-6)])
    assert r.target is None and r.passed is None and r.unstable is None
    assert r.ours == pytest.approx(1.05) and r.other == pytest.approx(1.0) and r.ratio == pytest.approx(1.05)
    assert "0% of the step at T=8,192" in r.note and "22% at T=65,536" in r.note   # 0.3 / 1.35
    assert "not graded" in r.row()[4]


def test_training_step_makes_the_output_gradient_once_and_clears_the_inputs_grads():
    x = torch.randn(3, 4, requires_grad=True)
    grads = []

    def forward():
        out = x * 2
        out.register_hook(grads.append)
        return out

    step = training_step(forward, [x])
    step()
    step()
    assert x.grad is None
    assert len(grads) == 2 and grads[0] is grads[1]          # the same tensor: made at the first call only
    assert torch.equal(grads[0], torch.ones(3, 4))


def test_fresh_pages_are_those_of_each_functions_fastest_run():
    t = Timings({"ours": [2.0, 1.0, 3.0]}, {}, {"ours": [100, 10, 1000]})
    page = resource.getpagesize()
    assert t.fresh_mb("ours") == pytest.approx(10 * page / 1e6)           # the fastest round's count
    assert t.scaled({"ours": 0.5}).fresh_mb("ours") == t.fresh_mb("ours")   # scaling times keeps the pages
    assert Timings({"ours": [1.0]}).fresh_mb("ours") is None              # not counted: not stated


def test_alternate_counts_the_pages_a_function_first_touches():
    def fresh():                # 64 MB: above glibc's largest mmap threshold, a new mapping every call
        torch.ones(16 << 20).sum()

    t = alternate({"fresh": fresh, "none": lambda: None}, rounds=2)
    assert t.fresh_mb("fresh") > 48
    assert t.fresh_mb("none") < 4
