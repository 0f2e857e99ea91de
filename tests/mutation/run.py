"""Mutation check: plant each bug of ``mutants.py`` in a scratch copy and see whether the tests catch it.

    python -m tests.mutation.run [--area inference] [--only NAME ...] [--timeout 240] [--json out.json]
    python -m tests.mutation.run --list                         # the planted changes
    python -m tests.mutation.run --only NAME --tests PATH ...   # other tests instead of the mutant's own
    python -m tests.mutation.run --changed-since REF            # generated mutants of the modules REF..now changed
    python -m tests.mutation.run --all [--budget S]             # generated mutants of every product module
    python -m tests.mutation.run --module PATH [--max-per-module N]
    python -m tests.mutation.run --combine                      # one product-wide table from the lane's reports

Generated mutants (``lane.py``, ``generate.py``, ``coverage_map.py``) run against the tests that
cover each mutated line and write a dated report under ``mutation-reports/``; the rest of this
text is about the fixed list of ``mutants.py``.

The repository is copied once (without ``.git``, virtual environments and caches) into a
temporary directory; each mutant's edits are applied there, its test files run in the given order
with ``-x`` (in the copy, no bytecode written), and the files restored. The runs are forked from
one parent that has imported the heavy third-party packages (torch, transformers, fla) but nothing
of the project, so each run imports the project afresh from the copy (``--no-fork``: a new
interpreter per run). A test that kills a mutant is then run on the unmutated copy: one that
fails there too is left out and the mutant run again, so a test that already fails never counts
as a kill (``--baseline``: run every named file unmutated first instead).

A mutant is *killed* when pytest reports a failure, *survived* when every test passes,
*timeout* when the run exceeds ``--timeout``, *stale* when its text no longer occurs exactly
once. ``--area inference`` also selects its sub-areas (``inference/slots``, ...). Prints one line
per mutant and the kill rate per area (and per parent of sub-areas); exits 0 (it reports, it
does not gate). Not collected by the default test run (no ``test_*`` files here); run it by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

from tests.mutation.mutants import MUTANTS, Edit, Mutant

ROOT = Path(__file__).resolve().parents[2]
IGNORED = (".git", ".venv", "venv", "env", "__pycache__", ".pytest_cache", ".hypothesis", ".ruff_cache",
           "*.egg-info", "build", "dist")


def scratch_copy() -> Path:
    """The working tree, as it is now, in a fresh temporary directory."""
    target = Path(tempfile.mkdtemp(prefix="ssm-pack-mutants-")) / "repo"
    shutil.copytree(ROOT, target, ignore=shutil.ignore_patterns(*IGNORED), symlinks=True)
    return target


def _env(repo: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(repo), PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1")
    env.pop("PYTEST_ADDOPTS", None)
    return env


def check_imports(repo: Path) -> None:
    """The copy's packages must shadow any installed (editable) ones, or the mutants test nothing."""
    out = subprocess.run([sys.executable, "-c", "import mixers, ssm_pack; print(mixers.__file__, ssm_pack.__file__)"],
                         cwd=repo, env=_env(repo), capture_output=True, text=True, check=True).stdout
    if not all(p.startswith(str(repo)) for p in out.split()):
        raise RuntimeError(f"the scratch copy's packages are not the ones imported ({out.strip()})")


# third-party modules imported once by the parent (never ours): each forked run starts with them loaded
PRELOAD = ("numpy", "torch", "hypothesis", "pytest", "safetensors.torch", "transformers", "fla.layers",
           "transformers.models.mamba2.modeling_mamba2", "transformers.models.bamba.modeling_bamba",
           "transformers.models.nemotron_h.modeling_nemotron_h",
           "transformers.models.granitemoehybrid.modeling_granitemoehybrid",
           "transformers.models.falcon_h1.modeling_falcon_h1", "transformers.models.qwen3_next.modeling_qwen3_next",
           "transformers.models.kimi_linear.modeling_kimi_linear")
OURS = ("mixers", "ssm_pack", "tests", "benchmarks")
_CHILD: list[int] = []                                          # the forked run in progress, if any
_CONFIRMED: set[str] = set()                                    # killing tests seen passing unmutated


def preload() -> None:
    import importlib
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in PRELOAD:
            try:
                importlib.import_module(name)
            except Exception:                                   # optional packages: the tests skip without them
                pass
    leaked = [m for m in sys.modules if m.split(".")[0] in ("mixers", "ssm_pack")]
    assert not leaked, f"a preloaded module imported the project: {leaked[:5]}"


def _forked(repo: Path, args: list[str], timeout: float, plugins=()) -> tuple[int | None, str]:
    """Run ``pytest.main(args)`` in a forked child (the parent's third-party imports reused), in ``repo``."""
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    pid = os.fork()
    if pid == 0:                                                # child: never returns
        code = 3
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            os.chdir(repo)
            for name in [m for m in sys.modules if m.split(".")[0] in OURS]:
                del sys.modules[name]
            sys.path.insert(0, str(repo))
            os.environ.update(_env(repo))
            sys.dont_write_bytecode = True
            import pytest as _pytest
            code = int(_pytest.main(args, plugins=list(plugins)))
            for pkg in ("mixers", "ssm_pack"):
                module = sys.modules.get(pkg)
                if module is not None and not str(module.__file__).startswith(str(repo)):
                    print(f"\nMUTATION-RUN: {pkg} was imported from {module.__file__}, not the copy")
                    code = 4
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _CHILD[:] = [pid]
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            return None, ""
        time.sleep(0.2)
    _CHILD.clear()
    output = Path(log.name).read_text()
    os.unlink(log.name)
    return os.waitstatus_to_exitcode(status), output


def pytest(repo: Path, paths, *, timeout: float, first_failure: bool, deselect=(), fork: bool = True,
           plugins=()) -> tuple[str, str, float]:
    """``(status, output, seconds)``: status is passed, failed, error or timeout."""
    present = [p for p in paths if (repo / p.split("::")[0]).exists()]
    if not present:
        return "passed", "no test path exists", 0.0
    args = ["-q", "-p", "no:cacheprovider", "-rfE", *(["-x"] if first_failure else [])] + exclusions(deselect) + present
    start = time.monotonic()
    if fork:
        code, output = _forked(repo, args, timeout, plugins)
    else:
        try:
            run = subprocess.run([sys.executable, "-m", "pytest", *args], cwd=repo, env=_env(repo),
                                 capture_output=True, text=True, timeout=timeout)
            code, output = run.returncode, run.stdout + run.stderr
        except subprocess.TimeoutExpired:
            code, output = None, ""
    if code is None:
        return "timeout", "", time.monotonic() - start
    status = {0: "passed", 5: "passed", 4: "error", 3: "error"}.get(code, "failed")
    return status, output, time.monotonic() - start


def failing_nodes(output: str) -> list[str]:
    """The failing tests (``FAILED``) and the files that failed to collect (``ERROR``) of a ``-rf`` run."""
    return re.findall(r"^(?:FAILED|ERROR) (\S+)", output, flags=re.M)


def exclusions(nodes) -> list[str]:
    """pytest options leaving ``nodes`` out: a test is deselected, a file that does not collect ignored."""
    return [f"--deselect={n}" if "::" in n else f"--ignore={n}" for n in dict.fromkeys(nodes)]


def _target(repo: Path, edit: Edit) -> Path | None:
    """The file (of the edit's candidate paths) holding ``edit.old`` exactly once, else ``None``."""
    for name in (edit.file,) if isinstance(edit.file, str) else edit.file:
        path = repo / name
        if path.exists() and path.read_text().count(edit.old) == 1:
            return path
    return None


def apply(repo: Path, mutant: Mutant) -> dict[Path, str] | None:
    """Apply the edits; returns the original texts to restore, or ``None`` (nothing left applied) if stale."""
    originals: dict[Path, str] = {}
    for edit in mutant.edits:
        path = _target(repo, edit)
        if path is None:
            restore(originals)
            return None
        current = path.read_text()
        originals.setdefault(path, current)
        path.write_text(current.replace(edit.old, edit.new))
    return originals


def restore(originals: dict[Path, str]) -> None:
    for path, text in originals.items():
        path.write_text(text)


def in_areas(area: str, chosen) -> bool:
    """Whether ``area`` is one of ``chosen`` (all when empty) or a sub-area (``inference/slots``) of one."""
    return not chosen or any(area == a or area.startswith(a.rstrip("/") + "/") for a in chosen)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--area", action="append", help="only these areas and their sub-areas (repeatable)")
    parser.add_argument("--only", action="append", help="only these mutant names (repeatable)")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per pytest run")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--list", action="store_true", help="print the chosen mutants and exit")
    parser.add_argument("--tests", nargs="+", metavar="PATH",
                        help="run these tests for every mutant instead of its own")
    parser.add_argument("--baseline", action="store_true",
                        help="first run every named test path unmutated and leave out what fails there")
    parser.add_argument("--no-fork", action="store_true",
                        help="a fresh interpreter per run (slower: re-imports torch, transformers and fla each time)")
    lane = parser.add_argument_group("generated mutants (tests/mutation/lane.py)")
    which = lane.add_mutually_exclusive_group()
    which.add_argument("--changed-since", metavar="REF", help="the product modules git diff REF touches")
    which.add_argument("--all", action="store_true", help="every product module (budgeted)")
    which.add_argument("--module", action="append", metavar="PATH", help="this module (repeatable; any .py file)")
    which.add_argument("--combine", action="store_true",
                       help="no run: one product-wide table from the dated lane reports, re-checked against the tree")
    lane.add_argument("--rerun-open", action="store_true",
                      help="run just the survivors, uncovered lines and budget-cut mutants the dated reports "
                           "leave open (of the --module files, else all)")
    lane.add_argument("--max-per-module", type=int, default=40, help="mutants sampled per module")
    lane.add_argument("--module-budget", type=float, default=300.0, help="seconds per module (tracing included)")
    lane.add_argument("--budget", type=float, default=3600.0, help="seconds for the whole lane")
    lane.add_argument("--max-test-files", type=int, default=8,
                      help="candidate test files traced per module (as many more when a sampled line is uncovered)")
    lane.add_argument("--tests-per-mutant", type=int, default=12,
                      help="covering tests run per mutant (file by file in turn, fastest first)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _stop)
    if args.combine:
        from tests.mutation import lane as lane_mod
        reports = sorted(lane_mod.REPORTS.glob("mutants-*.json"))
        path = lane_mod.write_combined(lane_mod.combine(reports), time.strftime("%Y-%m-%d-%H%M%S"))
        print(f"{len(reports)} lane reports combined: {path}")
        return 0
    if args.rerun_open and (args.changed_since or args.all or args.combine):
        parser.error("--rerun-open runs the mutants the reports leave open: combine it with --module or nothing else")
    if args.changed_since or args.all or args.module or args.rerun_open:
        from tests.mutation import lane as lane_mod
        try:
            return lane_mod.main(args, scratch_copy=scratch_copy, check_imports=check_imports, preload=preload,
                                 pytest_run=pytest)
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    mutants = [m for m in MUTANTS if in_areas(m.area, args.area) and (not args.only or m.name in args.only)]
    if args.tests:
        mutants = [replace(m, tests=tuple(args.tests)) for m in mutants]
    if args.list:
        for m in mutants:
            print(f"{m.area:20} {m.name:34} {m.what}")
        return 0
    repo = scratch_copy()
    try:
        check_imports(repo)
        fork = not args.no_fork and hasattr(os, "fork")
        if fork:
            preload()
        broken: list[str] = []
        if args.baseline:
            paths = list(dict.fromkeys(p for m in mutants for p in m.tests))
            status, output, seconds = pytest(repo, paths, timeout=4 * args.timeout, first_failure=False, fork=fork)
            broken = failing_nodes(output)
            print(f"baseline: {status} in {seconds:.0f} s" + (f"; left out (fail unmutated): {broken}" if broken
                                                               else ""), flush=True)
            if status in ("timeout", "error") or (status == "failed" and not broken):
                print("the baseline run did not complete cleanly; fix the tests first\n" + output[-3000:])
                return 0
        results = [run_mutant(repo, m, broken, timeout=args.timeout, fork=fork) for m in mutants]
        summary(results)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    finally:
        shutil.rmtree(repo.parent, ignore_errors=True)
    return 0


def run_mutant(repo: Path, mutant: Mutant, broken: list[str], *, timeout: float, fork: bool) -> dict:
    """Plant ``mutant``, run its tests, restore. A kill counts only if the killing test passes on the
    unmutated copy (checked once per test); a test that fails there joins ``broken`` (left out from
    then on) and the mutant runs again without it."""
    seconds, killer, status = 0.0, "", "stale"
    while True:
        originals = apply(repo, mutant)
        if originals is None:
            break
        try:
            status, output, spent = pytest(repo, mutant.tests, timeout=timeout, first_failure=True,
                                           deselect=broken, fork=fork)
        finally:
            restore(originals)
        seconds += spent
        killer = (failing_nodes(output) or ["(no test named)"])[0] if status == "failed" else ""
        if status != "failed" or killer in _CONFIRMED or killer.startswith("("):
            break
        check, _, spent = pytest(repo, [killer], timeout=timeout, first_failure=True, fork=fork)
        seconds += spent
        if check == "passed":
            _CONFIRMED.add(killer)
            break
        print(f"          {killer} fails on the unmutated tree too: left out", flush=True)
        broken.append(killer)
    status = {"failed": "killed", "passed": "survived"}.get(status, status)
    print(f"{status:9} {mutant.area:20} {mutant.name:34} {seconds:5.0f} s  {killer}", flush=True)
    return dict(name=mutant.name, area=mutant.area, status=status, seconds=round(seconds, 1), killed_by=killer,
                what=mutant.what)


def _stop(signum, frame):
    """SIGTERM: end the run in progress, then leave through ``finally`` (the scratch copy is removed)."""
    for pid in _CHILD:
        os.kill(pid, signal.SIGKILL)
    sys.exit(128 + signum)


def summary(results: list[dict]) -> None:
    by_area = defaultdict(list)
    for r in results:
        by_area[r["area"]].append(r)
    for r in results:                                           # a row for each parent of sub-areas
        if "/" in r["area"]:
            by_area[r["area"].split("/")[0] + " (all)"].append(r)
    print(f"\n{'area':20} killed / planted   survived")
    for area, rows in by_area.items():
        killed = sum(r["status"] == "killed" for r in rows)
        counted = sum(r["status"] in ("killed", "survived") for r in rows)
        others = [f"{r['name']} ({r['status']})" for r in rows if r["status"] not in ("killed",)]
        print(f"{area:20} {killed:3d} / {counted:<3d}           {', '.join(others) or '-'}")


if __name__ == "__main__":
    sys.exit(main())
