"""Hugging Face Qwen3.5 gated delta net -> :class:`~mixers.GatedDeltaNetMixer` and back.

    D = hidden, Hk = key heads, Hv = value heads, K / V = key / value head dims, W = conv width

Qwen3.5's ``Qwen3_5GatedDeltaNet`` computes what Qwen3-Next's does (and ours): a SiLU depthwise
conv over ``[q, k, v]``, sigmoid beta, scalar decay ``-exp(A_log) * softplus(a + dt_bias)``, q/k
l2 norm in the kernel, value head ``h`` reading key head ``h // (Hv / Hk)``, a SiLU-gated RMS norm
before ``out_proj``. Only the projections are stored otherwise: flat blocks, not Qwen3-Next's
per-key-head interleave, so every map is a row split:

| Qwen3.5 | shape | ours |
|---|---|---|
| ``in_proj_qkv.weight`` | ``[2HkK + HvV, D]``, rows ``[q, k, v]`` | ``q_proj``, ``k_proj``, ``v_proj`` |
| ``in_proj_z.weight`` | ``[HvV, D]`` | ``g_proj.weight`` |
| ``in_proj_b.weight``, ``in_proj_a.weight`` | ``[Hv, D]`` each | ``b_proj.weight``, ``a_proj.weight`` |
| ``conv1d.weight`` | ``[2HkK + HvV, 1, W]``, rows ``[q, k, v]``, no bias | ``q_conv``, ``k_conv``, ``v_conv`` |
| ``norm.weight`` | ``[V]`` | ``o_norm.weight`` |
| ``out_proj.weight``, ``dt_bias``, ``A_log`` | | ``o_proj.weight``, ``dt_bias``, ``A_log`` |

The conv's activation is the model's ``hidden_act`` (also the MLP's): anything but SiLU is
refused, as are a conv or projection with a bias. ``norm_eps`` is the model's ``rms_norm_eps``.
Qwen3.5-MoE's ``Qwen3_5MoeGatedDeltaNet`` is the same layer (transformers declares it a subclass
with no change) and converts the same way.
"""

from __future__ import annotations

import torch

from ..layers import GatedDeltaNetConfig, GatedDeltaNetMixer
from ._source import Source
from .qwen3_next import read_gated_delta_config, shared_to_ours, shared_to_upstream

_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


def read_config(module) -> GatedDeltaNetConfig:
    """Our config from ``transformers`` ``Qwen3_5GatedDeltaNet``."""
    return read_gated_delta_config(module, _PROJECTIONS, activation="the conv activation (hidden_act)")


def to_ours(sd, c: GatedDeltaNetConfig):
    q, k, v = sd["in_proj_qkv.weight"].split([c.key_dim, c.key_dim, c.value_dim], dim=0)
    return {"q_proj.weight": q, "k_proj.weight": k, "v_proj.weight": v, "g_proj.weight": sd["in_proj_z.weight"],
            "b_proj.weight": sd["in_proj_b.weight"], "a_proj.weight": sd["in_proj_a.weight"],
            **shared_to_ours(sd, c)}


def to_upstream(sd, c: GatedDeltaNetConfig):
    shared = shared_to_upstream(sd, c, "hf_qwen3_5", "Qwen3.5")
    return {"in_proj_qkv.weight": torch.cat([sd["q_proj.weight"], sd["k_proj.weight"], sd["v_proj.weight"]]),
            "in_proj_z.weight": sd["g_proj.weight"], "in_proj_b.weight": sd["b_proj.weight"],
            "in_proj_a.weight": sd["a_proj.weight"], **shared}


HF_QWEN3_5 = Source(name="hf_qwen3_5", description="transformers Qwen3_5GatedDeltaNet",
                    mixer=GatedDeltaNetMixer, config_type=GatedDeltaNetConfig, to_ours=to_ours,
                    to_upstream=to_upstream, read_config=read_config,
                    classes=("transformers:Qwen3_5GatedDeltaNet", "transformers:Qwen3_5MoeGatedDeltaNet"))

SOURCES = (HF_QWEN3_5,)
