import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ssm_pack as sp
from tests.support.megatron_standin import megatron_copy


def collator_batch(lengths, *, flash=True, seq_idx=True):
    """What transformers' DataCollatorWithFlattening emits for examples of ``lengths``."""
    cu = sp.lengths_to_cu_seqlens(lengths)
    batch = {"input_ids": torch.arange(sum(lengths)).unsqueeze(0),
             "position_ids": torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)}
    if flash:
        batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths))
    if seq_idx:
        batch["seq_idx"] = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])[None]
    return batch


@given(st.lists(st.integers(1, 9), min_size=1, max_size=12), st.booleans(), st.booleans())
def test_hf_batch_round_trip(lengths, flash, with_seq_idx):
    params = sp.PackedSeqParams.from_hf_batch(collator_batch(lengths, flash=flash, seq_idx=with_seq_idx))
    assert params.lengths().tolist() == lengths and params.total_tokens == sum(lengths)
    back = sp.hf_batch_from_packed_seq_params(params)
    ref = collator_batch(lengths)
    for key in ("position_ids", "seq_idx", "cu_seq_lens_q", "cu_seq_lens_k"):
        assert back[key].tolist() == ref[key].tolist(), key
    assert back["max_length_q"] == max(lengths)


def test_boundary_sources_that_disagree_are_refused():
    batch = collator_batch([2, 3])
    assert sp.packed_seq_params_from_hf_batch(batch).cu_seqlens_q.tolist() == [0, 2, 5]   # they agree
    batch["position_ids"] = torch.arange(5)[None]  # positions say one document
    with pytest.raises(ValueError, match=r"position_ids'\] and batch\['cu_seq_lens_q'\] describe different documents"):
        sp.packed_seq_params_from_hf_batch(batch)
    del batch["cu_seq_lens_q"]
    with pytest.raises(ValueError, match=r"position_ids'\] and batch\['seq_idx'\] describe different documents"):
        sp.packed_seq_params_from_hf_batch(batch)
    del batch["seq_idx"]
    assert sp.packed_seq_params_from_hf_batch(batch).cu_seqlens_q.tolist() == [0, 5]


@pytest.mark.parametrize("key,value,agrees", [
    pytest.param("seq_idx", [0, 0, 0, 1, 1], False, id="seq-idx-carries-document-1-into-the-tail"),
    pytest.param("seq_idx", [0, 0, 0, 1, 2], True, id="seq-idx-tail-its-own-segment"),
    pytest.param("position_ids", [0, 1, 2, 0, 1], False, id="positions-carry-document-1-into-the-tail"),
    pytest.param("position_ids", [0, 1, 2, 0, 0], True, id="positions-restart-at-the-tail"),
])
def test_a_tail_after_the_last_boundary_is_one_more_segment_for_every_source(key, value, agrees):
    """cu_seq_lens_q [0, 3, 4] over 5 tokens: the mixers run token 4 as a segment of its own, so a
    second source saying it continues document 1 describes other documents."""
    batch = {"input_ids": torch.zeros(1, 5, dtype=torch.long),
             "cu_seq_lens_q": torch.tensor([0, 3, 4], dtype=torch.int32), key: torch.tensor([value])}
    if agrees:
        assert sp.packed_seq_params_from_hf_batch(batch).cu_seqlens_q.tolist() == [0, 3, 4]
    else:
        with pytest.raises(ValueError, match=rf"{key}'\] and batch\['cu_seq_lens_q'\] describe different documents"):
            sp.packed_seq_params_from_hf_batch(batch)


def test_hf_batch_with_empty_documents_through_cu_seq_lens():
    batch = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "cu_seq_lens_q": torch.tensor([0, 2, 2, 4])}
    assert sp.packed_seq_params_from_hf_batch(batch).lengths().tolist() == [2, 0, 2]


def test_hf_batch_errors():
    with pytest.raises(ValueError, match="no boundaries"):
        sp.packed_seq_params_from_hf_batch({"input_ids": torch.zeros(1, 3, dtype=torch.long)})
    with pytest.raises(ValueError, match=r"one packed row \[1, T\]"):
        sp.packed_seq_params_from_hf_batch({"input_ids": torch.zeros(2, 3, dtype=torch.long),
                                            "position_ids": torch.zeros(2, 3, dtype=torch.long)})
    with pytest.raises(ValueError, match="max_length_q.*smaller than the longest"):
        sp.packed_seq_params_from_hf_batch({"cu_seq_lens_q": torch.tensor([0, 4]), "max_length_q": 2})


@pytest.mark.parametrize("positions,match", [
    pytest.param([2, 3, 4, 0, 1], r"restarts at 0 at token 3 \(after 4\) but the row starts at 2", id="lower-restart"),
    pytest.param([0, 1, 2, 1, 2], r"restarts at 1 at token 3 \(after 2\) but the row starts at 0", id="other-restart"),
    pytest.param([0, 1, 5, 6], r"restarts at 5 at token 2 \(after 1\)", id="jump"),
])
def test_ambiguous_position_resets_are_refused(positions, match):
    with pytest.raises(ValueError, match=match) as caught:
        sp.PackedSeqParams.from_hf_batch({"position_ids": torch.tensor([positions])})
    assert "return_flash_attn_kwargs=True" in str(caught.value)



def mrope(temporal, height):
    """MRoPE ``[3, 1, T]`` positions: the temporal plane, then height and width planes of ``height``."""
    return torch.tensor([[temporal], [height], [height]])


def test_mrope_positions_are_read_from_the_temporal_plane():
    """Only the temporal plane restarts at 0 per document; the other planes may start anywhere."""
    params = sp.PackedSeqParams.from_hf_batch({"position_ids": mrope([0, 1, 2, 0, 1], [4, 4, 5, 4, 4])})
    assert params.cu_seqlens_q.tolist() == [0, 3, 5] and params.total_tokens == 5


def test_mrope_positions_whose_temporal_plane_starts_elsewhere_are_refused():
    with pytest.raises(ValueError, match=r"position_ids'\] is MRoPE \[3, B, S\] starting at 2: its temporal plane"):
        sp.PackedSeqParams.from_hf_batch({"position_ids": mrope([2, 3, 4, 2, 3], [0, 0, 1, 0, 0])})


def test_position_resets_need_one_flattened_row():
    from ssm_pack.formats.hf import cu_seqlens_from_position_resets
    assert cu_seqlens_from_position_resets(torch.tensor([0, 1, 0])).tolist() == [0, 2, 3]
    assert cu_seqlens_from_position_resets(torch.tensor([[0, 1, 0]])).tolist() == [0, 2, 3]
    with pytest.raises(ValueError, match=r"must be one flattened row \[1, T\], got shape \(2, 3\); "
                                         "DataCollatorWithFlattening emits batch size 1"):
        cu_seqlens_from_position_resets(torch.tensor([[0, 1, 2], [0, 1, 2]]))


@pytest.mark.parametrize("batch,cu,total", [
    pytest.param({"seq_idx": torch.tensor([0, 0, 1, 1, 1])}, [0, 2, 5], 5, id="seq-idx-1d"),
    pytest.param({"seq_idx": torch.tensor([[0, 0, 1, 1, 1]])}, [0, 2, 5], 5, id="seq-idx-2d"),
    pytest.param({"cu_seq_lens_q": torch.tensor([0, 2, 5])}, [0, 2, 5], 5, id="cu-alone-ends-at-its-last-offset"),
    pytest.param({"cu_seq_lens_q": torch.tensor([0, 2, 5]), "input_ids": torch.zeros(1, 7, dtype=torch.long)},
                 [0, 2, 5], 7, id="cu-with-a-tail"),
])
def test_the_packed_length_is_the_rows_else_the_last_boundary(batch, cu, total):
    params = sp.PackedSeqParams.from_hf_batch(batch)
    assert params.cu_seqlens_q.tolist() == cu and params.total_tokens == total


def test_boundaries_beyond_the_packed_row_are_refused():
    batch = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "cu_seq_lens_q": torch.tensor([0, 2, 5])}
    with pytest.raises(ValueError, match=r"^cu_seq_lens_q\[-1\]=5 is beyond the 4 packed tokens$"):
        sp.PackedSeqParams.from_hf_batch(batch)

def test_single_token_documents_at_any_start():
    params = sp.PackedSeqParams.from_hf_batch({"position_ids": torch.tensor([[5, 5, 6, 5]])})
    assert params.lengths().tolist() == [1, 2, 1]


def test_hf_batch_of_megatron_style_params():
    """Any object with Megatron's fields (no methods of ours) gives the same batch; padded slots
    are the physical layout, a tail one more document."""
    params = sp.PackedSeqParams.from_lengths([3, 5, 0, 2], pad_to_multiple_of=4, total_tokens=19)
    ours, theirs = sp.hf_batch_from_packed_seq_params(params), sp.hf_batch_from_packed_seq_params(megatron_copy(params))
    varlen = sp.hf_batch_from_packed_seq_params(sp.VarlenBatch.build(params, 19))
    for batch in (theirs, varlen):
        assert batch.keys() == ours.keys()
        for key, value in ours.items():
            assert (value.tolist() if isinstance(value, torch.Tensor) else value) == \
                (batch[key].tolist() if isinstance(batch[key], torch.Tensor) else batch[key]), key
    assert ours["cu_seq_lens_q"].tolist() == [0, 4, 12, 12, 16, 19] and ours["max_length_k"] == 8
    assert ours["position_ids"].tolist() == [[0, 1, 2, 3] + list(range(8)) + [0, 1, 2, 3, 0, 1, 2]]
    assert ours["seq_idx"].tolist() == [[0] * 4 + [1] * 8 + [3] * 4 + [4] * 3]
    with pytest.raises(TypeError, match="params must be a PackedSeqParams"):
        sp.hf_batch_from_packed_seq_params({"cu_seq_lens_q": [0, 3]})
