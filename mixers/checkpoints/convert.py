"""Public converters: an upstream layer (module, or state dict plus our config) -> our mixer, and back.

    from_module(upstream_layer)                       -> our mixer, config read from the layer
    from_state_dict(state_dict, source, config)       -> our mixer
    to_state_dict(mixer, source)                      -> upstream state dict
    to_module(mixer, upstream_layer)                  -> the upstream layer, loaded with our weights

Every key is accounted for: a missing, unexpected or misshapen entry raises ``ValueError``
listing all of them, and nothing is converted. The converted mixer owns fresh copies of the
tensors, in their dtype and on their device.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from ..layers import registry
from ._source import Source, StateDict, check_keys, config_differences, detached, expected_upstream, template


def _module(name: str):
    """A converter module a registry entry names: one of this package (``"mamba2"``) or a dotted path."""
    return importlib.import_module(name if "." in name else f"{__package__}.{name}")


def registered_sources() -> dict[str, Source]:
    """Every converter of every registered mixer (:mod:`mixers.layers.registry`), by name: the
    ``SOURCES`` of the modules an entry names whose ``mixer`` is that entry's."""
    found = {}
    for kind in registry.MIXERS.values():
        for name in kind.checkpoints:
            found.update((s.name, s) for s in _module(name).SOURCES if s.mixer is kind.mixer)
    return found


class _Sources(Mapping):
    """:data:`SOURCES`: the registered converters by name, read from the registry on every use
    (so a mixer registered later brings its converters along)."""

    def __getitem__(self, name: str) -> Source:
        return registered_sources()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(registered_sources())

    def __len__(self) -> int:
        return len(registered_sources())

    def __repr__(self) -> str:
        return f"SOURCES({sorted(self)})"


SOURCES: Mapping[str, Source] = _Sources()


def _hints() -> dict[str, str]:
    """Key -> note, from the converter modules that give ``HINTS`` (a key that says which layout it is)."""
    names = dict.fromkeys(name for kind in registry.MIXERS.values() for name in kind.checkpoints)
    return {key: note for name in names for key, note in getattr(_module(name), "HINTS", {}).items()}


def _source(source) -> Source:
    if isinstance(source, Source):
        return source
    if source not in SOURCES:
        raise ValueError(f"source must be one of {sorted(SOURCES)}, got {source!r}")
    return SOURCES[source]


def source_of(module: nn.Module) -> Source:
    """The :class:`Source` whose upstream classes include ``module``'s class."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module (an upstream layer), got {type(module).__name__}")
    key = f"{type(module).__module__.split('.')[0]}:{type(module).__name__}"
    for source in SOURCES.values():
        if key in source.classes:
            return source
    known = sorted(c for s in SOURCES.values() for c in s.classes)
    raise TypeError(f"no converter reads a {key} layer; known layers: {known}. For a state dict, "
                    f"call from_state_dict(state_dict, source=..., config=...) with one of {sorted(SOURCES)}")


def _hint(source: Source, state_dict: Mapping, config) -> str:
    """Notes on the keys that are part of the problem: unexpected ones, or expected ones of another shape."""
    expected = expected_upstream(source, config)
    notes = [note for key, note in _hints().items() if key in state_dict and (
        key not in expected or getattr(state_dict[key], "shape", None) != expected[key])]
    keys = set(state_dict)
    for other in SOURCES.values():
        if other is source or other.mixer is not source.mixer:
            continue
        try:
            if set(expected_upstream(other, config)) == keys - {k for k in keys if other.ignorable
                                                                 and other.ignorable(k, state_dict[k])}:
                notes.append(f"the keys are those of source={other.name!r} ({other.description})")
        except ValueError:
            continue
    return "; ".join(notes)


def _check(source: Source, state_dict: Mapping, config) -> StateDict:
    if type(config) is not source.config_type:
        raise TypeError(f"config must be a {source.config_type.__name__} for source={source.name!r}, "
                        f"got {type(config).__name__}")
    expected = expected_upstream(source, config)
    return check_keys(state_dict, expected, f"{source.name} state dict ({source.description})",
                      ignorable=source.ignorable, hint=_hint(source, state_dict, config) if isinstance(
                          state_dict, Mapping) else "")


def from_state_dict(state_dict: Mapping[str, torch.Tensor], source, config, *, backend: str = "auto") -> nn.Module:
    """Our mixer holding an upstream layer's weights.

    ``state_dict``: one layer's entries, prefix stripped (see :func:`mixers.checkpoints.select`);
    ``source``: a name from :data:`SOURCES`; ``config``: our config for the layer (sizes, eps,
    gates), e.g. ``Mamba2Config(hidden_size=2048, num_heads=64, head_dim=64, state_size=128,
    num_groups=8)``. The mixer's tensors are copies in the checkpoint's dtype and device.
    """
    src = _source(source)
    upstream = _check(src, state_dict, config)
    ours = src.to_ours(upstream, config)
    names = set(template(src, config))
    assert set(ours) == names, f"{src.name} converter produced {sorted(set(ours) ^ names)}"
    with torch.device("meta"):
        mixer = src.mixer(config=config, backend=backend)
    mixer.load_state_dict(detached(ours), strict=True, assign=True)
    return mixer


def from_module(module: nn.Module, *, backend: str = "auto", chunk_size: int | None = None) -> nn.Module:
    """Our mixer equal to the upstream layer ``module`` (config read from it, weights copied).

    ``chunk_size`` overrides the scan's chunk (a numerical choice; upstream's by default).
    """
    src = source_of(module)
    config = src.read_config(module)
    if chunk_size is not None:
        import dataclasses
        config = dataclasses.replace(config, chunk_size=chunk_size)
    return from_state_dict(module.state_dict(), src, config, backend=backend)


def to_state_dict(mixer: nn.Module, source) -> StateDict:
    """``mixer``'s weights as the upstream layout ``source`` stores them (copies, same dtypes)."""
    src = _source(source)
    if not isinstance(mixer, src.mixer):
        raise TypeError(f"source={src.name!r} converts a {src.mixer.__name__}, got {type(mixer).__name__}")
    ours = {k: v.detach() for k, v in mixer.state_dict().items()}
    return detached(src.to_upstream(ours, mixer.config))


def to_module(mixer: nn.Module, module: nn.Module) -> nn.Module:
    """Load ``mixer``'s weights into the upstream layer ``module`` (built by the caller with the
    upstream config); refuses a layer whose sizes, eps or gates differ from the mixer's config.
    The layer's buffers that carry no weight (MiniMax's decay tables) keep their values."""
    src = source_of(module)
    differences = config_differences(mixer.config, src.read_config(module))
    if differences:
        raise ValueError(f"{type(module).__name__} does not match the mixer's config: {'; '.join(differences)}. "
                         "Build the upstream layer with the mixer's sizes and eps")
    state = to_state_dict(mixer, src)
    buffers = dict(module.named_buffers())
    own = {k: v for k, v in module.state_dict().items() if k not in state and k in buffers}   # derived, kept
    module.load_state_dict({**state, **own}, strict=True)
    return module
