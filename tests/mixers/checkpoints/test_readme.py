"""Every code block of README's "Bring your checkpoint" section runs as written."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[3] / "README.md"


def _blocks():
    text = README.read_text()
    start = text.index("## Bring your checkpoint")
    section = text[start:text.index("\n## ", start + 1)]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_the_section_has_its_three_examples():
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
