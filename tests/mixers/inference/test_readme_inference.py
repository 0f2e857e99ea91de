"""Every code block of docs/inference.md's first section runs as written (one namespace, in order)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[3] / "docs" / "inference.md"


def test_readme_inference_blocks_run(capsys):
    text = README.read_text()
    start = text.index("# Inference")
    section = text[start:text.index("\n## ", start + 1)]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 3
    namespace = {}
    for i, code in enumerate(blocks):
        exec(compile(code, f"README Inference block {i}", "exec"), namespace)
    assert len(namespace["texts"]) == 3 and all(len(t) == 8 for t in namespace["texts"])
    assert namespace["cache"].table.lengths.tolist() == [0, 6, 0, 8]
    assert "tensor([0, 6, 0, 8])" in capsys.readouterr().out
