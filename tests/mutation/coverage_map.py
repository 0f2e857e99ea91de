"""Which tests run which lines of a module: the selection of the generated-mutant lane.

Two steps per module. Candidate test files are found statically (the ``tests/`` files that name
the module's dotted path or one of its public names, the files mirroring its path first; then, to
fill the limit, those naming a product module that imports it). Those
files then run once under :class:`LineRecorder`, a pytest plugin that traces only the target
modules' files (``sys.settrace``; every other frame is left untraced, so the cost stays near a
plain run) and writes, per test, its outcome, its seconds and the target lines it executed. A
mutant on a line then runs only the tests that passed and executed that line, fastest first;
lines executed at import (module-level statements) count for every test that reached the module.
"""

from __future__ import annotations

import ast
import json
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


def _importers(root: Path, module: str) -> list[str]:
    """Product modules that import ``module`` (absolutely or relatively)."""
    target = dotted(module)
    found = []
    for path in sorted(p for top in ("ssm_pack", "mixers") for p in (Path(root) / top).rglob("*.py")):
        rel = str(path.relative_to(root))
        if rel != module and target in _imports(rel, ast.parse(path.read_text())):
            found.append(rel)
    return found


def _naming(root: Path, module: str) -> re.Pattern:
    names = public_names(Path(root) / module)
    return re.compile(r"\b(" + "|".join(map(re.escape, [dotted(module)] + names)) + r")\b")


def candidate_tests(root: Path, module: str, limit: int) -> list[str]:
    """Up to ``limit`` test files (relative paths) for ``module``: those that name it or one of its public
    names, the closest mirrors of its path first, then by how many of its names they use; when fewer
    than ``limit`` do, the files naming a product module that imports it (the entry points a private
    helper is tested through), by the same order."""
    root = Path(root)
    direct = _naming(root, module)
    by_importer = [(m, _naming(root, m)) for m in _importers(root, module)]
    scored = []
    for path in sorted((root / "tests").rglob("test_*.py")):
        rel = str(path.relative_to(root))
        if "/mutation/" in rel:
            continue
        text = path.read_text()
        hits, mirror = set(direct.findall(text)), _mirrors(module, rel)
        if hits or mirror:
            scored.append((0, -mirror, -len(hits), rel))
        else:
            indirect = [(_mirrors(m, rel), len(set(p.findall(text)))) for m, p in by_importer]
            best = max((i for i in indirect if i[1]), default=None)
            if best:
                scored.append((1, -best[0], -best[1], rel))
    return [rel for *_, rel in sorted(scored)[:limit]]


class LineRecorder:
    """pytest plugin: for each test, the lines of ``files`` it ran, appended as one JSON line to ``out``."""

    def __init__(self, files, out: Path):
        self.files = {str(f) for f in files}
        self.out = Path(out)
        self.hits: set[tuple[str, int]] = set()
        self.failed = False

    def _global(self, frame, event, arg):
        return self._local if frame.f_code.co_filename in self.files else None

    def _local(self, frame, event, arg):
        if event == "line":
            self.hits.add((frame.f_code.co_filename, frame.f_lineno))
        return self._local

    def start(self):
        sys.settrace(self._global)
        threading.settrace(self._global)

    def _flush(self, node: str, seconds: float, passed: bool):
        lines: dict[str, list[int]] = {}
        for file, line in self.hits:
            lines.setdefault(file, []).append(line)
        with self.out.open("a") as f:
            f.write(json.dumps({"node": node, "seconds": round(seconds, 3), "passed": passed,
                                "lines": {k: sorted(v) for k, v in lines.items()}}) + "\n")
        self.hits = set()

    def pytest_collection_finish(self, session):
        self._flush(IMPORT_TIME, 0.0, True)

    def pytest_runtest_protocol(self, item, nextitem):
        self.hits, self.failed, self._start = set(), False, time.perf_counter()

    def pytest_runtest_logreport(self, report):
        if report.failed or (report.when == "call" and report.skipped):
            self.failed = True
        if report.when == "teardown":
            self._flush(report.nodeid, time.perf_counter() - self._start, not self.failed)


def read_map(path: Path, repo: Path) -> tuple[dict, dict]:
    """``({module: {line: {node, ...}}}, {node: seconds})`` from a recorder's output; modules relative
    to ``repo``; import-time lines of a module map to every passing test that ran any of its lines."""
    by_line: dict[str, dict[int, set[str]]] = {}
    seconds: dict[str, float] = {}
    imported: dict[str, set[int]] = {}
    if not Path(path).exists():
        return by_line, seconds
    for raw in Path(path).read_text().splitlines():
        row = json.loads(raw)
        for file, lines in row["lines"].items():
            module = str(Path(file).relative_to(repo))
            if row["node"] == IMPORT_TIME:
                imported.setdefault(module, set()).update(lines)
            elif row["passed"]:
                seconds[row["node"]] = row["seconds"]
                for line in lines:
                    by_line.setdefault(module, {}).setdefault(line, set()).add(row["node"])
    for module, lines in imported.items():
        reached = set().union(*by_line.get(module, {}).values()) if by_line.get(module) else set()
        for line in lines:
            by_line.setdefault(module, {}).setdefault(line, set()).update(reached)
    return by_line, seconds
