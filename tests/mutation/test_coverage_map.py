"""The coverage map reaches spawned processes: a child interpreter started under the recorder traces
the target file and its lines count for the test that started it and for the tests sharing that
test's module fixture (not for the others); without the hook they are missing (negative control);
a rank's case labels narrow a test to the cases its id names."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.mutation.coverage_map import read_map

ROOT = Path(__file__).resolve().parents[2]

TINY = '''\
def work(n):
    total = 0
    for i in range(n):
        total += i
    return total
'''

INNER = '''\
import multiprocessing

import pytest

import tiny


def spawn(n):
    child = multiprocessing.get_context("spawn").Process(target=tiny.work, args=(n,))
    child.start()
    child.join()
    assert child.exitcode == 0


@pytest.fixture(scope="module")
def spawned():
    spawn(3)
    return "ran"


def test_starts_the_child(spawned):
    assert spawned == "ran"


def test_reads_what_the_child_left(spawned):
    assert spawned == "ran"


def test_in_process_only():
    assert tiny.work(0) == 0


def test_spawns_its_own():
    spawn(2)
'''

RUNNER = '''\
import sys
from pathlib import Path

import pytest

from tests.mutation.coverage_map import LineRecorder

tmp = Path(sys.argv[1])
children = tmp / "children" if sys.argv[2] == "hook" else None
recorder = LineRecorder([tmp / "tiny.py"], tmp / "lines.jsonl", children=children)
recorder.pytest_configure = lambda config: recorder.start()
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "--rootdir", str(tmp), str(tmp / "test_inner.py")],
                     plugins=[recorder]))
'''

LOOP_BODY = 4           # `total += i`: only a child with n > 1 runs it; the parent's work(0) does not


def _run(runner: str, tmp_path: Path, mode: str, timeout: float) -> None:
    """``runner`` (a recorder around a pytest run of ``tmp_path``) in a fresh interpreter, which must pass."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path)]), OMP_NUM_THREADS="1")
    env.pop("PYTEST_ADDOPTS", None)
    run = subprocess.run([sys.executable, "-c", runner, str(tmp_path), mode], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stdout + run.stderr


def _traced(tmp_path: Path, mode: str) -> dict:
    (tmp_path / "tiny.py").write_text(TINY)
    (tmp_path / "test_inner.py").write_text(INNER)
    _run(RUNNER, tmp_path, mode, timeout=60)
    by_line, _ = read_map(tmp_path / "lines.jsonl", tmp_path, tmp_path / "children")
    return by_line.get("tiny.py", {})


def test_a_spawned_childs_lines_count_for_its_test_and_the_tests_sharing_its_fixture(tmp_path):
    lines = _traced(tmp_path, "hook")
    node = "test_inner.py::"
    assert lines[LOOP_BODY] == {node + "test_starts_the_child", node + "test_reads_what_the_child_left",
                                node + "test_spawns_its_own"}
    assert node + "test_in_process_only" in lines[2]                     # the parent's own lines, as before
    assert len(list((tmp_path / "children").glob("*.jsonl"))) == 2      # one log per child


def test_without_the_hook_the_childs_lines_are_missing(tmp_path):
    lines = _traced(tmp_path, "plain")
    assert LOOP_BODY not in lines
    assert lines[2] == {"test_inner.py::test_in_process_only"}


def _write(path: Path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("test, want", [
    pytest.param("t.py::test_eq[rg_lru-spanning-p2]", {1, 5}, id="names-its-case"),
    pytest.param("t.py::test_eq[ssd-spanning-p2]", {1}, id="its-case-ran-no-line"),
    pytest.param("t.py::test_nan[rg_lru]", {1, 5, 6}, id="names-no-case-gets-all"),
    pytest.param("t.py::test_other", set(), id="no-shared-fixture"),
])
def test_case_labels_narrow_a_test_to_the_cases_its_id_names(tmp_path, test, want):
    f = str(tmp_path / "m.py")
    shared = ["t.py:1:ranks"]
    _write(tmp_path / "lines.jsonl", [
        {"node": "<import>", "seconds": 0, "passed": True, "lines": {}},
        {"node": "t.py::test_eq[rg_lru-spanning-p2]", "seconds": 30.0, "passed": True, "lines": {}, "shares": shared},
        {"node": "t.py::test_eq[ssd-spanning-p2]", "seconds": 0.1, "passed": True, "lines": {}, "shares": shared},
        {"node": "t.py::test_nan[rg_lru]", "seconds": 0.1, "passed": True, "lines": {}, "shares": shared},
        {"node": "t.py::test_other", "seconds": 0.1, "passed": True, "lines": {}},
    ])
    (tmp_path / "children").mkdir()
    _write(tmp_path / "children" / "7.jsonl", [
        {"node": "t.py::test_eq[rg_lru-spanning-p2]"}, [None, f, 1], {"case": "rg_lru-spanning-p2"},
        ["rg_lru-spanning-p2", f, 5], {"case": "ssd-spanning-p2"}, {"case": "conv-spanning-p2"},
        ["conv-spanning-p2", f, 6]])
    with (tmp_path / "children" / "7.jsonl").open("a") as fh:
        fh.write('["conv-spa')                                                # cut short by a kill
    by_line, seconds = read_map(tmp_path / "lines.jsonl", tmp_path, tmp_path / "children")
    assert {line for line, nodes in by_line.get("m.py", {}).items() if test in nodes} == want
    assert seconds[test] == (30.0 if want else 0.1)         # run alone, a test of the group starts the ranks


COMPILED = '''\
import torch


def step(x):
    if torch.compiler.is_compiling():
        return x * 2
    return x + x
'''

COMPILES = '''\
import torch

import compiled


def test_compiles():
    torch._dynamo.reset()
    assert torch.equal(torch.compile(compiled.step, backend="eager")(torch.ones(3)), torch.full((3,), 2.0))


def test_eager():
    assert torch.equal(compiled.step(torch.ones(3)), torch.full((3,), 2.0))
'''

COMPILE_RUNNER = '''\
import sys
from pathlib import Path

import pytest

from tests.mutation.coverage_map import LineRecorder

tmp = Path(sys.argv[1])
recorder = LineRecorder([tmp / "compiled.py"], tmp / "lines.jsonl")
if sys.argv[2] == "plain":
    recorder._dynamo_lines = lambda: None
recorder.pytest_configure = lambda config: recorder.start()
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "--rootdir", str(tmp), str(tmp / "test_compiles.py")],
                     plugins=[recorder]))
'''


@pytest.mark.parametrize("mode, want", [
    pytest.param("dynamo", {"test_compiles.py::test_compiles"}, id="recorded"),
    pytest.param("plain", None, id="without-the-wrapper-missing"),
])
def test_lines_only_torch_compile_traces_count_for_the_compiling_test(tmp_path, mode, want):
    pytest.importorskip("torch")
    (tmp_path / "compiled.py").write_text(COMPILED)
    (tmp_path / "test_compiles.py").write_text(COMPILES)
    _run(COMPILE_RUNNER, tmp_path, mode, timeout=120)
    lines = read_map(tmp_path / "lines.jsonl", tmp_path)[0]["compiled.py"]
    assert lines.get(6) == want                                              # `return x * 2`: compiled only
    assert lines[7] == {"test_compiles.py::test_eager"}                     # the eager branch, as before
