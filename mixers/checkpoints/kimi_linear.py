"""Hugging Face Kimi-Linear's KDA layer -> :class:`~mixers.KDAMixer` and back.

    D = hidden, H = heads, K = head dim (values have the same), W = conv width

Same math as ours (per-channel decay ``-exp(A_log[h]) * softplus(f + dt_bias)``, sigmoid beta,
q/k l2 norm, sigmoid-gated RMS norm), other storage:

| Kimi-Linear | shape | ours |
|---|---|---|
| ``conv1d.weight`` | ``[3HK, 1, W]``, rows ``[q, k, v]``, no bias | ``q_conv``, ``k_conv``, ``v_conv`` |
| ``forget_gate.f_a_proj`` / ``f_b_proj`` | ``[K, D]`` / ``[HK, K]`` | ``f_proj.0`` / ``.1`` |
| ``forget_gate.dt_bias`` | ``[HK]`` | ``dt_bias`` |
| ``forget_gate.A_log`` | ``[1, 1, H, 1]`` | ``A_log`` ``[H]`` |
| ``g_a_proj`` / ``g_b_proj`` | ``[K, D]`` / ``[HK, K]``, no bias | ``g_proj.0`` / ``.1``, no bias |
| ``q_proj``, ``k_proj``, ``v_proj``, ``b_proj`` | | same names |
| ``o_norm``, ``o_proj`` | | same names |

``norm_eps`` is the model's ``rms_norm_eps`` (1e-6 by default).
"""

from __future__ import annotations

import torch

from ..layers import KDAConfig, KDAMixer
from ._source import Source, require

_SAME = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "b_proj.weight", "o_norm.weight", "o_proj.weight")
_RENAMED = {"f_proj.0.weight": "forget_gate.f_a_proj.weight", "f_proj.1.weight": "forget_gate.f_b_proj.weight",
            "dt_bias": "forget_gate.dt_bias", "g_proj.0.weight": "g_a_proj.weight",
            "g_proj.1.weight": "g_b_proj.weight"}


def read_config(module) -> KDAConfig:
    """Our config from ``transformers`` ``KimiLinearDeltaAttention``."""
    name = type(module).__name__
    require(module.activation in ("silu", "swish"), name, f"the conv activation is {module.activation!r}",
            "Only SiLU convolutions convert")
    require(module.conv1d.bias is None, name, "the conv has a bias", "Only bias-free convolutions convert")
    require(module.g_b_proj.bias is None, name, "g_b_proj has a bias", "Only the bias-free gate converts")
    return KDAConfig(hidden_size=module.hidden_size, head_dim=module.head_dim, num_heads=module.num_heads,
                     num_v_heads=module.num_heads, expand_v=1.0, conv_size=module.conv_kernel_size,
                     norm_eps=float(module.o_norm.variance_epsilon), output_gate_bias=False)


def to_ours(sd, c: KDAConfig):
    out = {k: sd[k] for k in _SAME}
    out.update({ours: sd[theirs] for ours, theirs in _RENAMED.items()})
    out["A_log"] = sd["forget_gate.A_log"].reshape(-1)
    out["q_conv.weight"], out["k_conv.weight"], out["v_conv.weight"] = sd["conv1d.weight"].split(c.key_dim, dim=0)
    return out


def to_upstream(sd, c: KDAConfig):
    require(not c.output_gate_bias, "hf_kimi_linear", "our KDAConfig has output_gate_bias=True",
            "Kimi-Linear's g_b_proj has no bias; use source='fla_kda' or a mixer built with output_gate_bias=False")
    require(c.num_v_heads == c.num_heads and c.head_v_dim == c.head_dim and not c.allow_neg_eigval,
            "hf_kimi_linear", "our config has grouped values, expand_v != 1 or allow_neg_eigval=True",
            "Kimi-Linear has none of them")
    out = {k: sd[k] for k in _SAME}
    out.update({theirs: sd[ours] for ours, theirs in _RENAMED.items()})
    out["forget_gate.A_log"] = sd["A_log"].reshape(1, 1, -1, 1)
    out["conv1d.weight"] = torch.cat([sd["q_conv.weight"], sd["k_conv.weight"], sd["v_conv.weight"]], dim=0)
    return out


HF_KIMI_LINEAR = Source(name="hf_kimi_linear", description="transformers KimiLinearDeltaAttention (Kimi-Linear's KDA)",
                        mixer=KDAMixer, config_type=KDAConfig, to_ours=to_ours, to_upstream=to_upstream,
                        read_config=read_config, classes=("transformers:KimiLinearDeltaAttention",))

SOURCES = (HF_KIMI_LINEAR,)
