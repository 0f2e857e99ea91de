"""The environment for a test's child interpreter (``python -m ...``, ``torchrun``)."""

from __future__ import annotations

import os
from pathlib import Path


def child_env(root: Path, **extra: str) -> dict[str, str]:
    """``os.environ`` with ``root`` first on ``PYTHONPATH``, the inherited entries kept after it (a
    ``sitecustomize`` hook there, such as the mutation lane's child tracer, still loads), and ``extra``."""
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}
