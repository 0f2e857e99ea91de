"""HybridLM: packed loss equals per-document losses, no prediction across a boundary."""

import pytest
import torch

from mixers import HybridLM
from mixers.model.hybrid import IGNORE_INDEX, next_token_targets
from ssm_pack import PackedSeqParams
from ssm_pack.testing import assert_no_cross_document_leakage, assert_packed_equals_unpacked

SMALL = {"M": {"head_dim": 16, "state_size": 8, "chunk_size": 16}, "G": {"head_dim": 8, "chunk_size": 16},
         "K": {"head_dim": 8, "chunk_size": 16}, "P": {"head_dim": 8, "chunk_size": 16}, "A": {"head_dim": 8}}


def model(pattern="MGKPA", dtype=torch.float64):
    torch.manual_seed(0)
    return HybridLM(256, 32, pattern, mixer_overrides=SMALL).to(dtype)


def test_packed_loss_is_the_token_weighted_per_document_loss():
    m = model()
    lengths = [5, 30, 1, 0, 44]
    params = PackedSeqParams.from_lengths(lengths)
    ids = torch.randint(0, 256, (1, sum(lengths)))
    packed = m(ids, params, labels=ids)["loss"]
    total, count, start = 0.0, 0, 0
    for n in lengths:
        if n > 1:
            total = total + m(ids[:, start:start + n], labels=ids[:, start:start + n])["loss"] * (n - 1)
            count += n - 1
        start += n
    assert abs(float((packed - total / count).detach())) < 1e-12


def test_targets_never_cross_a_boundary():
    params = PackedSeqParams.from_lengths([3, 2, 4], pad_to_multiple_of=4, total_tokens=14)
    labels = torch.arange(14).unsqueeze(0)        # real labels everywhere: only the boundaries mask them
    targets = next_token_targets(labels, params)[0].tolist()
    # slots at physical 0..3, 4..7, 8..11; a tail 12..13: the last token of a slot predicts nothing
    assert [targets[i] for i in (3, 7, 11, 13)] == [IGNORE_INDEX] * 4
    assert targets[0] == 1 and targets[2] == 3 and targets[4] == 5 and targets[8] == 9 and targets[12] == 13


def test_backbone_packs_exactly():
    m = model()
    params = PackedSeqParams.from_lengths([0, 15, 40, 3], pad_to_multiple_of=4)
    x = torch.randn(1, params.total_tokens, 32, dtype=torch.float64)

    class Backbone(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = m

        def forward(self, hidden_states, packed_seq_params=None):
            return self.m.backbone(hidden_states, packed_seq_params)

    assert_packed_equals_unpacked(Backbone(), x, params)
    assert_no_cross_document_leakage(Backbone().float(), x.float(), params)


def test_padded_batch_ignores_padding_labels():
    m = model("GA")
    ids = torch.randint(0, 256, (2, 10))
    labels = ids.clone()
    labels[1, 6:] = IGNORE_INDEX
    loss = m(ids, labels=labels)["loss"]
    assert torch.isfinite(loss)


@pytest.mark.parametrize("pattern", ["", "MX", "mamba"])
def test_bad_pattern(pattern):
    with pytest.raises(ValueError, match="pattern must be letters of MGKPA"):
        HybridLM(256, 32, pattern)


def test_bad_inputs():
    m = model("A")
    with pytest.raises(ValueError, match=r"input_ids must be \[B, T\] integer token ids"):
        m(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="labels must match input_ids"):
        m(torch.zeros(1, 4, dtype=torch.long), labels=torch.zeros(1, 5, dtype=torch.long))
