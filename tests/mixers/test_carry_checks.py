"""CarriedStates refuses what does not follow or does not fit, naming it, with every state untouched.

Packs of 24 tokens (align_to=4) over documents of (9, 12, 70, 5) tokens: the 70-token document
(source index 2) is carried in slot 1, from tokens 16, 40 and 64, so a message that names the
document and the token cannot be confused with the slot. Each refusal is checked against the exact
message a user reads, the cache bitwise and the carried tuple; each has its negative control (the
untampered pack or state is accepted).
"""

import re

import pytest
import torch

from mixers import HybridLM
from mixers.model import CarriedStates
from ssm_pack import pack_stream
from tests.mixers.inference.common import same, snapshot

SMALL = {"G": {"head_dim": 8, "chunk_size": 16}, "A": {"head_dim": 8}}
KEYS = ["input_ids", "targets", "packed_seq_params", "documents", "offsets", "continues", "continued"]


def _model():
    torch.manual_seed(0)
    return HybridLM(64, 32, "GA", mixer_overrides=SMALL).double()


def _packs(lengths=(9, 12, 70, 5), max_tokens=24, align_to=4):
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 64, (n,), generator=g) for n in lengths]
    return list(pack_stream(docs, max_tokens, align_to=align_to))


def _fed(model, packs, count, **sizes):
    """A CarriedStates that has run the first ``count`` packs."""
    carry = CarriedStates(model, **({"max_documents": 8, "max_document_tokens": 80} | sizes))
    with torch.no_grad():
        for pack in packs[:count]:
            carry(pack)
    return carry


def _refused(carry, call, error, message):
    before = (snapshot(carry.cache), carry.carried)
    with pytest.raises(error, match=re.escape(message)):
        call()
    assert same(before[0], snapshot(carry.cache)) and carry.carried == before[1]


def test_the_stream_is_as_the_cases_below_assume():
    packs = _packs()
    assert [(p["documents"].tolist(), p["offsets"].tolist(), p["continues"], p["continued"]) for p in packs] == [
        ([0, 1], [0, 0], False, False), ([3, 2], [0, 0], False, True), ([2], [16], True, True),
        ([2], [40], True, True), ([2], [64], True, False)]
    assert _fed(_model(), packs, 2).carried == (2, 1, 16)


ORDER = [  # (packs run first, the pack fed next, what the message says)
    (0, 2, "the pack continues document 2 from token 16 but the carried state is none"),
    (2, 0, "the pack continues none but the carried state is document 2 from token 16"),
    (2, 3, "the pack continues document 2 from token 40 but the carried state is document 2 from token 16"),
    (3, 2, "the pack continues document 2 from token 16 but the carried state is document 2 from token 40"),
]


@pytest.mark.parametrize("ran, fed, message", [pytest.param(*case, id=i) for case, i in zip(ORDER, (
    "continuing-with-nothing-carried", "fresh-while-carrying", "skipped-pack", "same-pack-twice"))])
def test_a_pack_that_does_not_follow_is_refused_naming_both(ran, fed, message):
    model, packs = _model(), _packs()
    carry = _fed(model, packs, ran)
    _refused(carry, lambda: carry(packs[fed]), ValueError, message)
    with torch.no_grad():                                              # negative control: the next pack runs
        carry(packs[ran])


def _tampered(pack, what):
    if what == "not-a-dict":
        return [pack]
    if what == "missing-keys":
        return {k: v for k, v in pack.items() if k not in ("targets", "continued")}
    if what == "token-outside-vocabulary":
        ids = pack["input_ids"].clone()
        ids[0, 5] = 64
        return dict(pack, input_ids=ids)
    if what == "documents-disagree":
        return dict(pack, documents=pack["documents"][:1])
    if what == "says-it-continues":
        return dict(pack, continues=True)
    if what == "later-piece-offset":
        return dict(pack, offsets=torch.tensor([0, 3]))
    raise AssertionError(what)


MALFORMED = [
    ("not-a-dict", TypeError, f"pack must be a dict from ssm_pack.pack_stream; missing {KEYS}"),
    ("missing-keys", TypeError, "pack must be a dict from ssm_pack.pack_stream; missing ['continued', 'targets']"),
    ("token-outside-vocabulary", ValueError, "input_ids[0, 5]=64 is outside the vocabulary of 64 tokens (0..63)"),
    ("documents-disagree", ValueError, "the pack's documents (1), offsets (2) and packed_seq_params (2 documents) "
                                       "disagree; pass packs as pack_stream yields them"),
    ("says-it-continues", ValueError, "the pack says continues=True but its offsets are [0, 0]"),
    ("later-piece-offset", ValueError, "the pack says continues=False but its offsets are [0, 3]"),
]


@pytest.mark.parametrize("what, error, message", [pytest.param(*case, id=case[0]) for case in MALFORMED])
def test_a_malformed_pack_is_refused_naming_what_is_wrong(what, error, message):
    model, packs = _model(), _packs()
    carry = _fed(model, packs, 0)
    _refused(carry, lambda: carry(_tampered(packs[0], what)), error, message)
    with torch.no_grad():                                              # negative control: the pack itself runs
        carry(packs[0])


def test_a_pack_with_more_documents_than_slots_is_refused():
    model, packs = _model(), _packs()
    carry = _fed(model, packs, 0, max_documents=1)
    _refused(carry, lambda: carry(packs[0]), ValueError, "the pack holds 2 documents but CarriedStates was built "
             "with max_documents=1; raise max_documents")
    with torch.no_grad():                                              # negative control: 2 slots are enough
        _fed(model, packs, 0, max_documents=2)(packs[0])


def test_a_pack_holding_only_the_keys_carried_states_reads_runs_the_same():
    model, packs = _model(), _packs()
    full, lean = _fed(model, packs, 0), _fed(model, packs, 0)
    with torch.no_grad():
        for pack in packs:
            want = full(pack)["logits"]
            assert torch.equal(lean({k: pack[k] for k in KEYS})["logits"], want)


def test_a_carrying_state_names_a_slot_of_this_cache_only():
    """max_documents=2 gives three slots (two pieces and the carried one): slot 3 is refused."""
    model, packs = _model(), _packs()
    state = _fed(model, packs, 2, max_documents=2).state_dict()
    assert state["carried"] == (2, 1, 16)
    carry = _fed(model, packs, 0, max_documents=2)
    _refused(carry, lambda: carry.load_state_dict(dict(state, carried=(2, 3, 16))), ValueError,
             "state['carried'] names slot 3 but this cache has 3 slots; build CarriedStates with max_documents >= 3")
    carry.load_state_dict(dict(state, carried=(2, 2, 16)))            # negative control: the last slot is valid
    assert carry.carried == (2, 2, 16)


def _bad_states(state, what):
    layers = [dict(layer) for layer in state["states"]]
    if what == "one-mixer-missing":
        return dict(state, states=layers[:1])
    if what == "states-not-a-list":
        return dict(state, states=None)
    if what == "a-renamed-state":
        layers[0]["other"] = layers[0].pop("q_conv")
        return dict(state, states=layers)
    if what == "a-mixer-not-a-dict":
        return dict(state, states=[5, layers[1]])
    raise AssertionError(what)


GATED = ['k_conv', 'q_conv', 'recurrent', 'v_conv']
BAD_STATES = [
    ("one-mixer-missing", "state['states'] must hold one dict per mixer (2), got 1"),
    ("states-not-a-list", "state['states'] must hold one dict per mixer (2), got NoneType None"),
    ("a-renamed-state", f"state['states'][0] must hold {GATED} (GatedDeltaNetMixer), got "
                        "['k_conv', 'other', 'recurrent', 'v_conv']"),
    ("a-mixer-not-a-dict", f"state['states'][0] must hold {GATED} (GatedDeltaNetMixer), got int 5"),
]


@pytest.mark.parametrize("what, message", [pytest.param(*case, id=case[0]) for case in BAD_STATES])
def test_a_bad_state_is_refused_naming_what_it_holds(what, message):
    model, packs = _model(), _packs()
    state = _fed(model, packs, 2).state_dict()
    carry = _fed(model, packs, 3)
    _refused(carry, lambda: carry.load_state_dict(_bad_states(state, what)), ValueError, message)
    carry.load_state_dict(state)                                       # negative control: the state itself loads
    assert carry.carried == (2, 1, 16)


def test_loading_a_state_that_carries_nothing_forgets_the_carried_document():
    model, packs = _model(), _packs()
    carry = _fed(model, packs, 2)
    empty = _fed(model, packs, 1).state_dict()
    assert empty == {"carried": None}
    carry.load_state_dict(empty)
    assert carry.carried is None and carry.state_dict() == {"carried": None}
    with pytest.raises(ValueError, match="continues document 2 from token 16 but the carried state is none"):
        carry(packs[2])
    with torch.no_grad():
        got = carry(packs[0])["logits"]
        want = _fed(model, packs, 0)(packs[0])["logits"]
    assert torch.equal(got, want)


def test_a_state_carrying_a_one_token_piece_loads_and_resumes():
    """The lower end of state['length'] (1..max_document_tokens): documents of (23, 30) tokens in packs
    of 24 (align_to=1) leave one token of document 1 in the first pack, so its state holds length 1;
    loaded into a new CarriedStates it continues the next pack exactly as the uninterrupted run."""
    model, packs = _model(), _packs((23, 30), align_to=1)
    assert [(p["documents"].tolist(), p["offsets"].tolist()) for p in packs[:2]] == [([0, 1], [0, 0]), ([1], [1])]
    run = _fed(model, packs, 1)
    state = run.state_dict()
    assert state["carried"] == (1, 1, 1) and state["length"] == 1
    resumed = _fed(model, packs, 0)
    resumed.load_state_dict(state)
    assert resumed.carried == (1, 1, 1)
    with torch.no_grad():
        assert torch.equal(resumed(packs[1])["logits"], run(packs[1])["logits"])
