"""Real documents every Python installation has: the docstrings of the standard library, as bytes."""

from __future__ import annotations

import ast
import functools
import sysconfig
from pathlib import Path

_SKIP = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "turtledemo", "ensurepip"}


@functools.lru_cache(maxsize=1)
def stdlib_files() -> tuple[Path, ...]:
    """The standard library's ``.py`` files, sorted (deterministic), tests and vendored code left out
    (walked once per process: the walk costs about a second)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return tuple(sorted(p for p in root.rglob("*.py") if not _SKIP & set(p.relative_to(root).parts)))


def docstrings(source: str) -> list[str]:
    """Module, class and function docstrings of one file (none if it does not parse)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    found = []
    for node in nodes:
        text = ast.get_docstring(node)
        if text:
            found.append(text)
    return found


def load_documents(count: int, *, min_bytes: int = 24, max_bytes: int = 1024) -> list[bytes]:
    """Up to ``count`` UTF-8 documents of ``min_bytes`` to ``max_bytes`` (longer ones are cut)."""
    documents: list[bytes] = []
    for path in stdlib_files():
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for text in docstrings(source):
            data = text.encode("utf-8")
            if len(data) >= min_bytes:
                documents.append(data[:max_bytes])
                if len(documents) >= count:
                    return documents
    if not documents:
        raise RuntimeError(f"found no docstrings under {sysconfig.get_paths()['stdlib']}")
    return documents
