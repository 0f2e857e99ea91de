"""The public names: every name a user imports today keeps importing from the same place.

A frozen list, written out by hand: the ``__all__`` of every public package, the module paths that
README.md and docs/*.md tell users to import from, and the command entry points. A module that
moves inside the packages keeps these working through re-exports; a name leaves this list only
on purpose (and with a CHANGELOG entry).
"""

from __future__ import annotations

import importlib

import pytest

PUBLIC = {
    "ssm_pack": (
        "ContextParallelLayout", "PackPlan", "PackStream", "PackedSeqParams", "PackingAlignmentWarning", "Segments",
        "VarlenBatch", "assemble_packed_sequence", "attention_mask_from_lengths", "balanced_bounds",
        "build_packed_seq_idx", "check_block_alignment", "check_causal_conv1d_support", "check_fla_conv_support",
        "check_fla_sequence_packing_support", "check_flash_attn_support", "check_mamba_sequence_packing_support",
        "check_mamba_ssd_support", "cu_seqlens_from_position_ids", "cu_seqlens_from_seq_idx", "cu_seqlens_to_lengths",
        "dense_segment_keep", "get_cu_seqlens", "hf_batch_from_packed_seq_params", "is_packed",
        "lengths_from_attention_mask", "lengths_to_cu_seqlens", "max_seqlen_from_cu_seqlens", "pack_language_shard",
        "pack_padded", "pack_stream", "packed_masks", "packed_seq_params_from_doc_ids",
        "packed_seq_params_from_hf_batch", "plan_packs", "position_ids_from_cu_seqlens", "resolve_cp_group",
        "resolve_tp_cp_group", "round_up_lengths", "segment_ids", "segment_of", "segment_starts",
        "seq_idx_from_cu_seqlens", "shard_for_context_parallel", "to_flash_attention_kwargs", "unpack_to_padded",
        "__version__",
    ),
    "ssm_pack.testing": (
        "TOLERANCES", "Leak", "LeakageCheckInconclusive", "Span", "assert_no_cross_document_leakage",
        "assert_packed_equals_unpacked", "bitwise_equal", "document_spans",
    ),
    "ssm_pack.pytest_plugin": ("packing_check",),
    "ssm_pack.support": ("triton_interpreter",),
    "ssm_pack.cp_layout_check": (
        "check_layout_agreement", "checks_run", "fingerprint", "layout_check_mode", "set_layout_check",
    ),
    "ssm_pack.__main__": ("main", "support_matrix"),
    "mixers": (
        "AttentionMixer", "GatedDeltaNetMixer", "GatedDeltaProductMixer", "GatedShortConvMixer", "HybridLM", "KDAMixer",
        "LightningMixer", "Mamba1Mixer", "Mamba2Mixer", "RGLRUMixer",
    ),
    "mixers.ops": (
        "attention_with_kvcache", "causal_conv1d_fn", "causal_conv1d_update", "chunk_gated_delta_product",
        "chunk_gated_delta_rule", "chunk_kda", "chunk_simple_gla", "fused_recurrent_gated_delta_product",
        "fused_recurrent_gated_delta_rule", "fused_recurrent_kda", "fused_recurrent_simple_gla",
        "gated_delta_product_step", "gated_delta_rule_step", "kda_step", "mamba_chunk_scan_combined", "rg_lru",
        "rg_lru_update", "segment_attention", "selective_scan_fn", "selective_scan_update", "selective_state_update",
        "varlen_attention",
    ),
    "mixers.ops.device_policy": (
        "ENV_VAR", "POLICIES", "branch_free_isolation", "device_policy", "forced_policy", "policy_for",
        "read_environment", "whole_tensor",
    ),
    "mixers.layers": (
        "AttentionConfig", "AttentionMixer", "GatedDeltaNetConfig", "GatedDeltaNetMixer", "GatedDeltaProductConfig",
        "GatedDeltaProductMixer", "GatedRMSNorm", "GatedShortConvConfig", "GatedShortConvMixer", "KDAConfig",
        "KDAMixer", "LightningConfig", "LightningMixer", "Mamba1Config", "Mamba1Mixer", "Mamba2Config", "Mamba2Mixer",
        "RGLRUConfig", "RGLRUMixer", "RMSNorm",
    ),
    "mixers.layers.config": (
        "AttentionConfig", "GatedDeltaNetConfig", "GatedDeltaProductConfig", "GatedShortConvConfig", "KDAConfig",
        "LightningConfig", "Mamba1Config", "Mamba2Config", "RGLRUConfig",
    ),
    "mixers.model": ("HybridLM",),
    "mixers.carry": ("CarriedStates",),
    "mixers.inference": (
        "ContinuousBatcher", "InferenceCache", "LayerCache", "SlotBatch", "SlotTable", "check_against_recompute",
        "generate",
    ),
    "mixers.checkpoints": (
        "SOURCES", "Source", "from_module", "from_state_dict", "load_checkpoint", "select", "source_of", "to_module",
        "to_state_dict",
    ),
    "mixers.integrations.transformers": (
        "PackedMixer", "disable_packing", "enable_packing", "packing_from_model_kwargs",
    ),
    "mixers.cli": ("main",),
    "mixers.demo": ("main",),
}

CASES = [pytest.param(module, name, id=f"{module}.{name}") for module, names in PUBLIC.items() for name in names]


@pytest.mark.parametrize("module,name", CASES)
def test_a_public_name_imports(module, name):
    assert hasattr(importlib.import_module(module), name), f"from {module} import {name} no longer works"


@pytest.mark.parametrize("module", [m for m in PUBLIC if m != "ssm_pack.__main__"])
def test_every_name_a_package_exports_is_listed(module):
    """``__all__`` promises the names: each one exists (a re-export not dropped on a move)."""
    mod = importlib.import_module(module)
    missing = [name for name in getattr(mod, "__all__", ()) if not hasattr(mod, name)]
    assert missing == []


def test_the_command_entry_point_is_the_one_pyproject_names():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert 'ssm-pack = "mixers.cli:main"' in text and "main" in PUBLIC["mixers.cli"]
