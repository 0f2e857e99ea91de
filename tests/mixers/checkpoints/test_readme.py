"""Every code block of docs/checkpoints.md runs as written."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[3] / "docs" / "checkpoints.md"


def _blocks():
    text = README.read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


EXAMPLES = 4       # Mamba2 from a state dict, fla modules, enable_packing with Trainer, LFM2


def test_the_page_has_its_examples():
    assert len(_blocks()) == EXAMPLES


@pytest.mark.parametrize("index", [pytest.param(i, id=f"block{i}") for i in range(EXAMPLES)])
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
