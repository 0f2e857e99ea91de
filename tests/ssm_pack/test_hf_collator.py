"""Boundaries from Hugging Face's real ``DataCollatorWithFlattening``, whatever its ``position_ids_start``."""

import pytest

import ssm_pack as sp

transformers = pytest.importorskip("transformers")
EXAMPLES = [{"input_ids": list(range(10, 10 + n))} for n in (3, 2, 1, 4, 1)]


@pytest.mark.parametrize("start", [pytest.param(s, id=f"start-{s}") for s in (0, 1, 2, 7)])
@pytest.mark.parametrize("tensors", [pytest.param("pt", id="torch"), pytest.param("np", id="numpy")])
def test_real_collator_documents_are_found_whatever_the_start(start, tensors):
    collate = transformers.DataCollatorWithFlattening(position_ids_start=start, return_tensors=tensors)
    batch = collate(EXAMPLES)
    assert "cu_seq_lens_q" not in batch and "seq_idx" not in batch        # the positions are all there is
    params = sp.PackedSeqParams.from_hf_batch(batch)
    assert params.lengths().tolist() == [3, 2, 1, 4, 1] and params.total_tokens == 11
    explicit = transformers.DataCollatorWithFlattening(position_ids_start=start, return_flash_attn_kwargs=True,
                                                       return_seq_idx=True)(EXAMPLES)
    assert params.cu_seqlens_q.tolist() == explicit["cu_seq_lens_q"].tolist()
    assert sp.PackedSeqParams.from_hf_batch(explicit).cu_seqlens_q.tolist() == params.cu_seqlens_q.tolist()
