"""Every conversion round-trips (property tests)."""

import torch
from hypothesis import given
from hypothesis import strategies as st

import ssm_pack as sp

lengths_st = st.lists(st.integers(0, 12), min_size=1, max_size=30)
nonempty_st = st.lists(st.integers(1, 12), min_size=1, max_size=30)


@given(lengths_st)
def test_lengths_cu_seqlens_round_trip(lengths):
    cu = sp.lengths_to_cu_seqlens(lengths)
    assert cu.dtype == torch.int32 and cu[0] == 0
    assert sp.cu_seqlens_to_lengths(cu).tolist() == lengths


@given(lengths_st, st.integers(1, 8))
def test_padded_cu_seqlens_round_trip(lengths, multiple):
    params = sp.PackedSeqParams.from_lengths(lengths, pad_to_multiple_of=multiple)
    assert params.lengths().tolist() == lengths
    physical = sp.cu_seqlens_to_lengths(sp.get_cu_seqlens(params))
    assert all(p % multiple == 0 and p >= n and p - n < multiple for p, n in zip(physical.tolist(), lengths))
    # the per-token index of the physical layout gives the padded lengths back
    assert sp.cu_seqlens_from_seq_idx(params.seq_idx, num_docs=len(lengths)).tolist() == \
        sp.get_cu_seqlens(params).tolist()


@given(lengths_st, st.integers(0, 5))
def test_cu_seqlens_seq_idx_round_trip(lengths, tail):
    cu = sp.lengths_to_cu_seqlens(lengths)
    total = int(cu[-1]) + tail
    seq_idx = sp.seq_idx_from_cu_seqlens(cu, total)
    back = sp.cu_seqlens_from_seq_idx(seq_idx, num_docs=len(lengths) + (1 if tail else 0))
    expected = cu.tolist() + ([total] if tail else [])
    assert back.tolist() == expected


@given(nonempty_st)
def test_cu_seqlens_position_ids_round_trip(lengths):
    cu = sp.lengths_to_cu_seqlens(lengths)
    pos = sp.position_ids_from_cu_seqlens(cu)
    assert pos.shape == (1, sum(lengths)) and pos.dtype == torch.int64
    assert sp.cu_seqlens_from_position_ids(pos).tolist() == cu.tolist()
    assert sp.PackedSeqParams.from_position_ids(pos).cu_seqlens_q.tolist() == cu.tolist()


@given(lengths_st, st.integers(0, 5))
def test_position_ids_restart_at_every_document_and_the_tail(lengths, tail):
    """Empty documents anywhere (leading, repeated, last) and a tail past the last boundary, against
    one ``arange`` per document."""
    cu = sp.lengths_to_cu_seqlens(lengths)
    total = sum(lengths) + tail
    pos = sp.position_ids_from_cu_seqlens(cu, total if tail else None)
    want = [i for n in lengths + [tail] for i in range(n)]
    assert pos.dtype == torch.int64 and pos.tolist() == [want]



def test_unpack_of_no_document_is_empty():
    """``cu_seqlens = [0]`` (no document): ``[0, 0, ...]`` padded, any ``max_length`` kept as the width."""
    x = torch.randn(1, 3, 2)
    assert sp.unpack_to_padded(x, torch.tensor([0])).shape == (0, 0, 2)
    assert sp.unpack_to_padded(x, torch.tensor([0]), max_length=4).shape == (0, 4, 2)


@given(st.lists(st.integers(0, 9), min_size=1, max_size=8), st.integers(0, 3))
def test_attention_mask_round_trip(lengths, extra):
    mask = sp.attention_mask_from_lengths(lengths, max(lengths) + extra)
    assert sp.lengths_from_attention_mask(mask).tolist() == lengths
    assert sp.lengths_from_attention_mask(mask.to(torch.int64)).tolist() == lengths
    params = sp.PackedSeqParams.from_attention_mask(mask)
    assert params.lengths().tolist() == lengths


@given(st.lists(st.integers(0, 7), min_size=1, max_size=6), st.integers(0, 2))
def test_pack_padded_round_trip(lengths, extra):
    width = max(lengths) + extra
    x = torch.randn(len(lengths), width, 3)
    packed = sp.pack_padded(x, lengths)
    assert packed.shape == (1, sum(lengths), 3)
    cu = sp.lengths_to_cu_seqlens(lengths)
    back = sp.unpack_to_padded(packed, cu, width)
    mask = sp.attention_mask_from_lengths(lengths, width)
    assert torch.equal(back[mask], x[mask]) and bool((back[~mask] == 0).all())


def test_position_ids_of_rows_force_a_boundary_per_row():
    pos = torch.tensor([[0, 1, 2, 3], [4, 5, 0, 1]])  # row 2 continues a document: still a boundary
    assert sp.cu_seqlens_from_position_ids(pos).tolist() == [0, 4, 6, 8]


def test_mrope_positions_use_the_temporal_plane():
    pos = torch.stack([torch.tensor([[0, 1, 2, 0, 1]]), torch.tensor([[0, 0, 1, 0, 0]]),
                       torch.tensor([[0, 1, 1, 0, 1]])])
    assert sp.cu_seqlens_from_position_ids(pos).tolist() == [0, 3, 5]


def test_seq_idx_keeps_empty_documents():
    assert sp.cu_seqlens_from_seq_idx(torch.tensor([[0, 0, 2, 2, 2]])).tolist() == [0, 2, 2, 5]


@given(st.lists(st.integers(0, 12), max_size=30), st.integers(0, 15))
def test_max_seqlen_is_the_longest_document_and_the_tail_counts(lengths, tail):
    cu = sp.lengths_to_cu_seqlens(lengths)
    assert sp.max_seqlen_from_cu_seqlens(cu) == max(lengths, default=0)
    total = sum(lengths) + tail
    assert sp.max_seqlen_from_cu_seqlens(cu, total) == max(lengths + [tail])


def _seq_idx_oracle(values, num_docs):
    """Document ``i`` starts at the first token whose index is ``>= i`` (a loop)."""
    n = (max(values) + 1 if values else 0) if num_docs is None else num_docs
    return [next((t for t, x in enumerate(values) if x >= i), len(values)) for i in range(n + 1)]


@given(st.lists(st.integers(0, 6), max_size=30), st.integers(0, 3), st.booleans())
def test_cu_seqlens_from_seq_idx_numpy_path_equals_torch_path_and_oracle(values, extra, sort):
    # CPU finds the index's change points in numpy; every other device binary-searches with
    # torch ops: same boundaries, same refusal of a decreasing index (checked at change points
    # only on CPU: unsorted draws put the decrease anywhere, also right after a skip)
    import ssm_pack.formats.boundaries as convert
    values = sorted(values) if sort else values
    num_docs = None if not extra else (max(values, default=-1) + extra)
    t = torch.tensor(values, dtype=torch.int32)

    def both(x):
        outs = []
        for np_module in (convert._np, None):
            saved, convert._np = convert._np, np_module
            try:
                outs.append(convert.cu_seqlens_from_seq_idx(x, num_docs=num_docs).tolist())
            except ValueError as e:
                outs.append(str(e))
            finally:
                convert._np = saved
        return outs
    fast, plain = both(t)
    assert fast == plain
    if any(b < a for a, b in zip(values, values[1:])):
        assert "non-decreasing" in fast
    else:
        assert fast == _seq_idx_oracle(values, num_docs)
    assert both(torch.tensor(values, dtype=torch.int64).repeat_interleave(2)[::2]) == [fast, fast]   # strided int64
