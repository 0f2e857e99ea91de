import pytest
import torch

from ssm_pack import PackedSeqParams


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


def test_repr_is_short():
    text = repr(PackedSeqParams.from_lengths([2, 2]))
    assert "cu_seqlens_q=tensor(dtype=torch.int32, shape=(3,))" in text and "validate" not in text
