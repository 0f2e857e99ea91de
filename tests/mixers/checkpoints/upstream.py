"""Tiny random-weight upstream layers on CPU, and fla's layers run on fla's own naive references.

fla's layers call Triton kernels; on a CPU they run here with those entry points replaced by
fla's ``naive_*`` recurrences and gates (``fla.ops.*.naive``, ``fla.ops.*.gate``), the layer's
own forward (projections, reshapes, gating, conv wiring) untouched. The glue below only does what
the kernels' flags say: l2-normalise q/k (fla's ``x / sqrt(sum x^2 + 1e-6)``), sigmoid beta
(times 2 with ``allow_neg_eigval``), a causal depthwise conv, a gated RMS norm.
Transformers' layers run their own torch paths: where transformers bound fla's kernel at import,
the decorated function's ``__wrapped__`` (transformers' torch code) is put back.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

_ACT = {"swish": F.silu, "silu": F.silu, "sigmoid": torch.sigmoid}


def _l2(x):
    x = x.float()
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + 1e-6)


def _beta(beta, sigmoid, neg):
    beta = beta.float().sigmoid() if sigmoid else beta.float()
    return beta * 2 if neg else beta


def _gva(q, k, heads):
    group = heads // q.shape[2]
    return q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)


def _gdn(q, k, v, g, beta, *, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
         use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, cu_seqlens=None, **_):
    from fla.ops.gated_delta_rule.gate import naive_gdn_gate
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
    assert cu_seqlens is None
    if use_gate_in_kernel:
        g = naive_gdn_gate(g, A_log, dt_bias)
    if use_qk_l2norm_in_kernel:
        q, k = _l2(q), _l2(k)
    q, k = _gva(q, k, v.shape[2])
    o, _ = naive_recurrent_gated_delta_rule(q, k, v, _beta(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval), g)
    return o.to(v.dtype), None


def _kda(q, k, v, g, beta, *, A_log=None, dt_bias=None, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
         use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None, cu_seqlens=None, **_):
    from fla.ops.kda.gate import naive_kda_gate
    from fla.ops.kda.naive import naive_recurrent_kda
    assert cu_seqlens is None and lower_bound is None
    if use_gate_in_kernel:
        g = naive_kda_gate(g, A_log, dt_bias)
    if use_qk_l2norm_in_kernel:
        q, k = _l2(q), _l2(k)
    o, _ = naive_recurrent_kda(q, k, v, g, _beta(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval))
    return o, None


def _gdp(q, k, v, g, beta, *, num_householder, use_qk_l2norm_in_kernel=False, cu_seqlens=None, **_):
    from fla.ops.gated_delta_product.naive import naive_recurrent_gated_delta_product
    assert cu_seqlens is None
    if use_qk_l2norm_in_kernel:
        q, k = _l2(q), _l2(k)
    return naive_recurrent_gated_delta_product(q, k, v.float(), g, beta, q.shape[-1] ** -0.5,
                                               num_householder=num_householder)[0], None


def _conv(x, weight, bias, activation):
    """Causal depthwise conv of ``x [B, T, C]`` with ``weight [C, W]``."""
    width = weight.shape[-1]
    y = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), bias, padding=width - 1, groups=x.shape[-1])
    y = y[..., :x.shape[1]].transpose(1, 2)
    return F.silu(y) if activation in ("silu", "swish") else y


def _short_conv_forward(self, x, residual=None, cache=None, output_final_state=False, cu_seqlens=None, **_):
    assert cache is None and cu_seqlens is None and residual is None
    return _conv(x, self.weight[:, 0], self.bias, self.activation), None


def _fused_conv(x, weight, bias=None, activation=None, **_):
    return _conv(x, weight, bias, activation), None


def _gated_norm_forward(self, x, g, residual=None, prenorm=False, residual_in_fp32=False):
    assert residual is None and not prenorm
    y = x.float() * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + self.eps) * self.weight.float()
    return (y * _ACT[self.activation](g.float())).to(x.dtype)


def fla_on_cpu(monkeypatch):
    """Make fla's GatedDeltaNet / KimiDeltaAttention / GatedDeltaProduct layers runnable on a CPU."""
    pytest.importorskip("fla")
    from fla.layers import gated_deltanet, gated_deltaproduct, kda
    from fla.modules import FusedRMSNormGated, ShortConvolution
    monkeypatch.setattr(gated_deltanet, "chunk_gated_delta_rule", _gdn)
    monkeypatch.setattr(gated_deltanet, "causal_conv1d", _fused_conv)
    monkeypatch.setattr(kda, "chunk_kda", _kda)
    monkeypatch.setattr(gated_deltaproduct, "chunk_gated_delta_product", _gdp)
    monkeypatch.setattr(ShortConvolution, "forward", _short_conv_forward)
    monkeypatch.setattr(FusedRMSNormGated, "forward", _gated_norm_forward)


def transformers_torch_paths(monkeypatch, module, *names):
    """Undo transformers' import-time routing of ``names`` in ``module`` to an installed kernel
    package (fla): its own torch implementation is the decorated function's ``__wrapped__``."""
    for name in names:
        fn = getattr(module, name)
        monkeypatch.setattr(module, name, getattr(fn, "__wrapped__", fn))


# ---- tiny random-weight upstream layers -----------------------------------------------------------

HIDDEN = 32


def _perturb(module: torch.nn.Module) -> torch.nn.Module:
    """Random weights everywhere (norm weights and conv biases away from their inits)."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return module.train()


def _quiet_transformers():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers


def hf_mamba2(monkeypatch):
    t = _quiet_transformers()
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer
    config = t.Mamba2Config(hidden_size=HIDDEN, num_heads=4, head_dim=16, expand=2, state_size=8, n_groups=2,
                            conv_kernel=4, chunk_size=8, num_hidden_layers=1, vocab_size=64, layer_norm_epsilon=1e-5)
    return _perturb(Mamba2Mixer(config, layer_idx=0))


def hf_bamba(monkeypatch):
    t = _quiet_transformers()
    from transformers.models.bamba.modeling_bamba import BambaMixer
    config = t.BambaConfig(hidden_size=HIDDEN, mamba_n_heads=4, mamba_d_head=16, mamba_expand=2, mamba_d_state=8,
                           mamba_n_groups=2, mamba_d_conv=4, mamba_chunk_size=8, num_hidden_layers=1,
                           attn_layer_indices=[], vocab_size=64, num_attention_heads=2, num_key_value_heads=1)
    return _perturb(BambaMixer(config, 0))


def hf_nemotron_h(monkeypatch):
    """3 heads of 16: an inner width (48) that is no multiple of hidden (32)."""
    t = _quiet_transformers()
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer
    config = t.NemotronHConfig(hidden_size=HIDDEN, mamba_num_heads=3, mamba_head_dim=16, ssm_state_size=8, n_groups=1,
                               conv_kernel=4, chunk_size=8, num_hidden_layers=1, hybrid_override_pattern="M",
                               vocab_size=64, num_attention_heads=2, num_key_value_heads=1)
    return _perturb(NemotronHMamba2Mixer(config, 0))


def hf_granite(monkeypatch):
    t = _quiet_transformers()
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridMambaLayer
    config = t.GraniteMoeHybridConfig(hidden_size=HIDDEN, mamba_n_heads=4, mamba_d_head=16, mamba_expand=2,
                                      mamba_d_state=8, mamba_n_groups=2, mamba_d_conv=4, mamba_chunk_size=8,
                                      num_hidden_layers=1, layer_types=["mamba"], vocab_size=64,
                                      num_attention_heads=2, num_key_value_heads=1)
    return _perturb(GraniteMoeHybridMambaLayer(config, 0))


def falcon_h1_config(**overrides):
    t = _quiet_transformers()
    kwargs = dict(hidden_size=HIDDEN, mamba_n_heads=3, mamba_d_head=16, mamba_d_ssm=48, mamba_d_state=8,
                  mamba_n_groups=1, mamba_d_conv=4, mamba_chunk_size=8, num_hidden_layers=1, vocab_size=64,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, mamba_rms_norm=True,
                  mamba_norm_before_gate=False)
    return t.FalconH1Config(**{**kwargs, **overrides})


def hf_falcon_h1(monkeypatch):
    """The mixer of a FalconH1Model (the model sets the muP vector); multipliers all 1."""
    _quiet_transformers()
    from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1Model
    return _perturb(FalconH1Model(falcon_h1_config()).layers[0].mamba)


def hf_qwen3_next(monkeypatch):
    """2 key heads of 16, 4 value heads of 24: grouped values and expand_v = 1.5."""
    t = _quiet_transformers()
    from transformers.models.qwen3_next import modeling_qwen3_next as q
    transformers_torch_paths(monkeypatch, q, "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
    config = t.Qwen3NextConfig(hidden_size=HIDDEN, linear_num_key_heads=2, linear_num_value_heads=4,
                               linear_key_head_dim=16, linear_value_head_dim=24, linear_conv_kernel_dim=4,
                               num_hidden_layers=1, layer_types=["linear_attention"], vocab_size=64,
                               num_attention_heads=2, num_key_value_heads=1)
    return _perturb(q.Qwen3NextGatedDeltaNet(config, 0))


def qwen3_5_config(**overrides):
    t = _quiet_transformers()
    kwargs = dict(hidden_size=HIDDEN, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                  linear_value_head_dim=24, linear_conv_kernel_dim=4, num_hidden_layers=1,
                  layer_types=["linear_attention"], vocab_size=64, num_attention_heads=2, num_key_value_heads=1)
    return t.Qwen3_5TextConfig(**{**kwargs, **overrides})


def hf_qwen3_5(monkeypatch):
    """Qwen3.5's flat projections; 2 key heads of 16, 4 value heads of 24 (grouped, expand_v = 1.5)."""
    _quiet_transformers()
    from transformers.models.qwen3_5 import modeling_qwen3_5 as q
    transformers_torch_paths(monkeypatch, q, "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
    return _perturb(q.Qwen3_5GatedDeltaNet(qwen3_5_config(), 0))


def hf_qwen3_5_moe(monkeypatch):
    """Qwen3.5-MoE's layer (transformers: Qwen3.5's, renamed); 2 key heads of 16, 2 value heads of 32."""
    t = _quiet_transformers()
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as q
    transformers_torch_paths(monkeypatch, q, "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
    config = t.Qwen3_5MoeTextConfig(hidden_size=HIDDEN, linear_num_key_heads=2, linear_num_value_heads=2,
                                    linear_key_head_dim=16, linear_value_head_dim=32, linear_conv_kernel_dim=3,
                                    num_hidden_layers=1, layer_types=["linear_attention"], vocab_size=64,
                                    num_attention_heads=2, num_key_value_heads=1)
    return _perturb(q.Qwen3_5MoeGatedDeltaNet(config, 0))


def kimi_config(**overrides):
    t = _quiet_transformers()
    linear = {"head_dim": 16, "num_heads": 2, "short_conv_kernel_size": 4, "kda_layers": [1], "full_attn_layers": []}
    kwargs = dict(hidden_size=HIDDEN, num_hidden_layers=1, vocab_size=64, num_attention_heads=2,
                  num_key_value_heads=1, linear_attn_config=linear)
    return t.KimiLinearConfig(**{**kwargs, **overrides})


def hf_kimi_linear(monkeypatch):
    _quiet_transformers()
    from transformers.models.kimi_linear import modeling_kimi_linear as k
    transformers_torch_paths(monkeypatch, k, "chunk_kimi_delta_attention", "recurrent_kimi_delta_attention")
    module = k.KimiLinearDeltaAttention(kimi_config(), 0)
    with torch.no_grad():                  # the layer leaves these empty until the model initialises them
        module.forget_gate.A_log.copy_(torch.empty_like(module.forget_gate.A_log).uniform_(1, 4).log())
        module.forget_gate.dt_bias.normal_()
    return _perturb(module)


def lfm2_config(**overrides):
    t = _quiet_transformers()
    kwargs = dict(hidden_size=HIDDEN, num_hidden_layers=1, layer_types=["conv"], vocab_size=64, conv_L_cache=3,
                  conv_bias=True, num_attention_heads=2, num_key_value_heads=1)
    return t.Lfm2Config(**{**kwargs, **overrides})


def hf_lfm2(monkeypatch):
    """LFM2's gated short conv with every bias on (``conv_bias=True``: in_proj, conv, out_proj)."""
    _quiet_transformers()
    from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv
    return _perturb(Lfm2ShortConv(lfm2_config(), 0))


def olmo_hybrid_config(**overrides):
    t = _quiet_transformers()
    kwargs = dict(hidden_size=HIDDEN, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                  linear_value_head_dim=24, linear_conv_kernel_dim=4, num_hidden_layers=2,
                  layer_types=["linear_attention", "full_attention"], vocab_size=64, num_attention_heads=2,
                  num_key_value_heads=1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return t.OlmoHybridConfig(**{**kwargs, **overrides})


def hf_olmo_hybrid(monkeypatch, **overrides):
    """OLMo-hybrid's gated delta net: 2 key heads of 16, 4 value heads of 24 (grouped,
    expand_v = 1.5), negative eigenvalues allowed (``linear_allow_neg_eigval``, its default)."""
    _quiet_transformers()
    from transformers.models.olmo_hybrid import modeling_olmo_hybrid as o
    transformers_torch_paths(monkeypatch, o, "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
    return _perturb(o.OlmoHybridGatedDeltaNet(olmo_hybrid_config(**overrides), 0))


def hf_lfm3(monkeypatch):
    """LFM3's copy of LFM2's gated short conv, every bias on, width 4."""
    t = _quiet_transformers()
    from transformers.models.lfm3.modeling_lfm3 import Lfm3ShortConv
    config = t.Lfm3Config(hidden_size=HIDDEN, num_hidden_layers=1, layer_types=["conv"], vocab_size=64,
                          conv_L_cache=4, conv_bias=True, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    return _perturb(Lfm3ShortConv(config, 0))


def hf_lfm2_moe(monkeypatch):
    """LFM2-MoE's copy of LFM2's gated short conv, bias-free (the released configs' ``conv_bias``)."""
    t = _quiet_transformers()
    from transformers.models.lfm2_moe.modeling_lfm2_moe import Lfm2MoeShortConv
    config = t.Lfm2MoeConfig(hidden_size=HIDDEN, num_hidden_layers=1, layer_types=["conv"], vocab_size=64,
                             conv_L_cache=3, conv_bias=False, num_attention_heads=2, num_key_value_heads=1)
    return _perturb(Lfm2MoeShortConv(config, 0))


def minimax_config(**overrides):
    t = _quiet_transformers()
    kwargs = dict(hidden_size=HIDDEN, num_attention_heads=4, head_dim=8, num_key_value_heads=2, num_hidden_layers=3,
                  layer_types=["linear_attention", "linear_attention", "full_attention"], block_size=16,
                  vocab_size=64, intermediate_size=16, num_local_experts=2, num_experts_per_tok=1)
    return t.MiniMaxConfig(**{**kwargs, **overrides})


def hf_minimax(monkeypatch, layer_idx=1):
    """MiniMax's lightning attention: layer 1 of 3 (slopes scaled by ~0.5), 4 heads of 8, blocks of 16 (so
    a 70-token row crosses its block algorithm's boundaries). Its forward takes the rotary tables and the
    mask positionally; this layer gets neither (it reads neither), so the plain ``module(x)`` call works."""
    _quiet_transformers()
    import functools

    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention
    module = _perturb(MiniMaxLightningAttention(minimax_config(), layer_idx))
    module.forward = functools.partial(module.forward, position_embeddings=None, attention_mask=None)
    return module


def zamba2_config(**overrides):
    t = _quiet_transformers()
    kwargs = dict(hidden_size=HIDDEN, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_ngroups=2,
                  n_mamba_heads=4, chunk_size=8, num_hidden_layers=1, layers_block_type=["mamba"], vocab_size=64,
                  num_attention_heads=2, num_key_value_heads=2, time_step_min=1.0)
    return t.Zamba2Config(**{**kwargs, **overrides})


def hf_zamba2(monkeypatch):
    """Zamba2's Mamba2 layer: 4 heads of 16 in 2 groups; its scan clamps dt from below at
    ``time_step_min``, 1.0 here so that the clamp bites (on about a quarter of the dt values)."""
    _quiet_transformers()
    from transformers.models.zamba2.modeling_zamba2 import Zamba2MambaMixer
    return _perturb(Zamba2MambaMixer(zamba2_config(), layer_idx=0))


def mamba1_config(family: str, **overrides):
    """Tiny Mamba / Falcon-Mamba / Jamba configs: E = 64, Ns = 8, R = 4, W = 4, with projection biases
    (Mamba, Falcon-Mamba) so that every key is exercised."""
    t = _quiet_transformers()
    if family == "jamba":
        kwargs = dict(hidden_size=HIDDEN, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4,
                      num_hidden_layers=1, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                      expert_layer_offset=1, num_experts=2, vocab_size=64, num_attention_heads=2,
                      num_key_value_heads=1, mamba_proj_bias=True)
        return t.JambaConfig(**{**kwargs, **overrides})
    kwargs = dict(hidden_size=HIDDEN, state_size=8, conv_kernel=4, expand=2, time_step_rank=4, num_hidden_layers=1,
                  vocab_size=64, use_bias=True, use_conv_bias=True)
    cls = t.FalconMambaConfig if family == "falcon_mamba" else t.MambaConfig
    return cls(**{**kwargs, **overrides})


def _hf_mamba1(family, cls_name, **overrides):
    import importlib
    _quiet_transformers()
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    config = mamba1_config(family, **overrides)
    if family == "jamba":
        return _perturb(module.JambaMambaMixer(config, layer_idx=0))
    # FalconMambaMixer's own initialisation reads its norms before building them: initialise here
    layer = getattr(module, cls_name)(config, layer_idx=0, initialize_mixer_weights=False)
    with torch.no_grad():
        layer.A_log.copy_(torch.arange(1, 9, dtype=torch.float32).log().expand_as(layer.A_log))
        layer.D.fill_(1.0)
    return _perturb(layer)


def hf_mamba(monkeypatch):
    return _hf_mamba1("mamba", "MambaMixer")


def hf_falcon_mamba(monkeypatch):
    return _hf_mamba1("falcon_mamba", "FalconMambaMixer", mixer_rms_eps=1e-5)


def hf_jamba(monkeypatch):
    """Jamba's Mamba layer: learnt dt / B / C norm weights (perturbed away from ones)."""
    return _hf_mamba1("jamba", "JambaMambaMixer")


def recurrent_gemma_config(**overrides):
    t = _quiet_transformers()
    kwargs = dict(hidden_size=HIDDEN, lru_width=48, num_attention_heads=4, num_key_value_heads=1, conv1d_width=4,
                  num_hidden_layers=2, block_types=["recurrent", "attention"], vocab_size=64, head_dim=8,
                  intermediate_size=64)
    return t.RecurrentGemmaConfig(**{**kwargs, **overrides})


def hf_recurrent_gemma(monkeypatch, **overrides):
    """RecurrentGemma's recurrent block (lru_width 48 > hidden 32, 4 gate blocks of 12), called as its
    decoder layer calls it on one unpacked sequence per row: positions 0.., no cache."""
    _quiet_transformers()
    from transformers.models.recurrent_gemma.modeling_recurrent_gemma import RecurrentGemmaRecurrentBlock
    module = RecurrentGemmaRecurrentBlock(recurrent_gemma_config(**overrides), 0)
    lru = module.rg_lru                         # its parameters are torch.empty until a model initialises them
    with torch.no_grad():
        for name in ("input_gate_weight", "recurrent_gate_weight"):
            getattr(lru, name).normal_(0.0, lru.block_width ** -0.5)
        for name in ("input_gate_bias", "recurrent_gate_bias"):
            getattr(lru, name).zero_()
        a = torch.empty_like(lru.recurrent_param).uniform_(0.9 ** 2, 0.999 ** 2).sqrt()
        lru.recurrent_param.copy_(torch.log(1 / a - 1))     # a = sigmoid(-recurrent_param) in [0.9, 0.999]
    module = _perturb(module)
    block = type(module)

    def forward(x):
        positions = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
        return block.forward(module, x, positions, None, use_cache=False)

    module.forward = forward
    return module


def _fla(monkeypatch, name, **kwargs):
    fla_on_cpu(monkeypatch)
    import fla.layers
    return _perturb(getattr(fla.layers, name)(hidden_size=HIDDEN, head_dim=16, num_heads=2, **kwargs))


def fla_gdn(monkeypatch):
    """Grouped values (4 value heads over 2 key heads), expand_v = 1.5."""
    return _fla(monkeypatch, "GatedDeltaNet", num_v_heads=4, expand_v=1.5)


def fla_gdn_neg(monkeypatch):
    return _fla(monkeypatch, "GatedDeltaNet", allow_neg_eigval=True)


def fla_kda(monkeypatch):
    return _fla(monkeypatch, "KimiDeltaAttention", num_v_heads=4)


def fla_gdp(monkeypatch):
    return _fla(monkeypatch, "GatedDeltaProduct", num_householder=2)


BUILDERS = {"hf_mamba2": hf_mamba2, "hf_bamba": hf_bamba, "hf_nemotron_h": hf_nemotron_h, "hf_granite": hf_granite,
            "hf_falcon_h1": hf_falcon_h1, "hf_qwen3_next": hf_qwen3_next, "hf_qwen3_5": hf_qwen3_5,
            "hf_qwen3_5_moe": hf_qwen3_5_moe, "hf_kimi_linear": hf_kimi_linear,
            "fla_gdn": fla_gdn, "fla_gdn_neg": fla_gdn_neg, "fla_kda": fla_kda, "fla_gdp": fla_gdp, "hf_lfm2": hf_lfm2,
            "hf_lfm3": hf_lfm3, "hf_olmo_hybrid": hf_olmo_hybrid, "hf_lfm2_moe": hf_lfm2_moe, "hf_zamba2": hf_zamba2,
            "hf_mamba": hf_mamba, "hf_falcon_mamba": hf_falcon_mamba, "hf_jamba": hf_jamba,
            "hf_recurrent_gemma": hf_recurrent_gemma, "hf_minimax": hf_minimax}
