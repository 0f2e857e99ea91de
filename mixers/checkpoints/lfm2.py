"""Hugging Face LFM2 gated short convolution -> :class:`~mixers.GatedShortConvMixer` and back.

    D = hidden, W = conv width (``conv_L_cache``)

Same math and the same storage (``in_proj`` rows ``[B | C | x]``, an ``nn.Conv1d`` depthwise
weight ``[D, 1, W]``), so the map is the identity on every key:

| LFM2 (``Lfm2ShortConv``) | shape | ours |
|---|---|---|
| ``in_proj.weight`` (``.bias``) | ``[3D, D]`` (``[3D]``) | ``in_proj.weight`` (``.bias``) |
| ``conv.weight`` (``.bias``) | ``[D, 1, W]`` (``[D]``) | ``conv.weight`` (``.bias``) |
| ``out_proj.weight`` (``.bias``) | ``[D, D]`` (``[D]``) | ``out_proj.weight`` (``.bias``) |

LFM3's ``Lfm3ShortConv`` and LFM2-MoE's ``Lfm2MoeShortConv`` are the same layer (transformers
copies ``Lfm2ShortConv`` into each, line for line: same call, same weights, same conv, same
gating ``out_proj(C * conv(B * x))``) and convert the same way; what differs in those models
(LFM3's sandwich norms, attention output gate and sliding-window layers, LFM2-MoE's experts) lies
outside the layer.

LFM2's one ``conv_bias`` flag sets all three biases; a layer whose ``in_proj`` and ``out_proj``
disagree on a bias, or whose convolution is not LFM2's (not depthwise, strided, dilated, another
padding mode), is refused by name. Writing back refuses a config with ``proj_bias != conv_bias``
(LFM2 cannot store it).
"""

from __future__ import annotations

from ..layers import GatedShortConvConfig, GatedShortConvMixer
from ._source import Source, require, require_causal_depthwise_conv

_FIX = "Only LFM2's own layout converts (Lfm2ShortConv / Lfm3ShortConv / Lfm2MoeShortConv as transformers builds it)"


def read_config(module) -> GatedShortConvConfig:
    """Our config from ``transformers`` ``Lfm2ShortConv`` (or LFM3's / LFM2-MoE's copy of it)."""
    name = type(module).__name__
    conv, in_proj, out_proj = module.conv, module.in_proj, module.out_proj
    hidden = conv.in_channels
    require_causal_depthwise_conv(conv, name, hidden, _FIX)
    require((in_proj.in_features, in_proj.out_features, out_proj.in_features, out_proj.out_features)
            == (hidden, 3 * hidden, hidden, hidden), name,
            f"in_proj is {in_proj.in_features} -> {in_proj.out_features} and out_proj {out_proj.in_features} -> "
            f"{out_proj.out_features} for hidden {hidden}", _FIX)
    require((in_proj.bias is None) == (out_proj.bias is None), name,
            f"in_proj has {'a' if in_proj.bias is not None else 'no'} bias but out_proj has "
            f"{'one' if out_proj.bias is not None else 'none'}", "Give both projections a bias or neither")
    return GatedShortConvConfig(hidden_size=hidden, conv_size=conv.kernel_size[0],
                                proj_bias=in_proj.bias is not None, conv_bias=conv.bias is not None)


def to_ours(sd, c: GatedShortConvConfig):
    return dict(sd)


def to_upstream(sd, c: GatedShortConvConfig):
    require(c.proj_bias == c.conv_bias, "hf_lfm2", f"our config has proj_bias={c.proj_bias}, conv_bias={c.conv_bias}",
            "LFM2 has one conv_bias flag for the projections and the conv; set both alike")
    return dict(sd)


HF_LFM2 = Source(name="hf_lfm2", description="transformers Lfm2ShortConv (and LFM3's, LFM2-MoE's copies)",
                 mixer=GatedShortConvMixer, config_type=GatedShortConvConfig, to_ours=to_ours, to_upstream=to_upstream,
                 read_config=read_config,
                 classes=("transformers:Lfm2ShortConv", "transformers:Lfm3ShortConv", "transformers:Lfm2MoeShortConv"))

SOURCES = (HF_LFM2,)
