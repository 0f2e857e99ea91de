"""Which tests run which lines of a module: the selection of the generated-mutant lane.

Two steps per module. Candidate test files are found statically (the ``tests/`` files that name
the module's dotted path or one of its public names, the files mirroring its path first; then
those naming a product module that imports it; then those naming a module importing one of
those). Those
files then run once under :class:`LineRecorder`, a pytest plugin that traces only the target
modules' files (``sys.settrace``; every other frame is left untraced, so the cost stays near a
plain run) and writes, per test, its outcome, its seconds and the target lines it executed. A
mutant on a line then runs only the tests that passed and executed that line, fastest first;
lines executed at import (module-level statements) count for every test that reached the module.

Spawned processes (the context-parallel ranks of ``torch.multiprocessing``, any ``python``
subprocess) run the target lines in interpreters the parent's tracer does not reach. With
``children=DIR`` the recorder writes a ``sitecustomize.py`` hook into ``DIR`` and, for the run,
prepends ``DIR`` to ``PYTHONPATH`` and sets ``SSM_PACK_TRACE`` (the target files and ``DIR``):
every child interpreter then traces the same files and appends each target line, the first time
it runs it, to its own ``DIR/<pid>.jsonl`` (created at its first target line; one line-buffered
write per new line: nothing is lost when a rank is killed, and no file is shared). Its header
names the test that was running when it started (``PYTEST_CURRENT_TEST``, inherited from the
parent). Attribution, which may over-select but must not under-select:

- a child's lines count for the test that started it and for every test that requests one of
  the same project-defined fixtures of wider than function scope (a module fixture such as
  ``ranks`` or ``runs_per_world``'s starts the ranks once and later tests read their results);
- a rank may label its lines with the case it runs (``sys.modules["_ssm_pack_trace"].enter(id)``,
  as ``tests/context_parallel/worker.py`` does): a test whose parametrize id names a case that
  a child of its group entered (``[rg_lru-spanning-p2]``: the whole id or a run of its
  ``-``-separated parts) gets those children's unlabelled lines and the lines of the cases it
  names (a case's results are taken to depend on those alone; module and class bodies, run once
  at import by whichever case comes first, stay unlabelled); a test that names none
  (``test_a_nan_stays_in_its_document[rg_lru]`` reads a case it does not name) gets them all;
- each test of the group counts at least the starting test's seconds (run alone, it starts the
  ranks itself), so a mutant's time limit covers the spawn;
- a child started outside any test (at collection) counts for every passing test.

Lines that ``torch.compile`` traces (a branch under ``torch.compiler.is_compiling()``) raise no
line event: dynamo's own interpreter reads them. The recorder wraps the call with which that
interpreter reports each line it starts (``TracingContext.set_current_loc``), so a test that
compiles a function counts the lines dynamo traced in it.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import sys
import threading
import time
from pathlib import Path

IMPORT_TIME = "<import>"


def public_names(path: Path) -> list[str]:
    """Top-level functions, classes and UPPER_CASE constants of the module at ``path`` (not ``_private``)."""
    tree = ast.parse(Path(path).read_text())
    names = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            names += [t.id for t in node.targets if isinstance(t, ast.Name) and t.id.isupper()]
    return [n for n in names if not n.startswith("_") and len(n) >= 5 and n not in ("main", "check")]


def dotted(module: str) -> str:
    name = module.removesuffix(".py").replace("/", ".")
    return name.removesuffix(".__init__")


def _mirrors(module: str, test: str) -> int:
    """How closely the test file ``test`` mirrors ``module``: one point each for the module's stem and its
    package's name occurring as whole ``_``-separated words of the file name (``state`` is not ``states``)."""
    name = "_" + Path(test).stem + "_"
    parts = Path(module).parts
    words = [Path(module).stem] + ([parts[-2]] if len(parts) > 1 else [])
    return sum(f"_{w}_" in name for w in words if w != "__init__")


def _imports(rel: str, tree: ast.Module) -> set[str]:
    """The dotted modules (and ``module.name`` candidates) a module's imports name, relative ones resolved."""
    package = dotted(rel) if rel.endswith("__init__.py") else dotted(rel).rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            origin = ".".join(base + ([node.module] if node.module else []))
            out.add(origin)
            out.update(f"{origin}.{a.name}" for a in node.names)
    return out


def _import_graph(root: Path) -> dict[str, set[str]]:
    """``{product module: the dotted names its imports name}``, every module parsed once."""
    out = {}
    for path in sorted(p for top in ("ssm_pack", "mixers") for p in (Path(root) / top).rglob("*.py")):
        rel = str(path.relative_to(root))
        out[rel] = _imports(rel, ast.parse(path.read_text()))
    return out


def _importers(root: Path, module: str, graph: dict | None = None) -> list[str]:
    """Product modules that import ``module`` (absolutely or relatively)."""
    target = dotted(module)
    graph = _import_graph(root) if graph is None else graph
    return [rel for rel, names in graph.items() if rel != module and target in names]


def _with_support(root: Path, rel: str, text: str, imported: set[str], parsed: dict) -> tuple[str, set[str]]:
    """A test file's text and imports together with those of the test-support modules it imports
    (``tests/`` files not named ``test_*``, followed transitively): the context-parallel tests name
    the ops they run only through ``tests/context_parallel/cases.py``, and a spawned worker's
    imports count as the test's own. ``parsed`` caches each support module's ``(text, imports)``."""
    texts, names, seen = [text], set(imported), {rel}
    frontier = imported
    while frontier:
        found = set()
        for name in frontier:
            path = Path(*name.split(".")).with_suffix(".py")
            support = str(path)
            if (name.split(".")[0] == "tests" and support not in seen and not path.name.startswith("test_")
                    and (Path(root) / path).is_file()):
                seen.add(support)
                if support not in parsed:
                    source = (Path(root) / path).read_text()
                    parsed[support] = (source, _imports(support, ast.parse(source)))
                source, more = parsed[support]
                texts.append(source)
                found |= more - names
                names |= more
        frontier = found
    return "\n".join(texts), names


def _naming(root: Path, module: str) -> re.Pattern:
    """What names ``module`` in a test's text: its dotted path or a public name; for a package's
    ``__main__.py``, also running the package (``python -m pkg``, ``[sys.executable, "-m", "pkg"]``)."""
    names = public_names(Path(root) / module)
    ways = [r"\b(?:" + "|".join(map(re.escape, [dotted(module)] + names)) + r")\b"]
    if Path(module).name == "__main__.py":
        package = re.escape(dotted(module).removesuffix(".__main__"))
        ways.append(r"-m[\"',\s]+" + package + r"(?![\w.])")
    return re.compile("(" + "|".join(ways) + ")")


def _importer_tiers(root: Path, module: str, graph: dict) -> list[list[str]]:
    """The product modules importing ``module``, by import distance: tier 1 imports it, tier 2 imports
    a tier-1 module, and so on until no new importer appears (the package ``__init__`` files that
    re-export an op end the chain)."""
    seen, tiers, frontier = {module}, [], [module]
    while frontier:
        found = sorted({m for f in frontier for m in _importers(root, f, graph)} - seen)
        if found:
            tiers.append(found)
        seen.update(found)
        frontier = found
    return tiers


def candidate_tests(root: Path, module: str, limit: int | None) -> list[str]:
    """Up to ``limit`` (``None``: all) test files (relative paths) for ``module``, in tiers, each by how
    closely the file mirrors a module's path, then by how many of its names the file uses: tier 0 names
    the module or one of its public names; tier k names a product module k imports away from it (the
    entry points a private helper is tested through: a shared check reached through an op's
    ``_validate``, a grouped-state helper reached through the op package that re-exports the op). A file
    names a module by its dotted path, by ``from package import module``, or by a public name; within a
    tier, the files naming it in their own text come before those naming it only through a test-support
    module they import."""
    root = Path(root)
    graph = _import_graph(root)
    tiers = [[module]] + _importer_tiers(root, module, graph)
    patterns = {m: _naming(root, m) for tier in tiers for m in tier}
    scored, parsed = [], {}
    for path in sorted((root / "tests").rglob("test_*.py")):
        rel = str(path.relative_to(root))
        if "/mutation/" in rel:
            continue
        own_text = path.read_text()
        own = (own_text, _imports(rel, ast.parse(own_text)))
        views = {0: own}                     # 1: with its support modules, built when a tier needs it
        for tier, members in enumerate(tiers):
            best = None
            for via_support in (0, 1):
                if via_support not in views:
                    views[1] = _with_support(root, rel, *own, parsed)
                text, imported = views[via_support]
                named = [(_mirrors(m, rel), len(set(patterns[m].findall(text))) + (dotted(m) in imported))
                         for m in members]
                best = max(((mirror, hits) for mirror, hits in named if hits or (tier == 0 and mirror)), default=None)
                if best:
                    break
            if best:
                scored.append((tier, via_support, -best[0], -best[1], rel))
                break
    return [rel for *_, rel in sorted(scored)[:limit]]


HOOK_ENV = "SSM_PACK_TRACE"
# Written as sitecustomize.py for a run with children=DIR: in every child interpreter with
# SSM_PACK_TRACE set, trace the target files, appending each new (case, file, line) to DIR/<pid>.jsonl.
HOOK = r'''
import json as _json
import os as _os
import sys as _sys
import threading as _threading
import types as _types


def _install(spec):
    files, state, seen, log = set(spec["files"]), _types.ModuleType("_ssm_pack_trace"), set(), []
    node = _os.environ.get("PYTEST_CURRENT_TEST", "").rpartition(" (")[0]

    def write(row):                                     # the log is opened at its first row only
        if not log:
            log.append(open(_os.path.join(spec["dir"], f"{_os.getpid()}.jsonl"), "a", buffering=1))
            log[0].write(_json.dumps({"node": node}) + "\n")
        log[0].write(_json.dumps(row) + "\n")

    def enter(case):
        state.case = case
        if case is not None:
            write({"case": case})

    state.case, state.enter = None, enter
    _sys.modules["_ssm_pack_trace"] = state

    def local(frame, event, arg):
        if event == "line":                             # module and class bodies (not CO_OPTIMIZED): no case
            key = (state.case if frame.f_code.co_flags & 1 else None, frame.f_code.co_filename, frame.f_lineno)
            if key not in seen:
                seen.add(key)
                write(key)
        return local

    def start(frame, event, arg):
        return local if frame.f_code.co_filename in files else None

    _sys.settrace(start)
    _threading.settrace(start)


if _os.environ.get("SSM_PACK_TRACE"):
    _install(_json.loads(_os.environ["SSM_PACK_TRACE"]))
# chain to a sitecustomize further down the path, if there is one
_here = _os.path.dirname(_os.path.abspath(__file__))
_rest = [p for p in _sys.path if _os.path.abspath(p or ".") != _here]
del _sys.modules["sitecustomize"]
_saved, _sys.path[:] = _sys.path[:], _rest
try:
    import sitecustomize  # noqa: F401
except ImportError:
    pass
finally:
    _sys.path[:] = _saved
'''


def _shared_fixtures(item, root: str) -> list[str]:
    """The project-defined fixtures wider than function scope that ``item`` requests (directly or not)."""
    info = getattr(item, "_fixtureinfo", None)
    out = []
    for name, defs in (info.name2fixturedefs.items() if info else ()):
        for d in defs:
            code = getattr(inspect.unwrap(d.func), "__code__", None)
            if code and d.scope != "function" and code.co_filename.startswith(root) and \
                    "site-packages" not in code.co_filename:
                out.append(f"{code.co_filename}:{code.co_firstlineno}:{name}")
    return sorted(out)


class LineRecorder:
    """pytest plugin: for each test, the lines of ``files`` it ran, appended as one JSON line to ``out``;
    with ``children`` (a directory), also the lines spawned child interpreters ran (module docstring)."""

    def __init__(self, files, out: Path, children: Path | None = None):
        self.files = {str(f) for f in files}
        self.out = Path(out)
        self.children = Path(children) if children else None
        self.hits: set[tuple[str, int]] = set()
        self.failed = False
        self._environ: dict[str, str | None] = {}
        self._restore_dynamo = lambda: None

    def _global(self, frame, event, arg):
        return self._local if frame.f_code.co_filename in self.files else None

    def _local(self, frame, event, arg):
        if event == "line":
            self.hits.add((frame.f_code.co_filename, frame.f_lineno))
        return self._local

    def _dynamo_lines(self):
        """Wrap ``TracingContext.set_current_loc`` (dynamo's interpreter calls it at each line it
        starts tracing) to record the target lines torch.compile traces; nothing without torch."""
        guards = sys.modules.get("torch._guards")
        if guards is None:
            try:
                import torch._guards as guards
            except ImportError:
                return
        context = getattr(guards, "TracingContext", None)
        original = getattr(context, "set_current_loc", None)
        if original is None:
            return

        def set_current_loc(filename, lineno, *args, **kwargs):
            if filename in self.files:
                self.hits.add((filename, lineno))
            return original(filename, lineno, *args, **kwargs)
        context.set_current_loc = staticmethod(set_current_loc)
        self._restore_dynamo = lambda: setattr(context, "set_current_loc", staticmethod(original))

    def start(self):
        self._dynamo_lines()
        if self.children is not None:
            self.children.mkdir(parents=True, exist_ok=True)
            (self.children / "sitecustomize.py").write_text(HOOK)
            spec = json.dumps({"files": sorted(self.files), "dir": str(self.children)})
            path = os.pathsep.join(p for p in (str(self.children), os.environ.get("PYTHONPATH")) if p)
            self._environ = {k: os.environ.get(k) for k in (HOOK_ENV, "PYTHONPATH")}
            os.environ.update({HOOK_ENV: spec, "PYTHONPATH": path})
        sys.settrace(self._global)
        threading.settrace(self._global)

    def pytest_unconfigure(self, config):
        self._restore_dynamo()
        for key, value in self._environ.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    def _flush(self, node: str, seconds: float, passed: bool):
        lines: dict[str, list[int]] = {}
        for file, line in self.hits:
            lines.setdefault(file, []).append(line)
        row = {"node": node, "seconds": round(seconds, 3), "passed": passed,
               "lines": {k: sorted(v) for k, v in lines.items()}}
        if self._shares:
            row["shares"] = self._shares
        with self.out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        self.hits = set()

    def pytest_collection_finish(self, session):
        self._shares = []
        self._flush(IMPORT_TIME, 0.0, True)

    def pytest_runtest_protocol(self, item, nextitem):
        self.hits, self.failed, self._start = set(), False, time.perf_counter()
        self._shares = _shared_fixtures(item, str(item.config.rootpath)) if self.children is not None else []

    def pytest_runtest_logreport(self, report):
        if report.failed or (report.when == "call" and report.skipped):
            self.failed = True
        if report.when == "teardown":
            self._flush(report.nodeid, time.perf_counter() - self._start, not self.failed)


def _names(node: str, label: str) -> bool:
    """Whether the parametrize id of ``node`` names the case ``label`` (whole, or ``-``-separated parts)."""
    if not node.endswith("]") or "[" not in node:
        return False
    ident = "-" + node[node.index("[") + 1:-1] + "-"
    return f"-{label}-" in ident


def read_children(children: Path) -> list[tuple[str, dict, set]]:
    """``[(node, {case or None: {(file, line), ...}}, {case, ...}), ...]``, one per child interpreter the hook
    traced that ran a target line or entered a case (the last set: every case it entered)."""
    out = []
    for path in sorted(Path(children).glob("*.jsonl")):
        for raw in path.read_text().splitlines():
            try:
                row = json.loads(raw)
            except ValueError:                                  # a line cut short by a kill
                continue
            if isinstance(row, dict) and "node" in row:
                out.append((row["node"], {}, set()))
            elif isinstance(row, dict) and out:
                out[-1][2].add(row["case"])
            elif out:
                out[-1][1].setdefault(row[0], set()).add((row[1], row[2]))
    return out


def read_map(path: Path, repo: Path, children: Path | None = None) -> tuple[dict, dict]:
    """``({module: {line: {node, ...}}}, {node: seconds})`` from a recorder's output; modules relative
    to ``repo``; import-time lines of a module map to every passing test that ran any of its lines;
    with ``children``, the spawned interpreters' lines map as the module docstring says."""
    by_line: dict[str, dict[int, set[str]]] = {}
    seconds: dict[str, float] = {}
    imported: dict[str, set[int]] = {}
    if not Path(path).exists():
        return by_line, seconds
    rows = [json.loads(raw) for raw in Path(path).read_text().splitlines()]
    for row in rows:
        if row["node"] != IMPORT_TIME and row["passed"]:
            seconds[row["node"]] = row["seconds"]
        for file, lines in row["lines"].items():
            module = str(Path(file).relative_to(repo))
            if row["node"] == IMPORT_TIME:
                imported.setdefault(module, set()).update(lines)
            elif row["passed"]:
                for line in lines:
                    by_line.setdefault(module, {}).setdefault(line, set()).add(row["node"])
    spawned = read_children(children) if children is not None and Path(children).is_dir() else []
    shares = {row["node"]: set(row.get("shares", ())) for row in rows}
    spawn_seconds = {row["node"]: row["seconds"] for row in rows}
    passing = [n for n in shares if n in seconds]
    groups = []         # (its starting test, the tests its lines may count for, its lines by case, its cases)
    for node, by_case, cases in spawned:
        group = [n for n in passing if n == node or shares[n] & shares.get(node, set())] \
            if node in shares else passing
        groups.append((node, group, by_case, cases))
    entered: dict[str, set[str]] = {}
    for _, group, _, cases in groups:
        for test in group:
            entered.setdefault(test, set()).update(cases)
    for node, group, by_case, _ in groups:
        for test in group:
            named = {c for c in entered[test] if _names(test, c)}
            for case in ([None, *(c for c in by_case if c in named)] if named else by_case):
                for file, line in by_case.get(case, ()):
                    try:
                        module = str(Path(file).relative_to(repo))
                    except ValueError:
                        continue
                    by_line.setdefault(module, {}).setdefault(line, set()).add(test)
            seconds[test] = max(seconds[test], spawn_seconds.get(node, 0.0))
    for module, lines in imported.items():
        reached = set().union(*by_line.get(module, {}).values()) if by_line.get(module) else set()
        for line in lines:
            by_line.setdefault(module, {}).setdefault(line, set()).update(reached)
    return by_line, seconds
