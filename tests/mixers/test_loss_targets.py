"""Next-token targets on packed rows: no position predicts across a boundary, the padding tail
included (a tail after the last boundary is one more segment, Megatron's seq_idx semantics).

Every layout here gives real labels to every token, the tail's too, so only the boundary mask can
hide a cross-segment prediction (with ``-100`` labels in the tail the mask would be invisible).
"""

import pytest
import torch

from mixers import HybridLM
from mixers.model.hybrid import IGNORE_INDEX, next_token_targets
from ssm_pack import PackedSeqParams, VarlenBatch
from tests.support.megatron_standin import megatron_copy

FORMS = [
    pytest.param(lambda p: p, id="PackedSeqParams"),
    pytest.param(lambda p: megatron_copy(p, seq_idx=None), id="megatron-standin"),
    pytest.param(lambda p: VarlenBatch.build(p, p.total_tokens), id="VarlenBatch"),
]


def expected_targets(segments, total):
    """Oracle: ``labels = arange(total)``; inside a segment a token predicts the next token's label."""
    want = [IGNORE_INDEX] * total
    for s, e in segments:
        for t in range(s, e - 1):
            want[t] = t + 1
    return want


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("lengths,pad,total,segments", [
    pytest.param([3, 2], 1, 8, [(0, 3), (3, 5), (5, 8)], id="tail-without-padding"),
    pytest.param([3, 2], 1, 6, [(0, 3), (3, 5), (5, 6)], id="one-token-tail"),
    pytest.param([3, 0, 5], 4, 15, [(0, 4), (4, 12), (12, 15)], id="padded-slots-and-tail"),
    pytest.param([4, 4], 1, 8, [(0, 4), (4, 8)], id="no-tail"),
])
def test_targets_stop_at_every_segment_end(form, lengths, pad, total, segments):
    params = PackedSeqParams.from_lengths(lengths, pad_to_multiple_of=pad, total_tokens=total)
    labels = torch.arange(total).unsqueeze(0)
    assert next_token_targets(labels, form(params))[0].tolist() == expected_targets(segments, total)


def test_last_document_never_predicts_the_tail():
    params = PackedSeqParams.from_lengths([3, 2], total_tokens=8)
    targets = next_token_targets(torch.arange(8).unsqueeze(0), params)[0]
    assert int(targets[4]) == IGNORE_INDEX                 # token 4 ends the last document; 5 starts the tail


def test_packed_loss_with_a_labelled_tail_is_the_per_segment_loss():
    """HybridLM's packed loss equals the token-weighted loss of every segment run alone, the
    tail being one segment: a prediction from the last document into the tail would add a term."""
    torch.manual_seed(0)
    small = {"G": {"head_dim": 8, "chunk_size": 16}, "A": {"head_dim": 8}}
    model = HybridLM(64, 16, "GA", mixer_overrides=small).double()
    params = PackedSeqParams.from_lengths([5, 7], pad_to_multiple_of=4, total_tokens=19)    # slots 8, 8; tail 3
    ids = torch.randint(0, 64, (1, 19))
    packed = model(ids, params, labels=ids)["loss"]
    total, count = 0.0, 0
    for s, e in [(0, 8), (8, 16), (16, 19)]:
        total = total + model(ids[:, s:e], labels=ids[:, s:e])["loss"] * (e - s - 1)
        count += e - s - 1
    assert abs(float((packed - total / count).detach())) < 1e-12
