"""CarriedStates.reset(): after it, nothing is carried; the next fresh pack runs as on a new object,
and a continuing pack (whose state reset() wiped) is refused instead of reading a wiped slot."""

import pytest
import torch

from mixers import HybridLM
from mixers.model import CarriedStates
from ssm_pack import pack_stream

SMALL = {"G": {"head_dim": 8, "chunk_size": 16}, "M": {"head_dim": 16, "state_size": 8, "chunk_size": 16},
         "A": {"head_dim": 8}}


def _setup(pattern):
    torch.manual_seed(0)
    model = HybridLM(64, 32, pattern, mixer_overrides=SMALL).double()
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 64, (n,), generator=g) for n in (9, 70, 5, 12)]
    return model, list(pack_stream(docs, 24, align_to=4))


def _carrying(model, packs):
    """A CarriedStates fed the packs up to the first one whose last piece continues (inclusive), and
    the index of the pack that continues it."""
    carry = CarriedStates(model, max_documents=8, max_document_tokens=80)
    first = next(i for i, p in enumerate(packs) if p["continued"])
    with torch.no_grad():
        for pack in packs[:first + 1]:
            carry(pack)
    assert carry.carried is not None
    return carry, first + 1


@pytest.mark.parametrize("pattern", [pytest.param("GA", id="GA"), pytest.param("MA", id="MA")])
def test_after_reset_a_fresh_pack_runs_as_on_a_new_object(pattern):
    model, packs = _setup(pattern)
    carry, _ = _carrying(model, packs)
    carry.reset()
    with torch.no_grad():
        got = carry(packs[0])["logits"]
        want = CarriedStates(model, max_documents=8, max_document_tokens=80)(packs[0])["logits"]
    assert torch.equal(got, want)


@pytest.mark.parametrize("pattern", [pytest.param("GA", id="GA"), pytest.param("MA", id="MA")])
def test_after_reset_a_continuing_pack_is_refused(pattern):
    model, packs = _setup(pattern)
    carry, follow = _carrying(model, packs)
    assert packs[follow]["continues"]
    carry.reset()
    with pytest.raises(ValueError, match="carried state is none"):
        carry(packs[follow])


def test_without_reset_the_continuing_pack_is_accepted():
    """Negative control: the same continuing pack runs when the carried state was kept."""
    model, packs = _setup("GA")
    carry, follow = _carrying(model, packs)
    with torch.no_grad():
        out = carry(packs[follow])
    assert torch.isfinite(out["logits"]).all()


@pytest.mark.parametrize("value", [pytest.param(1, id="one"), pytest.param(2, id="two")])
def test_the_smallest_sizes_are_accepted(value):
    """max_documents / max_document_tokens of 1 are valid (the check refuses only < 1); a pack of
    one document runs with max_documents=1."""
    model, _ = _setup("GA")
    carry = CarriedStates(model, max_documents=value, max_document_tokens=value)
    assert carry.max_documents == value
    docs = [torch.arange(1, 6)]
    (pack,) = list(pack_stream(docs, 8))
    with torch.no_grad():
        out = CarriedStates(model, max_documents=value, max_document_tokens=8)(pack)
    assert torch.isfinite(out["logits"]).all()
