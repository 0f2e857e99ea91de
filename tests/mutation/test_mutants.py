"""The mutation check stays runnable: every planted edit still finds its text exactly once in one of
its candidate files, and every test file it names exists (a move or a rename that changed the
text would otherwise turn the mutant "stale" only when the check is run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.mutation.mutants import MUTANTS

ROOT = Path(__file__).resolve().parents[2]


def _applies(edit) -> bool:
    files = (edit.file,) if isinstance(edit.file, str) else edit.file
    return any((ROOT / f).is_file() and (ROOT / f).read_text().count(edit.old) == 1 for f in files)


@pytest.mark.parametrize("mutant", [pytest.param(m, id=m.name) for m in MUTANTS])
def test_every_mutant_still_applies(mutant):
    assert all(_applies(edit) for edit in mutant.edits), "the planted text moved: update tests/mutation/mutants.py"
    assert all((ROOT / test.split("::")[0]).is_file() for test in mutant.tests)


def test_a_stale_edit_is_seen():
    """Negative control: an edit whose text is nowhere does not apply."""
    edit = type(MUTANTS[0].edits[0])(MUTANTS[0].edits[0].file, "text that is in no file \u2603", "x")
    assert not _applies(edit)
