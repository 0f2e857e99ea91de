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
from ._source import Source, require

_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


def read_config(module) -> GatedDeltaNetConfig:
    """Our config from ``transformers`` ``Qwen3_5GatedDeltaNet``."""
    name = type(module).__name__
    require(module.activation in ("silu", "swish"), name, f"the conv activation (hidden_act) is {module.activation!r}",
            "Only SiLU convolutions convert")
    require(module.conv1d.bias is None, name, "the conv has a bias", "Only bias-free convolutions convert")
    biased = [p for p in _PROJECTIONS if getattr(module, p).bias is not None]
    require(not biased, name, f"the projections {biased} have a bias", "Only bias-free projections convert")
    require(module.num_v_heads % module.num_k_heads == 0, name,
            f"num_v_heads={module.num_v_heads} is not a multiple of num_k_heads={module.num_k_heads}",
            "Fix the upstream config")
    return GatedDeltaNetConfig(hidden_size=module.hidden_size, head_dim=module.head_k_dim,
                               num_heads=module.num_k_heads, num_v_heads=module.num_v_heads,
                               expand_v=module.head_v_dim / module.head_k_dim, conv_size=module.conv_kernel_size,
                               norm_eps=float(module.norm.variance_epsilon))


def to_ours(sd, c: GatedDeltaNetConfig):
    split = [c.key_dim, c.key_dim, c.value_dim]
    q, k, v = sd["in_proj_qkv.weight"].split(split, dim=0)
    cq, ck, cv = sd["conv1d.weight"].split(split, dim=0)
    return {"q_proj.weight": q, "k_proj.weight": k, "v_proj.weight": v, "g_proj.weight": sd["in_proj_z.weight"],
            "b_proj.weight": sd["in_proj_b.weight"], "a_proj.weight": sd["in_proj_a.weight"],
            "q_conv.weight": cq, "k_conv.weight": ck, "v_conv.weight": cv,
            "o_norm.weight": sd["norm.weight"], "o_proj.weight": sd["out_proj.weight"],
            "dt_bias": sd["dt_bias"], "A_log": sd["A_log"]}


def to_upstream(sd, c: GatedDeltaNetConfig):
    require(not c.allow_neg_eigval, "hf_qwen3_5", "our config has allow_neg_eigval=True",
            "Qwen3.5 has no negative-eigenvalue beta; keep allow_neg_eigval=False")
    return {"in_proj_qkv.weight": torch.cat([sd["q_proj.weight"], sd["k_proj.weight"], sd["v_proj.weight"]]),
            "in_proj_z.weight": sd["g_proj.weight"], "in_proj_b.weight": sd["b_proj.weight"],
            "in_proj_a.weight": sd["a_proj.weight"],
            "conv1d.weight": torch.cat([sd["q_conv.weight"], sd["k_conv.weight"], sd["v_conv.weight"]]),
            "norm.weight": sd["o_norm.weight"], "out_proj.weight": sd["o_proj.weight"],
            "dt_bias": sd["dt_bias"], "A_log": sd["A_log"]}


HF_QWEN3_5 = Source(name="hf_qwen3_5", description="transformers Qwen3_5GatedDeltaNet",
                    mixer=GatedDeltaNetMixer, config_type=GatedDeltaNetConfig, to_ours=to_ours,
                    to_upstream=to_upstream, read_config=read_config,
                    classes=("transformers:Qwen3_5GatedDeltaNet", "transformers:Qwen3_5MoeGatedDeltaNet"))

SOURCES = (HF_QWEN3_5,)
