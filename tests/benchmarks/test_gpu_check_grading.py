"""How the GPU check grades a kernel (``benchmarks/gpu_check/grading.py``, ``autocast.py``,
``stage.py``) and the shape of its package: on the CPU, with stand-in kernels."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from benchmarks.gpu_check.autocast import case_layer_autocast, plan_kernels
from benchmarks.gpu_check.correctness import ATTENTION, CONV, Setup, all_cases
from benchmarks.gpu_check.grading import as_skip, compare, pinned
from benchmarks.gpu_check.record import Case, Recorder, Skip
from benchmarks.gpu_check.stage import run_cases
from ssm_pack.support.requirements import KERNELS

PACKAGE = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check"


def _refuse(x, y):
    raise ValueError("op: the upstream kernel cannot do dtype torch.float32; use backend='reference' (or 'auto')")


def _missing(x, y):
    raise RuntimeError("op: backend='kernel' is unavailable: fake is not installed: pip install fake")


def _bug(x, y):
    raise ValueError("shapes do not match")


@pytest.mark.parametrize("kernel, expected, kind", [
    pytest.param(lambda x, y: 2 * x + y, "passed", None, id="matches"),
    pytest.param(lambda x, y: 2 * x + y + 1e-3, "failed", None, id="off-by-1e-3"),
    pytest.param(lambda x, y: 2 * x + y.detach(), "failed", None, id="drops-a-gradient"),
    pytest.param(_refuse, "skipped", "refused", id="refuses-the-inputs"),
    pytest.param(_missing, "skipped", "unavailable", id="missing-here"),
    pytest.param(_bug, "failed", None, id="an-error-is-not-a-skip"),
])
def test_a_correctness_case_grades_the_kernel(tmp_path, kernel, expected, kind):
    def op(backend, a):
        return (kernel if backend == "kernel" else lambda x, y: 2 * x + y)(a["x"], a["y"])

    recorder = Recorder(tmp_path, "correctness", {})
    tensors = {"x": torch.randn(64), "y": torch.randn(64)}
    recorder.run("case", compare, op, tensors, torch.float32, Setup(dry_run=True), kernels=("fla",))
    case = json.loads((tmp_path / "correctness.json").read_text())["cases"][0]
    assert case["status"] == expected and case["skip"] == kind, case
    assert case["kernels"] == ["fla"]
    assert recorder.exit_code() == (1 if expected == "failed" else 0)


def test_a_refusal_is_told_apart_from_a_missing_kernel(monkeypatch):
    from mixers.ops import dispatch
    monkeypatch.setattr(dispatch, "cached_support", lambda kernel, features=(): (False, "no CUDA device"))
    assert as_skip(ValueError("shapes do not match")) is None
    refused = as_skip(ValueError("x: the upstream kernel cannot do fp32; use backend='reference' (or 'auto')"))
    assert refused.kind == "refused" and refused.missing == ()
    missing = as_skip(RuntimeError("x: backend='kernel' is unavailable: no"), kernels=("flash_attn",))
    assert missing.kind == "unavailable" and missing.missing == ("flash_attn",)


def test_pinning_offers_one_kernel_of_a_family_and_says_what_ran():
    """causal-conv1d comes first in dispatch; pinned to fla's conv the op is offered fla's conv alone,
    and an op that does not offer the pinned kernel is a broken case, not a skip."""
    from mixers.ops import dispatch
    candidates = (("causal_conv1d", "causal-conv1d", None, lambda: (True, None)),
                  ("fla_conv", "fla's Triton conv", None, lambda: (True, None)))
    assert dispatch.choose_kernel("conv", "kernel", on_cuda=True, candidates=candidates) == "causal_conv1d"
    with pinned("fla_conv") as chosen:
        assert dispatch.choose_kernel("conv", "kernel", on_cuda=True, candidates=candidates) == "fla_conv"
        with pytest.raises(AssertionError, match="offers \\['causal_conv1d', 'fla_conv'\\], not the pinned fla"):
            with pinned("flash_attn"):
                dispatch.choose_kernel("conv", "kernel", on_cuda=True, candidates=candidates)
    assert chosen == ["fla_conv"]
    refused = (("causal_conv1d", "causal-conv1d", "per-document initial states", lambda: (True, None)),
               candidates[1])
    with pinned("causal_conv1d"), pytest.raises(ValueError, match="cannot do per-document initial states"):
        dispatch.choose_kernel("conv", "kernel", on_cuda=True, candidates=refused)      # refused, not "unavailable"
    assert dispatch.choose_kernel("conv", "kernel", on_cuda=True, candidates=candidates) == "causal_conv1d"


def test_every_kernel_of_the_table_has_its_own_correctness_cases():
    """On a GPU each kernel must pass a case of its own: the conv and attention families run once per kernel."""
    gpu = Setup(dry_run=False)
    own = {k: [c.name for c in all_cases(gpu) if c.kernels == (k,)] for k in KERNELS}
    assert all(own.values()), own
    assert set(CONV) | set(ATTENTION) <= set(KERNELS)
    assert any(name.endswith("on causal_conv1d") for name in own["causal_conv1d"])
    assert {c.name for c in all_cases(gpu)} == {c.name for c in all_cases(gpu)} and len(all_cases(gpu)) == len(
        {c.name for c in all_cases(gpu)})                                                # names are unique


def test_a_dry_run_does_not_run_cases_of_cuda_only_kernels(tmp_path):
    ran = []

    def case(tag):
        ran.append(tag)
        return "ok", {}, True
    cases = [Case("cuda only", case, ("cuda",), ("flash_attn", "torch_varlen")), Case("triton", case, ("triton",),
                                                                                       ("fla",)),
             Case("mixed", case, ("mixed",), ("causal_conv1d", "fla_conv"))]
    recorder = Recorder(tmp_path, "correctness", {})
    run_cases(recorder, cases, dry_run=True)
    got = {c["name"]: c for c in recorder.data["cases"]}
    assert ran == ["triton", "mixed"]
    assert got["cuda only"]["skip"] == "not applicable"
    assert "not applicable in a dry run: flash_attn, torch_varlen need a CUDA device" in got["cuda only"]["detail"]


def test_an_unavailable_skip_names_the_missing_kernels(tmp_path, monkeypatch):
    from mixers.ops import dispatch
    monkeypatch.setattr(dispatch, "cached_support", lambda kernel, features=(): (kernel == "fla_conv", "no"))

    def case():
        raise Skip("backend='kernel' is unavailable", "unavailable")
    recorder = Recorder(tmp_path, "correctness", {})
    run_cases(recorder, [Case("layer", case, (), ("causal_conv1d", "fla_conv", "mamba_ssd"))], dry_run=False)
    assert recorder.data["cases"][0]["missing"] == ["causal_conv1d", "mamba_ssd"]


class _FakeMixer(torch.nn.Module):
    """A mixer whose ``backend="kernel"`` twin behaves as ``KERNEL`` says (the reference is exact)."""

    KERNEL = "matches"
    PLAN = (("scan", (("fla", ()),)),)

    def __init__(self, hidden, backend="auto"):
        super().__init__()
        if backend == "kernel" and self.KERNEL == "refuses-at-construction":
            raise RuntimeError("FakeMixer(backend='kernel'): its scan cannot run here: fake is not installed")
        self.backend = backend
        self.proj = torch.nn.Linear(hidden, hidden)

    def forward(self, x, packed_seq_params=None):
        y = self.proj(x)
        if self.backend != "kernel":
            return y
        if self.KERNEL == "refuses-the-inputs":
            raise ValueError("scan: the upstream kernel cannot do this; use backend='reference' (or 'auto')")
        if self.KERNEL == "ignores-autocast":
            with torch.autocast(x.device.type, enabled=False):
                return torch.nn.functional.linear(x.float(), self.proj.weight, self.proj.bias)
        if self.KERNEL == "off-by-1e-2":
            return y * 1.01
        if self.KERNEL == "drops-the-input-gradient":
            return self.proj(x.detach())
        return y


@pytest.mark.parametrize("kernel, expected, kind", [
    pytest.param("matches", "passed", None, id="matches"),
    pytest.param("ignores-autocast", "failed", None, id="ignores-autocast"),
    pytest.param("off-by-1e-2", "failed", None, id="off-by-1e-2"),
    pytest.param("drops-the-input-gradient", "failed", None, id="drops-the-input-gradient"),
    pytest.param("refuses-the-inputs", "skipped", "refused", id="refuses-the-inputs"),
    pytest.param("refuses-at-construction", "skipped", "unavailable", id="refuses-at-construction"),
])
def test_an_autocast_layer_case_grades_the_kernel_twin(tmp_path, monkeypatch, kernel, expected, kind):
    """The layer is built twice from one seed and run under the same autocast: a kernel side that
    computes outside autocast or loses a gradient fails, one that refuses is skipped with its reason."""
    from mixers.layers import registry

    fake = type("FakeMixer", (_FakeMixer,), {"KERNEL": kernel})
    monkeypatch.setitem(registry.MIXERS, "Z", registry.MixerKind("Z", "fake", fake, "state"))
    recorder = Recorder(tmp_path, "correctness", {})
    recorder.run("fake", case_layer_autocast, Setup(dry_run=True), "Z", kernels=plan_kernels(fake))
    case = json.loads((tmp_path / "correctness.json").read_text())["cases"][0]
    assert case["status"] == expected and case["skip"] == kind, case
    assert case["kernels"] == ["fla"]
    if expected == "skipped":
        assert "backend='kernel'" in case["detail"] or "use backend='reference'" in case["detail"], case
    if expected == "passed":
        assert case["figures"] == {"out": 0.0, "dx": 0.0, "dproj.weight": 0.0, "dproj.bias": 0.0}, case


# ---------------------------------------------------------------------------- the package's shape
def _imports(path: Path) -> set[str]:
    """The modules of ``benchmarks.gpu_check`` that ``path`` imports, wherever the import sits."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level == 1:
                base = f"benchmarks.gpu_check.{base}".rstrip(".")
            if base == "benchmarks.gpu_check":
                found.update(f"{base}.{alias.name}" for alias in node.names)
            elif base.startswith("benchmarks.gpu_check."):
                found.add(base)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("benchmarks.gpu_check."))
    return found


def _graph() -> dict[str, set[str]]:
    modules = {f"benchmarks.gpu_check.{p.stem}": p for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    return {name: _imports(path) & modules.keys() for name, path in modules.items()}


def _cycle(graph):
    done, path = set(), []

    def visit(node):
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        path.append(node)
        for nxt in sorted(graph[node]):
            if found := visit(nxt):
                return found
        path.pop()
        done.add(node)
        return None
    return next((c for c in (visit(n) for n in sorted(graph)) if c), None)


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_gpu_check_package_has_no_import_cycle():
    graph = _graph()
    assert "benchmarks.gpu_check.grading" in graph["benchmarks.gpu_check.correctness"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))
    assert "benchmarks.gpu_check.correctness" not in graph["benchmarks.gpu_check.autocast"]
    assert "benchmarks.gpu_check.report" not in graph["benchmarks.gpu_check.loading"]


def test_the_old_gpu_check_modules_are_gone():
    benchmarks = PACKAGE.parent
    assert not [p.name for p in benchmarks.glob("gpu_*.py")] and not (benchmarks / "bench_gpu.py").exists()
