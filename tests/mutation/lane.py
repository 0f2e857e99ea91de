"""The generated-mutant lane of ``python -m tests.mutation.run`` (``--changed-since REF``, ``--all``, ``--module``).

For each chosen module: its mutants (:mod:`.generate`) less those ``equivalent.txt`` lists, sampled
to ``--max-per-module`` (a fixed sample per module name); its candidate tests traced once
(:mod:`.coverage_map`, spawned processes such as the CP ranks included); then each mutant
planted in the scratch copy (the working tree is never edited; the copy's file is restored in
``finally``) and run with ``-x`` against ``--tests-per-mutant`` of the tests that passed and
executed its line (:func:`select_tests`), then, if it survives them, against the other tests that
executed it; survivors and uncovered lines then trace the next candidate files, batch after batch within
the module budget. Statuses: ``killed`` (a test failed, or the run exceeded its time: a hang counts as
caught), ``survived`` (every test of the traced files that executed its line ran and passed),
``uncovered`` (no test runs the line), ``budget`` (the module's time ran out first, cut a run short,
or cut the trace of the first candidate files, so a test it never reached may kill the mutant: not
counted). Score per module: killed /
(killed + survived + uncovered). The report (markdown and JSON) goes to a dated file under
``mutation-reports/`` (ignored by git).
"""

from __future__ import annotations

import ast
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.mutation.coverage_map import LineRecorder, candidate_tests, read_map
from tests.mutation.generate import Generated, mutants_of, product_modules

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
EQUIVALENT = HERE / "equivalent.txt"
REPORTS = ROOT / "mutation-reports"
PRODUCT = ("ssm_pack/", "mixers/")


def read_equivalent(path: Path = EQUIVALENT) -> dict[tuple[str, str], tuple[str, str]]:
    """``{(module, fingerprint): (id, reason)}`` of the allow-list: ``ID FINGERPRINT REASON`` per line."""
    out = {}
    for number, raw in enumerate(Path(path).read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(None, 2)
        if len(parts) < 3 or parts[0].count(":") != 3:
            raise ValueError(f"{path.name}:{number}: want 'module:line:kind:n fingerprint reason', got {raw!r}")
        out[(parts[0].split(":")[0], parts[1])] = (parts[0], parts[2])
    return out


def changed_modules(ref: str, root: Path = ROOT) -> list[str]:
    """Product modules that ``git diff REF`` touches (and that still exist)."""
    check = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"], cwd=root,
                           capture_output=True, text=True)
    if check.returncode != 0:
        raise ValueError(f"--changed-since {ref!r} is not a commit of this repository; pass a branch, tag or "
                         "commit (e.g. $(git merge-base HEAD origin/main))")
    names = subprocess.run(["git", "diff", "--name-only", ref, "--"], cwd=root, capture_output=True, text=True,
                           check=True).stdout.split()
    return sorted(n for n in names if n.endswith(".py") and n.startswith(PRODUCT) and (root / n).is_file())


def sample(mutants: list[Generated], limit: int | None, module: str) -> list[Generated]:
    """At most ``limit`` of ``mutants``, the same ones for the same module and list, in id order."""
    if limit is None or len(mutants) <= limit:
        return mutants
    chosen = set(random.Random(module).sample(range(len(mutants)), limit))
    return [m for i, m in enumerate(mutants) if i in chosen]


def plant(repo: Path, mutant: Generated, run):
    """``run()`` with ``mutant`` written into the copy ``repo``; the file is restored whatever happens."""
    path = repo / mutant.module
    original = path.read_text()
    try:
        path.write_text(mutant.apply(original))
        return run()
    finally:
        path.write_text(original)


def _trace_files(repo: Path, module: str, files: list[str], timeout: float, pytest_run) -> tuple[dict, dict, bool]:
    """``({line: {test, ...}}, {test: seconds}, cut)`` of ``module`` from one traced run of ``files``;
    ``cut``: the run reached its time limit, so a line missing from the map may still be run by a
    test it did not reach."""
    log = Path(tempfile.mkdtemp(prefix="ssm-pack-cover-")) / "lines.jsonl"
    children = log.parent / "children"          # spawned interpreters' lines (coverage_map's hook)
    recorder = LineRecorder([repo / module], log, children=children)
    recorder.pytest_configure = lambda config: recorder.start()
    status, _, _ = pytest_run(repo, files, timeout=timeout, first_failure=False, plugins=[recorder])
    by_line, seconds = read_map(log, repo, children)
    return by_line.get(module, {}), seconds, status == "timeout"


def next_files(ranked: list[str], traced: int, limit: int, by_line: dict, wanted) -> list[str]:
    """The next ``limit`` of the ranked candidate files after the ``traced`` first ones, when a line
    in ``wanted`` has no covering test yet (else none): a line that only a lower-ranked file runs
    (a context-parallel dispatch line that only the spawned-rank tests reach) is then covered
    rather than reported "uncovered"."""
    if all(by_line.get(line) for line in wanted):
        return []
    return ranked[traced:traced + limit]


def trace(repo: Path, module: str, args, pytest_run, wanted=(), ranked=None) -> tuple[dict, dict, list[str], bool]:
    """The coverage map of ``module`` from its candidate test files (``ranked``, else found here;
    within half the module budget): the first ``--max-test-files`` of them, then, if a line in
    ``wanted`` is still uncovered, the next as many in the budget left. The last item says whether a
    traced run was cut by its time limit (a line it left unmapped is not known to be uncovered)."""
    start, limit = time.monotonic(), args.max_test_files
    ranked = candidate_tests(repo, module, None) if ranked is None else ranked
    files = ranked[:limit]
    if not files:
        return {}, {}, [], False
    by_line, seconds, cut = _trace_files(repo, module, files, args.module_budget / 2, pytest_run)
    more = next_files(ranked, len(files), limit, by_line, wanted)
    left = args.module_budget / 2 - (time.monotonic() - start)
    if more and left > 10:
        extra, extra_seconds, extra_cut = _trace_files(repo, module, more, left, pytest_run)
        for line, tests in extra.items():
            by_line.setdefault(line, set()).update(tests)
        seconds.update(extra_seconds)
        files, cut = files + more, cut or extra_cut
    return by_line, seconds, files, cut


def signature_body_lines(source: str) -> dict[int, int]:
    """``{line: body line}`` for every line of a function's signature (its defaults run at import,
    so every test that imports the module "runs" it): the first line of the body that runs when the
    function is called (its docstring skipped); a body of a docstring alone has no entry."""
    out: dict[int, int] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]
            if body:
                out.update(dict.fromkeys(range(node.lineno, node.body[0].lineno), body[0].lineno))
    return out


def covering_tests(by_line: dict, line: int, body_line: int | None = None) -> set[str]:
    """The tests that passed and ran ``line`` (for a signature line, those that ran the function's
    ``body_line``, when any did)."""
    return set((by_line.get(body_line) if body_line is not None else None) or by_line.get(line, ()))


def select_tests(by_line: dict, seconds: dict, line: int, limit: int, body_line: int | None = None) -> list[str]:
    """Up to ``limit`` of :func:`covering_tests`, taken file by file in turn, each file's fastest
    first, so one file's many quick tests do not crowd out another file's."""
    per_file: dict[str, list[str]] = {}
    for name in sorted(covering_tests(by_line, line, body_line), key=lambda n: (seconds.get(n, 0.0), n)):
        per_file.setdefault(name.split("::")[0], []).append(name)
    queues = sorted(per_file.values(), key=lambda q: (seconds.get(q[0], 0.0), q[0]))
    chosen: list[str] = []
    while len(chosen) < limit and any(queues):
        for queue in queues:
            if queue and len(chosen) < limit:
                chosen.append(queue.pop(0))
    return sorted(chosen, key=lambda n: (seconds.get(n, 0.0), n))


def _attempt(repo: Path, mutant: Generated, row: dict, batches, args, pytest_run, seconds: dict, start: float) -> None:
    """Run ``mutant`` against each batch of tests in turn until one kills it (``row`` updated). A batch
    the budget cuts leaves the mutant "budget" even when earlier batches passed: "survived" means
    every covering test ran and passed."""
    for batch in batches:
        left = args.module_budget - (time.monotonic() - start)
        if not batch or row.get("status") in ("uncovered", "killed"):
            break
        if left <= 0:
            row["status"] = "budget"
            break
        natural = min(args.timeout, 30 + 3 * sum(seconds.get(n, 1.0) for n in batch))
        limit = min(natural, left)
        status, output, spent = plant(repo, mutant, lambda: pytest_run(repo, batch, timeout=limit,
                                                                       first_failure=True))
        row["seconds"] = round(row["seconds"] + spent, 1)
        row["tests"] += len(batch)
        if status == "timeout" and limit < natural:      # cut by the budget: no evidence either way
            row["status"] = "budget"
            break
        failing = [line.split()[1] for line in output.splitlines() if line.startswith(("FAILED ", "ERROR "))]
        row.update(status={"failed": "killed", "timeout": "killed", "error": "killed"}.get(status, "survived"),
                   killed_by="(time limit)" if status == "timeout" else (failing or [""])[0])


def run_module(repo: Path, module: str, args, pytest_run, equivalent, only: set[str] | None = None) -> dict:
    """The lane's result for ``module``: its sample of mutants (``only``: the mutants with these
    fingerprints instead, as ``--rerun-open`` passes) run against their covering tests."""
    start = time.monotonic()
    every = mutants_of(repo, module)
    listed = [m for m in every if (module, m.fingerprint) in equivalent]
    kept = [m for m in every if (module, m.fingerprint) not in equivalent]
    chosen = sample(kept, args.max_per_module, module) if only is None else [m for m in kept if m.fingerprint in only]
    signatures = signature_body_lines((repo / module).read_text())
    wanted = {signatures.get(m.line, m.line) for m in chosen}
    ranked = candidate_tests(repo, module, None)            # parses the product's imports: once per module
    by_line, seconds, files, cut = trace(repo, module, args, pytest_run, wanted, ranked)
    first_cut = cut
    rows = []
    for mutant in chosen:
        body_line = signatures.get(mutant.line)
        tests = select_tests(by_line, seconds, mutant.line, args.tests_per_mutant, body_line)
        row = {"id": mutant.id, "fingerprint": mutant.fingerprint, "old": mutant.old.strip(),
               "new": mutant.new.strip(), "tests": 0, "killed_by": "", "seconds": 0.0}
        if not tests:              # no test ran the line, or the tracing run was cut before one did
            row["status"] = "budget" if cut else "uncovered"
        # a survivor of the selection runs the other covering tests too (within the budget): a
        # "survived" then means every test that ran its line passed
        rest = sorted(covering_tests(by_line, mutant.line, body_line) - set(tests),
                      key=lambda n: (seconds.get(n, 0.0), n))
        _attempt(repo, mutant, row, (tests, rest), args, pytest_run, seconds, start)
        rows.append(row)
        print(f"  {row['status']:9} {mutant.id:48} {row['killed_by'][:60]}", flush=True)
    # survivors and uncovered lines: the next candidate files are traced, batch after batch while
    # one is left open and the budget lasts, and their covering tests run
    while True:
        open_rows = [(m, r) for m, r in zip(chosen, rows) if r["status"] in ("survived", "uncovered")]
        more = ranked[len(files):len(files) + args.max_test_files] if open_rows else []
        left = args.module_budget - (time.monotonic() - start)
        if not more or left <= 10:
            break
        extra, extra_seconds, cut = _trace_files(repo, module, more, left / 2, pytest_run)
        seconds.update(extra_seconds)
        files = files + more
        for mutant, row in open_rows:
            body_line = signatures.get(mutant.line)
            new = sorted(covering_tests(extra, mutant.line, body_line), key=lambda n: (seconds.get(n, 0.0), n))
            if new:
                row["status"] = "survived" if row["status"] == "uncovered" else row["status"]
                _attempt(repo, mutant, row, (new,), args, pytest_run, seconds, start)
            if cut and row["status"] in ("survived", "uncovered"):
                row["status"] = "budget"          # the batch's trace was cut: a test it did not reach may kill it
            if new or row["status"] == "budget":
                print(f"  {row['status']:9} {mutant.id:48} {row['killed_by'][:60]} (next files)", flush=True)
        if cut:
            break
    for row in rows:                # a survivor with candidate files left untraced may yet be killed by one
        if row["status"] in ("survived", "uncovered"):
            row["untraced_files"] = max(len(ranked) - len(files), 0)
            if first_cut:           # the first files' trace was cut: a test it did not reach may kill it
                row["status"] = "budget"
    counted = [r for r in rows if r["status"] in ("killed", "survived", "uncovered")]
    killed = sum(r["status"] == "killed" for r in counted)
    return {"module": module, "generated": len(every), "equivalent": len(listed), "sampled": len(chosen),
            "killed": killed, "counted": len(counted), "score": round(killed / len(counted), 3) if counted else None,
            "test_files": files, "candidate_files": len(ranked), "seconds": round(time.monotonic() - start),
            "mutants": rows}


def write_report(results: list[dict], args, started: str) -> Path:
    REPORTS.mkdir(exist_ok=True)
    base = REPORTS / f"mutants-{started}"
    Path(f"{base}.json").write_text(json.dumps({"args": vars(args), "commit": _commit(), "modules": results},
                                               indent=1, default=str))
    lines = [f"# Generated mutants, {started}", "", f"command: python -m tests.mutation.run {' '.join(sys.argv[1:])}",
             "", "| module | score | killed / counted | generated | equivalent | sampled | files traced | seconds |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        score = "-" if r["score"] is None else f"{r['score']:.0%}"
        lines.append(f"| {r['module']} | {score} | {r['killed']} / {r['counted']} | {r['generated']} | "
                     f"{r['equivalent']} | {r['sampled']} | {len(r['test_files'])} / {r['candidate_files']} | "
                     f"{r['seconds']} |")
    for title, statuses in (("Survivors (and uncovered lines)", ("survived", "uncovered")),
                            ("Cut by the budget (not counted: rerun with a larger --module-budget)", ("budget",))):
        lines += ["", f"## {title}", ""]
        for r in results:
            for m in r["mutants"]:
                if m["status"] in statuses:
                    lines.append(f"- `{m['id']} {m['fingerprint']}` {m['status']} ({m['tests']} tests"
                                 f"{untraced(m)}): `{m['old']}` -> `{m['new']}`")
    Path(f"{base}.md").write_text("\n".join(lines) + "\n")
    return Path(f"{base}.md")


def untraced(row: dict) -> str:
    """``"; N candidate files untraced"`` for a survivor the budget left candidate test files for
    (one of them may kill it: rerun with a larger ``--module-budget``), else ``""`` (every candidate
    file traced: a gap in the tests, or an equivalent mutant)."""
    n = row.get("untraced_files", 0)
    return f"; {n} candidate file{'s' * (n != 1)} untraced" if n else ""


def _commit(root: Path = ROOT) -> str:
    """``HEAD``'s short hash, ``+`` when the tree has uncommitted changes (the scratch copy holds them)."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                           capture_output=True, text=True)
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "")


FINAL = ("killed", "survived", "uncovered")


def combine(reports: list[Path], root: Path = ROOT, equivalent=None) -> list[dict]:
    """One row per product module from the lane's dated JSON ``reports`` (read oldest first): per
    mutant, the latest final status (``killed``/``survived``/``uncovered``; a later ``budget`` row
    does not erase an earlier result), kept only while today's tree still generates that mutant
    (same fingerprint) and the allow-list does not name it. A module no report ran has ``score``
    ``None``. This is how the whole product gets a score from runs of parts of it (``--all`` over
    every module takes hours on two cores): each result was measured, on the commit its report
    names; a survivor a newer test kills stays one until its module runs again."""
    equivalent = read_equivalent() if equivalent is None else equivalent
    latest: dict[str, dict[str, tuple[dict, str]]] = {}
    cut: dict[str, set[str]] = {}                     # mutants some run's budget cut
    for path in sorted(reports, key=lambda p: Path(p).name):
        data = json.loads(Path(path).read_text())
        for module in data.get("modules", []):
            rows = latest.setdefault(module["module"], {})
            for row in module["mutants"]:
                if row["status"] in FINAL:
                    rows[row["fingerprint"]] = (row, Path(path).stem.removeprefix("mutants-"))
                elif row["status"] == "budget":
                    cut.setdefault(module["module"], set()).add(row["fingerprint"])
    out = []
    for module in product_modules(root):
        now = {m.fingerprint: m for m in mutants_of(root, module)}
        listed = {f for f in now if (module, f) in equivalent}
        kept = {f: v for f, v in latest.get(module, {}).items() if f in now and f not in listed}
        killed = sum(row["status"] == "killed" for row, _ in kept.values())
        open_rows = {f"{now[f].id} {f}": row for f, (row, _) in kept.items() if row["status"] != "killed"}
        survivors = sorted(open_rows)
        never = sorted(f"{now[f].id} {f}" for f in cut.get(module, ()) if f in now and f not in listed
                       and f not in kept)
        out.append({"module": module, "generated": len(now), "equivalent": len(listed), "killed": killed,
                    "counted": len(kept), "score": round(killed / len(kept), 3) if kept else None,
                    "runs": sorted({run for _, run in kept.values()}), "survivors": survivors,
                    "untraced": {name: untraced(row) for name, row in open_rows.items() if untraced(row)},
                    "cut": never})
    return out


def write_combined(rows: list[dict], started: str) -> Path:
    """``mutation-reports/product-<date>.md``: :func:`combine`'s table, the modules below 90% first."""
    REPORTS.mkdir(exist_ok=True)
    scored = [r for r in rows if r["score"] is not None]
    below = [r for r in scored if r["score"] < 0.9]
    lines = [f"# Generated mutants over the product, {started}", "",
             f"{len(scored)} of {len(rows)} product modules measured; {len(scored) - len(below)} at >= 90%, "
             f"{sum(r['score'] == 1 for r in scored)} at 100%; "
             f"{sum(r['killed'] for r in scored)} killed of {sum(r['counted'] for r in scored)} mutants run "
             f"({sum(r['generated'] for r in rows)} generated, {sum(r['equivalent'] for r in rows)} allow-listed).",
             f"{sum(len(r['survivors']) for r in rows)} survivors, "
             f"{sum(len(r['untraced']) for r in rows)} of them with candidate test files the budget left untraced; "
             f"{sum(len(r['cut']) for r in rows)} mutants the budget cut and no run measured.",
             "", "| module | score | killed / run | generated | allow-listed | from runs |",
             "|---|---|---|---|---|---|"]
    order = sorted(rows, key=lambda r: (r["score"] is None, r["score"] if r["score"] is not None else 0, r["module"]))
    for r in order:
        score = "not run" if r["score"] is None else f"{r['score']:.0%}"
        lines.append(f"| {r['module']} | {score} | {r['killed']} / {r['counted']} | {r['generated']} | "
                     f"{r['equivalent']} | {', '.join(r['runs'])} |")
    lines += ["", "## Survivors (and uncovered lines)", ""]
    lines += [f"- `{s}`{r['untraced'].get(s, '')}" for r in order for s in r["survivors"]]
    lines += ["", "## Cut by the budget, never measured (`--rerun-open` runs them)", ""]
    lines += [f"- `{s}`" for r in order for s in r["cut"]]
    path = REPORTS / f"product-{started}.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def open_mutants(reports=None, root: Path | None = None) -> dict[str, set[str]]:
    """``{module: {fingerprint, ...}}`` of the mutants the combined dated reports (:func:`combine`) leave
    open: survivors, uncovered lines, and mutants the budget cut that no run measured. After tests
    are written for them, one run of just these shows the kills (``--rerun-open``, with a larger
    ``--module-budget`` for the cut ones), without sampling the modules again."""
    reports = sorted(REPORTS.glob("mutants-*.json")) if reports is None else reports
    return {r["module"]: {s.split()[1] for s in r["survivors"] + r["cut"]}
            for r in combine(reports, ROOT if root is None else root) if r["survivors"] or r["cut"]}


def choose_modules(args) -> list[str]:
    if args.module:
        missing = [m for m in args.module if not (ROOT / m).is_file()]
        if missing:
            raise ValueError(f"--module: no such file {missing}; give paths relative to the repository root")
        return list(dict.fromkeys(args.module))
    if args.all:
        return product_modules(ROOT)
    return changed_modules(args.changed_since)


def main(args, *, scratch_copy, check_imports, preload, pytest_run) -> int:
    """Run the lane for ``args`` (parsed by ``run.py``); exits 0 (it reports, it does not gate)."""
    only = open_mutants() if getattr(args, "rerun_open", False) else None
    if only is not None:
        modules = [m for m in (choose_modules(args) if args.module else sorted(only)) if m in only]
        if not modules:
            print("no open mutant (survivor, uncovered line or budget cut) in the dated reports"
                  + (" of those modules" if args.module else "") + ": no mutant to rerun")
            return 0
    else:
        modules = choose_modules(args)
    if not modules:
        print(f"no product module (ssm_pack/, mixers/) changed since {args.changed_since}: no mutant to run")
        return 0
    equivalent = read_equivalent()
    started = time.strftime("%Y-%m-%d-%H%M%S")
    deadline = time.monotonic() + args.budget
    repo = scratch_copy()
    results = []
    try:
        check_imports(repo)
        preload()
        for module in modules:
            if time.monotonic() > deadline:
                print(f"total budget ({args.budget:g} s) spent: {module} and later modules not run")
                break
            print(f"{module}", flush=True)
            results.append(run_module(repo, module, args, pytest_run, equivalent,
                                      None if only is None else only[module]))
    finally:
        import shutil
        shutil.rmtree(repo.parent, ignore_errors=True)
        if results:
            path = write_report(results, args, started)
            print(f"\nreport: {path}")
    for r in results:
        score = "-" if r["score"] is None else f"{r['score']:.0%}"
        print(f"{r['module']:50} {score:>5} killed {r['killed']} / {r['counted']} "
              f"(generated {r['generated']}, equivalent {r['equivalent']}, sampled {r['sampled']})")
    return 0
