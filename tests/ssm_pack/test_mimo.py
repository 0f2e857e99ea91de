import pytest
import torch

import ssm_pack as sp


def padded_batch():
    tokens = torch.tensor([[11, 12, 13, 0], [21, 22, 0, 0], [31, 32, 33, 34]])
    lengths = [3, 2, 4]
    labels = torch.where(tokens == 0, -100, tokens + 100)
    loss_mask = (tokens != 0).long()
    pos = torch.arange(4).expand(3, 4).clone()
    return tokens, lengths, labels, loss_mask, pos


def test_group_order_and_outputs():
    tokens, lengths, labels, loss_mask, pos = padded_batch()
    out = sp.assemble_packed_sequence([2, 0], tokens, lengths, labels=labels, loss_mask=loss_mask, position_ids=pos)
    assert out["input_ids"].tolist() == [[31, 32, 33, 34, 11, 12, 13]]
    assert out["labels"].tolist() == [[131, 132, 133, 134, 111, 112, 113]]
    assert out["loss_mask"].tolist() == [[1] * 7]
    assert out["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2]]
    assert out["cu_seqlens"].tolist() == [0, 4, 7] and out["cu_seqlens"].dtype == torch.int32
    assert out["max_seqlen"] == 4


def test_mrope_positions():
    tokens, lengths, *_ = padded_batch()
    pos = torch.arange(3 * 3 * 4).reshape(3, 3, 4)
    out = sp.assemble_packed_sequence([1, 0], tokens, lengths, position_ids=pos)
    assert out["position_ids"].shape == (3, 1, 5)
    assert out["position_ids"][:, 0].tolist() == [pos[p, 1, :2].tolist() + pos[p, 0, :3].tolist() for p in range(3)]


def test_label_only_stage():
    _, lengths, labels, loss_mask, _ = padded_batch()
    out = sp.assemble_packed_sequence([0, 1, 2], None, lengths, labels=labels, loss_mask=loss_mask)
    assert out["input_ids"] is None and out["labels"].shape == (1, 9) and out["position_ids"] is None


@pytest.mark.parametrize("kwargs,match", [
    pytest.param(dict(position_ids=torch.zeros(4, dtype=torch.long)), "2-D .B, S. or 3-D MRoPE", id="pos-1d"),
    pytest.param(dict(position_ids=torch.zeros(2, 3, 4, dtype=torch.long)), "MRoPE .3, B, S.", id="pos-not-3"),
])
def test_seed_errors_position_ids(kwargs, match):
    tokens, lengths, *_ = padded_batch()
    with pytest.raises(ValueError, match=match):
        sp.assemble_packed_sequence([0], tokens, lengths, **kwargs)


def test_seed_errors_no_tensor_and_empty():
    with pytest.raises(ValueError, match="at least one of tokens"):
        sp.assemble_packed_sequence([0], None, [3])
    tokens, *_ = padded_batch()
    with pytest.raises(ValueError, match="sum to zero"):
        sp.assemble_packed_sequence([0, 1], tokens, [0, 0, 4])


def test_pack_language_shard():
    tokens, lengths, labels, loss_mask, pos = padded_batch()
    batch = {"input_ids": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": pos,
             "attention_mask": tokens != 0, "modality_inputs": {"image": torch.ones(2)}}
    packed, kwargs = sp.pack_language_shard(batch, lengths=torch.tensor(lengths))
    assert packed["input_ids"].tolist() == [[11, 12, 13, 21, 22, 31, 32, 33, 34]]
    assert packed["attention_mask"] is None and packed["modality_inputs"] is batch["modality_inputs"]
    params = sp.PackedSeqParams(qkv_format="thd", **kwargs)
    assert params.cu_seqlens_q.tolist() == [0, 3, 5, 9] and params.max_seqlen_q == 4
    assert batch["input_ids"] is tokens  # the input dict is not modified


def test_pack_language_shard_without_lengths_is_a_no_op():
    batch = {"input_ids": torch.ones(2, 3, dtype=torch.long)}
    out, kwargs = sp.pack_language_shard(batch)
    assert out is batch and kwargs is None


@pytest.mark.parametrize("lengths", [pytest.param(None, id="without-lengths"), pytest.param([3], id="with-lengths")])
def test_pack_language_shard_refuses_a_batch_that_is_not_a_dict(lengths):
    """A batch given as a tensor (not Megatron-Bridge's dict of tensors) is refused by name, also
    when ``lengths`` is ``None`` (the call that otherwise returns the batch untouched)."""
    with pytest.raises(TypeError, match=r"^data_batch must be a dict, got "):
        sp.pack_language_shard(torch.ones(1, 3, dtype=torch.long), lengths=lengths)


def test_pack_language_shard_refuses_mis_shaped_lengths():
    with pytest.raises(ValueError, match=r"lengths must be \[B\] = \[2\]"):
        sp.pack_language_shard({"input_ids": torch.ones(2, 3, dtype=torch.long)}, lengths=[1, 2, 3])


@pytest.mark.parametrize("mrope", [pytest.param(False, id="2d"), pytest.param(True, id="mrope")])
def test_pack_language_shard_of_positions_alone_counts_rows_from_them(mrope):
    """A stage that holds only positions (no tokens, labels or loss mask) takes B from them."""
    *_, pos = padded_batch()
    pos = pos.expand(3, 3, 4) if mrope else pos
    packed, kwargs = sp.pack_language_shard({"position_ids": pos}, lengths=[3, 2, 4])
    assert packed["position_ids"].shape == ((3, 1, 9) if mrope else (1, 9))
    assert packed["position_ids"].reshape(-1, 9)[0].tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]
    assert kwargs["cu_seqlens_q"].tolist() == [0, 3, 5, 9] and kwargs["max_seqlen_q"] == 4
    with pytest.raises(ValueError, match=r"lengths must be \[B\] = \[3\] for this batch, got shape \(2,\)"):
        sp.pack_language_shard({"position_ids": pos}, lengths=[3, 2])


def test_pack_language_shard_of_no_tensor_is_refused():
    with pytest.raises(ValueError, match="needs at least one of tokens / labels / loss_mask / position_ids"):
        sp.pack_language_shard({"modality_inputs": {}}, lengths=[3, 2])
