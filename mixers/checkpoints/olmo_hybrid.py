"""Hugging Face OLMo-hybrid gated delta net -> :class:`~mixers.GatedDeltaNetMixer` and back.

    D = hidden, Hk = key heads, Hv = value heads, K / V = key / value head dims, W = conv width

``OlmoHybridGatedDeltaNet`` computes what ours computes (fla's Gated DeltaNet): separate q / k / v
projections through a SiLU depthwise conv, ``beta = sigmoid(b_proj(x))`` (times 2 when the model's
``linear_allow_neg_eigval`` is set, the default: ours is ``allow_neg_eigval``), scalar decay
``-exp(A_log) * softplus(a_proj(x) + dt_bias)``, q / k l2 norm in the kernel, value head ``h``
reading key head ``h // (Hv / Hk)``, a SiLU-gated RMS norm with ``g_proj(x)`` before ``o_proj``.
Every key but the conv has our name; the conv is one ``nn.Conv1d`` over ``[q, k, v]``
(depthwise, so it is our three convs stacked):

| OLMo-hybrid | shape | ours |
|---|---|---|
| ``q_proj``, ``k_proj``, ``v_proj``, ``a_proj``, ``b_proj``, ``g_proj``, ``o_proj`` (``.weight``) | | the same |
| ``conv1d.weight`` | ``[2HkK + HvV, 1, W]``, rows ``[q, k, v]``, no bias | ``q_conv``, ``k_conv``, ``v_conv`` |
| ``o_norm.weight`` | ``[V]`` | ``o_norm.weight`` |
| ``A_log``, ``dt_bias`` | ``[Hv]`` | the same |

The output norm's eps is fixed at 1e-5 by the layer (not the model's ``rms_norm_eps``); the
converted config carries it. Refused by name, nothing converted: a conv activation (the model's
``hidden_act``) other than SiLU, a conv or projection with a bias, an output gate other than SiLU,
value heads that are not a multiple of the key heads.
"""

from __future__ import annotations

import torch

from ..layers import GatedDeltaNetConfig, GatedDeltaNetMixer
from ._source import Source, require

_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj", "o_proj")
_SAME = (*(f"{p}.weight" for p in _PROJECTIONS), "o_norm.weight", "A_log", "dt_bias")


def read_config(module) -> GatedDeltaNetConfig:
    """Our config from ``transformers`` ``OlmoHybridGatedDeltaNet``."""
    name = type(module).__name__
    require(module.activation in ("silu", "swish"), name, f"the conv activation (hidden_act) is {module.activation!r}",
            "Only SiLU convolutions convert")
    require(module.conv1d.bias is None, name, "the conv has a bias", "Only bias-free convolutions convert")
    biased = [p for p in _PROJECTIONS if getattr(module, p).bias is not None]
    require(not biased, name, f"the projections {biased} have a bias", "Only bias-free projections convert")
    require(module.o_norm.activation in ("silu", "swish"), name,
            f"the output gate uses {module.o_norm.activation!r}", "Only the SiLU output gate converts")
    require(module.num_v_heads % module.num_k_heads == 0, name,
            f"num_v_heads={module.num_v_heads} is not a multiple of num_k_heads={module.num_k_heads}",
            "Fix the upstream config")
    return GatedDeltaNetConfig(hidden_size=module.hidden_size, head_dim=module.head_k_dim,
                               num_heads=module.num_k_heads, num_v_heads=module.num_v_heads,
                               expand_v=module.head_v_dim / module.head_k_dim, conv_size=module.conv_kernel_size,
                               allow_neg_eigval=bool(module.allow_neg_eigval),
                               norm_eps=float(module.o_norm.variance_epsilon))


def to_ours(sd, c: GatedDeltaNetConfig):
    q, k, v = sd["conv1d.weight"].split([c.key_dim, c.key_dim, c.value_dim], dim=0)
    return {**{key: sd[key] for key in _SAME}, "q_conv.weight": q, "k_conv.weight": k, "v_conv.weight": v}


def to_upstream(sd, c: GatedDeltaNetConfig):
    conv = torch.cat([sd["q_conv.weight"], sd["k_conv.weight"], sd["v_conv.weight"]], dim=0)
    return {**{key: sd[key] for key in _SAME}, "conv1d.weight": conv}


HF_OLMO_HYBRID = Source(name="hf_olmo_hybrid", description="transformers OlmoHybridGatedDeltaNet",
                        mixer=GatedDeltaNetMixer, config_type=GatedDeltaNetConfig, to_ours=to_ours,
                        to_upstream=to_upstream, read_config=read_config,
                        classes=("transformers:OlmoHybridGatedDeltaNet",))

SOURCES = (HF_OLMO_HYBRID,)
