"""The pure-PyTorch peers our references are measured against, loaded without their CUDA parts.

Each loader returns the function, or ``None`` with the reason in :data:`MISSING` (a benchmark
prints the reason instead of a row; nothing here is required). ``pip install -e ".[bench]"``
installs fla and transformers; mamba-ssm needs the ``cuda`` extra's build flags (docs/gpu.md,
"Installing the kernels").

* fla's ``naive_chunk_gated_delta_rule`` / ``naive_chunk_kda`` (fla imports on CPU when triton
  is installed);
* transformers' ``torch_chunk_gated_delta_rule`` (Qwen3-Next's CPU path), unwrapped from the
  decorator that routes it to fla's Triton kernel when fla imports;
* mamba-ssm's ``ssd_minimal_discrete`` (the paper's listing). ``mamba_ssm/__init__`` imports its
  CUDA extension, so the one file is read and run on its own, without the Triton import it does
  not use.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from collections.abc import Callable
from pathlib import Path

MISSING: dict[str, str] = {}


def _load(name: str, module: str, attr: str) -> Callable | None:
    try:
        return getattr(importlib.import_module(module), attr)
    except Exception as e:  # noqa: BLE001 - a missing or broken peer is reported, not fatal
        MISSING[name] = f"{module}.{attr}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return None


def fla_naive_gdn() -> Callable | None:
    return _load("fla naive GDN", "fla.ops.gated_delta_rule.naive", "naive_chunk_gated_delta_rule")


def fla_naive_kda() -> Callable | None:
    return _load("fla naive KDA", "fla.ops.kda.naive", "naive_chunk_kda")


def hf_torch_gdn() -> Callable | None:
    """transformers wraps the function so that it calls fla's Triton kernel whenever fla imports
    (as good as blocking fla's import: the torch function itself, under the wrappers)."""
    fn = _load("HF torch GDN", "transformers.models.qwen3_next.modeling_qwen3_next", "torch_chunk_gated_delta_rule")
    if fn is None:
        return None
    inner = inspect.unwrap(fn)
    if not inner.__module__.startswith("transformers."):
        MISSING["HF torch GDN"] = f"unwrapping gave {inner.__module__}.{inner.__name__}, not transformers' own function"
        return None
    return inner


def mamba_ssd_minimal() -> Callable | None:
    """``ssd_minimal_discrete(X, A, B, C, block_len)`` from mamba-ssm's file, run on its own."""
    name = "mamba ssd_minimal"
    spec = importlib.util.find_spec("mamba_ssm")
    if spec is None or not spec.submodule_search_locations:
        MISSING[name] = "mamba-ssm is not installed"
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "modules" / "ssd_minimal.py"
    if not path.exists():
        MISSING[name] = f"{path} not found"
        return None
    # the one line importing the Triton kernel (unused by ssd_minimal_discrete) pulls in the CUDA extension
    source = "\n".join(line for line in path.read_text().splitlines() if "mamba_ssm.ops" not in line)
    scope: dict = {"__name__": "mamba_ssd_minimal_peer"}
    try:
        exec(compile(source, str(path), "exec"), scope)   # noqa: S102 - an installed package's own file
        return scope["ssd_minimal_discrete"]
    except Exception as e:  # noqa: BLE001
        MISSING[name] = f"{path}: {type(e).__name__}: {e}"
        return None
