"""Every code block of docs/checkpoints.md runs as written."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[3] / "docs" / "checkpoints.md"


def _blocks():
    text = README.read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_the_page_has_its_three_examples():
    assert len(_blocks()) == 3


@pytest.mark.parametrize("index", [pytest.param(i, id=f"block{i}") for i in range(3)])
def test_readme_block_runs(index, tmp_path, monkeypatch):
    code = _blocks()[index]
    for module in re.findall(r"^from (\w+)", code, flags=re.M):
        pytest.importorskip(module)
    if "Trainer" in code:
        pytest.importorskip("accelerate")
        import transformers
        transformers.logging.set_verbosity_error()
    monkeypatch.chdir(tmp_path)
    exec(compile(code.replace("/tmp/", f"{tmp_path}/"), f"README block {index}", "exec"), {})
