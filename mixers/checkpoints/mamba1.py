"""Hugging Face Mamba, Falcon-Mamba and Jamba selective-scan layers -> :class:`~mixers.Mamba1Mixer` and back.

    D = hidden, E = d_inner (``intermediate_size``), R = dt rank, Ns = state size, W = conv width

The same computation as our mixer, stored as transformers stores it; the map renames the conv
and, for Jamba, the three norms' weights:

| transformers (``MambaMixer`` / ``FalconMambaMixer`` / ``JambaMambaMixer``) | shape | ours |
|---|---|---|
| ``in_proj.weight`` (``.bias``), rows ``[x | z]`` | ``[2E, D]`` (``[2E]``) | ``in_proj.weight`` (``.bias``) |
| ``conv1d.weight`` (``.bias``), depthwise | ``[E, 1, W]`` (``[E]``) | ``conv.weight`` (``.bias``) |
| ``x_proj.weight``, rows ``[dt_low | B | C]`` | ``[R + 2 Ns, E]`` | ``x_proj.weight`` |
| ``dt_proj.weight`` / ``.bias`` | ``[E, R]`` / ``[E]`` | the same |
| ``A_log`` / ``D`` | ``[E, Ns]`` / ``[E]`` | the same |
| ``out_proj.weight`` (``.bias``) | ``[D, E]`` (``[D]``) | ``out_proj.weight`` (``.bias``) |
| Jamba: ``{dt,b,c}_layernorm.weight`` | ``[R]``, ``[Ns]``, ``[Ns]`` | ``dt_norm``, ``b_norm``, ``c_norm`` |

Falcon-Mamba's norms have no weight (its ``weight`` buffers are not saved and hold ones): our
``dt_bc_norm="weightless"`` with ``config.mixer_rms_eps``; Jamba's are ``"weighted"`` with
``config.rms_norm_eps``. Refused by name: an activation other than SiLU (``hidden_act``: the conv
and the gate), a conv that is not transformers' causal depthwise one, projections whose biases
disagree (``use_bias`` sets both), and a quantized config (``_is_quantized``: its ``dt_proj`` is
not a plain weight). ``use_mambapy`` / ``use_associative_scan`` and the ``time_step_*`` options
(initialisation) do not change the function and pass.
"""

from __future__ import annotations

from torch import nn

from ..layers import Mamba1Config, Mamba1Mixer
from ._source import Source, renaming, require, require_causal_depthwise_conv

_CONV = {"conv.weight": "conv1d.weight", "conv.bias": "conv1d.bias"}
_NORMS = {"dt_norm": "dt_layernorm.weight", "b_norm": "b_layernorm.weight", "c_norm": "c_layernorm.weight"}


def _norm(module, name: str) -> tuple[str | None, float]:
    """``(dt_bc_norm, eps)`` of ``module``: its norms' kind (the three must agree) and eps."""
    norms = [getattr(module, n, None) for n in ("dt_layernorm", "b_layernorm", "c_layernorm")]
    if all(n is None for n in norms):
        return None, 1e-6
    require(all(n is not None for n in norms), name, "only some of dt_layernorm, b_layernorm, c_layernorm exist",
            "Only all three norms or none convert")
    eps = {float(n.variance_epsilon) for n in norms}
    require(len(eps) == 1, name, f"the dt / B / C norms have different eps {sorted(eps)}", "Use one eps")
    weighted = [isinstance(n.weight, nn.Parameter) for n in norms]
    require(len(set(weighted)) == 1, name, "some dt / B / C norms have learnt weights and some not",
            "Only all three weighted (Jamba) or all weightless (Falcon-Mamba) convert")
    return ("weighted" if weighted[0] else "weightless"), eps.pop()


def read_config(module) -> Mamba1Config:
    """Our config from transformers' ``MambaMixer``, ``FalconMambaMixer`` or ``JambaMambaMixer``."""
    name = type(module).__name__
    conv, in_proj, out_proj = module.conv1d, module.in_proj, module.out_proj
    require(getattr(module, "activation", None) in ("silu", "swish"), name,
            f"hidden_act is {getattr(module, 'activation', None)!r}",
            "Only SiLU (the conv's activation and the gate) converts")
    require(not hasattr(module.config, "_is_quantized"), name, "the config is quantized (_is_quantized)",
            "Dequantize the model before converting")
    inner = module.intermediate_size
    require_causal_depthwise_conv(conv, name, inner, "Only transformers' depthwise conv1d over intermediate_size "
                                  "converts")
    require((in_proj.bias is None) == (out_proj.bias is None), name,
            "in_proj and out_proj disagree on a bias", "Give both projections a bias or neither (use_bias)")
    require(module.dt_proj.bias is not None, name, "dt_proj has no bias", "Only dt_proj with its bias converts")
    norm, eps = _norm(module, name)
    return Mamba1Config(hidden_size=in_proj.in_features, d_inner=inner, state_size=module.ssm_state_size,
                        conv_size=conv.kernel_size[0], dt_rank=module.time_step_rank, conv_bias=conv.bias is not None,
                        proj_bias=in_proj.bias is not None, dt_bc_norm=norm, norm_eps=eps)


def _refusing(norm: str | None, source: str, to_ours, to_upstream):
    """``to_upstream`` refusing our configs whose norm option ``source`` cannot store."""
    def back(sd, c: Mamba1Config):
        require(c.dt_bc_norm == norm, source, f"our config has dt_bc_norm={c.dt_bc_norm!r}",
                f"{source} stores dt_bc_norm={norm!r} only")
        return to_upstream(sd, c)
    return to_ours, back


def _source(name, description, norm, mapping, cls) -> Source:
    to_ours, to_upstream = _refusing(norm, name, *renaming(mapping))
    return Source(name=name, description=description, mixer=Mamba1Mixer, config_type=Mamba1Config, to_ours=to_ours,
                  to_upstream=to_upstream, read_config=read_config, classes=(f"transformers:{cls}",))


HF_MAMBA = _source("hf_mamba", "transformers MambaMixer (Mamba)", None, _CONV, "MambaMixer")
HF_FALCON_MAMBA = _source("hf_falcon_mamba", "transformers FalconMambaMixer (Falcon-Mamba)", "weightless", _CONV,
                          "FalconMambaMixer")
HF_JAMBA = _source("hf_jamba", "transformers JambaMambaMixer (the Mamba layers of Jamba)", "weighted",
                   {**_CONV, **_NORMS}, "JambaMambaMixer")

SOURCES = (HF_MAMBA, HF_FALCON_MAMBA, HF_JAMBA)
