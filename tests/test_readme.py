"""README runs as written: every fenced ```python block, each in a fresh namespace, and the
support matrix quotes the minimums of the one requirements table.

Blocks are read from README.md when the tests are collected, so a block added by anyone is
covered. A block that imports an optional package that is not installed (transformers, fla, ...)
is skipped, naming it; shell and output blocks are not run.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest
from packaging.version import Version

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", flags=re.S | re.M)
# what a block needs beyond its imports: (text in the block, module it then needs)
HIDDEN_NEEDS = (("Trainer(", "accelerate"),)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:40] or "top"


def python_blocks(text: str | None = None) -> list[tuple[str, int, str]]:
    """``[(id, line, code)]`` of every ```python block; ids are the section heading plus an index."""
    text = README.read_text() if text is None else text
    fences = list(FENCE.finditer(text))
    prose = FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)   # no "# comment" read as a heading
    blocks, seen = [], {}
    for match in fences:
        if match.group(1) != "python":
            continue
        line = text.count("\n", 0, match.start()) + 1
        headings = re.findall(r"^#+ (.+)$", prose[:match.start()], flags=re.M)
        section = _slug(headings[-1] if headings else "")
        seen[section] = seen.get(section, -1) + 1
        blocks.append((f"{section}-{seen[section]}", line, match.group(2)))
    return blocks


def missing_modules(code: str) -> list[str]:
    """Top-level modules the block imports (or needs) that are not installed here."""
    wanted = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            wanted.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            wanted.add(node.module.split(".")[0])
    wanted.update(module for marker, module in HIDDEN_NEEDS if marker in code)
    return sorted(m for m in wanted if importlib.util.find_spec(m) is None)


BLOCKS = python_blocks()


def test_the_fence_reader_finds_every_python_block():
    text = README.read_text()
    opened = len(re.findall(r"^```python\s*$", text, flags=re.M))
    assert len(BLOCKS) == opened >= 10
    sample = ("# A\n```python\nx = 1\n```\n\n```bash\nls\n```\n## B\n```python\ny = 2\n```\n"
              "```python\n# not a heading\nz\n```\n")
    assert [(i, code) for i, _, code in python_blocks(sample)] == [("a-0", "x = 1\n"), ("b-0", "y = 2\n"),
                                                                  ("b-1", "# not a heading\nz\n")]


def test_a_block_needing_a_missing_package_is_skipped_not_failed():
    code = "import torch\nimport surely_not_installed.sub\nfrom mixers import HybridLM\nfrom . import x\n"
    assert missing_modules(code) == ["surely_not_installed"]
    assert missing_modules("from ssm_pack import plan_packs\n") == []
    needs = missing_modules("Trainer(model=m)\n")
    assert needs == ([] if importlib.util.find_spec("accelerate") else ["accelerate"])


@pytest.mark.parametrize("block", [pytest.param(b, id=b[0]) for b in BLOCKS])
def test_readme_python_block_runs_as_written(block, tmp_path, monkeypatch):
    name, line, code = block
    missing = missing_modules(code)
    if missing:
        pytest.skip(f"README block {name} (line {line}) needs {', '.join(missing)}, not installed here")
    if "transformers" in code:
        import transformers
        transformers.logging.set_verbosity_error()
    monkeypatch.chdir(tmp_path)                       # files a block writes land in a fresh folder
    code = code.replace("/tmp/", f"{tmp_path}/")
    exec(compile(code, f"README.md block {name} (line {line})", "exec"), {"__name__": "__readme__"})


def test_support_matrix_quotes_the_requirements_table():
    """One table of minimums: every version README's support matrix names is one the table asks for."""
    from ssm_pack import kernels

    text = README.read_text()
    start = text.index("## Support matrix")
    section = text[start:text.index("\n## ", start + 1)]
    quoted = {Version(v) for v in re.findall(r">= ?(\d+\.\d+(?:\.\d+)?(?:\.post\d+)?)", section)}
    table = {Version(f.minimum) for f in kernels.FEATURES.values()}
    table |= {Version(minimum) for k in kernels.KERNELS.values() for _, minimum in k.packages}
    assert quoted and quoted <= table, sorted(str(v) for v in quoted - table)
