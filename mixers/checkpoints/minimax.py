"""Hugging Face MiniMax lightning attention -> :class:`~mixers.LightningMixer` and back.

    D = hidden, H = heads, K = head dim, E = H * K

Same math and the same storage, so the map is the identity on every weight:

| MiniMax (``MiniMaxLightningAttention``) | shape | ours |
|---|---|---|
| ``qkv_proj.weight`` | ``[3E, D]`` (per head ``[q | k | v]``) | ``qkv_proj.weight`` |
| ``output_gate.weight`` | ``[E, D]`` | ``output_gate.weight`` |
| ``norm.weight`` | ``[E]`` | ``norm.weight`` |
| ``out_proj.weight`` | ``[D, E]`` | ``out_proj.weight`` |
| ``slope_rate`` (buffer) | ``[H, 1, 1]`` | ``slope`` (buffer) ``[H]`` |

MiniMax also stores the decay tables of its block algorithm (``query_decay``, ``key_decay``,
``diagonal_decay``, sized by ``block_size``), derived from ``slope_rate``: they carry no weight, so they
are passed over when reading and left as the layer holds them when writing back. A layer whose
``slope_rate`` is not MiniMax's formula for its index (an edited buffer, which its decay tables would not
follow), whose activation is not SiLU, whose projections have a bias or whose sizes disagree is refused
by name.
"""

from __future__ import annotations

import torch

from ..layers import LightningConfig, LightningMixer
from ..layers.lightning import minimax_slopes
from ._source import Source, require

_FIX = "Only MiniMax's own layout converts (MiniMaxLightningAttention as transformers builds it)"
DERIVED = ("query_decay", "key_decay", "diagonal_decay")


def read_config(module) -> LightningConfig:
    """Our config from ``transformers`` ``MiniMaxLightningAttention``."""
    name = type(module).__name__
    heads, head_dim = module.num_attention_heads, module.head_dim
    inner = heads * head_dim
    qkv, gate, out = module.qkv_proj, module.output_gate, module.out_proj
    hidden = qkv.in_features
    act = type(module.act_fn).__name__
    require(act in ("SiLUActivation", "SiLU"), name, f"its activation is {act} (config.hidden_act)",
            "Only SiLU converts (hidden_act='silu', MiniMax's)")
    for label, linear in (("qkv_proj", qkv), ("output_gate", gate), ("out_proj", out)):
        require(linear.bias is None, name, f"{label} has a bias", "MiniMax's projections have none; drop it")
    require((qkv.out_features, gate.in_features, gate.out_features, out.in_features, out.out_features)
            == (3 * inner, hidden, inner, inner, hidden), name,
            f"qkv_proj is {hidden} -> {qkv.out_features}, output_gate {gate.in_features} -> {gate.out_features}, "
            f"out_proj {out.in_features} -> {out.out_features} for {heads} heads of {head_dim}", _FIX)
    norm = module.norm
    require(tuple(norm.weight.shape) == (inner,), name,
            f"norm.weight is {list(norm.weight.shape)}, not [{inner}] (one RMS norm over all heads)", _FIX)
    layer, layers = module.layer_idx, module.num_hidden_layers
    require(isinstance(layer, int) and isinstance(layers, int) and 0 <= layer < layers, name,
            f"layer_idx={layer!r} is not an index of num_hidden_layers={layers!r}", _FIX)
    slope = module.slope_rate
    if slope.device.type != "meta":
        want = minimax_slopes(heads, layer, layers).to(slope.device, slope.dtype)
        require(tuple(slope.shape) == (heads, 1, 1) and torch.equal(slope.reshape(heads), want), name,
                f"slope_rate is not MiniMax's slopes for layer_idx={layer} of num_hidden_layers={layers}",
                "Our mixer derives its slopes from the layer index; recompute the buffer with get_slope_rate()")
    return LightningConfig(hidden_size=hidden, head_dim=head_dim, num_heads=heads, layer_idx=layer, num_layers=layers,
                           norm_eps=float(norm.variance_epsilon))


def _derived(key: str, value) -> bool:
    """MiniMax's derived buffers: no weight, passed over (see the module docstring)."""
    return key in DERIVED


def _moved(sd, src: str, dst: str, shape) -> dict:
    """``sd`` with ``src`` renamed ``dst`` and reshaped (the weights, and gradients, which have no slope,
    pass as they are)."""
    out = {k: v for k, v in sd.items() if k != src}
    if src in sd:
        out[dst] = sd[src].reshape(shape)
    return out


def to_ours(sd, c: LightningConfig):
    return _moved(sd, "slope_rate", "slope", (c.num_heads,))


def to_upstream(sd, c: LightningConfig):
    return _moved(sd, "slope", "slope_rate", (c.num_heads, 1, 1))


HF_MINIMAX = Source(name="hf_minimax", description="transformers MiniMaxLightningAttention", mixer=LightningMixer,
                    config_type=LightningConfig, to_ours=to_ours, to_upstream=to_upstream, read_config=read_config,
                    classes=("transformers:MiniMaxLightningAttention",), ignorable=_derived,
                    returns_pair=True)

SOURCES = (HF_MINIMAX,)
