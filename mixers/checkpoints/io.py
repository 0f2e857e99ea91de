"""Reading checkpoint files without running code from them, and picking one layer's entries.

``.safetensors`` files go through safetensors; anything else through
``torch.load(..., weights_only=True)``, which refuses pickled code. A directory is read shard by
shard (``*.safetensors``, else ``*.bin`` / ``*.pt``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch

_TORCH_SUFFIXES = (".bin", ".pt", ".pth")


def _read_file(path: Path, device: str) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError as err:
            raise ImportError(f"reading {path} needs safetensors: pip install safetensors") from err
        return load_file(str(path), device=device)
    state = torch.load(path, map_location=device, weights_only=True)
    if not isinstance(state, Mapping):
        raise ValueError(f"{path} holds a {type(state).__name__}, not a state dict")
    if "state_dict" in state and isinstance(state["state_dict"], Mapping):   # Lightning-style wrapper
        state = state["state_dict"]
    return dict(state)


def load_checkpoint(path, *, device: str = "cpu") -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint file or directory, never unpickling code.

    ``path``: a ``.safetensors`` file, a ``torch.save`` file (read with ``weights_only=True``) or
    a directory of shards. A key found in two shards raises ``ValueError``.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"path={str(path)!r} does not exist")
    if path.is_file():
        return _read_file(path, device)
    files = sorted(path.glob("*.safetensors")) or sorted(p for p in path.iterdir() if p.suffix in _TORCH_SUFFIXES)
    if not files:
        raise ValueError(f"path={str(path)!r} is a directory with no *.safetensors, *.bin or *.pt files")
    out: dict[str, torch.Tensor] = {}
    for file in files:
        part = _read_file(file, device)
        twice = sorted(set(part) & set(out))
        if twice:
            raise ValueError(f"{file.name} repeats keys of an earlier shard: {twice[:5]}")
        out.update(part)
    return out


def select(state_dict: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The entries under ``prefix`` (e.g. ``"backbone.layers.3.mixer."``), with the prefix removed."""
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
    out = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
    if not out:
        sample = sorted(state_dict)[:5]
        raise ValueError(f"no key starts with prefix={prefix!r}; the first keys are {sample}")
    return out
