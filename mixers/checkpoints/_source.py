"""What one upstream layout of one of our mixers is, and the strict key checks every converter shares.

A :class:`Source` maps an upstream state dict to ours and back. Both maps are pure tensor
rearrangements (renames, splits, concatenations, reshapes): no arithmetic touches a value, so a
round trip is bit-exact and the same maps apply to gradients.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

StateDict = dict[str, torch.Tensor]

# Config fields that only shape the initialisation or the numerics of the scan, never the weights
# or the function the weights compute (up to rounding): they are not compared between an upstream
# module and our mixer.
INIT_ONLY_FIELDS = frozenset({"chunk_size", "dt_min", "dt_max", "dt_init_floor", "heads_share", "expand"})


@dataclass(frozen=True)
class Source:
    """One upstream layout of one of our mixers.

    ``to_ours(state_dict, config)`` / ``to_upstream(state_dict, config)`` map between the two key
    sets (each gets exactly the keys it expects: the callers check them first);
    ``read_config(module)`` reads our config from an upstream module, refusing options our mixer
    cannot express; ``classes`` names the upstream classes ``read_config`` accepts (``"package:ClassName"``,
    the package being the top-level module the class is defined in);
    ``config_type`` is our config class for ``mixer``;
    ``ignorable(key, value)`` says whether an extra upstream entry carries no weight (Transformer
    Engine's ``_extra_state``, MiniMax's decay tables), so it can be passed over;
    ``returns_pair``: the upstream layer's forward returns a pair, ``(output, attention weights)``
    (MiniMax's lightning attention) or ``(output, None)`` (RecurrentGemma's recurrent block), so a
    layer standing in for it in the upstream model returns ``(output, None)``.
    """

    name: str
    description: str
    mixer: type
    config_type: type
    to_ours: Callable[[StateDict, object], StateDict]
    to_upstream: Callable[[StateDict, object], StateDict]
    read_config: Callable[[nn.Module], object] | None = None
    classes: tuple[str, ...] = ()
    ignorable: Callable[[str, object], bool] | None = None
    returns_pair: bool = False


def renaming(ours_to_upstream: Mapping[str, str]):
    """``(to_ours, to_upstream)`` for a layout that differs from ours only in key names."""
    upstream_to_ours = {v: k for k, v in ours_to_upstream.items()}

    def to_ours(state_dict: StateDict, config) -> StateDict:
        return {upstream_to_ours.get(k, k): v for k, v in state_dict.items()}

    def to_upstream(state_dict: StateDict, config) -> StateDict:
        return {ours_to_upstream.get(k, k): v for k, v in state_dict.items()}

    return to_ours, to_upstream


def template(source: Source, config) -> StateDict:
    """Our mixer's state dict for ``config`` with no storage (meta tensors): names and shapes."""
    with torch.device("meta"):
        mixer = source.mixer(config=config, backend="reference")
    return dict(mixer.state_dict())


def expected_upstream(source: Source, config) -> dict[str, torch.Size]:
    """Upstream key -> shape for ``config``, derived by mapping our (meta) template."""
    return {k: v.shape for k, v in source.to_upstream(template(source, config), config).items()}


def check_keys(state_dict: Mapping, expected: Mapping[str, torch.Size], what: str,
               ignorable: Callable[[str, object], bool] | None = None, hint: str = "") -> StateDict:
    """The entries of ``state_dict`` that ``expected`` names, after checking that none is missing,
    none is left over (except ``ignorable`` ones), every shape matches and every value is a real
    floating-point tensor (each key keeps its own dtype); raises listing them."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping of names to tensors, got {type(state_dict).__name__}")
    missing = sorted(k for k in expected if k not in state_dict)
    leftover = sorted(k for k in state_dict if k not in expected
                      and not (ignorable is not None and ignorable(k, state_dict[k])))
    problems = []
    if missing:
        problems.append(f"missing keys {missing}")
    if leftover:
        problems.append(f"unexpected keys {leftover}")
    for key in sorted(k for k in expected if k in state_dict):
        value = state_dict[key]
        if not isinstance(value, torch.Tensor):
            problems.append(f"{key!r} is a {type(value).__name__}, not a tensor")
        elif value.shape != expected[key]:
            problems.append(f"{key!r} has shape {tuple(value.shape)}, expected {tuple(expected[key])}")
        elif not value.is_floating_point():
            problems.append(f"{key!r} has dtype {value.dtype}, expected a floating-point dtype (a real-valued weight)")
    if problems:
        raise ValueError(f"{what}: " + "; ".join(problems) + (f". {hint}" if hint else "")
                         + ". Nothing was converted: every key must be accounted for")
    return {k: state_dict[k] for k in expected}


def detached(state_dict: Mapping[str, torch.Tensor]) -> StateDict:
    """Fresh contiguous copies: a converted mixer never shares storage with its source."""
    return {k: v.detach().clone(memory_format=torch.contiguous_format) for k, v in state_dict.items()}


def config_differences(ours, theirs) -> list[str]:
    """Fields (except :data:`INIT_ONLY_FIELDS`) whose values differ between two configs of one type,
    with ``d_inner`` / ``num_heads`` compared through their derived values."""
    out = []
    for f in dataclasses.fields(ours):
        if f.name in INIT_ONLY_FIELDS:
            continue
        a, b = getattr(ours, f.name), getattr(theirs, f.name)
        if a != b:
            out.append(f"{f.name}: ours {a!r}, upstream {b!r}")
    return out


def require(condition: bool, source: str, what: str, fix: str) -> None:
    """Refuse an upstream option our mixer cannot express (``ValueError`` with the fix)."""
    if not condition:
        raise ValueError(f"{source}: {what}; our mixer cannot represent it exactly, so nothing was converted. {fix}")


def require_causal_depthwise_conv(conv, source: str, channels: int, fix: str) -> None:
    """Refuse an upstream ``nn.Conv1d`` that is not the causal depthwise conv our short conv is:
    ``channels`` in and out, one group per channel, stride and dilation 1, ``kernel_size - 1`` zeros
    in front. ``fix`` ends the depthwise refusal (the family's own layout)."""
    require(conv.groups == channels == conv.in_channels == conv.out_channels, source,
            f"the conv is not depthwise over {channels} channels (in_channels={conv.in_channels}, "
            f"out_channels={conv.out_channels}, groups={conv.groups})", fix)
    require(tuple(conv.stride) == (1,) and tuple(conv.dilation) == (1,), source,
            f"the conv has stride={tuple(conv.stride)}, dilation={tuple(conv.dilation)}",
            "Only stride 1, dilation 1 convert")
    require(conv.padding_mode == "zeros", source, f"the conv pads with {conv.padding_mode!r}",
            "Only zero padding (a causal conv from a zero state) converts")
    require(tuple(conv.padding) == (conv.kernel_size[0] - 1,), source,
            f"the conv's padding is {tuple(conv.padding)} for kernel_size {conv.kernel_size[0]}",
            "Only causal padding (kernel_size - 1) converts")
