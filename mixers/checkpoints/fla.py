"""flash-linear-attention layers -> our delta-rule mixers and back.

fla's ``GatedDeltaNet``, ``KimiDeltaAttention`` and ``GatedDeltaProduct`` store what our
:class:`~mixers.GatedDeltaNetMixer`, :class:`~mixers.KDAMixer` and
:class:`~mixers.GatedDeltaProductMixer` store, under the same names, except the three short
convolutions: fla's ``{q,k,v}_conv1d.weight`` are our ``{q,k,v}_conv.weight`` (``[C, 1, W]``
both). Options our mixers do not have are refused: no output gate, no short convolution, conv
biases, KDA's lower-bounded gate (``safe_gate`` / ``lower_bound``), Gated DeltaProduct without a
forget gate or with grouped values. ``norm_eps`` is the layer's ``o_norm.eps`` (1e-5 by default).
"""

from __future__ import annotations

from ..layers import (
    GatedDeltaNetConfig,
    GatedDeltaNetMixer,
    GatedDeltaProductConfig,
    GatedDeltaProductMixer,
    KDAConfig,
    KDAMixer,
)
from ._source import Source, renaming, require

_CONVS = {f"{x}_conv.weight": f"{x}_conv1d.weight" for x in "qkv"}
_to_ours, _to_upstream = renaming(_CONVS)


def _common(module, name: str) -> dict:
    """Sizes and checks every fla delta-rule layer shares."""
    require(getattr(module, "use_short_conv", True), name, "use_short_conv=False",
            "Only layers with the q/k/v short convolutions convert")
    require(not getattr(module, "conv_bias", False), name, "conv_bias=True", "Only bias-free convolutions convert")
    for conv in (module.q_conv1d, module.k_conv1d, module.v_conv1d):
        require(conv.activation in ("silu", "swish"), name, f"a short convolution uses {conv.activation!r}",
                "Only SiLU convolutions convert")
    head_v_dim = module.head_v_dim
    return dict(hidden_size=module.hidden_size, head_dim=module.head_k_dim, num_heads=module.num_heads,
                num_v_heads=module.num_v_heads, expand_v=head_v_dim / module.head_k_dim,
                conv_size=module.conv_size, allow_neg_eigval=bool(module.allow_neg_eigval),
                norm_eps=float(module.o_norm.eps))


def _swish_gate(module, name: str, flag: str) -> None:
    require(getattr(module, flag, True), name, f"{flag}=False (no output gate)", "Only gated layers convert")
    require(module.o_norm.activation in ("swish", "silu"), name,
            f"the output gate uses {module.o_norm.activation!r}", "Only the SiLU output gate converts")


def read_gdn_config(module) -> GatedDeltaNetConfig:
    """Our config from ``fla.layers.GatedDeltaNet``."""
    name = type(module).__name__
    _swish_gate(module, name, "use_gate")
    return GatedDeltaNetConfig(**_common(module, name))


def read_kda_config(module) -> KDAConfig:
    """Our config from ``fla.layers.KimiDeltaAttention``."""
    name = type(module).__name__
    require(not getattr(module, "safe_gate", False) and getattr(module, "lower_bound", None) is None, name,
            "the gate is lower-bounded (safe_gate / lower_bound)", "Only the unbounded softplus gate converts")
    return KDAConfig(**_common(module, name), output_gate_bias=module.g_proj[1].bias is not None)


def read_gdp_config(module) -> GatedDeltaProductConfig:
    """Our config from ``fla.layers.GatedDeltaProduct``."""
    name = type(module).__name__
    _swish_gate(module, name, "use_output_gate")
    require(getattr(module, "use_forget_gate", True), name, "use_forget_gate=False", "Only gated layers convert")
    require(module.num_v_heads == module.num_heads, name, f"num_v_heads={module.num_v_heads} != num_heads",
            "Only layers without grouped values convert")
    return GatedDeltaProductConfig(**_common(module, name), num_householder=module.num_householder)


def _kda_to_upstream(state_dict, config):
    require(config.output_gate_bias, "fla_kda", "our KDAConfig has output_gate_bias=False",
            "fla's KimiDeltaAttention always has the gate bias; use source='hf_kimi_linear'")
    return _to_upstream(state_dict, config)


FLA_GDN = Source(name="fla_gdn", description="fla.layers.GatedDeltaNet",
                 mixer=GatedDeltaNetMixer, config_type=GatedDeltaNetConfig, to_ours=_to_ours,
                 to_upstream=_to_upstream, read_config=read_gdn_config, classes=("fla:GatedDeltaNet",))
FLA_KDA = Source(name="fla_kda", description="fla.layers.KimiDeltaAttention",
                 mixer=KDAMixer, config_type=KDAConfig, to_ours=_to_ours,
                 to_upstream=_kda_to_upstream, read_config=read_kda_config, classes=("fla:KimiDeltaAttention",))
FLA_GDP = Source(name="fla_gdp", description="fla.layers.GatedDeltaProduct",
                 mixer=GatedDeltaProductMixer, config_type=GatedDeltaProductConfig, to_ours=_to_ours,
                 to_upstream=_to_upstream, read_config=read_gdp_config, classes=("fla:GatedDeltaProduct",))

SOURCES = (FLA_GDN, FLA_KDA, FLA_GDP)
