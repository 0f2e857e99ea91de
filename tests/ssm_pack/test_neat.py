import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ssm_pack as sp


def test_seed_example():
    params = sp.packed_seq_params_from_doc_ids(torch.tensor([[1, 1, 2, 2, 2, 0]]))
    assert params.cu_seqlens_q.tolist() == [0, 2, 5, 6] and params.cu_seqlens_q.dtype == torch.int32
    assert params.max_seqlen_q == 3 and params.total_tokens == 6
    kwargs = sp.to_flash_attention_kwargs(params)
    assert kwargs["cu_seq_lens_q"].tolist() == kwargs["cu_seq_lens_k"].tolist() == [0, 2, 5, 6]
    assert kwargs["max_length_q"] == kwargs["max_length_k"] == 3


def test_row_start_is_a_forced_boundary():
    # document 1 fills row 0 and row 1 starts with document 1 again: they must not merge
    params = sp.packed_seq_params_from_doc_ids(torch.tensor([[1, 1, 1], [1, 2, 0]]))
    assert params.cu_seqlens_q.tolist() == [0, 3, 4, 5, 6]


def test_doc_ids_are_kept():
    doc_ids = torch.tensor([[1, 0, 0]])
    assert sp.PackedSeqParams.from_doc_ids(doc_ids).doc_ids is doc_ids


@given(st.integers(1, 4), st.integers(1, 12), st.data())
def test_segments_reconstruct_the_map(rows, cols, data):
    doc_ids = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, 3), min_size=cols, max_size=cols),
                                              min_size=rows, max_size=rows)))
    cu = sp.packed_seq_params_from_doc_ids(doc_ids).cu_seqlens_q
    assert cu[-1] == rows * cols
    flat = doc_ids.reshape(-1)
    lengths = (cu[1:] - cu[:-1]).tolist()
    assert min(lengths) >= 1
    # each segment holds one value, sits in one row, and neighbours differ unless a row starts
    rebuilt = torch.repeat_interleave(flat[cu[:-1].long()], torch.tensor(lengths))
    assert torch.equal(rebuilt, flat)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        assert a // cols == (b - 1) // cols
    starts = cu[1:-1].long()
    assert all(s % cols == 0 or flat[s] != flat[s - 1] for s in starts.tolist())


def test_neat_errors():
    with pytest.raises(ValueError, match="doc_ids must be 2-D"):
        sp.packed_seq_params_from_doc_ids(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="doc_ids must be >= 0"):
        sp.packed_seq_params_from_doc_ids(torch.tensor([[1, -1]]))
    with pytest.raises(TypeError, match="integer dtype"):
        sp.packed_seq_params_from_doc_ids(torch.tensor([[1.0, 2.0]]))
    with pytest.raises(ValueError, match="at least one token"):
        sp.packed_seq_params_from_doc_ids(torch.zeros(0, 4, dtype=torch.long))
