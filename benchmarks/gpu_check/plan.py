"""What one run of the GPU check does: the stages, their budgets, and which kernel it expects to run.

Stages, in order (``--stages`` / ``GPU_CHECK_STAGES`` picks a subset, e.g. ``correctness`` for a
short rerun; the rest are reported as not selected):

    setup        the wheelhouse into OUT/site; causal-conv1d prebuilt, compiled or skipped (needs WHEELS_DIR)
    support      python -m ssm_pack: the machine as ssm-pack's support checks see it
    kernels      which kernel of ssm_pack.support.requirements.KERNELS can run once the sources are loaded
    correctness  every kernel against the reference, forward and backward
    speed        packed vs padded, wrapper overhead, a training step

Budgets, in seconds, each overridden by ``GPU_CHECK_BUDGET_<NAME>`` (e.g. ``GPU_CHECK_BUDGET_CORRECTNESS=600``):
one per stage, ``build`` (the causal-conv1d compile, inside the setup stage's limit) and ``total``
(the whole run: a stage gets at most what is left of it, and a stage that cannot start in time is
reported as not run, so the summary is written before an outer limit stops the machine).

A kernel is *expected* to run unless it is allowed to skip (``--allow-skip KERNEL``, repeatable or a
comma list; ``GPU_CHECK_ALLOW_SKIP``) or, on a dry run, is not a Triton kernel (causal-conv1d's
CUDA extension, PyTorch's ``varlen_attn``, flash-attn: nothing to interpret on a CPU).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

STAGES = ("setup", "support", "kernels", "correctness", "speed")

# name: (GPU seconds, dry-run seconds, what it bounds). The correctness budget is the one to measure
# with cold Triton caches (every kernel compiles and autotunes on its first call).
BUDGETS = {
    "setup": (60, 120, "unpacking the wheelhouse; the build's budget is added to its limit"),
    "build": (240, 0, "compiling causal-conv1d's CUDA extension for this device"),
    "support": (60, 120, "python -m ssm_pack"),
    "kernels": (60, 120, "loading each kernel"),
    "correctness": (330, 900, "every kernel vs the reference, cold Triton caches"),
    "speed": (150, 1200, "packed vs padded, wrapper overhead, a training step"),
    "total": (480, 2400, "the whole run"),
}

EXPECTED, ALLOWED, NOT_APPLICABLE = "expected", "allowed", "not applicable"


def budgets(dry_run: bool, environ=None) -> dict[str, float]:
    """``{name: seconds}`` for every row of :data:`BUDGETS`, ``GPU_CHECK_BUDGET_<NAME>`` first."""
    environ = os.environ if environ is None else environ
    out = {}
    for name, (gpu, dry, _) in BUDGETS.items():
        var = f"GPU_CHECK_BUDGET_{name.upper()}"
        text = environ.get(var, "")
        if not text:
            out[name] = float(dry if dry_run else gpu)
            continue
        try:
            value = float(text)
        except ValueError:
            value = -1.0
        if not value >= 0:
            raise ValueError(f"{var} must be a number of seconds >= 0, got {text!r}")
        out[name] = value
    return out


def parse_stages(text: str | None) -> tuple[str, ...]:
    """``"setup,correctness"`` -> the stages in run order; empty or ``None``: every stage."""
    if not text:
        return STAGES
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in STAGES]
    if unknown or not names:
        raise ValueError(f"--stages: unknown stage(s) {unknown or [text]}; choose from {','.join(STAGES)}")
    return tuple(s for s in STAGES if s in names)


def parse_allow_skip(values) -> frozenset[str]:
    """``["flash_attn", "causal_conv1d,fla"]`` -> the kernel names; each must be a row of the kernel table."""
    from ssm_pack.support.requirements import KERNELS
    names = {n.strip() for value in values for n in value.split(",") if n.strip()}
    unknown = sorted(names - set(KERNELS))
    if unknown:
        raise ValueError(f"--allow-skip: unknown kernel(s) {unknown}; the kernel table has {sorted(KERNELS)}")
    return frozenset(names)


def expectation(kernel: str, dry_run: bool, allowed) -> tuple[str, str]:
    """``(EXPECTED | ALLOWED | NOT_APPLICABLE, why)`` for one kernel of the table in this run."""
    from ssm_pack.support.requirements import KERNELS
    entry = KERNELS[kernel]
    if dry_run and not entry.triton:
        return NOT_APPLICABLE, (f"not applicable in a dry run: {entry.label} needs a CUDA device "
                                "(no Triton to interpret)")
    if kernel in allowed:
        return ALLOWED, "allowed to skip (--allow-skip)"
    return EXPECTED, "should run here"


@dataclass
class Plan:
    """One run, as the runner starts it; written to ``OUT/plan.json`` for the report."""

    out: str
    dry_run: bool = False
    wheels: str | None = None
    stages: tuple[str, ...] = STAGES
    allow_skip: tuple[str, ...] = ()
    cases: str = ""
    budgets: dict = field(default_factory=dict)
    results: str | None = None

    def __post_init__(self):
        self.stages = tuple(self.stages)
        self.allow_skip = tuple(sorted(self.allow_skip))
        if not self.budgets:
            self.budgets = budgets(self.dry_run)

    def write(self) -> Path:
        path = Path(self.out) / "plan.json"
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")
        return path

    @classmethod
    def read(cls, out: Path) -> Plan | None:
        path = Path(out) / "plan.json"
        return cls(**json.loads(path.read_text())) if path.exists() else None

    def selected(self, stage: str) -> bool:
        return stage in self.stages and (stage != "setup" or self.wheels is not None)

    def why_not(self, stage: str) -> str:
        """Why a stage of :data:`STAGES` is not run (only for ``not self.selected(stage)``)."""
        if stage == "setup" and stage in self.stages:
            return "not run: no WHEELS_DIR given (the installed packages are used)"
        return f"not selected (--stages {','.join(self.stages)})"

    def budget_lines(self) -> list[str]:
        """One line per budget: ``correctness 330 s: every kernel vs the reference, ...``."""
        return [f"{name} {self.budgets[name]:g} s: {BUDGETS[name][2]}" for name in BUDGETS]
