"""Hugging Face's names and layout for the state dict of a model patched by ``enable_packing``.

A swapped layer (:class:`~mixers.integrations.transformers.PackedMixer`) holds our mixer under
``<layer>.mixer.``; its state dict hooks convert to and from the Hugging Face layer's keys
(``<layer>.in_proj.weight``, ...) with :mod:`mixers.checkpoints`, so that

- ``state_dict()`` / ``save_pretrained`` write Hugging Face's checkpoint;
- ``load_state_dict`` reports missing, unexpected and mis-shaped keys in Hugging Face's names, as
  the unpatched model does: a missing key keeps the layer's current value for it, as a missing
  parameter does in torch;
- a mis-shaped tensor of a swapped layer is refused before anything is written: the model-level
  pre-hook (:func:`check_whole_load`) checks every swapped layer first and raises torch's own
  ``RuntimeError`` ("size mismatch for <key>: ..."), where torch alone would load the other
  tensors first;
- the Hugging Face layer's saved buffers that the converter does not produce (values derived from
  the config, e.g. MiniMax's decay tables) are saved and loaded as the swapped layer keeps them
  (its copy of the layer's buffers, which ``disable_packing`` puts back), so the key set is the
  unpatched model's.
"""

from __future__ import annotations

import torch
from torch import nn

from ..checkpoints import SOURCES


def _upstream_now(module) -> dict[str, torch.Tensor]:
    """The Hugging Face layer's keys (in its ``state_dict`` order) -> the current values."""
    mixer = module.mixer
    current = SOURCES[module.source].to_upstream({k: v.detach() for k, v in mixer.state_dict().items()},
                                                 mixer.config)
    order = [k for k in module._original[0].state_dict(keep_vars=True) if k in current]
    return {k: current[k] for k in order + [k for k in current if k not in order]}


def _kept_buffers(module, produced) -> dict[str, torch.Tensor]:
    """The Hugging Face layer's saved buffers not in ``produced`` (the converter's keys): the swapped
    layer's copies, by key."""
    original, buffers = module._original
    return {k: buffers[k] for k in original.state_dict(keep_vars=True) if k in buffers and k not in produced}


def save_upstream(module, state_dict, prefix, local_metadata):
    inner = prefix + "mixer."
    ours = {k[len(inner):]: state_dict.pop(k) for k in [k for k in state_dict if k.startswith(inner)]}
    upstream = SOURCES[module.source].to_upstream(ours, module.mixer.config)
    state_dict.update({prefix + k: v for k, v in upstream.items()})
    state_dict.update({prefix + k: v for k, v in _kept_buffers(module, upstream).items()})


def _load_kept(module, state_dict, prefix, produced, missing, errors) -> None:
    """Pop the layer's kept buffers (:func:`_kept_buffers`) from ``state_dict`` into its copies."""
    for key, now in _kept_buffers(module, produced).items():
        given = state_dict.pop(prefix + key, None)
        if given is None:
            missing.append(prefix + key)
        elif not isinstance(given, torch.Tensor) or given.shape != now.shape:
            errors.append(f"size mismatch for {prefix + key}: copying a param with shape "
                          f"{getattr(given, 'shape', type(given))} from checkpoint, the shape in current model is "
                          f"{now.shape}.")
        else:
            with torch.no_grad():
                now.copy_(given)


def size_errors(module, state_dict, prefix: str) -> list[str]:
    """torch's messages for the layer's Hugging Face keys in ``state_dict`` that cannot be loaded."""
    errors = []
    for key, now in _upstream_now(module).items():
        given = state_dict.get(prefix + key)
        if given is None:
            continue
        if not isinstance(given, torch.Tensor):
            errors.append(f'While copying the parameter named "{prefix + key}", expected torch.Tensor or '
                          f"Tensor-like object from checkpoint but received {type(given)}")
        elif given.shape != now.shape:
            errors.append(f"size mismatch for {prefix + key}: copying a param with shape {given.shape} from "
                          f"checkpoint, the shape in current model is {now.shape}.")
    return errors


def load_upstream(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
    """Pre-hook of one swapped layer: its Hugging Face keys in ``state_dict`` -> ours."""
    current = _upstream_now(module)
    given = [k for k in current if prefix + k in state_dict]
    inner = prefix + "mixer."
    if not given and any(k.startswith(inner) for k in state_dict):
        return                                            # our own layout (mixer.*): torch loads it as is
    _load_kept(module, state_dict, prefix, current, missing, errors)
    problems = size_errors(module, state_dict, prefix)
    missing.extend(prefix + k for k in current if k not in given)
    if problems:                                          # reported as torch reports them; ours stay as they are
        errors.extend(problems)
        for k in given:
            state_dict.pop(prefix + k)
        upstream = current
    else:
        upstream = {k: state_dict.pop(prefix + k) if k in given else v for k, v in current.items()}
    ours = SOURCES[module.source].to_ours(upstream, module.mixer.config)
    state_dict.update({inner + k: v for k, v in ours.items()})


def check_whole_load(packed_type: type):
    """A model-level ``load_state_dict`` pre-hook: raises before any tensor is written when a
    swapped layer's tensor cannot be loaded."""

    def hook(model: nn.Module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        problems = [p for name, layer in model.named_modules() if isinstance(layer, packed_type)
                    for p in size_errors(layer, state_dict, prefix + name + ".")]
        if problems:
            raise RuntimeError(f"Error(s) in loading state_dict for {type(model).__name__}:\n\t"
                               + "\n\t".join(problems))

    return hook
