"""README and docs run as written: every fenced ```python block of README.md and docs/*.md, each
in a fresh namespace, and the docs' support matrix is the one ``python -m ssm_pack --matrix``
generates from the requirements table.

Blocks are read from the files when the tests are collected, so a block added by anyone (or a
new page) is covered. A block that imports an optional package that is not installed (transformers, fla, ...)
is skipped, naming it; shell and output blocks are not run. A block whose first line says how to
launch it (``# torchrun --nproc-per-node N file.py``, a distributed script) is saved under that
name and launched exactly so.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.child_env import child_env

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
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


def _page_blocks(page: Path) -> list[tuple[str, int, str]]:
    name = page.relative_to(ROOT).as_posix()
    return [(f"{name}:{block_id}", line, code) for block_id, line, code in python_blocks(page.read_text())]


BLOCKS = [block for page in PAGES for block in _page_blocks(page)]


@pytest.mark.parametrize("page", [pytest.param(p, id=p.name) for p in PAGES])
def test_the_fence_reader_finds_every_python_block(page):
    opened = len(re.findall(r"^```python\s*$", page.read_text(), flags=re.M))
    assert len(_page_blocks(page)) == opened


def test_blocks_are_collected_from_readme_and_every_docs_page():
    pages = {name.split(":")[0] for name, _, _ in BLOCKS}
    assert "README.md" in pages and len(BLOCKS) >= 10
    assert {"docs/ops.md", "docs/packing.md", "docs/inference.md"} <= pages


def test_the_fence_reader_on_a_sample():
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
        pytest.skip(f"block {name} (line {line}) needs {', '.join(missing)}, not installed here")
    if "transformers" in code:
        import transformers
        transformers.logging.set_verbosity_error()
    monkeypatch.chdir(tmp_path)                       # files a block writes land in a fresh folder
    code = code.replace("/tmp/", f"{tmp_path}/")
    launch = re.match(r"# torchrun --nproc-per-node (\d+) (\S+\.py)\n", code)
    if launch:
        _torchrun(code, int(launch.group(1)), tmp_path / launch.group(2))
        return
    exec(compile(code, f"{name} (line {line})", "exec"), {"__name__": "__readme__"})


def _torchrun(code: str, procs: int, script: Path) -> None:
    """Launch a docs script the way its first line says, on a free local port."""
    script.write_text(code)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = child_env(ROOT, OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={procs}",
                          f"--master-port={port}", "--master-addr=127.0.0.1", str(script)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]


MATRIX = re.compile(r"<!-- support-matrix: generated by `python -m ssm_pack --matrix` -->\n"
                    r"(.*?)<!-- /support-matrix -->", flags=re.S)


def test_docs_support_matrix_is_the_generated_one():
    """One table of minimums: the matrix in docs/gpu.md is what ``python -m ssm_pack --matrix`` prints."""
    from ssm_pack.__main__ import support_matrix

    found = MATRIX.search((ROOT / "docs" / "gpu.md").read_text())
    assert found, "docs/gpu.md lacks the generated support matrix between its markers"
    assert found.group(1) == support_matrix(), "regenerate it: python -m ssm_pack --matrix"


def test_readme_stays_short():
    """README is the ten-minute read; the detail lives in docs/ (a page per topic)."""
    lines = README.read_text().count("\n")
    assert lines <= 360, f"README.md has {lines} lines: move the detail into a docs/ page"


def test_readme_links_only_pages_that_exist():
    links = re.findall(r"\]\(((?:docs/)?[\w./-]+\.(?:md|png))(?:#[\w-]+)?\)", README.read_text())
    assert links and all((ROOT / link).exists() for link in links), [x for x in links if not (ROOT / x).exists()]


def layout_paths(text: str) -> list[str]:
    """The paths README's Layout block names: the first column of each line, top-level folders
    unindented, the others relative to the folder above (a ``<op>`` placeholder: the folder holding it)."""
    block = text.split("## Layout", 1)[1].split("```")[1]
    top, paths = "", []
    for line in block.splitlines():
        if not line.strip() or line.startswith("    "):                 # a description's second line
            continue
        for token in re.split(r"\s{2,}", line.strip())[0].split(", "):
            path = token if not line.startswith(" ") else top + token
            top = path if not line.startswith(" ") else top
            paths.append(path.split("<")[0])
    return paths


def test_the_layout_names_only_paths_that_exist_and_every_package_room():
    paths = layout_paths(README.read_text())
    assert [p for p in paths if not (ROOT / p).exists()] == []
    rooms = sorted(f"{pkg}/{d.name}/" for pkg in ("ssm_pack", "mixers") for d in (ROOT / pkg).iterdir()
                   if (d / "__init__.py").is_file())
    assert [room for room in rooms if room not in paths] == [], "README's Layout misses a package"


def test_the_layout_reader_sees_a_missing_path():
    """Negative control."""
    text = "## Layout\n\n```\nmixers/          x\n  nowhere.py, ops/<op>/     y\n        more of y\n```\n"
    assert layout_paths(text) == ["mixers/", "mixers/nowhere.py", "mixers/ops/"]
    assert not (ROOT / "mixers/nowhere.py").exists()
