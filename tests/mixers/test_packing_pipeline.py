"""Planner to model: ``plan.assemble`` lays a pack out the way ``plan.packed_seq_params`` says,
so the two go straight into ``HybridLM`` (the tight row of ``assemble_packed_sequence`` does not)."""

import pytest
import torch

from mixers import HybridLM
from ssm_pack import assemble_packed_sequence, plan_packs

SMALL = {"M": {"head_dim": 16, "state_size": 8, "chunk_size": 16}, "G": {"head_dim": 8, "chunk_size": 16},
         "K": {"head_dim": 8, "chunk_size": 16}, "P": {"head_dim": 8, "chunk_size": 16}, "A": {"head_dim": 8}}
LENGTHS = [13, 2, 30, 7, 1, 21]


def _model():
    torch.manual_seed(0)
    return HybridLM(256, 32, "MGKPA", mixer_overrides=SMALL).double()


@pytest.mark.parametrize("fixed_length", [pytest.param(True, id="fixed-length"), pytest.param(False, id="tight")])
def test_assembled_pack_trains_with_the_plans_metadata(fixed_length):
    documents = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)) for n in LENGTHS]
    plan = plan_packs(LENGTHS, max_tokens=64, align_to=8)
    model = _model()
    assert len(plan.packs) > 1
    for i, pack in enumerate(plan.packs):
        batch = plan.assemble(i, documents, labels=documents, fixed_length=fixed_length)
        with torch.no_grad():
            loss = model(batch["input_ids"], batch["packed_seq_params"], labels=batch["labels"])["loss"]
        # equal to the token-weighted loss of the pack's documents run alone: the padding predicts nothing
        with torch.no_grad():
            total = sum(float(model(documents[d][None], labels=documents[d][None])["loss"]) * (LENGTHS[d] - 1)
                        for d in pack if LENGTHS[d] > 1)
        count = sum(LENGTHS[d] - 1 for d in pack if LENGTHS[d] > 1)
        assert abs(float(loss) - total / count) < 1e-10


def test_the_tight_row_does_not_fit_the_plans_aligned_metadata():
    """Why ``assemble`` exists: the MIMO helper packs documents back to back."""
    padded = torch.zeros(len(LENGTHS), max(LENGTHS), dtype=torch.long)
    plan = plan_packs(LENGTHS, max_tokens=64, align_to=8)
    tight = assemble_packed_sequence(plan.packs[0], padded, LENGTHS)["input_ids"]
    params = plan.packed_seq_params(0, fixed_length=False)
    assert tight.shape[1] < params.total_tokens
    with pytest.raises(ValueError, match="but the input has"):
        _model()(tight, params)
