"""Tiny random-weight Hugging Face models of every class ``enable_packing`` accepts: two layers, one
SSM / linear-attention layer and one full-attention layer (FalconH1: both in each layer; Mamba2:
no attention; Zamba2: a Mamba2 layer, then its shared attention block before a second Mamba2
layer; LFM3: sliding-window attention; Mamba and Falcon-Mamba: two selective-scan layers, no
attention; Jamba: a selective-scan layer, then an attention layer with a mixture of experts;
RecurrentGemma: two recurrent blocks, then local attention; MiniMax: a lightning-attention layer, then
full attention, each with a mixture of experts), hidden 32, vocabulary 64."""

import pytest
import torch

from tests.mixers.checkpoints.upstream import kimi_config, transformers_torch_paths

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
VOCAB = 64
SMALL = dict(vocab_size=VOCAB, num_attention_heads=2, num_key_value_heads=1)


def mamba2(monkeypatch, impl):
    return transformers.Mamba2ForCausalLM(transformers.Mamba2Config(
        hidden_size=32, num_heads=4, head_dim=16, expand=2, state_size=8, n_groups=2, chunk_size=8,
        num_hidden_layers=2, vocab_size=VOCAB))


def bamba(monkeypatch, impl):
    return transformers.BambaForCausalLM(transformers.BambaConfig(
        hidden_size=32, intermediate_size=64, mamba_n_heads=4, mamba_d_head=16, mamba_expand=2, mamba_d_state=8,
        mamba_n_groups=2, mamba_chunk_size=8, num_hidden_layers=2, attn_layer_indices=[1],
        attn_implementation=impl, **SMALL))


def nemotron_h(monkeypatch, impl):
    return transformers.NemotronHForCausalLM(transformers.NemotronHConfig(
        hidden_size=32, intermediate_size=64, mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, n_groups=2,
        conv_kernel=4, chunk_size=8, num_hidden_layers=2, hybrid_override_pattern="M*", head_dim=16,
        attn_implementation=impl, **SMALL))


def granite(monkeypatch, impl):
    return transformers.GraniteMoeHybridForCausalLM(transformers.GraniteMoeHybridConfig(
        hidden_size=32, intermediate_size=64, mamba_n_heads=4, mamba_d_head=16, mamba_expand=2, mamba_d_state=8,
        mamba_n_groups=2, mamba_d_conv=4, mamba_chunk_size=8, num_hidden_layers=2,
        layer_types=["mamba", "attention"], num_local_experts=2, num_experts_per_tok=1, shared_intermediate_size=64,
        attn_implementation=impl, **SMALL))


def falcon_h1(monkeypatch, impl):
    return transformers.FalconH1ForCausalLM(transformers.FalconH1Config(
        hidden_size=32, intermediate_size=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_ssm=64, mamba_d_state=8,
        mamba_n_groups=2, mamba_d_conv=4, mamba_chunk_size=8, num_hidden_layers=2, head_dim=16,
        mamba_rms_norm=True, mamba_norm_before_gate=False, attn_implementation=impl, **SMALL))


def qwen3_next(monkeypatch, impl):
    from transformers.models.qwen3_next import modeling_qwen3_next as q
    transformers_torch_paths(monkeypatch, q, "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
    return transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
        hidden_size=32, intermediate_size=64, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], head_dim=16, num_experts=0,
        attn_implementation=impl, **SMALL))


def qwen3_5(monkeypatch, impl):
    from transformers.models.qwen3_5 import modeling_qwen3_5 as q
    transformers_torch_paths(monkeypatch, q, "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
    return transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(
        hidden_size=32, intermediate_size=64, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], head_dim=16, attn_implementation=impl, **SMALL))


def kimi_linear(monkeypatch, impl):
    from transformers.models.kimi_linear import modeling_kimi_linear as k
    transformers_torch_paths(monkeypatch, k, "chunk_kimi_delta_attention", "recurrent_kimi_delta_attention")
    config = kimi_config(num_hidden_layers=2, intermediate_size=64, attn_implementation=impl, pad_token_id=0,
                         num_key_value_heads=2, mlp_layer_types=["dense", "dense"],
                         linear_attn_config={"head_dim": 16, "num_heads": 2, "short_conv_kernel_size": 4,
                                             "kda_layers": [1], "full_attn_layers": [2]})
    model = transformers.KimiLinearForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.self_attn, "forget_gate", None)
            if gate is not None:
                gate.A_log.copy_(torch.empty_like(gate.A_log).uniform_(1, 4).log())
                gate.dt_bias.normal_()
    return model


def lfm2(monkeypatch, impl):
    return transformers.Lfm2ForCausalLM(transformers.Lfm2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, layer_types=["conv", "full_attention"],
        conv_L_cache=3, conv_bias=True, attn_implementation=impl, **SMALL))


def lfm3(monkeypatch, impl):
    """A gated short conv layer, then a sliding-window attention layer (window 8, shorter than the
    documents; RoPE, q/k norms, a sigmoid output gate per head, sandwich norms)."""
    return transformers.Lfm3ForCausalLM(transformers.Lfm3Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, layer_types=["conv", "sliding_attention"],
        sliding_window=8, conv_L_cache=4, conv_bias=False, head_dim=16, use_attention_gate=True,
        use_sandwich_norm=True, pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation=impl, **SMALL))


def lfm2_moe(monkeypatch, impl):
    """A gated short conv layer with a dense MLP, then an attention layer with two experts."""
    return transformers.Lfm2MoeForCausalLM(transformers.Lfm2MoeConfig(
        hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        layer_types=["conv", "full_attention"], num_dense_layers=1, num_experts=2, num_experts_per_tok=1,
        conv_L_cache=3, attn_implementation=impl, **SMALL))


def olmo_hybrid(monkeypatch, impl):
    """A gated delta net layer (negative eigenvalues allowed, OLMo-hybrid's default; grouped
    values), then an attention layer with q / k norms over all heads and no RoPE (NoPE, as the
    released checkpoints: ``rope_theta`` None)."""
    from transformers.models.olmo_hybrid import modeling_olmo_hybrid as o
    transformers_torch_paths(monkeypatch, o, "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
    return transformers.OlmoHybridForCausalLM(transformers.OlmoHybridConfig(
        hidden_size=32, intermediate_size=64, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], head_dim=16, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": None}, attn_implementation=impl,
        **SMALL))


def zamba2(monkeypatch, impl):
    """A Mamba2 layer, then a hybrid layer (the shared attention block with RoPE and LoRA adapters,
    then a Mamba2 layer); full multi-head attention (Zamba2's adapters need it)."""
    return transformers.Zamba2ForCausalLM(transformers.Zamba2Config(
        hidden_size=32, intermediate_size=64, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_ngroups=2,
        n_mamba_heads=4, chunk_size=8, num_hidden_layers=2, layers_block_type=["mamba", "hybrid"],
        use_mem_rope=True, use_shared_attention_adapter=True, adapter_rank=4, attn_implementation=impl,
        **{**SMALL, "num_key_value_heads": 2}))


MAMBA1 = dict(hidden_size=32, state_size=8, conv_kernel=4, expand=2, time_step_rank=4, num_hidden_layers=2,
              vocab_size=VOCAB, use_bias=True)


def mamba(monkeypatch, impl):
    """Projection biases on, so the converter's every key runs."""
    return transformers.MambaForCausalLM(transformers.MambaConfig(**MAMBA1))


def falcon_mamba(monkeypatch, impl):
    """Weightless RMS norms on dt, B and C (eps 1e-5, not the default, so a wrong eps shows)."""
    return transformers.FalconMambaForCausalLM(transformers.FalconMambaConfig(**MAMBA1, mixer_rms_eps=1e-5))


def jamba(monkeypatch, impl):
    """A selective-scan layer with weighted dt / B / C norms, then attention with 2 experts."""
    return transformers.JambaForCausalLM(transformers.JambaConfig(
        hidden_size=32, intermediate_size=64, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4,
        num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
        num_experts=2, num_experts_per_tok=1, attn_implementation=impl, **SMALL))


def recurrent_gemma(monkeypatch, impl):
    """Griffin's pattern (two recurrent blocks, one local attention block) with a sliding window of
    4 tokens, shorter than the test documents; 4 gate blocks. lru_width stays hidden_size: with another
    width the unpatched model's one-token (decode-branch) call fails, its conv state being sized for
    hidden_size (the converter tests cover lru_width 48)."""
    return transformers.RecurrentGemmaForCausalLM(transformers.RecurrentGemmaConfig(
        hidden_size=32, lru_width=32, intermediate_size=64, num_hidden_layers=3, head_dim=8, conv1d_width=4,
        block_types=["recurrent", "recurrent", "attention"], attention_window_size=4, attn_implementation=impl,
        **{**SMALL, "num_attention_heads": 4}))


def minimax(monkeypatch, impl):
    """A lightning-attention layer (layer 0 of 2: full slopes), then a full-attention layer; MoE of three
    experts, top two (so the router has gradients); MiniMax's own algorithm in blocks of 8."""
    return transformers.MiniMaxForCausalLM(transformers.MiniMaxConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        head_dim=16, block_size=8, num_local_experts=3, num_experts_per_tok=2, sliding_window=None,
        attn_implementation=impl, **SMALL))


FACTORIES = {f.__name__: f for f in (mamba2, bamba, nemotron_h, granite, falcon_h1, qwen3_next, qwen3_5, kimi_linear,
                                     lfm2, zamba2, lfm3, lfm2_moe, olmo_hybrid, mamba, falcon_mamba, jamba,
                                     recurrent_gemma, minimax)}


def build(name: str, monkeypatch, impl: str = "sdpa") -> torch.nn.Module:
    """The model ``name`` in fp32 with every parameter moved off its init (seeded)."""
    torch.manual_seed(0)
    model = FACTORIES[name](monkeypatch, impl).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model
