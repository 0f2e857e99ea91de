import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ssm_pack import PackedSeqParams, build_packed_seq_idx, get_cu_seqlens, seq_idx_from_cu_seqlens


def loop_seq_idx(cu, total):
    """Oracle: Megatron's definition, written as a loop over documents."""
    cu = list(cu) + [total]
    out = []
    for i in range(len(cu) - 1):
        out += [i] * (cu[i + 1] - cu[i])
    return out


def test_seed_example():
    params = PackedSeqParams(cu_seqlens_q=torch.tensor([0, 5, 7, 11], dtype=torch.int32))
    got = build_packed_seq_idx(params, 16)
    assert got.dtype == torch.int32 and got.shape == (1, 16)
    assert got.tolist() == [[0, 0, 0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 3]]


def test_no_extra_index_when_boundaries_cover_every_token():
    got = build_packed_seq_idx(torch.tensor([0, 5, 7, 11]), 11)
    assert got.tolist() == [[0] * 5 + [1] * 2 + [2] * 4]


def test_empty_documents_are_skipped():
    got = build_packed_seq_idx(torch.tensor([0, 2, 2, 2, 3]), 5)
    assert got.tolist() == [[0, 0, 3, 4, 4]]


def test_padded_boundaries_win():
    params = PackedSeqParams(cu_seqlens_q=torch.tensor([0, 3, 5]), cu_seqlens_q_padded=torch.tensor([0, 4, 8]))
    assert torch.equal(get_cu_seqlens(params), params.cu_seqlens_q_padded)
    assert build_packed_seq_idx(params, 8).tolist() == [[0, 0, 0, 0, 1, 1, 1, 1]]


def test_post_init_precomputes_seq_idx():
    params = PackedSeqParams(cu_seqlens_q=torch.tensor([0, 5, 7, 11]), total_tokens=16)
    assert params.seq_idx.tolist() == [[0, 0, 0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 3]]
    assert build_packed_seq_idx(params, 16) is params.seq_idx  # reused, not rebuilt
    assert build_packed_seq_idx(params, 18).shape == (1, 18)  # another length is rebuilt


def test_zero_tokens():
    assert build_packed_seq_idx(torch.tensor([0]), 0).shape == (1, 0)


@given(st.lists(st.integers(0, 9), max_size=40), st.integers(0, 12))
def test_matches_the_per_document_loop(lengths, tail):
    cu = torch.tensor([0] + lengths).cumsum(0)
    total = int(cu[-1]) + tail
    got = seq_idx_from_cu_seqlens(cu, total)
    assert got.tolist() == [loop_seq_idx(cu.tolist(), total)]


def test_refuses_total_tokens_before_the_last_boundary():
    with pytest.raises(ValueError, match="total_tokens=10 is smaller than the last boundary"):
        build_packed_seq_idx(torch.tensor([0, 5, 11]), 10)


def test_refuses_objects_without_boundaries():
    with pytest.raises(TypeError, match="packed_seq_params must be"):
        build_packed_seq_idx(object(), 4)
    with pytest.raises(ValueError, match="neither cu_seqlens_q_padded nor cu_seqlens_q"):
        build_packed_seq_idx(PackedSeqParams(), 4)


@given(st.lists(st.integers(0, 9), max_size=40), st.integers(0, 12))
def test_torch_path_equals_numpy_path(lengths, tail):
    import ssm_pack.seq_idx as mod
    cu = torch.tensor([0] + lengths).cumsum(0)
    total = int(cu[-1]) + tail
    fast = mod.seq_idx_from_cu_seqlens(cu, total)
    saved, mod._np = mod._np, None
    try:
        plain = mod.seq_idx_from_cu_seqlens(cu, total)
    finally:
        mod._np = saved
    assert plain.dtype == fast.dtype == torch.int32 and torch.equal(plain, fast)
