"""The product's tolerance table may be stricter than the tests' own numbers, never looser,
and no test reads the product's table (it would loosen with it)."""

import ast
from pathlib import Path

import pytest
import torch

from ssm_pack import testing
from tests.support.tolerances import TOLERANCES

TESTS = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("dtype", [pytest.param(d, id=str(d).removeprefix("torch.")) for d in TOLERANCES])
def test_product_table_is_not_looser_than_the_tests(dtype):
    assert dtype in testing.TOLERANCES, f"ssm_pack.testing.TOLERANCES has no entry for {dtype}"
    for what, product, ours in zip(("forward", "gradient"), testing.TOLERANCES[dtype], TOLERANCES[dtype]):
        assert product <= ours, f"{dtype} {what} tolerance loosened in the product: {product:g} > {ours:g}"


def test_tests_hold_the_design_numbers():
    assert TOLERANCES[torch.float64] == (1e-10, 1e-10) and TOLERANCES[torch.float32] == (1e-5, 1e-5)
    assert TOLERANCES[torch.bfloat16] == (5e-3, 1e-2)


def _reads_product_tolerances(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "ssm_pack.testing":
            if any(alias.name == "TOLERANCES" for alias in node.names):
                return True
        if isinstance(node, ast.Attribute) and node.attr == "TOLERANCES":
            return True
    return False


def test_no_test_reads_the_product_table():
    here = Path(__file__).resolve()
    offenders = [str(path.relative_to(TESTS)) for path in sorted(TESTS.rglob("*.py"))
                 if path.resolve() != here and _reads_product_tolerances(ast.parse(path.read_text()))]
    assert offenders == [], f"these tests read ssm_pack.testing.TOLERANCES; use tests.support.tolerances: {offenders}"


def test_the_scan_sees_both_spellings():
    assert _reads_product_tolerances(ast.parse("from ssm_pack.testing import TOLERANCES"))
    assert _reads_product_tolerances(ast.parse("import ssm_pack.testing as t\nx = t.TOLERANCES"))
    assert not _reads_product_tolerances(ast.parse("from tests.support.tolerances import TOLERANCES"))
