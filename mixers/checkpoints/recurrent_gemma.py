"""Hugging Face RecurrentGemma's recurrent block -> :class:`~mixers.RGLRUMixer` and back.

    D = hidden, W = ``lru_width``, H = gate blocks (``num_attention_heads``), K = W / H,
    Wc = ``conv1d_width``

The same math and the same storage; the map only renames (the conv and the RG-LRU's parameters
sit one level up in ours):

| RecurrentGemma (``RecurrentGemmaRecurrentBlock``) | shape | ours |
|---|---|---|
| ``linear_y.weight`` (``.bias``) | ``[W, D]`` (``[W]``) | ``linear_y.weight`` (``.bias``) |
| ``linear_x.weight`` (``.bias``) | ``[W, D]`` (``[W]``) | ``linear_x.weight`` (``.bias``) |
| ``conv_1d.weight`` (``.bias``) | ``[W, 1, Wc]`` (``[W]``) | ``conv.weight`` (``.bias``) |
| ``rg_lru.input_gate_weight`` (``recurrent_gate_weight``) | ``[H, K, K]`` | ``input_gate_weight`` (same) |
| ``rg_lru.input_gate_bias`` (``recurrent_gate_bias``) | ``[H, K]`` | ``input_gate_bias`` (same) |
| ``rg_lru.recurrent_param`` | ``[W]`` | ``recurrent_param`` |
| ``linear_out.weight`` (``.bias``) | ``[D, W]`` (``[D]``) | ``linear_out.weight`` (``.bias``) |

Refused by name (our mixer cannot express them): a convolution that is not RecurrentGemma's
(not depthwise, strided, dilated, another padding mode or amount), a linear without its bias or of
other sizes, and a GeLU branch other than the tanh or exact GeLU. Writing back refuses ``scale != 8`` (RecurrentGemma
fixes it).
"""

from __future__ import annotations

import torch.nn.functional as F

from ..layers import RGLRUConfig, RGLRUMixer
from ._source import Source, renaming, require, require_causal_depthwise_conv

_FIX = "Only RecurrentGemma's own layout converts (RecurrentGemmaRecurrentBlock as transformers builds it)"
_MOVED = {"conv.weight": "conv_1d.weight", "conv.bias": "conv_1d.bias"}
_MOVED.update({name: f"rg_lru.{name}" for name in ("recurrent_param", "input_gate_weight", "input_gate_bias",
                                                     "recurrent_gate_weight", "recurrent_gate_bias")})


def _activation(module, name: str) -> str:
    """Our ``activation`` for the block's ``act_fn`` (probed on a few values: the class alone does not say
    which GeLU it is in every transformers release)."""
    import torch
    probe = torch.linspace(-4, 4, 33, dtype=torch.float64)
    got = module.act_fn(probe)
    for ours, fn in (("gelu_pytorch_tanh", lambda t: F.gelu(t, approximate="tanh")), ("gelu", F.gelu)):
        if isinstance(got, torch.Tensor) and torch.equal(got, fn(probe)):
            return ours
    require(False, name, f"its activation {type(module.act_fn).__name__} is neither the tanh nor the exact GeLU",
            "Only hidden_activation='gelu_pytorch_tanh' (RecurrentGemma's) or 'gelu' converts")
    raise AssertionError


def read_config(module) -> RGLRUConfig:
    """Our config from ``transformers`` ``RecurrentGemmaRecurrentBlock``."""
    name = type(module).__name__
    conv, lru = module.conv_1d, module.rg_lru
    width = conv.in_channels
    hidden = module.linear_x.in_features
    require_causal_depthwise_conv(conv, name, width, _FIX)
    require(conv.bias is not None, name, "the conv has no bias", "RecurrentGemma's conv carries a bias; give it one")
    for proj, shape in (("linear_x", (hidden, width)), ("linear_y", (hidden, width)), ("linear_out", (width, hidden))):
        layer = getattr(module, proj)
        require((layer.in_features, layer.out_features) == shape, name,
                f"{proj} is {layer.in_features} -> {layer.out_features}, not {shape[0]} -> {shape[1]}", _FIX)
        require(layer.bias is not None, name, f"{proj} has no bias", "RecurrentGemma's linears carry biases")
    heads = lru.num_attention_heads
    require(tuple(lru.input_gate_weight.shape) == (heads, width // heads, width // heads) and width % heads == 0,
            name, f"the RG-LRU gates are {tuple(lru.input_gate_weight.shape)} for lru_width {width} and "
            f"{heads} heads", _FIX)
    return RGLRUConfig(hidden_size=hidden, lru_width=width, num_heads=heads, conv_size=conv.kernel_size[0],
                       activation=_activation(module, name))


_to_ours, _renamed_upstream = renaming(_MOVED)


def _to_upstream(sd, c: RGLRUConfig):
    require(float(c.scale) == 8.0, "hf_recurrent_gemma", f"our config has scale={c.scale}",
            "RecurrentGemma fixes the decay exponent at 8.0; set scale=8.0")
    return _renamed_upstream(sd, c)

HF_RECURRENT_GEMMA = Source(name="hf_recurrent_gemma", description="transformers RecurrentGemmaRecurrentBlock",
                            mixer=RGLRUMixer, config_type=RGLRUConfig, to_ours=_to_ours, to_upstream=_to_upstream,
                            read_config=read_config, classes=("transformers:RecurrentGemmaRecurrentBlock",),
                            returns_pair=True)

SOURCES = (HF_RECURRENT_GEMMA,)
