"""Metadata that used to pass validation and then give wrong results: each is now a
correct result or a clear error, and a layer never runs on a stale or contradictory copy."""

import numpy as np
import pytest
import torch

from mixers import GatedDeltaNetMixer, Mamba2Mixer
from mixers.ops import chunk_gated_delta_rule, varlen_attention
from ssm_pack import PackedSeqParams, VarlenBatch, build_packed_seq_idx
from tests.support.megatron_standin import MegatronPackedSeqParams

HIDDEN = 32


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64],
                         ids=lambda d: str(d).split(".")[1])
def test_non_monotone_offsets_are_refused_in_every_integer_dtype(dtype):
    # 9 -> 3 decreases; in uint8 the difference 3 - 9 wraps to 250, which passed before
    with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing, got 9 then 3"):
        PackedSeqParams(cu_seqlens_q=torch.tensor([0, 9, 3], dtype=dtype))


def test_overflowed_narrow_offsets_name_the_dtype():
    overflowed = torch.tensor([0, 100, 200], dtype=torch.int32).to(torch.int8)     # 200 wraps to -56
    with pytest.raises(ValueError, match=r"int8 holds at most 127: use int32"):
        PackedSeqParams(cu_seqlens_q=overflowed)


def test_seq_idx_contradicting_the_boundaries_is_refused():
    good = PackedSeqParams.from_lengths([3, 4], total_tokens=9)
    wrong = good.seq_idx.clone()
    wrong[0, 3] = 0                                         # token 3 claims document 0
    with pytest.raises(ValueError, match="seq_idx disagrees with the boundaries at token 3"):
        PackedSeqParams(cu_seqlens_q=good.cu_seqlens_q, total_tokens=9, seq_idx=wrong)
    assert torch.equal(PackedSeqParams(cu_seqlens_q=good.cu_seqlens_q, total_tokens=9, seq_idx=good.seq_idx).seq_idx,
                       good.seq_idx)


def test_boundaries_cannot_change_under_a_cached_seq_idx():
    params = PackedSeqParams.from_lengths([3, 4], total_tokens=7)
    with pytest.raises(AttributeError, match=r"cu_seqlens_q is fixed after construction.*params.replace"):
        params.cu_seqlens_q = torch.tensor([0, 5, 7], dtype=torch.int32)
    moved = params.replace(cu_seqlens_q=torch.tensor([0, 5, 7], dtype=torch.int32),
                           cu_seqlens_kv=torch.tensor([0, 5, 7], dtype=torch.int32))
    assert moved.seq_idx.tolist() == [[0] * 5 + [1] * 2]
    params.cu_seqlens_q[1] = 5                              # an in-place edit is detected before use
    with pytest.raises(ValueError, match="cu_seqlens_q was modified in place"):
        Mamba2Mixer(HIDDEN, head_dim=16, state_size=8)(torch.randn(1, 7, HIDDEN), packed_seq_params=params)
    params.cp_group = None                                  # the topology fields stay assignable


def test_kv_boundaries_other_than_q_are_refused_by_the_mixers():
    cu_q = torch.tensor([0, 3, 7], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=torch.tensor([0, 4, 7]),
                             total_tokens=7)
    with pytest.raises(ValueError, match="cu_seqlens_kv differs from cu_seqlens_q"):
        GatedDeltaNetMixer(HIDDEN, head_dim=8)(torch.randn(1, 7, HIDDEN), packed_seq_params=params)
    same = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_q.clone(), total_tokens=7)
    GatedDeltaNetMixer(HIDDEN, head_dim=8)(torch.randn(1, 7, HIDDEN), packed_seq_params=same)


def test_varlen_attention_refuses_a_max_seqlen_below_the_longest_document():
    q = torch.randn(12, 2, 8)
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"max_seqlen=5 is smaller than the longest document of cu_seqlens \(7"):
        varlen_attention(q, q, q, cu, 5)
    tail_only = varlen_attention(q, q, q, cu, 7)            # the 2-token tail is ssm-pack's, not the user's
    assert torch.equal(tail_only, varlen_attention(q, q, q, cu, None))


@pytest.mark.parametrize("boundaries", [
    pytest.param([0, 3, 7], id="list"),
    pytest.param(np.array([0, 3, 7]), id="numpy"),
    pytest.param(torch.tensor([0, 3, 7], dtype=torch.uint8), id="uint8-tensor"),
])
def test_boundaries_as_lists_and_arrays_are_accepted(boundaries):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 7, 2, 8, generator=g) for _ in range(3))
    gate, beta = -torch.rand(1, 7, 2, generator=g), torch.rand(1, 7, 2, generator=g)
    want, _ = chunk_gated_delta_rule(q, k, v, gate, beta, cu_seqlens=torch.tensor([0, 3, 7]))
    got, _ = chunk_gated_delta_rule(q, k, v, gate, beta, cu_seqlens=boundaries)
    assert torch.equal(got, want)
    assert torch.equal(PackedSeqParams.from_cu_seqlens(boundaries).cu_seqlens_q, torch.tensor([0, 3, 7],
                                                                                              dtype=torch.int32))


def test_boundaries_of_another_kind_are_refused_by_name():
    with pytest.raises(TypeError, match="packed_seq_params must be a PackedSeqParams"):
        VarlenBatch.build({"cu_seqlens": [0, 7]}, 7)
    with pytest.raises(TypeError, match="cu_seqlens must hold integers, got a numpy array of dtype float64"):
        VarlenBatch.build(np.array([0.0, 7.0]), 7)


def test_megatron_params_pack_exactly_like_ours():
    torch.manual_seed(0)
    layer = GatedDeltaNetMixer(HIDDEN, head_dim=8).double()
    x = torch.randn(1, 16, HIDDEN, dtype=torch.float64)
    ours = PackedSeqParams.from_lengths([5, 2, 4], pad_to_multiple_of=2, total_tokens=16)
    theirs = MegatronPackedSeqParams(qkv_format="thd", cu_seqlens_q=ours.cu_seqlens_q, cu_seqlens_kv=ours.cu_seqlens_kv,
                            cu_seqlens_q_padded=ours.cu_seqlens_q_padded,
                            cu_seqlens_kv_padded=ours.cu_seqlens_kv_padded, max_seqlen_q=6, max_seqlen_kv=6,
                            total_tokens=16)
    assert torch.equal(layer(x, packed_seq_params=theirs), layer(x, packed_seq_params=ours))
    assert torch.equal(build_packed_seq_idx(theirs, 16), build_packed_seq_idx(ours, 16))


def test_a_foreign_seq_idx_is_never_trusted():
    """Megatron's object may carry a seq_idx that disagrees with its boundaries: the boundaries win."""
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    stale = torch.zeros(1, 7, dtype=torch.int32)            # claims one document
    theirs = MegatronPackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, total_tokens=7, seq_idx=stale)
    assert VarlenBatch.build(theirs, 7).seq_idx.tolist() == [[0, 0, 0, 1, 1, 1, 1]]
