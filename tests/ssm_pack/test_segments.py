import warnings

import pytest
import torch

import ssm_pack as sp
from ssm_pack.formats import masks as segments


def test_is_packed_and_segment_ids():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0]])
    assert sp.is_packed(pos) and not sp.is_packed(torch.arange(6)[None]) and not sp.is_packed(None)
    assert sp.segment_ids(pos).tolist() == [[0, 0, 0, 1, 1, 2]]
    assert sp.segment_starts(pos).tolist() == [0, 3, 5]
    assert sp.segment_of(pos, torch.tensor([[5, 0, 4, 9]])).tolist() == [[2, 0, 1, 2]]  # 9 clamps to 5


def test_packed_masks_in_global_key_space():
    pos = torch.tensor([[0, 1, 2, 0, 1]])
    masks = sp.packed_masks(pos, torch.arange(5), torch.tensor([3, 4]), local_window=2)
    assert masks["same_seg"][0, 0].tolist() == [[False, False, False, True, True]] * 2
    assert masks["token_future"][0, 0, 0].tolist() == [False, False, False, False, True]
    assert masks["local_token"][0, 0, 1].tolist() == [False, False, False, True, True]
    assert masks["gpos"].tolist() == [[3, 4]]
    # the bug the masks exist for: reset positions would let sample 2's first query see key 0
    assert not (masks["same_seg"] & ~masks["token_future"])[0, 0, 0, 0]


def test_dense_segment_keep():
    keep = sp.dense_segment_keep(torch.tensor([[0, 1, 0]]), "cpu")
    assert keep.shape == (1, 1, 3, 3)
    assert keep[0, 0].tolist() == [[True, False, False], [True, True, False], [False, False, True]]


def test_block_alignment_warns_once(monkeypatch):
    monkeypatch.setattr(segments, "_alignment_warned", False)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0]])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert sp.check_block_alignment(pos, 4) == 2
        assert sp.check_block_alignment(pos, 4) == 2
    assert len(caught) == 1 and issubclass(caught[0].category, sp.PackingAlignmentWarning)
    assert "align_to=4" in str(caught[0].message)


def test_aligned_rows_do_not_warn(monkeypatch):
    monkeypatch.setattr(segments, "_alignment_warned", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sp.check_block_alignment(torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]), 4) == 0


def test_segment_errors():
    with pytest.raises(ValueError, match="position_ids must be 2-D"):
        sp.segment_ids(torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="local_window must be >= 1"):
        sp.packed_masks(torch.tensor([[0, 1]]), torch.arange(2), torch.arange(2), 0)
    with pytest.raises(ValueError, match="token_indices must be"):
        sp.segment_of(torch.tensor([[0, 1]]), torch.tensor([1, 0]))


@pytest.mark.parametrize("seq_idx,last", [
    pytest.param(torch.zeros(2, 0, dtype=torch.int32), [-1, -1], id="no-token-no-segment"),
    pytest.param(torch.tensor([[0, 0, 1], [2, 2, 2]]), [1, 2], id="last-segment-of-each-row"),
])
def test_last_segment_of_every_row(seq_idx, last):
    from ssm_pack.formats.segments import segments_from_seq_idx
    batch, length = seq_idx.shape
    assert segments_from_seq_idx(seq_idx).last_in_row(batch, length).tolist() == last
