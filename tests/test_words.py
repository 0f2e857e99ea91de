"""The repository speaks of the product, not of how or when it was written: no run histories,
tracker numbers or documents that are not in the repository. Every tracked text file is read
(binary files are skipped); each phrase below is a pattern that has no place in product text."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PHRASES = {
    "a tracker number": r"\bissues? #?\d+",
    "a run history": r"\b(previous|earlier|later|last) (run|stop|session)s?\b",
    "the writing session": r"\b(this|that|the previous) (stop|session)\b|\bstop's\b",
    "a run count": r"\bmet \d+, \d+ and \d+\b",
    "an outside document": r"DESIGN\.md|(?-i:\bDESIGN\b)|\bseed semantics\b|\bthe seed document",
    "a tracker": r"\btracker\b",
}
PATTERN = re.compile("|".join(f"(?P<p{i}>{p})" for i, p in enumerate(PHRASES.values())), flags=re.I)
THIS_FILE = Path(__file__).resolve().relative_to(ROOT).as_posix()


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    files = []
    for name in filter(None, names.decode().split("\0")):
        path = ROOT / name
        if name == THIS_FILE or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue                                   # binary (PNG, archives)
        files.append(path)
    return files


def hits(text: str) -> list[tuple[int, str, str]]:
    """``[(line, what, matched text)]`` of every phrase in ``text``."""
    found = []
    for match in PATTERN.finditer(text):
        what = list(PHRASES)[int(match.lastgroup[1:])]
        found.append((text.count("\n", 0, match.start()) + 1, what, match.group(0)))
    return found


@pytest.mark.parametrize("text, expected", [
    pytest.param("fixed in issue 12 of the list", ["a tracker number"], id="tracker-number"),
    pytest.param("In an earlier run on the same machine", ["a run history"], id="earlier-run"),
    pytest.param("the previous stop's three", ["the writing session"], id="previous-stop"),
    pytest.param("two earlier runs met it", ["a run history"], id="earlier-runs"),
    pytest.param("on this stop's final code: 46 met", ["the writing session"], id="this-stop"),
    pytest.param("the numbers of DESIGN.md", ["an outside document"], id="design-doc"),
    pytest.param("the length grid of DESIGN; a good design", ["an outside document"], id="design-name"),
    pytest.param("follows the seed semantics", ["an outside document"], id="seed"),
    pytest.param("met 43, 44 and 45", ["a run count"], id="run-count"),
    pytest.param("the issue tracker", ["a tracker"], id="tracker"),
    pytest.param("a document's final state; the run of padding; the epoch's last round", [], id="product-words"),
])
def test_phrases_are_found(text, expected):
    assert [what for _, what, _ in hits(text)] == expected


def test_the_file_list_holds_the_readme_and_code_but_no_binary():
    names = {p.relative_to(ROOT).as_posix() for p in tracked_text_files()}
    assert {"README.md", "ssm_pack/support/requirements.py", "tests/test_readme.py"} <= names
    assert THIS_FILE not in names and "docs/demo.png" not in names


def test_no_tracked_file_speaks_of_how_it_was_written():
    found = [f"{path.relative_to(ROOT)}:{line}: {what}: {text!r}"
             for path in tracked_text_files() for line, what, text in hits(path.read_text(errors="replace"))]
    assert not found, "\n".join(found)
