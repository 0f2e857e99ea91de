"""CarriedStates.state_dict / load_state_dict: a run stopped mid-document resumes bitwise.

A 70-token document is split over 3+ packs of 24 tokens (pack_stream(split_long="carry")); the run
stops after pack k, its carried states go through torch.save / torch.load (weights_only), and a
NEW model copy with a NEW CarriedStates continues from pack k + 1: logits, loss and gradients equal
the uninterrupted run bitwise. Negative controls: without the load the continuing pack is refused,
and with the carried states zeroed the logits differ.
"""

import io

import pytest
import torch

from mixers import HybridLM
from mixers.model import CarriedStates
from ssm_pack import pack_stream

SMALL = {"M": {"head_dim": 16, "state_size": 8, "chunk_size": 16}, "G": {"head_dim": 8, "chunk_size": 16},
         "K": {"head_dim": 8, "chunk_size": 16}, "P": {"head_dim": 8, "chunk_size": 16}, "A": {"head_dim": 8}}
LONG = 1          # the source index of the long document


def _model():
    torch.manual_seed(0)
    return HybridLM(64, 32, "MGKPA", mixer_overrides=SMALL).double()


def _packs():
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 64, (n,), generator=g) for n in (9, 70, 5, 12)]
    packs = list(pack_stream(docs, 24, align_to=4, split_long="carry"))
    assert sum(LONG in p["documents"].tolist() for p in packs) >= 3
    return packs


def _carry(model):
    return CarriedStates(model, max_documents=8, max_document_tokens=80)


def _step(model, carry, pack):
    """Logits, loss and gradients of one pack."""
    model.zero_grad(set_to_none=True)
    out = carry(pack)
    out["loss"].backward()
    return {"logits": out["logits"].detach(), "loss": out["loss"].detach(),
            "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}


def _same(a, b) -> bool:
    return (torch.equal(a["logits"], b["logits"]) and torch.equal(a["loss"], b["loss"])
            and a["grads"].keys() == b["grads"].keys()
            and all(torch.equal(a["grads"][n], b["grads"][n]) for n in a["grads"]))


def _roundtrip(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _stopped_after(k):
    """The first model and packs run up to pack k, the packs, and the saved carried state."""
    model, packs = _model(), _packs()
    carry = _carry(model)
    for pack in packs[:k + 1]:
        _step(model, carry, pack)
    return model, packs, _roundtrip(carry.state_dict())


def _cuts():
    packs = _packs()
    mid = [k for k in range(len(packs) - 1) if packs[k]["continued"]]
    whole = [k for k in range(len(packs) - 1) if not packs[k]["continued"]]
    assert len(mid) >= 2 and whole
    return [pytest.param(k, id=f"mid-document-after-pack-{k}") for k in mid] + [
        pytest.param(whole[0], id=f"between-documents-after-pack-{whole[0]}")]


@pytest.mark.parametrize("k", _cuts())
def test_resumed_run_equals_the_uninterrupted_run_bitwise(k):
    model, packs = _model(), _packs()
    carry = _carry(model)
    want = [_step(model, carry, pack) for pack in packs]

    first, _, state = _stopped_after(k)
    assert (state["carried"] is not None) == bool(packs[k]["continued"])
    resumed = _model()
    resumed.load_state_dict(first.state_dict())
    carry = _carry(resumed)
    carry.load_state_dict(state)
    for i, pack in enumerate(packs[k + 1:], start=k + 1):
        assert _same(_step(resumed, carry, pack), want[i]), f"pack {i} differs after resuming at pack {k}"


def test_without_the_load_the_continuing_pack_is_refused_or_differs():
    """Negative controls: no load (refused), the carried states zeroed (different logits)."""
    k = next(k for k, p in enumerate(_packs()) if p["continued"])
    model, packs, state = _stopped_after(k)
    fresh = _carry(model)
    with pytest.raises(ValueError, match="carried state is none"):
        fresh(packs[k + 1])
    zeroed = dict(state, states=[{n: torch.zeros_like(t) for n, t in layer.items()} for layer in state["states"]])
    control = _carry(model)
    control.load_state_dict(zeroed)
    loaded = _carry(model)
    loaded.load_state_dict(state)
    got, want = control(packs[k + 1])["logits"], loaded(packs[k + 1])["logits"]
    assert (got - want).abs().max() > 1e-6


def _bad(state, what):
    state = dict(state, states=[dict(layer) for layer in state["states"]])
    if what == "not-a-dict":
        return [state]
    if what == "missing-key":
        return {k: v for k, v in state.items() if k != "length"}
    if what == "extra-key":
        return dict(state, cache=1)
    if what == "layer-count":
        return dict(state, states=state["states"][:-1])
    if what == "state-name":
        state["states"][0]["other"] = state["states"][0].pop("conv")
        return state
    if what == "shape":
        state["states"][1]["recurrent"] = state["states"][1]["recurrent"][..., :-1]
        return state
    if what == "dtype":
        state["states"][4]["key"] = state["states"][4]["key"].float()
        return state
    if what == "slot-range":
        return dict(state, carried=(state["carried"][0], 9, state["carried"][2]))
    if what == "length-over":
        return dict(state, length=81)
    if what == "length-zero":
        return dict(state, length=0)
    if what == "carried-bool":
        return dict(state, carried=(True, 0, 3))
    raise AssertionError(what)


BAD = [("not-a-dict", "state must be a dict"), ("missing-key", r"keys \['carried', 'states'\]"),
       ("extra-key", "'cache'"), ("layer-count", "one dict per mixer"), ("state-name", r"state\['states'\]\[0\]"),
       ("shape", r"state\['states'\]\[1\]\['recurrent'\]"), ("dtype", r"\['key'\] must be a torch.float64"),
       ("slot-range", "slot 9"), ("length-over", r"state\['length'\].*81"), ("length-zero", r"state\['length'\]"),
       ("carried-bool", r"state\['carried'\]")]


@pytest.mark.parametrize("what, message", [pytest.param(w, m, id=w) for w, m in BAD])
def test_bad_states_are_refused_with_the_cache_untouched(what, message):
    first, second = [k for k, p in enumerate(_packs()) if p["continued"]][:2]
    model, packs, state = _stopped_after(first)
    _, _, loaded_state = _stopped_after(second)            # a different carried state already loaded
    assert loaded_state["length"] != state["length"]
    carry = _carry(model)
    carry.load_state_dict(loaded_state)
    before = ([{n: t.clone() for n, t in layer.states.items()} for layer in carry.cache.layers],
              carry.cache.lengths, carry.carried)
    with pytest.raises((ValueError, TypeError), match=message):
        carry.load_state_dict(_bad(state, what))
    assert carry.carried == before[2] and torch.equal(carry.cache.lengths, before[1])
    for layer, saved in zip(carry.cache.layers, before[0]):
        assert all(torch.equal(layer.states[n], saved[n]) for n in saved)
