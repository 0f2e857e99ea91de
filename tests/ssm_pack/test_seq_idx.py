import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ssm_pack import PackedSeqParams, VarlenBatch, build_packed_seq_idx, get_cu_seqlens, seq_idx_from_cu_seqlens
from ssm_pack.formats.seq_idx import renumber_seq_idx
from tests.support.megatron_standin import megatron_copy


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
    import ssm_pack.formats.seq_idx as mod
    cu = torch.tensor([0] + lengths).cumsum(0)
    total = int(cu[-1]) + tail
    fast = mod.seq_idx_from_cu_seqlens(cu, total)
    saved, mod._np = mod._np, None
    try:
        plain = mod.seq_idx_from_cu_seqlens(cu, total)
    finally:
        mod._np = saved
    assert plain.dtype == fast.dtype == torch.int32 and torch.equal(plain, fast)



def test_checked_boundaries_without_numpy_take_the_torch_path(monkeypatch):
    import ssm_pack.formats.seq_idx as mod
    monkeypatch.setattr(mod, "_np", None)
    params = PackedSeqParams.from_lengths([2, 0, 3], total_tokens=7)
    assert params.seq_idx.tolist() == [[0, 0, 2, 2, 2, 3, 3]] and params.seq_idx.dtype == torch.int32


def test_checked_boundaries_off_the_cpu_are_never_read():
    """``meta`` stands in for a GPU: numpy cannot take its tensor, the torch path reads no value."""
    from ssm_pack.formats.seq_idx import seq_idx_of_checked
    seq = seq_idx_of_checked(torch.tensor([0, 2, 5], dtype=torch.int32, device="meta"), 7)
    assert seq.device.type == "meta" and seq.shape == (1, 7) and seq.dtype == torch.int32

# ----------------------------------------------------------------- padded boundaries, no cache to hide behind
def padded():
    # documents of 3, 5, 0 and 2 tokens in slots of 4, 8, 0 and 4: physical [0, 4, 12, 12, 16]
    return PackedSeqParams.from_lengths([3, 5, 0, 2], pad_to_multiple_of=4)


@pytest.mark.parametrize("total", [pytest.param(16, id="no-tail"), pytest.param(19, id="tail")])
@pytest.mark.parametrize("form", [
    pytest.param(lambda p: p, id="PackedSeqParams"),
    pytest.param(lambda p: megatron_copy(p, seq_idx=None, total_tokens=None), id="megatron-no-cache"),
    pytest.param(lambda p: megatron_copy(p, seq_idx=build_packed_seq_idx(p.cu_seqlens_q, 16)), id="megatron-stale"),
])
def test_build_packed_seq_idx_reads_the_padded_boundaries(form, total):
    """Computed, not read from a cache: another length than the precomputed one, a Megatron-style
    object without one, or one whose seq_idx was built from the unpadded boundaries."""
    want = [loop_seq_idx([0, 4, 12, 12, 16], total)]
    got = build_packed_seq_idx(form(padded()), total)
    assert got.dtype == torch.int32 and got.tolist() == want
    assert want != [loop_seq_idx([0, 3, 8, 8, 10], total)]              # the unpadded answer differs


@pytest.mark.parametrize("total", [pytest.param(16, id="no-tail"), pytest.param(19, id="tail")])
@pytest.mark.parametrize("form", [
    pytest.param(lambda p: p, id="PackedSeqParams"),
    pytest.param(lambda p: megatron_copy(p, seq_idx=None), id="megatron-no-cache"),
    pytest.param(lambda p: megatron_copy(p, seq_idx=build_packed_seq_idx(p.cu_seqlens_q, 16)), id="megatron-stale"),
])
def test_varlen_batch_seq_idx_is_the_padded_one(form, total):
    params = form(PackedSeqParams.from_lengths([3, 5, 0, 2], pad_to_multiple_of=4, total_tokens=total))
    varlen = VarlenBatch.build(params, total)
    assert varlen.seq_idx.tolist() == [loop_seq_idx([0, 4, 12, 12, 16], total)]
    assert varlen.position_ids.tolist() == [[0, 1, 2, 3] + list(range(8)) + [0, 1, 2, 3] + list(range(total - 16))]


def test_layers_on_padded_boundaries_without_a_cached_seq_idx():
    """Mamba2's conv and scan read seq_idx: with no cached copy, the one built from the padded
    boundaries must still give every document its own result."""
    from mixers import Mamba2Mixer
    from ssm_pack.testing import assert_packed_equals_unpacked
    torch.manual_seed(0)
    mixer = Mamba2Mixer(16, head_dim=8, state_size=4, chunk_size=8).double()
    x = torch.randn(1, 19, 16, dtype=torch.float64)
    assert_packed_equals_unpacked(mixer, x, megatron_copy(padded(), seq_idx=None, total_tokens=19))
    assert_packed_equals_unpacked(mixer, x, padded().replace(total_tokens=19))


@pytest.mark.parametrize("given, want", [
    pytest.param([[4, 4, 9, 9, 9, -1]], [[0, 0, 1, 1, 1, 2]], id="padding-run-gets-its-own-value"),
    pytest.param([[2, 0, 2], [7, 7, 7]], [[0, 1, 2], [0, 0, 0]], id="value-used-again-and-rows"),
])
def test_renumber_seq_idx_counts_runs_per_row(given, want):
    got = renumber_seq_idx(torch.tensor(given, dtype=torch.int64))
    assert got.dtype == torch.int32 and got.is_contiguous() and got.tolist() == want
