"""Bad input is answered by ValueError / TypeError naming the argument and the value seen."""

import pytest
import torch

import ssm_pack as sp
from mixers.ops import segment_attention

i32 = torch.int32


class Group:
    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size


CASES = [
    ("float boundaries", lambda: sp.PackedSeqParams(cu_seqlens_q=torch.tensor([0.0, 3.0])),
     TypeError, r"cu_seqlens_q must have an integer dtype.*float32"),
    ("2-D boundaries", lambda: sp.PackedSeqParams(cu_seqlens_q=torch.tensor([[0, 3]])),
     ValueError, r"cu_seqlens_q must be 1-D, got shape \(1, 2\)"),
    ("string boundaries", lambda: sp.PackedSeqParams(cu_seqlens_q="0,3"),
     TypeError, r"cu_seqlens_q must be a 1-D integer tensor or a list of ints, got str"),
    ("float list boundaries", lambda: sp.PackedSeqParams(cu_seqlens_q=[0, 3.0]),
     TypeError, r"cu_seqlens_q must hold ints, got element float 3.0"),
    ("empty boundaries", lambda: sp.PackedSeqParams(cu_seqlens_q=torch.tensor([], dtype=i32)),
     ValueError, r"cu_seqlens_q must hold at least one offset"),
    ("not starting at 0", lambda: sp.PackedSeqParams(cu_seqlens_q=torch.tensor([3, 5])),
     ValueError, r"cu_seqlens_q must start at 0, got 3"),
    ("decreasing", lambda: sp.PackedSeqParams(cu_seqlens_q=torch.tensor([0, 5, 4])),
     ValueError, r"cu_seqlens_q must be non-decreasing, got 5 then 4"),
    ("negative offset", lambda: sp.PackedSeqParams(cu_seqlens_q=torch.tensor([0, -2])),
     ValueError, r"cu_seqlens_q must be non-decreasing, got 0 then -2"),
    ("decreasing kv", lambda: sp.PackedSeqParams(cu_seqlens_q=torch.tensor([0, 2]),
                                                 cu_seqlens_kv=torch.tensor([0, 3, 1])),
     ValueError, r"cu_seqlens_kv must be non-decreasing, got 3 then 1"),
    ("q/kv doc counts", lambda: sp.PackedSeqParams(cu_seqlens_q=torch.tensor([0, 2]),
                                                   cu_seqlens_kv=torch.tensor([0, 1, 2])),
     ValueError, r"same number of documents, got 1 and 2"),
    ("padded count mismatch", lambda: sp.PackedSeqParams(cu_seqlens_q=torch.tensor([0, 2, 4]),
                                                         cu_seqlens_q_padded=torch.tensor([0, 4])),
     ValueError, r"cu_seqlens_q_padded describes 1 documents but cu_seqlens_q describes 2"),
    ("padded shorter than real", lambda: sp.PackedSeqParams(cu_seqlens_q=torch.tensor([0, 5, 6]),
                                                            cu_seqlens_q_padded=torch.tensor([0, 4, 8])),
     ValueError, r"document 0 is longer than its padded slot: length 5 > padded length 4"),
    ("padded without real", lambda: sp.PackedSeqParams(cu_seqlens_q_padded=torch.tensor([0, 4])),
     ValueError, r"cu_seqlens_q_padded is set but cu_seqlens_q is None"),
    ("total tokens too small", lambda: sp.PackedSeqParams(cu_seqlens_q=torch.tensor([0, 5, 11]), total_tokens=10),
     ValueError, r"total_tokens=10 is smaller than the last physical boundary 11"),
    ("negative total tokens", lambda: sp.PackedSeqParams(total_tokens=-1),
     ValueError, r"total_tokens must be >= 0, got -1"),
    ("float max_seqlen", lambda: sp.PackedSeqParams(max_seqlen_q=3.5),
     TypeError, r"max_seqlen_q must be an int, got float 3.5"),
    ("max_seqlen too small", lambda: sp.PackedSeqParams(cu_seqlens_q=torch.tensor([0, 7]), max_seqlen_q=4),
     ValueError, r"max_seqlen_q=4 is smaller than the longest document \(7 tokens\)"),
    ("bad qkv_format", lambda: sp.PackedSeqParams(qkv_format="thd2"),
     ValueError, r"qkv_format must be one of .*got 'thd2'"),
    ("thd without boundaries", lambda: sp.PackedSeqParams(qkv_format="thd"),
     ValueError, r"qkv_format='thd' needs cu_seqlens_q"),
    ("local_cp_size without group", lambda: sp.PackedSeqParams(local_cp_size=2),
     ValueError, r"local_cp_size=2 needs the matching cp_group"),
    ("local_cp_size mismatch", lambda: sp.PackedSeqParams(local_cp_size=2, cp_group=Group(4)),
     ValueError, r"cp_group has size 4 but local_cp_size=2"),
    ("seq_idx wrong shape", lambda: sp.PackedSeqParams(cu_seqlens_q=torch.tensor([0, 4]), total_tokens=4,
                                                       seq_idx=torch.zeros(1, 3, dtype=i32)),
     ValueError, r"seq_idx must be \[1, total_tokens\] = \[1, 4\], got \(1, 3\)"),
    ("negative length", lambda: sp.PackedSeqParams.from_lengths([3, -1]),
     ValueError, r"lengths must be >= 0, got -1 at index 1"),
    ("float lengths", lambda: sp.PackedSeqParams.from_lengths([3.0, 1.0]),
     TypeError, r"lengths must hold ints, got element float 3.0"),
    ("zero multiple", lambda: sp.PackedSeqParams.from_lengths([3], pad_to_multiple_of=0),
     ValueError, r"pad_to_multiple_of must be >= 1, got 0"),
    ("string lengths", lambda: sp.lengths_to_cu_seqlens("3,4"),
     TypeError, r"lengths must be a 1-D integer tensor or a list of ints, got str"),
    ("left-padded mask", lambda: sp.lengths_from_attention_mask(torch.tensor([[0, 1, 1], [1, 1, 0]])),
     ValueError, r"attention_mask must be right-padded .* row 0"),
    ("non-binary mask", lambda: sp.lengths_from_attention_mask(torch.tensor([[1.0, 0.5]])),
     ValueError, r"attention_mask must hold only 0 and 1, got 0.5"),
    ("1-D mask", lambda: sp.lengths_from_attention_mask(torch.tensor([1, 1, 0])),
     ValueError, r"attention_mask must be 2-D, got shape \(3,\)"),
    ("seq_idx with B > 1", lambda: sp.cu_seqlens_from_seq_idx(torch.zeros(2, 4, dtype=i32)),
     ValueError, r"seq_idx must be \[1, T\] \(one packed row\), got shape \(2, 4\)"),
    ("decreasing seq_idx", lambda: sp.cu_seqlens_from_seq_idx(torch.tensor([0, 1, 0])),
     ValueError, r"seq_idx must be non-decreasing"),
    ("float position ids", lambda: sp.cu_seqlens_from_position_ids(torch.tensor([[0.0, 1.0]])),
     TypeError, r"position_ids must have an integer dtype"),
    ("empty batch positions", lambda: sp.PackedSeqParams.from_position_ids(torch.zeros(0, 5, dtype=torch.long)),
     ValueError, r"position_ids must hold at least one token, got shape \(0, 5\)"),
    ("pack_padded lengths count", lambda: sp.pack_padded(torch.zeros(2, 4), [1, 2, 3]),
     ValueError, r"lengths must have one entry per row of x \(2\), got 3"),
    ("pack_padded 1-D", lambda: sp.pack_padded(torch.zeros(4), [4]),
     ValueError, r"x must be \[B, S, ...\], got shape \(4,\)"),
    ("pack_padded too long", lambda: sp.pack_padded(torch.zeros(2, 4), [1, 5]),
     ValueError, r"lengths must be <= the row length 4, got 5"),
    ("unpack not packed", lambda: sp.unpack_to_padded(torch.zeros(2, 4), torch.tensor([0, 4])),
     ValueError, r"x must be packed \[1, T, ...\], got shape \(2, 4\)"),
    ("unpack beyond tokens", lambda: sp.unpack_to_padded(torch.zeros(1, 4), torch.tensor([0, 6])),
     ValueError, r"cu_seqlens\[-1\]=6 is beyond the 4 tokens of x"),
    ("seq_idx total too small", lambda: sp.seq_idx_from_cu_seqlens(torch.tensor([0, 9]), 4),
     ValueError, r"total_tokens=4 is smaller than the last boundary cu_seqlens\[-1\]=9"),
    ("bool total tokens", lambda: sp.seq_idx_from_cu_seqlens(torch.tensor([0, 2]), True),
     TypeError, r"total_tokens must be an int, got bool True"),
    ("mimo group out of range", lambda: sp.assemble_packed_sequence([0, 3], torch.ones(2, 4, dtype=torch.long), [2, 2]),
     ValueError, r"group indices must be rows in \[0, 2\), got \[0, 3\]"),
    ("mimo length beyond row", lambda: sp.assemble_packed_sequence([0], torch.ones(2, 4, dtype=torch.long), [6, 2]),
     ValueError, r"a length exceeds the padded row length 4: \[6\]"),
    ("mimo shapes differ", lambda: sp.assemble_packed_sequence([0], torch.ones(2, 4, dtype=torch.long), [2, 2],
                                                               labels=torch.ones(2, 5, dtype=torch.long)),
     ValueError, r"must share one \[B, S\] shape"),
    ("hf batch not a mapping", lambda: sp.packed_seq_params_from_hf_batch([1, 2]),
     TypeError, r"batch must be a mapping .* got list"),
    ("flash kwargs of a dict", lambda: sp.to_flash_attention_kwargs({"cu_seqlens": 1}),
     TypeError, r"params must be a PackedSeqParams \(or any object with Megatron-core's PackedSeqParams fields.*"
                r"got dict"),
    ("planner float budget", lambda: sp.plan_packs([3], 8.0),
     TypeError, r"max_tokens must be an int, got float 8.0"),
    ("block size zero", lambda: sp.check_block_alignment(torch.tensor([[0, 1]]), 0),
     ValueError, r"block_size must be >= 1, got 0"),
    ("segment attention heads", lambda: segment_attention(torch.zeros(1, 3, 4, 2), torch.zeros(1, 2, 4, 2),
                                                          torch.zeros(1, 2, 4, 2),
                                                          torch.zeros(1, 4, dtype=torch.long)),
     ValueError, r"q heads \(3\) must be a multiple of k/v heads \(2\)"),
]


@pytest.mark.parametrize("call,exc,match", [pytest.param(c, e, m, id=i) for i, c, e, m in CASES])
def test_bad_input_is_named(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_enough_distinct_bad_inputs():
    assert len({i for i, *_ in CASES}) >= 25
