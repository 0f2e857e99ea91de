import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ssm_pack as sp
from tests.support.megatron_standin import MegatronPackedSeqParams, megatron_copy


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


@given(st.integers(1, 4), st.integers(1, 12), st.data())
def test_torch_path_equals_numpy_path(rows, cols, data):
    # CPU compares and finds the starts with numpy; every other device takes the torch ops
    import ssm_pack.formats.boundaries as convert
    import ssm_pack.formats.doc_ids as doc_ids_module
    doc_ids = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, 3), min_size=cols, max_size=cols),
                                              min_size=rows, max_size=rows)))
    fast = sp.packed_seq_params_from_doc_ids(doc_ids)
    saved = convert._np, doc_ids_module._np
    convert._np = doc_ids_module._np = None
    try:
        plain = sp.packed_seq_params_from_doc_ids(doc_ids)
    finally:
        convert._np, doc_ids_module._np = saved
    assert plain.cu_seqlens_q.dtype == fast.cu_seqlens_q.dtype == torch.int32
    assert torch.equal(plain.cu_seqlens_q, fast.cu_seqlens_q) and torch.equal(plain.seq_idx, fast.seq_idx)


def test_strided_doc_ids():
    # a transposed (non-contiguous) map is read as its logical rows
    doc_ids = torch.tensor([[1, 1], [1, 2], [2, 2]]).t()
    assert sp.packed_seq_params_from_doc_ids(doc_ids).cu_seqlens_q.tolist() == [0, 2, 3, 4, 6]


def test_neat_errors():
    with pytest.raises(ValueError, match="doc_ids must be 2-D"):
        sp.packed_seq_params_from_doc_ids(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="doc_ids must be >= 0"):
        sp.packed_seq_params_from_doc_ids(torch.tensor([[1, -1]]))
    with pytest.raises(TypeError, match="integer dtype"):
        sp.packed_seq_params_from_doc_ids(torch.tensor([[1.0, 2.0]]))
    with pytest.raises(ValueError, match="at least one token"):
        sp.packed_seq_params_from_doc_ids(torch.zeros(0, 4, dtype=torch.long))


# ----------------------------------------------------------------- flash kwargs of padded layouts
def flash_varlen(q, k, v, cu_q, cu_k):
    """flash-attn's varlen causal attention, written out: query segment i attends to key segment i
    (causal mask aligned to the bottom right). ``q/k/v`` are ``[T, D]``."""
    out = torch.zeros_like(q)
    for a, b, c, d in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
        if b > a:
            scores = q[a:b] @ k[c:d].T
            keep = torch.ones(b - a, d - c, dtype=torch.bool).tril(d - c - (b - a))
            out[a:b] = scores.masked_fill(~keep, float("-inf")).softmax(-1) @ v[c:d]
    return out


def padded_params(total_tokens=None):
    # documents of 3, 5, 0 and 2 tokens in slots of 4, 8, 0 and 4
    return sp.PackedSeqParams.from_lengths([3, 5, 0, 2], pad_to_multiple_of=4, total_tokens=total_tokens)


@pytest.mark.parametrize("form", [
    pytest.param(lambda p: p, id="PackedSeqParams"),
    pytest.param(megatron_copy, id="megatron-standin"),
    pytest.param(lambda p: megatron_copy(p, total_tokens=None, seq_idx=None), id="megatron-no-total"),
    pytest.param(lambda p: megatron_copy(p, cu_seqlens_kv_padded=None), id="megatron-q-padded-only"),
    pytest.param(lambda p: sp.VarlenBatch.build(p, 16), id="VarlenBatch"),
])
def test_flash_kwargs_of_padded_params_are_the_padded_boundaries(form):
    kwargs = sp.to_flash_attention_kwargs(form(padded_params()))
    assert kwargs["cu_seq_lens_q"].tolist() == kwargs["cu_seq_lens_k"].tolist() == [0, 4, 12, 12, 16]
    assert kwargs["cu_seq_lens_q"].dtype == kwargs["cu_seq_lens_k"].dtype == torch.int32
    assert kwargs["max_length_q"] == kwargs["max_length_k"] == 8


def test_flash_kwargs_cover_a_padding_tail():
    """flash-attn leaves tokens after cu_seqlens[-1] uncomputed: the tail is one more segment."""
    for params in (padded_params(total_tokens=19), megatron_copy(padded_params(total_tokens=19))):
        kwargs = sp.to_flash_attention_kwargs(params)
        assert kwargs["cu_seq_lens_q"].tolist() == kwargs["cu_seq_lens_k"].tolist() == [0, 4, 12, 12, 16, 19]
    params = sp.PackedSeqParams.from_lengths([2, 2], total_tokens=12)
    assert sp.to_flash_attention_kwargs(params)["max_length_k"] == 8           # the tail is the longest


def test_flash_kwargs_give_each_document_its_own_attention():
    """What the kwargs are for: varlen attention with them equals each document attending alone."""
    params = padded_params(total_tokens=19)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(19, 8, generator=g, dtype=torch.float64) for _ in range(3))
    kwargs = sp.to_flash_attention_kwargs(params)
    out = flash_varlen(q, k, v, kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"])
    starts, lengths = params.cu_seqlens_q_padded.tolist(), params.lengths().tolist()
    for s, n in zip(starts, lengths):
        alone = flash_varlen(q[s:s + n], k[s:s + n], v[s:s + n], torch.tensor([0, n]), torch.tensor([0, n]))
        assert torch.allclose(out[s:s + n], alone, rtol=0, atol=1e-12), (s, n)


def test_flash_kwargs_keep_distinct_key_boundaries():
    """Cross-attention layouts (keys of other lengths) keep their own key boundaries."""
    cross = megatron_copy(sp.PackedSeqParams.from_lengths([2, 3]), cu_seqlens_kv=torch.tensor([0, 4, 7]),
                          cu_seqlens_kv_padded=None, total_tokens=None, seq_idx=None)
    kwargs = sp.to_flash_attention_kwargs(cross)
    assert kwargs["cu_seq_lens_q"].tolist() == [0, 2, 5] and kwargs["cu_seq_lens_k"].tolist() == [0, 4, 7]
    assert kwargs["max_length_q"] == 3 and kwargs["max_length_k"] == 4


@pytest.mark.parametrize("params,error,match", [
    pytest.param(MegatronPackedSeqParams(), ValueError, r"params.cu_seqlens_q is None", id="no-boundaries"),
    pytest.param(MegatronPackedSeqParams(cu_seqlens_q=torch.tensor([0, 5, 3])), ValueError,
                 r"params.cu_seqlens_q must be non-decreasing", id="decreasing"),
    pytest.param(MegatronPackedSeqParams(cu_seqlens_q=torch.tensor([0, 5]), total_tokens=4), ValueError,
                 r"params.total_tokens=4 is smaller than the last physical boundary 5", id="total-too-small"),
    pytest.param(torch.tensor([0, 5]), TypeError, r"params must be a PackedSeqParams .* got tensor", id="tensor"),
])
def test_flash_kwargs_refuse_bad_params(params, error, match):
    with pytest.raises(error, match=match):
        sp.to_flash_attention_kwargs(params)
