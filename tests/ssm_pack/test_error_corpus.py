"""Every bad input of the fixed corpus is refused clearly, and docs/errors.md lists exactly those cases."""

import re
from pathlib import Path

import pytest

from tests.ssm_pack.contracts import outcome
from tests.ssm_pack.error_corpus import CASES, main

DOCS = Path(__file__).resolve().parents[2] / "docs" / "errors.md"


@pytest.mark.parametrize("case", [pytest.param(case, id=case.id) for case in CASES])
def test_each_bad_input_is_refused_clearly(case):
    assert case.verdict() == "clear"


def test_the_contract_page_lists_every_case():
    listed = re.findall(r"`case:([a-z0-9-]+)`", DOCS.read_text())
    assert sorted(listed) == sorted(case.id for case in CASES)


@pytest.mark.parametrize("call,names,oracle,want", [
    pytest.param(lambda: 1, ("x",), None, "silent", id="accepted-where-refused"),
    pytest.param(lambda: 1, ("x",), lambda r: r == 2, "silent", id="wrong-result"),
    pytest.param(lambda: 1, ("x",), lambda r: r == 1, "ok", id="right-result"),
    pytest.param(lambda: int("x"), ("nothing",), None, "obscure", id="message-without-the-name"),
    pytest.param(lambda: [][1], ("x",), None, "obscure", id="index-error"),
    pytest.param(lambda: int("x"), ("invalid literal",), None, "clear", id="clear"),
])
def test_the_classifier_tells_the_verdicts_apart(call, names, oracle, want):
    """Negative controls: a classifier that called everything clear would pass the test above."""
    assert outcome(call, names, oracle) == want


def test_a_hang_is_reported(monkeypatch):
    def forever():
        while True:
            pass
    assert outcome(forever, ("x",), seconds=1) == "hang"


def test_the_report_command_writes_a_dated_file(tmp_path):
    path = main(["--out", str(tmp_path), "--examples", "3"])
    text = path.read_text()
    assert path.name.startswith("error-corpus-") and "| silent | 0 | 0 | 0 |" in text and "| hang | 0 | 0 | 0 |" in text
