"""Hugging Face Qwen3-Next gated delta net -> :class:`~mixers.GatedDeltaNetMixer` and back.

    D = hidden, Hk = key heads, Hv = value heads, r = Hv / Hk, K / V = key / value head dims,
    W = conv width

Same math as ours (scalar decay ``-exp(A_log) * softplus(a + dt_bias)``, sigmoid beta, q/k l2
norm, SiLU-gated RMS norm before ``out_proj``), other storage:

| Qwen3-Next | shape | ours |
|---|---|---|
| ``in_proj_qkvz.weight`` | ``[Hk * (2K + 2rV), D]``: per key head ``[q K, k K, v rV, z rV]`` | ``q/k/v/g_proj`` |
| ``in_proj_ba.weight`` | ``[Hk * 2r, D]``: per key head ``[b r, a r]`` | ``b_proj``, ``a_proj`` |
| ``conv1d.weight`` | ``[2HkK + HvV, 1, W]``, rows ``[q, k, v]``, no bias | ``q_conv``, ``k_conv``, ``v_conv`` |
| ``norm.weight`` | ``[V]`` | ``o_norm.weight`` |
| ``out_proj.weight``, ``dt_bias``, ``A_log`` | | ``o_proj.weight``, ``dt_bias``, ``A_log`` |

Value head ``h`` belongs to key head ``h // r`` in both. ``norm_eps`` is the model's
``rms_norm_eps`` (1e-6 in the released configs; ours defaults to 1e-5, so the converted config
carries it).
"""

from __future__ import annotations

import torch

from ..layers import GatedDeltaNetConfig, GatedDeltaNetMixer
from ._source import Source, require


def read_gated_delta_config(module, projections: tuple[str, ...] = (),
                            activation: str = "the conv activation") -> GatedDeltaNetConfig:
    """Our config from a ``transformers`` gated delta net of the Qwen3-Next lineage (the checks
    Qwen3-Next and Qwen3.5 share), refusing a non-SiLU conv, a conv bias, a bias on any of
    ``projections`` and value heads that are not a multiple of the key heads."""
    name = type(module).__name__
    require(module.activation in ("silu", "swish"), name, f"{activation} is {module.activation!r}",
            "Only SiLU convolutions convert")
    require(module.conv1d.bias is None, name, "the conv has a bias", "Only bias-free convolutions convert")
    biased = [p for p in projections if getattr(module, p).bias is not None]
    require(not biased, name, f"the projections {biased} have a bias", "Only bias-free projections convert")
    require(module.num_v_heads % module.num_k_heads == 0, name,
            f"num_v_heads={module.num_v_heads} is not a multiple of num_k_heads={module.num_k_heads}",
            "Fix the upstream config")
    return GatedDeltaNetConfig(hidden_size=module.hidden_size, head_dim=module.head_k_dim,
                               num_heads=module.num_k_heads, num_v_heads=module.num_v_heads,
                               expand_v=module.head_v_dim / module.head_k_dim, conv_size=module.conv_kernel_size,
                               norm_eps=float(module.norm.variance_epsilon))


def read_config(module) -> GatedDeltaNetConfig:
    """Our config from ``transformers`` ``Qwen3NextGatedDeltaNet``."""
    return read_gated_delta_config(module)


def shared_to_ours(sd, c: GatedDeltaNetConfig):
    """The entries both layouts store alike: the ``[q, k, v]`` conv, the gated norm, ``out_proj``,
    ``dt_bias``, ``A_log``."""
    cq, ck, cv = sd["conv1d.weight"].split([c.key_dim, c.key_dim, c.value_dim], dim=0)
    return {"q_conv.weight": cq, "k_conv.weight": ck, "v_conv.weight": cv,
            "o_norm.weight": sd["norm.weight"], "o_proj.weight": sd["out_proj.weight"],
            "dt_bias": sd["dt_bias"], "A_log": sd["A_log"]}


def shared_to_upstream(sd, c: GatedDeltaNetConfig, source: str, family: str):
    """The inverse of :func:`shared_to_ours`; refuses ``allow_neg_eigval`` (neither layout has it)."""
    require(not c.allow_neg_eigval, source, "our config has allow_neg_eigval=True",
            f"{family} has no negative-eigenvalue beta; keep allow_neg_eigval=False")
    return {"conv1d.weight": torch.cat([sd["q_conv.weight"], sd["k_conv.weight"], sd["v_conv.weight"]], dim=0),
            "norm.weight": sd["o_norm.weight"], "out_proj.weight": sd["o_proj.weight"],
            "dt_bias": sd["dt_bias"], "A_log": sd["A_log"]}


def _sizes(c: GatedDeltaNetConfig):
    r = c.num_v_heads // c.num_heads
    return c.num_heads, r, c.head_dim, c.head_v_dim


def to_ours(sd, c: GatedDeltaNetConfig):
    hk, r, k, v = _sizes(c)
    qkvz = sd["in_proj_qkvz.weight"]
    q, kk, vv, z = qkvz.reshape(hk, 2 * k + 2 * r * v, -1).split([k, k, r * v, r * v], dim=1)
    b, a = sd["in_proj_ba.weight"].reshape(hk, 2 * r, -1).split([r, r], dim=1)
    width = qkvz.shape[-1]
    return {"q_proj.weight": q.reshape(-1, width), "k_proj.weight": kk.reshape(-1, width),
            "v_proj.weight": vv.reshape(-1, width), "g_proj.weight": z.reshape(-1, width),
            "b_proj.weight": b.reshape(-1, width), "a_proj.weight": a.reshape(-1, width),
            **shared_to_ours(sd, c)}


def to_upstream(sd, c: GatedDeltaNetConfig):
    shared = shared_to_upstream(sd, c, "hf_qwen3_next", "Qwen3-Next")
    hk, r, k, v = _sizes(c)
    width = sd["q_proj.weight"].shape[-1]
    qkvz = torch.cat([sd["q_proj.weight"].reshape(hk, k, width), sd["k_proj.weight"].reshape(hk, k, width),
                      sd["v_proj.weight"].reshape(hk, r * v, width), sd["g_proj.weight"].reshape(hk, r * v, width)],
                     dim=1)
    ba = torch.cat([sd["b_proj.weight"].reshape(hk, r, width), sd["a_proj.weight"].reshape(hk, r, width)], dim=1)
    return {"in_proj_qkvz.weight": qkvz.reshape(-1, width), "in_proj_ba.weight": ba.reshape(-1, width), **shared}


HF_QWEN3_NEXT = Source(name="hf_qwen3_next", description="transformers Qwen3NextGatedDeltaNet",
                       mixer=GatedDeltaNetMixer, config_type=GatedDeltaNetConfig, to_ours=to_ours,
                       to_upstream=to_upstream, read_config=read_config,
                       classes=("transformers:Qwen3NextGatedDeltaNet",))

SOURCES = (HF_QWEN3_NEXT,)
