"""``shard_for_context_parallel``, the CP layout and the refusals, in one process (no collective runs)."""

from __future__ import annotations

import pytest
import torch

from mixers.ops import causal_conv1d_fn, chunk_gated_delta_rule, mamba_chunk_scan_combined, varlen_attention
from ssm_pack import PackedSeqParams, VarlenBatch, shard_for_context_parallel


class FakeGroup:
    """A stand-in process group: only its size is read before a collective would run."""

    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size


def row():
    # documents 0:5, empty at 5, 5:14, 14:17, tail 17:20; shards 0:6, 6:13, 13:20
    return PackedSeqParams.from_lengths([5, 0, 9, 3], total_tokens=20)


def test_shards_tile_the_row_and_keep_the_global_documents():
    shards = [shard_for_context_parallel(row(), r, 3) for r in range(3)]
    assert [(s, e) for s, e, _ in shards] == [(0, 6), (6, 13), (13, 20)]
    locals_ = [local for _, _, local in shards]
    assert [local.cu_seqlens_q.tolist() for local in locals_] == [[0, 5, 5, 6, 6], [0, 0, 0, 7, 7], [0, 0, 0, 1, 4]]
    assert [local.total_tokens for local in locals_] == [6, 7, 7]
    lay = locals_[1].cp_layout
    assert lay.first_seg == (0, 2, 2) and lay.last_seg == (2, 2, 4)
    assert lay.continues_in == (False, True, True) and lay.continues_out == (True, True, False)
    assert lay.first_len == (5, 7, 1) and lay.last_len == (1, 7, 3)
    assert lay.owners.tolist() == [0, 0, 2, 2]          # the empty document belongs where it lies
    # negative control: a different split moves the facts
    other = shard_for_context_parallel(row(), 1, 3, bounds=[0, 5, 14, 20])[2].cp_layout
    assert other.continues_in == (False, False, False) and other.first_len != lay.first_len


def test_uneven_and_padded_shards():
    params = PackedSeqParams.from_lengths([3, 6], pad_to_multiple_of=4, total_tokens=14)   # physical 0:4, 4:12
    start, end, local = shard_for_context_parallel(params, 1, 2, bounds=[0, 6, 14])
    assert (start, end) == (6, 14)
    assert local.cu_seqlens_q_padded.tolist() == [0, 0, 6]       # document 1's slot continues: 6 of its 8 tokens
    assert local.cu_seqlens_q.tolist() == [0, 0, 4]              # its real tokens 4:10 -> 6:10 here


def test_global_positions_continue_across_ranks():
    full = VarlenBatch.build(row(), 20).position_ids[0]
    got = []
    for r in range(3):
        start, end, local = shard_for_context_parallel(row(), r, 3, cp_group=FakeGroup(3))
        got.append(VarlenBatch.build(local, end - start).position_ids[0])
    assert torch.equal(torch.cat(got), full)
    alone = shard_for_context_parallel(row(), 1, 3)[2].replace(cp_layout=None)     # negative control
    assert not torch.equal(VarlenBatch.build(alone, 7).position_ids[0], full[6:13])


@pytest.mark.parametrize("kwargs, match", [
    pytest.param({"bounds": [0, 6, 13]}, "cp_size \\+ 1 = 4 offsets", id="bounds-too-few"),
    pytest.param({"bounds": [0, 6, 13, 21]}, "tile the row", id="bounds-past-the-row"),
    pytest.param({"bounds": [0, 6, 6, 20]}, "every rank needs at least one token", id="empty-shard"),
    pytest.param({"total_tokens": 16}, "smaller than the last physical boundary", id="short-row"),
    pytest.param({"cp_group": FakeGroup(2)}, "cp_group has 2 ranks but .* cp_size=3", id="group-size"),
])
def test_bad_sharding_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        shard_for_context_parallel(row(), 0, 3, **kwargs)


def test_bad_rank_and_resharding_are_refused():
    with pytest.raises(ValueError, match="cp_rank must be in"):
        shard_for_context_parallel(row(), 3, 3)
    with pytest.raises(ValueError, match="smaller than cp_size"):
        shard_for_context_parallel(PackedSeqParams.from_lengths([2]), 0, 3)
    with pytest.raises(ValueError, match="must be non-decreasing"):
        shard_for_context_parallel([0, 5, 3, 9], 0, 3)
    with pytest.raises(TypeError, match="bounds must be 4 ints"):
        shard_for_context_parallel(row(), 0, 3, bounds=[0, 6.5, 13, 20])
    local = shard_for_context_parallel(row(), 0, 3)[2]
    with pytest.raises(ValueError, match="already one rank's shard"):
        shard_for_context_parallel(local, 0, 3)


def test_metadata_refuses_a_shard_without_its_group_and_a_row_with_a_group():
    _, _, local = shard_for_context_parallel(row(), 0, 3)
    with pytest.raises(ValueError, match="cp_group is None"):
        VarlenBatch.build(local, 6)
    local.cp_group = FakeGroup(2)
    with pytest.raises(ValueError, match="cp_group has 2 ranks"):
        VarlenBatch.build(local, 6)
    local.cp_group = FakeGroup(3)
    with pytest.raises(ValueError, match="input has 7"):
        VarlenBatch.build(local, 7)
    assert VarlenBatch.build(local, 6).cp is not None
    whole = row()
    whole.cp_group = FakeGroup(3)
    with pytest.raises(ValueError, match="describe a whole row"):
        VarlenBatch.build(whole, 20)
    whole.cp_group = FakeGroup(1)          # a singleton group: CP off
    assert VarlenBatch.build(whole, 20).cp is None


def _cp_varlen():
    start, end, local = shard_for_context_parallel(row(), 1, 3, cp_group=FakeGroup(3))
    return VarlenBatch.build(local, end - start)


def test_ops_refuse_what_cp_cannot_mean():
    varlen = _cp_varlen()
    t = varlen.total_tokens
    x = torch.randn(1, 4, t)
    with pytest.raises(ValueError, match="seq_idx cannot be combined"):
        causal_conv1d_fn(x, torch.randn(4, 3), seq_idx=varlen.seq_idx, cu_seqlens=varlen)
    with pytest.raises(ValueError, match="initial_states must be per document"):
        causal_conv1d_fn(x, torch.randn(4, 3), initial_states=torch.randn(1, 4, 2), cu_seqlens=varlen)
    with pytest.raises(ValueError, match="initial_states must be per"):
        mamba_chunk_scan_combined(torch.randn(1, t, 2, 3), torch.randn(1, t, 2), -torch.rand(2),
                                  torch.randn(1, t, 1, 4), torch.randn(1, t, 1, 4), 8,
                                  initial_states=torch.randn(1, 2, 3, 4), cu_seqlens=varlen)
    with pytest.raises(ValueError, match="causal=True"):
        varlen_attention(torch.randn(t, 2, 4), torch.randn(t, 2, 4), torch.randn(t, 2, 4), varlen, causal=False)
    with pytest.raises(ValueError, match="initial_state must be"):
        chunk_gated_delta_rule(torch.randn(1, t, 2, 4), torch.randn(1, t, 2, 4), torch.randn(1, t, 2, 3),
                               -torch.rand(1, t, 2), torch.rand(1, t, 2), initial_state=torch.randn(3, 2, 4, 3),
                               cu_seqlens=varlen)
