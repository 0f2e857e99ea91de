"""The generated-mutant lane's pieces: the generator (kinds, ids, order, validity), the planting
(the copy's file always restored) and the allow-list of equivalent mutants (every entry still
names a mutant, with a reason)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.mutation.coverage_map import candidate_tests, read_map
from tests.mutation.generate import KINDS, mutants_of, mutants_of_source, product_modules
from tests.mutation.lane import plant, read_equivalent, sample, select_tests, signature_body_lines

ROOT = Path(__file__).resolve().parents[2]

SOURCE = '''\
def f(x, y, items):
    """A docstring with 1 < 2 stays."""
    assert x >= 0, "invariants stay"
    if x < 3:
        return y + 1
    items.append(x)
    z = g(x, y).detach()
    if y in items:
        raise ValueError(f"bad {y + 1}")
    total = 0  # pragma: no mutate
    return z
'''


def _by_kind(mutants):
    out = {}
    for m in mutants:
        out.setdefault(m.kind, []).append(m.new.strip())
    return out


def test_every_kind_is_generated_and_protected_text_is_not():
    found = _by_kind(mutants_of_source("m.py", SOURCE))
    assert set(found) == set(KINDS)
    assert "if x <= 3:" in found["cmp"] and "if y not in items:" in found["cmp"]
    assert "return y - 1" in found["arith"] and "if x < 4:" in found["const"]
    assert {"if True:", "if False:"} <= set(found["cond"])
    assert {"pass"} == set(found["drop"])               # the early return, the call, the raise
    assert "z = g(y, x).detach()" in found["swap"] and "z = g(x, y)" in found["detach"]
    every = [m.new for m in mutants_of_source("m.py", SOURCE)]
    assert not any("1 <= 2" in t or "x > 0" in t or "{y - 1}" in t or "total = 1" in t for t in every)
    assert len([m for m in mutants_of_source("m.py", SOURCE) if m.kind == "drop"]) == 3


@pytest.mark.parametrize("call, swapped", [
    pytest.param("x.transpose(1, 2)", False, id="transpose"),
    pytest.param("torch.equal(a, b)", False, id="equal"),
    pytest.param("max(a, b)", False, id="max"),
    pytest.param("records_grad(a, b)", False, id="records-grad"),
    pytest.param("x.permute(1, 2)", True, id="permute-is-not"),
    pytest.param("torch.sub(a, b)", True, id="sub-is-not"),
])
def test_calls_symmetric_in_their_arguments_are_not_swapped(call, swapped):
    kinds = [m.kind for m in mutants_of_source("m.py", f"def f(x, a, b):\n    return {call}\n")]
    assert ("swap" in kinds) == swapped


def test_ids_are_ordered_unique_and_every_mutant_compiles_to_a_different_tree():
    module = "ssm_pack/stream/assemble.py"
    source = (ROOT / module).read_text()
    mutants = mutants_of(ROOT, module)
    assert mutants == mutants_of(ROOT, module)                                  # deterministic
    assert len({m.id for m in mutants}) == len(mutants)
    assert [m.line for m in mutants] == sorted(m.line for m in mutants)
    assert all(m.id.startswith(f"{module}:{m.line}:{m.kind}:") for m in mutants)
    reference = ast.dump(ast.parse(source))
    for m in mutants[:40]:
        assert ast.dump(ast.parse(m.apply(source))) != reference, m.id


def test_product_modules_are_the_two_packages():
    modules = product_modules(ROOT)
    assert "ssm_pack/stream/assemble.py" in modules and "mixers/model/carry.py" in modules
    assert all(m.startswith(("ssm_pack/", "mixers/")) for m in modules)


def test_planting_restores_the_file_even_when_the_run_fails(tmp_path):
    (tmp_path / "m.py").write_text(SOURCE)
    mutant = mutants_of(tmp_path, "m.py")[0]
    seen = []

    def run():
        seen.append((tmp_path / "m.py").read_text())
        raise RuntimeError("the test run broke")

    with pytest.raises(RuntimeError):
        plant(tmp_path, mutant, run)
    assert seen and seen[0] != SOURCE                    # the mutant was in place during the run
    assert (tmp_path / "m.py").read_text() == SOURCE     # and is gone after it


def test_sampling_is_fixed_per_module():
    mutants = mutants_of(ROOT, "ssm_pack/stream/assemble.py")
    a, b = sample(mutants, 10, "x"), sample(mutants, 10, "x")
    assert a == b and len(a) == 10 and a == sorted(a, key=mutants.index)
    assert sample(mutants, 10, "y") != a


def test_every_equivalent_entry_names_a_mutant_and_a_reason():
    entries = read_equivalent()
    assert entries
    for (module, fingerprint), (ident, reason) in entries.items():
        prints = {m.fingerprint: m for m in mutants_of(ROOT, module)}
        assert fingerprint in prints, f"{ident}: no mutant has fingerprint {fingerprint} any more"
        assert prints[fingerprint].kind == ident.split(":")[2] and len(reason.split()) >= 4


def test_a_malformed_equivalent_entry_is_refused(tmp_path):
    path = tmp_path / "equivalent.txt"
    path.write_text("ssm_pack/x.py:1:cmp 0123456789\n")
    with pytest.raises(ValueError, match="want 'module:line:kind:n fingerprint reason'"):
        read_equivalent(path)


def test_candidate_tests_mirror_the_module_first():
    files = candidate_tests(ROOT, "mixers/model/carry.py", 3)
    assert files[0].startswith("tests/mixers/model/test_carry")     # the mirror of mixers/model/carry.py


@pytest.mark.parametrize("module, want, never", [
    pytest.param("ssm_pack/stream/state.py", "tests/ssm_pack/test_stream_errors.py",
                 "tests/mixers/ops/test_fla_wrapper_states.py", id="whole-word-mirror-and-importer-tests"),
    pytest.param("ssm_pack/formats/consistency.py", "tests/ssm_pack/test_varlen.py", None,
                 id="relative-import-from-a-parent-package"),
    pytest.param("mixers/ops/common/empty.py", "tests/mixers/ops/test_causal_conv1d.py", None,
                 id="helper-no-test-names"),
])
def test_candidate_tests_reach_a_helper_through_the_modules_importing_it(module, want, never):
    files = candidate_tests(ROOT, module, None)          # as the lane asks (lane.py): every candidate, ranked
    assert want in files, files
    if never is not None:           # reached only far down the import chain: ranked after the importers' tests
        assert never not in files or files.index(never) > files.index(want), files


def test_the_coverage_map_gives_import_lines_to_every_test_of_the_module(tmp_path):
    log = tmp_path / "lines.jsonl"
    f = str(tmp_path / "m.py")
    log.write_text('{"node": "<import>", "seconds": 0, "passed": true, "lines": {"%s": [1]}}\n'
                   '{"node": "t::a", "seconds": 0.5, "passed": true, "lines": {"%s": [4]}}\n'
                   '{"node": "t::b", "seconds": 0.1, "passed": false, "lines": {"%s": [5]}}\n' % (f, f, f))
    by_line, seconds = read_map(log, tmp_path)
    assert by_line["m.py"] == {1: {"t::a"}, 4: {"t::a"}}           # a failing test selects nothing
    assert seconds == {"t::a": 0.5}


SIGNATURE = '''def op(x,
       chunk_size=64):
    """Docs."""
    return x * chunk_size


def bare(x=1):
    """Only docs."""
'''


@pytest.mark.parametrize("line, want", [
    pytest.param(2, 4, id="default-on-a-continuation-line"),
    pytest.param(1, 4, id="the-def-line"),
    pytest.param(4, None, id="a-body-line"),
    pytest.param(7, None, id="a-body-of-docs-alone"),
])
def test_a_signature_line_maps_to_the_first_body_line(line, want):
    assert signature_body_lines(SIGNATURE).get(line) == want


def test_a_signature_mutant_runs_the_tests_that_called_the_function():
    """A default runs at import, so every test "ran" its line; the tests that ran the body are the
    ones that can see it (and the line's own, when no test ran the body)."""
    by_line = {2: {"a.py::t1", "a.py::t2", "b.py::call"}, 4: {"b.py::call"}}
    seconds = {"a.py::t1": 0.1, "a.py::t2": 0.2, "b.py::call": 5.0}
    assert select_tests(by_line, seconds, 2, 1, 4) == ["b.py::call"]
    assert select_tests(by_line, seconds, 2, 1, None) == ["a.py::t1"]          # the control: fastest overall
    assert select_tests({2: by_line[2]}, seconds, 2, 3, 4) == ["a.py::t1", "a.py::t2", "b.py::call"]


def test_the_tests_of_a_mutant_come_from_every_file_in_turn():
    """Many quick tests of one file do not crowd out a slower file's fastest test."""
    by_line = {9: {f"quick.py::t{i}" for i in range(20)} | {"slow.py::s1", "slow.py::s2"}}
    seconds = {**{f"quick.py::t{i}": 0.01 * (i + 1) for i in range(20)}, "slow.py::s1": 3.0, "slow.py::s2": 4.0}
    got = select_tests(by_line, seconds, 9, 4)
    assert got == ["quick.py::t0", "quick.py::t1", "slow.py::s1", "slow.py::s2"]
    assert select_tests(by_line, seconds, 9, 3) == ["quick.py::t0", "quick.py::t1", "slow.py::s1"]


def _lane_run(tmp_path, monkeypatch, killer: str | None):
    """``run_module`` on a one-line module whose line 13 tests ran, with pytest replaced: the run fails
    when its tests include ``killer``."""
    import argparse

    from tests.mutation import lane
    (tmp_path / "m.py").write_text("def f(x):\n    return x + 1\n")
    covering = {f"t{i:02d}.py::test" for i in range(13)}
    monkeypatch.setattr(lane, "trace", lambda *a, **k: ({2: covering}, {}, ["t.py"], False))
    runs = []

    def pytest_run(repo, tests, timeout, first_failure):
        runs.append(list(tests))
        return ("failed", f"FAILED {killer} - boom", 0.1) if killer in tests else ("passed", "", 0.1)
    args = argparse.Namespace(max_per_module=None, tests_per_mutant=12, module_budget=100.0, timeout=60.0,
                              max_test_files=8)
    result = lane.run_module(tmp_path, "m.py", args, pytest_run, {})
    return result["mutants"], runs


def test_a_survivor_of_the_selection_runs_the_other_covering_tests(tmp_path, monkeypatch):
    """12 of 13 covering tests pass; the 13th, outside the selection, kills every mutant of the line."""
    rows, runs = _lane_run(tmp_path, monkeypatch, "t12.py::test")
    assert rows and all(r["status"] == "killed" and r["killed_by"] == "t12.py::test" for r in rows)
    assert all(r["tests"] == 13 for r in rows) and [len(r) for r in runs[:2]] == [12, 1]


def test_a_survivor_has_passed_every_covering_test(tmp_path, monkeypatch):
    rows, runs = _lane_run(tmp_path, monkeypatch, None)
    assert rows and all(r["status"] == "survived" and r["tests"] == 13 for r in rows)
    assert sorted(runs[0] + runs[1]) == sorted(f"t{i:02d}.py::test" for i in range(13))


@pytest.mark.parametrize("wanted, traced", [
    pytest.param({2}, [["f0", "f1"]], id="covered-by-the-first-files"),
    pytest.param({2, 7}, [["f0", "f1"], ["f2", "f3"]], id="a-line-only-later-files-run"),
])
def test_an_uncovered_sampled_line_traces_the_next_candidate_files(monkeypatch, wanted, traced):
    """The first ``--max-test-files`` candidates cover line 2 only; a sampled mutant on line 7 (a
    context-parallel dispatch line only the spawned-rank tests reach) traces the next as many, and
    their tests join the map."""
    import argparse

    from tests.mutation import lane
    monkeypatch.setattr(lane, "candidate_tests", lambda repo, module, limit: ["f0", "f1", "f2", "f3", "f4"])
    runs = []

    def trace_files(repo, module, files, timeout, run):
        runs.append(list(files))
        if files[0] == "f0":
            return {2: {"f0::a"}}, {"f0::a": 1.0}, False
        return {7: {"f2::cp"}}, {"f2::cp": 3.0}, False
    monkeypatch.setattr(lane, "_trace_files", trace_files)
    args = argparse.Namespace(max_test_files=2, module_budget=100.0)
    by_line, seconds, files, cut = lane.trace(Path("."), "m.py", args, None, wanted)
    assert runs == traced and files == [f for batch in traced for f in batch] and not cut
    assert (7 in by_line) == (len(traced) == 2) and by_line[2] == {"f0::a"}
    assert lane.next_files(["f0", "f1", "f2"], 2, 2, {2: {"t"}, 7: set()}, {7}) == ["f2"]    # an empty set is uncovered


def test_combined_reports_keep_the_latest_result_of_each_mutant_still_generated(tmp_path):
    """Two dated lane reports over ``ssm_pack/m.py``: the newer report's kill replaces the earlier
    survivor, a later ``budget`` row erases nothing, a mutant the tree no longer generates (its
    line changed) and one the allow-list names leave the count, a module no report ran is ``None``."""
    import json

    from tests.mutation import lane
    (tmp_path / "ssm_pack").mkdir()
    (tmp_path / "ssm_pack" / "m.py").write_text(SOURCE)
    (tmp_path / "ssm_pack" / "other.py").write_text("X = 1\n")
    a, b, c, d = mutants_of(tmp_path, "ssm_pack/m.py")[:4]

    def report(name, rows):
        path = tmp_path / f"mutants-{name}.json"
        path.write_text(json.dumps({"modules": [{"module": "ssm_pack/m.py", "mutants": [
            {"fingerprint": f, "status": status} for f, status in rows]}]}))
        return path
    older = report("2026-01-01-000000", [(a.fingerprint, "survived"), (b.fingerprint, "killed"),
                                         (c.fingerprint, "uncovered"), ("0000000000", "killed")])
    newer = report("2026-01-02-000000", [(a.fingerprint, "killed"), (b.fingerprint, "budget"),
                                         (d.fingerprint, "survived")])
    equivalent = {("ssm_pack/m.py", d.fingerprint): (d.id, "reason")}
    rows = {r["module"]: r for r in lane.combine([newer, older], tmp_path, equivalent)}
    assert rows["ssm_pack/other.py"]["score"] is None and rows["ssm_pack/other.py"]["counted"] == 0
    m = rows["ssm_pack/m.py"]
    assert (m["killed"], m["counted"], m["score"], m["equivalent"]) == (2, 3, 0.667, 1)
    assert m["survivors"] == [f"{c.id} {c.fingerprint}"] and m["cut"] == []     # b's later cut erases nothing
    assert m["runs"] == ["2026-01-01-000000", "2026-01-02-000000"]


def _run_past_the_first_file(tmp_path, monkeypatch, candidates, next_map, pytest_run, cut=False, budget=100.0):
    """``run_module`` with ``--max-test-files`` 1 on a one-line module whose line 2 only ``a.py::t``
    (passing) ran in the first traced file; ``candidates``: the ranked files; ``next_map(files)``: the
    ``{line: tests}`` a trace of the next batch finds (``cut``: that trace hit its time limit).
    Returns the result and the batches traced after the first file."""
    import argparse

    from tests.mutation import lane
    (tmp_path / "m.py").write_text("def f(x):\n    return x + 1\n")
    monkeypatch.setattr(lane, "trace", lambda *a, **k: ({2: {"a.py::t"}}, {}, ["a.py"], False))
    monkeypatch.setattr(lane, "candidate_tests", lambda repo, module, limit: list(candidates))
    traced = []

    def trace_files(repo, module, files, timeout, run):
        traced.append(list(files))
        found = next_map(files)
        return found, {t: 0.5 for tests in found.values() for t in tests}, cut
    monkeypatch.setattr(lane, "_trace_files", trace_files)
    args = argparse.Namespace(max_per_module=None, tests_per_mutant=12, module_budget=budget, timeout=60.0,
                              max_test_files=1)
    return lane.run_module(tmp_path, "m.py", args, pytest_run, {}), traced


def _far_kills(repo, tests, timeout, first_failure):
    return ("failed", "FAILED far.py::t - boom", 0.1) if "far.py::t" in tests else ("passed", "", 0.1)


def test_a_survivor_runs_the_tests_of_the_next_candidate_files(tmp_path, monkeypatch):
    """Every mutant of line 2 survives the traced files' test; the next candidate file (beyond
    ``--max-test-files``) has a test that runs line 2 and fails on every mutant: they end killed."""
    result, traced = _run_past_the_first_file(tmp_path, monkeypatch, ["a.py", "far.py", "other.py"],
                                              lambda files: {2: {"far.py::t"}}, _far_kills)
    assert traced == [["far.py"]] and result["test_files"] == ["a.py", "far.py"]
    assert result["mutants"] and all(r["status"] == "killed" and r["killed_by"] == "far.py::t" and r["tests"] == 2
                                     for r in result["mutants"])


def test_survivors_trace_batch_after_batch_until_one_kills_them(tmp_path, monkeypatch):
    """Only the third batch of candidate files (``--max-test-files`` 1) runs a test that fails on the
    mutants: the batches are traced in turn until it is reached, and none after the kill."""
    result, traced = _run_past_the_first_file(tmp_path, monkeypatch, ["a.py", "b.py", "c.py", "far.py", "late.py"],
                                              lambda files: {2: {f"{files[0]}::t"}}, _far_kills)
    assert traced == [["b.py"], ["c.py"], ["far.py"]] and result["test_files"] == ["a.py", "b.py", "c.py", "far.py"]
    assert result["mutants"] and all(r["status"] == "killed" and r["killed_by"] == "far.py::t" and r["tests"] == 4
                                     for r in result["mutants"])


def test_a_survivor_whose_next_files_trace_was_cut_is_budget(tmp_path, monkeypatch):
    """The second batch's trace reaches its time limit: a test it did not reach may kill the mutants,
    so they end "budget" (listed in the report's budget section), and no later batch is traced."""
    import argparse

    from tests.mutation import lane
    result, traced = _run_past_the_first_file(tmp_path, monkeypatch, ["a.py", "b.py", "c.py"],
                                              lambda files: {2: {"b.py::t"}}, lambda *a, **k: ("passed", "", 0.1),
                                              cut=True)
    assert traced == [["b.py"]]
    assert result["mutants"] and all(r["status"] == "budget" for r in result["mutants"]) and result["counted"] == 0
    monkeypatch.setattr(lane, "REPORTS", tmp_path / "reports")
    text = lane.write_report([result], argparse.Namespace(), "2026-01-01-000000").read_text()
    assert "## Cut by the budget" in text and result["mutants"][0]["id"] in text.split("## Cut by the budget")[1]


def _tree(root: Path, files: dict[str, str]) -> Path:
    """``files`` (``{relative path: text}``) written under ``root``, folders made as needed."""
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_candidate_tests_reach_a_helper_two_imports_away(tmp_path):
    """``check`` is imported by ``_validate``, which ``op`` imports: a test naming only ``op``'s
    public function is a candidate, after one naming ``_validate``'s, and an unrelated test is not."""
    _tree(tmp_path, {
        "ssm_pack/check.py": "def check_thing(x):\n    return x\n",
        "ssm_pack/_validate.py": "from .check import check_thing\n\n\n"
                                 "def validate_call(x):\n    return check_thing(x)\n",
        "ssm_pack/op.py": "from ._validate import validate_call\n\n\ndef public_op(x):\n    return validate_call(x)\n",
        "tests/test_op.py": "from ssm_pack.op import public_op\n",
        "tests/test_calls.py": "from ssm_pack._validate import validate_call\n",
        "tests/test_other.py": "import torch\n",
    })
    assert candidate_tests(tmp_path, "ssm_pack/check.py", 8) == ["tests/test_calls.py", "tests/test_op.py"]


def test_a_packages_main_is_named_by_the_tests_that_run_the_package(tmp_path):
    """``pkg/__main__.py`` runs as ``python -m pkg``: a test starting that process names it (as an
    argument list or a command line); one running ``pkg.sub`` or ``pkgx``, or importing ``pkg`` only,
    does not."""
    _tree(tmp_path, {
        "mixers/__init__.py": "",
        "mixers/cli.py": "def run_cli():\n    return 0\n",
        "mixers/__main__.py": "import sys\n\nfrom .cli import run_cli\n\nsys.exit(run_cli())\n",
        "tests/test_list.py": 'import subprocess, sys\nsubprocess.run([sys.executable, "-m", "mixers"])\n',
        "tests/test_line.py": 'import os\nos.system("python -m mixers report")\n',
        "tests/test_sub.py": 'import subprocess, sys\nsubprocess.run([sys.executable, "-m", "mixers.sub"])\n',
        "tests/test_prefix.py": 'import os\nos.system("python -m mixersx")\n',
        "tests/test_import.py": "import mixers\n",
    })
    assert candidate_tests(tmp_path, "mixers/__main__.py", 8) == ["tests/test_line.py", "tests/test_list.py"]


def test_candidate_tests_follow_imports_to_the_package_and_resolve_from_package_import_module(tmp_path):
    """``grouped`` -> ``states`` -> ``reference`` -> the package ``__init__`` that re-exports the op: a
    test calling the op through the package is a candidate, three imports away; so is a test that
    names the module only as ``from package import module``, one import away; an unrelated test is not."""
    _tree(tmp_path, {
        "mixers/ops/grouped.py": "def _bucket(x):\n    return x\n",
        "mixers/ops/states.py": "from .grouped import _bucket\n\n\ndef _doc_states(x):\n    return _bucket(x)\n",
        "mixers/ops/reference.py": "from .states import _doc_states\n\n\ndef _ref(x):\n    return _doc_states(x)\n",
        "mixers/ops/__init__.py": "from .reference import _ref as chunk_scan_op\n",
        "tests/test_public.py": "from mixers.ops import chunk_scan_op\n",
        "tests/test_module.py": "from mixers.ops import states\n\nstates._doc_states(1)\n",
        "tests/test_other.py": "import torch\n",
    })
    assert candidate_tests(tmp_path, "mixers/ops/grouped.py", None) == ["tests/test_module.py", "tests/test_public.py"]


def test_candidate_tests_read_the_support_modules_a_test_imports(tmp_path):
    """A test that runs ``op`` only through a support module (``tests/cp/cases.py`` names it, a
    spawned-rank test imports ``worker``, which imports ``cases``) is a candidate; it comes after the
    test naming ``op`` itself, and the support module itself is never a candidate."""
    pkg = tmp_path / "ssm_pack"
    pkg.mkdir()
    (pkg / "op.py").write_text("def public_op(x):\n    return x\n")
    support = tmp_path / "tests" / "cp"
    support.mkdir(parents=True)
    (support / "cases.py").write_text("from ssm_pack.op import public_op\n\nCASES = [public_op]\n")
    (support / "worker.py").write_text("from tests.cp.cases import CASES\n")
    (support / "test_ranks.py").write_text("from tests.cp.worker import CASES\n")
    (support / "test_direct.py").write_text("from ssm_pack.op import public_op\n")
    (support / "test_other.py").write_text("import torch\n")
    assert candidate_tests(tmp_path, "ssm_pack/op.py", None) == ["tests/cp/test_direct.py", "tests/cp/test_ranks.py"]


@pytest.mark.parametrize("status, want", [
    pytest.param("passed", "uncovered", id="trace-completed"),
    pytest.param("timeout", "budget", id="trace-cut-by-its-time-limit"),
])
def test_a_line_a_cut_trace_left_unmapped_is_budget_not_uncovered(tmp_path, monkeypatch, status, want):
    """The tracing run of the candidate files reaches its time limit before any test runs line 2 (a
    spawned-rank test on a loaded machine): its mutants are reported cut by the budget, not
    uncovered; a completed trace that maps no test to the line reports them uncovered."""
    import argparse

    from tests.mutation import lane
    (tmp_path / "m.py").write_text("def f(x):\n    return x + 1\n")
    monkeypatch.setattr(lane, "candidate_tests", lambda repo, module, limit: ["a.py"])
    monkeypatch.setattr(lane, "read_map", lambda log, repo, children: ({}, {}))

    def pytest_run(repo, tests, timeout, first_failure, plugins=()):
        return status, "", timeout
    args = argparse.Namespace(max_per_module=None, tests_per_mutant=12, module_budget=100.0, timeout=60.0,
                              max_test_files=1)
    result = lane.run_module(tmp_path, "m.py", args, pytest_run, {})
    assert result["mutants"] and {r["status"] for r in result["mutants"]} == {want}


def test_a_survivor_whose_other_covering_tests_the_budget_cut_is_budget(tmp_path, monkeypatch):
    """The 12 selected tests pass; the run of the 13th (a spawned-rank file, 50 s a test) reaches the
    module budget's limit before its natural one: no evidence either way, so "budget", not "survived"."""
    import argparse

    from tests.mutation import lane
    (tmp_path / "m.py").write_text("def f(x):\n    return x + 1\n")
    covering = {f"t{i:02d}.py::test" for i in range(13)}
    seconds = {name: 0.1 for name in covering} | {"t12.py::test": 50.0}
    monkeypatch.setattr(lane, "trace", lambda *a, **k: ({2: covering}, seconds, ["t.py"], False))

    def pytest_run(repo, tests, timeout, first_failure):
        return ("timeout", "", timeout) if "t12.py::test" in tests else ("passed", "", 0.1)
    args = argparse.Namespace(max_per_module=None, tests_per_mutant=12, module_budget=100.0, timeout=600.0,
                              max_test_files=8)
    rows = lane.run_module(tmp_path, "m.py", args, pytest_run, {})["mutants"]
    assert rows and all(r["status"] == "budget" and r["tests"] == 13 for r in rows), rows


@pytest.mark.parametrize("first_cut, want", [
    pytest.param(False, "survived", id="first-trace-complete"),
    pytest.param(True, "budget", id="first-trace-cut"),
])
def test_a_survivor_of_a_cut_first_trace_is_budget(tmp_path, monkeypatch, first_cut, want):
    """The trace of the first candidate files reaches its time limit after a passing test ran line 2,
    and the next files' trace finds no other: a test of the first files the trace never reached
    may kill the mutants, so they end "budget" and are not counted; with a complete trace they
    survive."""
    import argparse

    from tests.mutation import lane
    (tmp_path / "m.py").write_text("def f(x):\n    return x + 1\n")
    monkeypatch.setattr(lane, "trace", lambda *a, **k: ({2: {"a.py::t"}}, {}, ["a.py"], first_cut))
    monkeypatch.setattr(lane, "candidate_tests", lambda repo, module, limit: ["a.py", "b.py"])
    monkeypatch.setattr(lane, "_trace_files", lambda repo, module, files, timeout, run: ({}, {}, False))
    args = argparse.Namespace(max_per_module=None, tests_per_mutant=12, module_budget=100.0, timeout=60.0,
                              max_test_files=1)
    result = lane.run_module(tmp_path, "m.py", args, lambda *a, **k: ("passed", "", 0.1), {})
    assert result["mutants"] and {r["status"] for r in result["mutants"]} == {want}
    assert result["counted"] == (0 if first_cut else len(result["mutants"]))


@pytest.mark.parametrize("budget, traced, untraced", [
    pytest.param(100.0, [["b.py"], ["c.py"]], 0, id="every-candidate-traced"),
    pytest.param(10.0, [], 2, id="budget-ended-first"),       # 10 s: no time left for a next batch
])
def test_a_survivor_says_how_many_candidate_files_were_left_untraced(tmp_path, monkeypatch, budget, traced,
                                                                      untraced):
    """A survivor of every traced file is a gap in the tests only when no candidate file is left: the
    report, and the combined table read from it, say how many the budget left untraced."""
    import argparse
    import json

    from tests.mutation import lane
    result, got = _run_past_the_first_file(tmp_path, monkeypatch, ["a.py", "b.py", "c.py"], lambda files: {},
                                           lambda *a, **k: ("passed", "", 0.1), budget=budget)
    assert got == traced and result["candidate_files"] == 3
    rows = result["mutants"]
    assert rows and all(r["status"] == "survived" and r["untraced_files"] == untraced for r in rows)
    monkeypatch.setattr(lane, "REPORTS", tmp_path / "reports")
    text = lane.write_report([result], argparse.Namespace(), "2026-01-01-000000").read_text()
    assert f"| {1 + len(traced)} / 3 |" in text
    assert ("2 candidate files untraced" in text) == bool(untraced) and "untraced" not in lane.untraced({})
    (tmp_path / "mixers").mkdir()
    (tmp_path / "mixers" / "m.py").write_text((tmp_path / "m.py").read_text())
    result["module"] = "mixers/m.py"
    report = tmp_path / "mutants-2026-01-01-000000.json"
    report.write_text(json.dumps({"modules": [result]}, default=str))
    row, = lane.combine([report], tmp_path, {})
    assert row["survivors"] and len(row["untraced"]) == (len(row["survivors"]) if untraced else 0)
    text = lane.write_combined([row], "2026-01-01-000000").read_text()
    assert text.count("; 2 candidate files untraced") == (len(row["survivors"]) if untraced else 0)
    n = len(row["survivors"])
    assert f"{n} survivors, {n if untraced else 0} of them with candidate test files" in text


@pytest.mark.parametrize("modules, want", [
    pytest.param(None, {"mixers/m.py"}, id="every-module-with-an-open-mutant"),
    pytest.param(["mixers/m.py", "mixers/other.py"], {"mixers/m.py"}, id="of-the-named-modules"),
    pytest.param(["mixers/other.py"], set(), id="named-module-without-open-mutants"),
])
def test_rerun_open_runs_just_the_survivors_and_the_never_measured(tmp_path, monkeypatch, capsys, modules, want):
    """``--rerun-open``: the dated reports leave two mutants of ``mixers/m.py`` open, a survivor and one
    the budget cut in every run (a third was killed); ``mixers/other.py``'s one mutant was killed
    and later cut, which leaves it measured. The lane runs the two open ones alone, and the new
    report's kills close them."""
    import argparse
    import json
    import shutil

    from tests.mutation import lane
    (tmp_path / "mixers").mkdir()
    for name in ("m.py", "other.py"):
        (tmp_path / "mixers" / name).write_text(SOURCE)
    first, second, third = mutants_of(tmp_path, "mixers/m.py")[:3]
    other = mutants_of(tmp_path, "mixers/other.py")[0]
    reports = tmp_path / "reports"
    reports.mkdir()
    runs = {"2026-01-01-000000": {"mixers/m.py": [(first, "survived"), (second, "killed"), (third, "budget")],
                                  "mixers/other.py": [(other, "killed")]},
            "2026-01-02-000000": {"mixers/m.py": [(third, "budget")], "mixers/other.py": [(other, "budget")]}}
    for name, rows in runs.items():
        (reports / f"mutants-{name}.json").write_text(json.dumps({"modules": [
            {"module": module, "mutants": [{"fingerprint": m.fingerprint, "status": status} for m, status in got]}
            for module, got in rows.items()]}))
    monkeypatch.setattr(lane, "ROOT", tmp_path)
    monkeypatch.setattr(lane, "REPORTS", reports)
    assert lane.open_mutants() == {"mixers/m.py": {first.fingerprint, third.fingerprint}}
    text = lane.write_combined(lane.combine(sorted(reports.glob("mutants-*.json")), tmp_path),
                               "2026-01-03-000000").read_text()
    assert "1 mutants the budget cut and no run measured" in text
    assert text.split("## Cut by the budget, never measured")[1].strip().splitlines()[1:] == ["",
        f"- `{third.id} {third.fingerprint}`"]
    monkeypatch.setattr(lane, "candidate_tests", lambda repo, module, limit: ["t.py"])
    monkeypatch.setattr(lane, "trace", lambda repo, module, *a, **k: (
        {line: {"t.py::t"} for line in range(1, 40)}, {}, ["t.py"], False))
    ran = []

    def pytest_run(repo, tests, timeout, first_failure):
        ran.append((repo / "mixers" / "m.py").read_text())
        return "failed", "FAILED t.py::t - boom", 0.1

    def scratch_copy():              # the lane removes the copy's parent when it ends
        shutil.copytree(tmp_path / "mixers", tmp_path / "scratch" / "repo" / "mixers")
        return tmp_path / "scratch" / "repo"
    args = argparse.Namespace(rerun_open=True, module=modules, all=False, changed_since=None,
                              max_per_module=40, tests_per_mutant=12, module_budget=100.0, budget=100.0,
                              timeout=60.0, max_test_files=8)
    assert lane.main(args, scratch_copy=scratch_copy, check_imports=lambda repo: None, preload=lambda: None,
                     pytest_run=pytest_run) == 0
    if not want:
        assert ran == [] and "no open mutant" in capsys.readouterr().out
        return
    assert ran == [first.apply(SOURCE), third.apply(SOURCE)]
    assert lane.open_mutants() == {}
