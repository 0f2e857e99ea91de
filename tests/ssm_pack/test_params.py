import dataclasses

import pytest
import torch

from ssm_pack import PackedSeqParams, VarlenBatch


class Group:
    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size


def test_megatron_fields_and_defaults():
    params = PackedSeqParams()
    for name in ("qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
                 "max_seqlen_q", "max_seqlen_kv", "local_cp_size", "cp_group", "tp_cp_group", "total_tokens",
                 "seq_idx", "tokens_per_sample", "pad_between_seqs", "cp_scatter_cache"):
        assert getattr(params, name) is None


def test_te_kwargs_filter_mcore_fields():
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=3, max_seqlen_kv=3,
                             local_cp_size=1, cp_group=Group(1), tp_cp_group=Group(2), total_tokens=8,
                             tokens_per_sample=4, cp_scatter_cache=object(), pad_between_seqs=False)
    kwargs = params.to_te_kwargs()
    assert set(kwargs) == {"qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "max_seqlen_q", "max_seqlen_kv",
                           "pad_between_seqs"}
    assert kwargs["cu_seqlens_q"] is cu


@pytest.mark.parametrize("lengths,multiple,padded", [
    pytest.param([3, 0, 5], 1, None, id="no-padding"),
    pytest.param([3, 0, 5], 4, [0, 4, 4, 12], id="pad-to-4"),
    pytest.param([1], 8, [0, 8], id="single"),
])
def test_from_lengths(lengths, multiple, padded):
    params = PackedSeqParams.from_lengths(lengths, pad_to_multiple_of=multiple)
    assert params.cu_seqlens_q.dtype == torch.int32
    expected = [0]
    for n in lengths:
        expected.append(expected[-1] + n)
    assert params.cu_seqlens_q.tolist() == expected
    if padded is None:
        assert params.cu_seqlens_q_padded is None and not params.pad_between_seqs
        assert params.total_tokens == sum(lengths)
    else:
        assert params.cu_seqlens_q_padded.tolist() == padded and params.pad_between_seqs
        assert params.total_tokens == padded[-1]
    assert params.seq_idx.shape == (1, params.total_tokens)
    assert params.max_seqlen_q >= max(lengths)


def test_from_lengths_tail_is_an_extra_document():
    params = PackedSeqParams.from_lengths([2, 3], total_tokens=8)
    assert params.seq_idx.tolist() == [[0, 0, 1, 1, 1, 2, 2, 2]]


def test_from_cu_seqlens_accepts_lists():
    params = PackedSeqParams.from_cu_seqlens([0, 2, 6], cu_seqlens_padded=[0, 4, 8])
    assert params.cu_seqlens_q.tolist() == [0, 2, 6] and params.cu_seqlens_q_padded.tolist() == [0, 4, 8]
    assert params.lengths().tolist() == [2, 4] and params.num_docs == 2
    assert params.seq_idx.tolist() == [[0] * 4 + [1] * 4]


def test_local_cp_size_with_matching_group():
    params = PackedSeqParams(local_cp_size=2, cp_group=Group(2))
    assert params.cp_group.size() == 2


def test_validate_false_skips_value_checks():
    params = PackedSeqParams(cu_seqlens_q=torch.tensor([3, 1]), validate=False)
    assert params.cu_seqlens_q.tolist() == [3, 1]


def test_replace_rebuilds_seq_idx():
    params = PackedSeqParams.from_lengths([2, 2])
    longer = params.replace(total_tokens=6)
    assert longer.seq_idx.tolist() == [[0, 0, 1, 1, 2, 2]] and params.seq_idx.shape == (1, 4)



@pytest.mark.parametrize("built,cu,longest", [
    pytest.param(lambda: PackedSeqParams.from_lengths([3, 5]), [0, 6, 8], 6, id="unpadded-real-boundaries"),
    pytest.param(lambda: PackedSeqParams.from_lengths([3, 5], pad_to_multiple_of=4), [0, 2, 5], 8,
                 id="padded-slots-are-the-physical-layout"),
])
def test_replace_recomputes_max_seqlen_from_the_physical_boundaries(built, cu, longest):
    """New boundaries without a max_seqlen: the longest physical document, as a fresh build gives."""
    cu = torch.tensor(cu, dtype=torch.int32)
    moved = built().replace(cu_seqlens_q=cu, cu_seqlens_kv=cu)
    assert moved.max_seqlen_q == moved.max_seqlen_kv == longest
    fresh = PackedSeqParams.from_cu_seqlens(cu, cu_seqlens_padded=moved.cu_seqlens_q_padded)
    assert fresh.max_seqlen_q == longest


@pytest.mark.parametrize("kv,match", [
    pytest.param([0, 4], r"^cu_seqlens_q and cu_seqlens_kv must describe the same number of documents, got 2 and 1$",
                 id="fewer-kv-documents"),
    pytest.param([0, 1, 2, 6], r"same number of documents, got 2 and 3$", id="more-kv-documents"),
])
def test_cross_attention_boundaries_must_count_the_same_documents(kv, match):
    q = torch.tensor([0, 2, 4], dtype=torch.int32)
    assert PackedSeqParams(qkv_format="thd", cu_seqlens_q=q, cu_seqlens_kv=torch.tensor([0, 3, 6])).num_docs == 2
    with pytest.raises(ValueError, match=match):
        PackedSeqParams(qkv_format="thd", cu_seqlens_q=q, cu_seqlens_kv=torch.tensor(kv))

def test_repr_is_short():
    text = repr(PackedSeqParams.from_lengths([2, 2]))
    assert "cu_seqlens_q=tensor(dtype=torch.int32, shape=(3,))" in text and "validate" not in text


TENSOR_FIELDS = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "seq_idx", "doc_ids")


@pytest.mark.parametrize("params", [
    pytest.param(lambda: PackedSeqParams.from_lengths([3, 0, 5], pad_to_multiple_of=4, total_tokens=14), id="padded"),
    pytest.param(lambda: PackedSeqParams.from_doc_ids(torch.tensor([[1, 1, 2, 0], [3, 3, 3, 3]])), id="doc-ids"),
    pytest.param(lambda: PackedSeqParams.from_lengths([1, 1, 2]), id="unpadded"),
    pytest.param(lambda: PackedSeqParams(cu_seqlens_q=torch.tensor([0, 2, 5], dtype=torch.int32), validate=False),
                 id="unvalidated"),
])
def test_to_moves_every_tensor_field_and_keeps_the_rest(params):
    """``meta`` stands in for a GPU: every tensor moves, none is read (a meta tensor has no values)."""
    params = params()
    moved = params.to("meta")
    assert moved is not params and isinstance(moved, PackedSeqParams)
    for f in dataclasses.fields(params):
        before, after = getattr(params, f.name), getattr(moved, f.name)
        if isinstance(before, torch.Tensor):
            assert after.device.type == "meta" and after.shape == before.shape and after.dtype == before.dtype, f.name
        else:
            assert after is before or after == before, f.name           # None kept, ints, groups, flags
    assert (moved.seq_idx is None) == (params.seq_idx is None)           # the precomputed one moved, not rebuilt
    assert all(getattr(params, name).device.type == "cpu" for name in TENSOR_FIELDS
               if getattr(params, name) is not None)                     # the original is untouched


def test_to_the_same_device_gives_an_equal_params_that_packs_the_same():
    params = PackedSeqParams.from_lengths([4, 1, 3], pad_to_multiple_of=2, total_tokens=12)
    moved = params.to(torch.device("cpu"))
    for name in TENSOR_FIELDS:
        if getattr(params, name) is not None:
            assert torch.equal(getattr(moved, name), getattr(params, name)), name
    assert torch.equal(VarlenBatch.build(moved, 12).seq_idx, VarlenBatch.build(params, 12).seq_idx)


def test_to_keeps_a_shared_boundary_tensor_shared():
    params = PackedSeqParams.from_lengths([2, 3])
    assert params.cu_seqlens_kv is params.cu_seqlens_q
    moved = params.to("meta")
    assert moved.cu_seqlens_kv is moved.cu_seqlens_q


def test_to_refuses_a_bad_device_and_a_modified_params():
    params = PackedSeqParams.from_lengths([2, 3])
    with pytest.raises(ValueError, match="device must be a torch.device or a device name .* got 'gpu0'"):
        params.to("gpu0")
    params.cu_seqlens_q.add_(0)                                           # changed in place after construction
    with pytest.raises(ValueError, match="cu_seqlens_q was modified in place"):
        params.to("cpu")


@pytest.mark.cuda
def test_to_cuda_and_back():
    params = PackedSeqParams.from_lengths([4, 1, 3], pad_to_multiple_of=2, total_tokens=12)
    on_gpu = params.to("cuda")
    assert all(getattr(on_gpu, name).is_cuda for name in TENSOR_FIELDS if getattr(params, name) is not None)
    back = on_gpu.to("cpu")
    assert torch.equal(back.seq_idx, params.seq_idx)
    assert torch.equal(back.cu_seqlens_q_padded, params.cu_seqlens_q_padded)
