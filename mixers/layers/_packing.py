"""What a mixer needs from the packing metadata, resolved once per forward.

    B = rows, T = tokens the op sees, N = documents (physical layout)

Kernels index the physical (padded) layout: the scan gets the padded boundaries (a padding run
after a document's real tokens belongs to that document's slot, so it never reaches a real
token of another document), the short convolution the int32 ``seq_idx`` built from them for
the length the op really sees, attention the positions restarting at every document.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from ssm_pack import PackedSeqParams, build_packed_seq_idx, get_cu_seqlens
from ssm_pack.convert import position_ids_from_cu_seqlens

from ..ops import _dispatch

_WARNED: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Packing:
    """``cu_seqlens [N+1]`` (int32, physical), ``seq_idx [1, T]`` (int32), ``position_ids [B, T]``."""

    cu_seqlens: torch.Tensor | None
    seq_idx: torch.Tensor | None
    position_ids: torch.Tensor
    packed: bool


def resolve(hidden_states: torch.Tensor, packed_seq_params, layer: str) -> Packing:
    """Validate ``hidden_states [B, T, D]`` against the metadata and derive the op inputs."""
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3:
        shape = tuple(hidden_states.shape) if isinstance(hidden_states, torch.Tensor) else type(hidden_states)
        raise ValueError(f"{layer}: hidden_states must be [B, T, D], got {shape}")
    batch, length, _ = hidden_states.shape
    device = hidden_states.device
    if packed_seq_params is None:
        positions = torch.arange(length, device=device).unsqueeze(0).expand(batch, length)
        return Packing(None, None, positions, False)
    if not isinstance(packed_seq_params, PackedSeqParams):
        raise TypeError(f"{layer}: packed_seq_params must be a ssm_pack.PackedSeqParams, got "
                        f"{type(packed_seq_params).__name__}")
    if batch != 1:
        raise ValueError(f"{layer}: packed input must be one row [1, T, D] (fla / THD convention), got B={batch}; "
                         "pack the batch with ssm_pack.pack_padded or pass packed_seq_params=None")
    cu = get_cu_seqlens(packed_seq_params).to(device=device, dtype=torch.int32)
    if cu.device.type == "cpu" and int(cu[-1]) > length:
        raise ValueError(f"{layer}: the packed boundaries end at {int(cu[-1])} but hidden_states has {length} tokens")
    seq_idx = build_packed_seq_idx(packed_seq_params, length).to(device)
    return Packing(cu, seq_idx, position_ids_from_cu_seqlens(cu, length), True)


def _packing_support(kernel: str) -> tuple[bool, str]:
    """Can ``kernel`` run packed input? The short convolution (``"causal_conv1d"``) may run on
    causal-conv1d's CUDA kernel (with its ``seq_idx`` feature) or on fla's Triton conv."""
    if kernel != "causal_conv1d":
        return _dispatch.cached_support(kernel)
    ok, reason = _dispatch.cached_support("causal_conv1d", ("seq_idx",))
    if ok:
        return ok, reason
    fla_ok, fla_reason = _dispatch.cached_support("fla_conv")
    return (True, None) if fla_ok else (False, f"{reason}; and fla's Triton conv: {fla_reason}")


def warn_reference_once(layer: str, hidden_states: torch.Tensor, backend: str, kernels: tuple[str, ...]) -> None:
    """In ``auto`` on CUDA, say once per layer type when a kernel cannot pack and the reference runs."""
    if backend != "auto" or not _dispatch.is_cuda(hidden_states):
        return
    for name in kernels:
        ok, reason = _packing_support(name)
        key = (layer, name)
        if not ok and key not in _WARNED:
            _WARNED.add(key)
            warnings.warn(f"{layer}: packed input runs ssm-pack's reference instead of the {name} kernel: {reason}",
                          RuntimeWarning, stacklevel=3)


def check_kernels(layer: str, backend: str, kernels: tuple[str, ...]) -> None:
    """At construction with ``backend='kernel'``: every kernel must be available."""
    if backend not in _dispatch.BACKENDS:
        raise ValueError(f"{layer}: backend must be one of {_dispatch.BACKENDS}, got {backend!r}")
    if backend != "kernel":
        return
    for name in kernels:
        ok, reason = _packing_support(name)
        if not ok:
            raise RuntimeError(f"{layer}(backend='kernel'): {reason}")


def setup(layer, config_cls, hidden_size, config, backend: str, overrides: dict):
    """A mixer's constructor preamble: its config (given, or built from ``hidden_size`` and the
    overrides), its backend (kernels checked now for ``"kernel"``) set on ``layer``."""
    name = type(layer).__name__
    if config is None:
        config = config_cls(hidden_size=hidden_size, **overrides)
    elif not isinstance(config, config_cls):
        raise TypeError(f"{name}: config must be a {config_cls.__name__}, got {type(config).__name__}")
    elif hidden_size is not None or overrides:
        given = ["hidden_size"] * (hidden_size is not None) + sorted(overrides)
        raise ValueError(f"{name}: config is given, so {', '.join(given)} would be ignored; "
                         f"set them in the config (dataclasses.replace(config, ...)) instead")
    check_kernels(name, backend, layer.KERNELS)
    layer.backend = backend
    return config


def for_layer(layer, hidden_states: torch.Tensor, packed_seq_params) -> Packing:
    """``resolve`` for ``layer`` plus the once-per-type warning when a kernel cannot pack."""
    name = type(layer).__name__
    packing = resolve(hidden_states, packed_seq_params, name)
    if packing.packed:
        warn_reference_once(name, hidden_states, layer.backend, layer.KERNELS)
    return packing
