"""Mamba2 layouts -> :class:`~mixers.Mamba2Mixer` and back.

    D = hidden, E = d_inner = H * P, H = heads, P = head dim, G = groups, N = state size, W = conv width

Every upstream Mamba2 block stores the same tensors: ``in_proj`` ``[2E + 2GN + H, D]`` with rows
``[z | x B C | dt]``, a depthwise conv ``[E + 2GN, 1, W]`` with bias, ``dt_bias`` / ``A_log`` /
``D`` ``[H]``, a gated norm weight ``[E]`` (``rmsnorm(y * silu(z))`` per group) and ``out_proj``
``[D, E]``. Only the conv's names differ:

| source | conv keys |
|---|---|
| ``hf_mamba2`` (transformers Mamba2, Bamba, NemotronH, GraniteMoeHybrid, FalconH1) | ``conv1d.weight``, ``.bias`` |
| ``mamba_ssm`` (``mamba_ssm.modules.mamba2.Mamba2``) | ``conv1d.weight``, ``conv1d.bias`` |
| ``megatron`` (Megatron-core ``MambaMixer``, current) | ``conv1d_weight``, ``conv1d_bias`` |
| ``megatron_legacy`` (Megatron-core releases with an ``nn.Conv1d``) | ``conv1d.weight``, ``conv1d.bias`` |

ours: ``conv.weight``, ``conv.bias``. Options our mixer does not have are refused, never dropped:
projection biases, a conv without bias, ``D`` per channel (``D_has_hdim``), a gate applied after
the norm, no norm, FalconH1's muP multipliers unless all are 1, mamba-ssm's extra MLP channels
(``d_ssm < d_inner``).
"""

from __future__ import annotations

import torch

from ..layers import Mamba2Config, Mamba2Mixer
from ._source import Source, renaming, require

_CONV = {"conv.weight": "conv1d.weight", "conv.bias": "conv1d.bias"}

HF_CLASSES = tuple(f"transformers:{c}" for c in ("Mamba2Mixer", "BambaMixer", "NemotronHMamba2Mixer",
                                                "GraniteMoeHybridMambaLayer", "FalconH1Mixer"))


def _falcon_h1_is_plain(module, name: str) -> None:
    """FalconH1 scales the input and each in_proj section (muP) and may drop or reorder the norm;
    our mixer equals it only when every multiplier is 1 and the norm is gate-then-norm."""
    multiplier = getattr(module, "ssm_in_multiplier", 1.0)
    require(float(multiplier) == 1.0, name, f"ssm_in_multiplier={multiplier} scales the input",
            "Fold it into the checkpoint or use a FalconH1 config with ssm_in_multiplier=1")
    mup = getattr(module, "mup_vector", None)
    require(mup is None or bool(torch.all(mup == 1)), name,
            "mup_vector (config.ssm_multipliers) scales the in_proj sections",
            "Use a config whose ssm_multipliers are all 1")
    require(bool(getattr(module, "mamba_rms_norm", True)), name, "mamba_rms_norm=False (no gated norm)",
            "Only checkpoints with the gated RMS norm convert")


def read_hf_config(module) -> Mamba2Config:
    """Our config from a transformers Mamba2-style mixer (Mamba2Mixer, BambaMixer, NemotronHMamba2Mixer,
    GraniteMoeHybridMambaLayer, FalconH1Mixer); ``norm_eps`` is the module's own norm eps."""
    name = type(module).__name__
    if name == "FalconH1Mixer":
        _falcon_h1_is_plain(module, name)
    require(module.activation in ("silu", "swish"), name, f"the conv activation is {module.activation!r}",
            "Only SiLU convolutions convert")
    require(module.in_proj.bias is None and module.out_proj.bias is None, name,
            "in_proj / out_proj have biases (use_bias / mamba_proj_bias / projectors_bias)",
            "Only bias-free projections convert")
    require(module.conv1d.bias is not None, name, "the conv has no bias (use_conv_bias=False)",
            "Only convs with bias convert")
    norm = module.norm
    require(not getattr(norm, "norm_before_gate", False), name, "the gate is applied after the norm",
            "Only mamba's gate-then-norm (norm_before_gate=False) converts")
    heads, head_dim, groups = module.num_heads, module.head_dim, module.n_groups
    require(module.intermediate_size == heads * head_dim, name,
            f"intermediate_size={module.intermediate_size} != num_heads * head_dim = {heads * head_dim}",
            "Fix the upstream config")
    group_size = getattr(norm, "group_size", None) or module.intermediate_size // getattr(norm, "n_groups", groups)
    require(group_size * groups == module.intermediate_size, name,
            f"the norm groups ({group_size} channels) do not match n_groups={groups}",
            "Only a norm over the SSM groups converts")
    return Mamba2Config(hidden_size=module.in_proj.in_features, num_heads=heads, head_dim=head_dim,
                        state_size=module.ssm_state_size, num_groups=groups, conv_size=module.conv_kernel_size,
                        chunk_size=module.chunk_size, dt_limit=tuple(float(v) for v in module.time_step_limit),
                        norm_eps=float(norm.variance_epsilon))


def _is_te_extra_state(key: str, value) -> bool:
    """Transformer Engine's ``*._extra_state`` (FP8 scaling bookkeeping), never a weight."""
    return key.endswith("._extra_state") and (value is None or not isinstance(value, torch.Tensor)
                                              or value.dtype == torch.uint8 or value.numel() == 0)


_to_ours, _to_upstream = renaming(_CONV)
_mg_to_ours, _mg_to_upstream = renaming({"conv.weight": "conv1d_weight", "conv.bias": "conv1d_bias"})

HF_MAMBA2 = Source(
    name="hf_mamba2",
    description="transformers Mamba2Mixer (and the Mamba2 blocks of Bamba, NemotronH, GraniteMoeHybrid, FalconH1)",
    mixer=Mamba2Mixer, config_type=Mamba2Config, to_ours=_to_ours, to_upstream=_to_upstream,
    read_config=read_hf_config, classes=HF_CLASSES)

MAMBA_SSM = Source(
    name="mamba_ssm", description="mamba-ssm's mamba_ssm.modules.mamba2.Mamba2 (rmsnorm=True, d_ssm=None)",
    mixer=Mamba2Mixer, config_type=Mamba2Config, to_ours=_to_ours, to_upstream=_to_upstream)

MEGATRON = Source(
    name="megatron", description="Megatron-core MambaMixer (conv1d_weight / conv1d_bias parameters)",
    mixer=Mamba2Mixer, config_type=Mamba2Config, to_ours=_mg_to_ours, to_upstream=_mg_to_upstream,
    ignorable=_is_te_extra_state)

MEGATRON_LEGACY = Source(
    name="megatron_legacy", description="Megatron-core MambaMixer of releases with an nn.Conv1d (conv1d.weight)",
    mixer=Mamba2Mixer, config_type=Mamba2Config, to_ours=_to_ours, to_upstream=_to_upstream,
    ignorable=_is_te_extra_state)

SOURCES = (HF_MAMBA2, MAMBA_SSM, MEGATRON, MEGATRON_LEGACY)

HINTS = {
    "in_proj.layer_norm_weight": "in_proj.layer_norm_weight is the block's pre-norm that Transformer Engine fuses "
                                 "into in_proj, not part of the mixer: pop it (load it into your block's norm) "
                                 "and convert the rest",
    "D": "a D of d_inner entries (D_has_hdim=True) has no per-head equivalent",
}
