"""Hugging Face Zamba2's Mamba2 layer (``Zamba2MambaMixer``) -> :class:`~mixers.Mamba2Mixer` and back.

    D = hidden, E = d_inner = H * P, H = heads, P = head dim, G = groups, N = state size, W = conv width

The same computation as our mixer, stored as transformers' Mamba2 stores it, so the map only
renames the conv:

| Zamba2 (``Zamba2MambaMixer``) | shape | ours |
|---|---|---|
| ``in_proj.weight``, rows ``[z | x B C | dt]`` | ``[2E + 2GN + H, D]`` | ``in_proj.weight`` |
| ``conv1d.weight`` / ``.bias`` (always a bias) | ``[E + 2GN, 1, W]`` / ``[E + 2GN]`` | ``conv.weight`` / ``.bias`` |
| ``dt_bias``, ``A_log``, ``D`` (per head) | ``[H]`` | the same |
| ``norm.weight`` (``rmsnorm(y * silu(z))`` per group, eps 1e-5) | ``[E]`` | ``norm.weight`` |
| ``out_proj.weight`` | ``[D, E]`` | ``out_proj.weight`` |

Zamba2 clamps ``softplus(dt + dt_bias)`` from below at ``config.time_step_min`` in its scan
(``time_step_limit = (time_step_min, inf)``): it becomes our ``dt_limit``. ``config.add_bias_linear``
(biases on ``in_proj`` / ``out_proj``) is refused, as is any layer whose sizes do not add up
(``n_mamba_heads * mamba_headdim != mamba_expand * hidden_size``, norm groups other than
``mamba_ngroups``). ``config.use_conv_bias`` does not reach the layer (its conv always has a bias).
"""

from __future__ import annotations

from ..layers import Mamba2Config, Mamba2Mixer
from ._source import Source, renaming, require

_FIX = "Only Zamba2MambaMixer as transformers builds it converts"


def read_config(module) -> Mamba2Config:
    """Our config from ``transformers`` ``Zamba2MambaMixer``; ``norm_eps`` is its gated norm's eps."""
    name = type(module).__name__
    require(module.activation in ("silu", "swish"), name, f"the conv activation is {module.activation!r}",
            "Only SiLU convolutions convert")
    require(module.in_proj.bias is None and module.out_proj.bias is None, name,
            "in_proj / out_proj have biases (config.add_bias_linear=True)",
            "Only bias-free projections (add_bias_linear=False) convert")
    require(module.conv1d.bias is not None, name, "the conv has no bias", _FIX)
    heads, head_dim, groups = module.num_heads, module.head_dim, module.n_groups
    require(module.intermediate_size == heads * head_dim, name,
            f"intermediate_size={module.intermediate_size} != n_mamba_heads * mamba_headdim = {heads * head_dim}",
            "Use a config whose mamba_expand * hidden_size is a multiple of n_mamba_heads")
    norm = module.norm
    require(norm.group_size * groups == module.intermediate_size, name,
            f"the gated norm's groups ({norm.group_size} channels) do not match mamba_ngroups={groups}",
            "Only a norm over the SSM groups converts")
    low, high = (float(v) for v in module.time_step_limit)
    return Mamba2Config(hidden_size=module.in_proj.in_features, num_heads=heads, head_dim=head_dim,
                        state_size=module.ssm_state_size, num_groups=groups, conv_size=module.conv_kernel_size,
                        chunk_size=module.chunk_size, dt_limit=(low, high), norm_eps=float(norm.variance_epsilon))


_to_ours, _to_upstream = renaming({"conv.weight": "conv1d.weight", "conv.bias": "conv1d.bias"})

HF_ZAMBA2 = Source(
    name="hf_zamba2", description="transformers Zamba2MambaMixer (the Mamba2 layers of Zamba2)",
    mixer=Mamba2Mixer, config_type=Mamba2Config, to_ours=_to_ours, to_upstream=_to_upstream,
    read_config=read_config, classes=("transformers:Zamba2MambaMixer",))

SOURCES = (HF_ZAMBA2,)
