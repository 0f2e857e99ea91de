"""Tiny random-weight Hugging Face models of every class ``enable_packing`` accepts: two layers, one
SSM / linear-attention layer and one full-attention layer (FalconH1: both in each layer; Mamba2:
no attention; Zamba2: a Mamba2 layer, then its shared attention block before a second Mamba2
layer), hidden 32, vocabulary 64."""

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


def zamba2(monkeypatch, impl):
    """A Mamba2 layer, then a hybrid layer (the shared attention block with RoPE and LoRA adapters,
    then a Mamba2 layer); full multi-head attention (Zamba2's adapters need it)."""
    return transformers.Zamba2ForCausalLM(transformers.Zamba2Config(
        hidden_size=32, intermediate_size=64, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_ngroups=2,
        n_mamba_heads=4, chunk_size=8, num_hidden_layers=2, layers_block_type=["mamba", "hybrid"],
        use_mem_rope=True, use_shared_attention_adapter=True, adapter_rank=4, attn_implementation=impl,
        **{**SMALL, "num_key_value_heads": 2}))


def minimax(monkeypatch, impl):
    """A lightning-attention layer (layer 0 of 2: full slopes), then a full-attention layer; MoE of three
    experts, top two (so the router has gradients); MiniMax's own algorithm in blocks of 8."""
    return transformers.MiniMaxForCausalLM(transformers.MiniMaxConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        head_dim=16, block_size=8, num_local_experts=3, num_experts_per_tok=2, sliding_window=None,
        attn_implementation=impl, **SMALL))


FACTORIES = {f.__name__: f for f in (mamba2, bamba, nemotron_h, granite, falcon_h1, qwen3_next, qwen3_5, kimi_linear,
                                     lfm2, zamba2, minimax)}


def build(name: str, monkeypatch, impl: str = "sdpa") -> torch.nn.Module:
    """The model ``name`` in fp32 with every parameter moved off its init (seeded)."""
    torch.manual_seed(0)
    model = FACTORIES[name](monkeypatch, impl).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model
