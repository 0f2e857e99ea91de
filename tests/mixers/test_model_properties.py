"""Property tests over HybridLM's and CarriedStates' arguments: any input is either refused clearly
(naming the argument) with every piece of state bitwise unchanged, or gives the oracle's result."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mixers import HybridLM
from mixers.model import CarriedStates
from ssm_pack import PackedSeqParams, pack_stream
from tests.mixers.inference.common import same, snapshot
from tests.ssm_pack.contracts import outcome

VOCAB = 16
_MODEL = {}


def _model(pattern: str = "GA"):
    if pattern not in _MODEL:
        torch.manual_seed(0)
        _MODEL[pattern] = HybridLM(VOCAB, 16, pattern, mixer_overrides={"G": {"head_dim": 8, "chunk_size": 4},
                                                                        "A": {"head_dim": 8}}).double().eval()
    return _MODEL[pattern]


@st.composite
def forward_case(draw):
    t = draw(st.integers(1, 9))
    ids = draw(st.lists(st.integers(0, VOCAB - 1), min_size=t, max_size=t))
    lengths = draw(st.lists(st.integers(0, 4), max_size=4))
    total = draw(st.one_of(st.none(), st.integers(0, 10)))
    labels = draw(st.one_of(st.none(), st.lists(st.sampled_from([-100, 0, 3, VOCAB - 1, VOCAB, -1]),
                                                min_size=t, max_size=t)))
    return ids, lengths, total, labels


def _alone_oracle(model, ids, params, labels):
    def check(out) -> bool:
        if params.total_tokens != ids.shape[1]:          # metadata for another row: must be refused
            return False
        logits = out["logits"][0]
        cu = params.cu_seqlens_q.tolist()
        for a, b in zip(cu, cu[1:]):
            if b > a:
                alone = model(ids[:, a:b])["logits"][0]
                if not torch.allclose(logits[a:b], alone, atol=1e-10, rtol=0):
                    return False
        return labels is None or bool(torch.isfinite(out["loss"]))
    return check


@given(forward_case())
def test_hybrid_forward_refuses_clearly_or_matches_each_document_alone(case):
    ids, lengths, total, labels = case
    model = _model()
    ids = torch.tensor([ids])
    label_t = None if labels is None else torch.tensor([labels])
    try:
        params = PackedSeqParams.from_lengths(lengths, total_tokens=total)
    except ValueError as err:
        assert "total_tokens" in str(err) or "lengths" in str(err)
        return
    with torch.no_grad():
        verdict = outcome(lambda: model(ids, packed_seq_params=params, labels=label_t),
                          ("total_tokens", "labels", "cu_seqlens", "input_ids"),
                          _alone_oracle(model, ids, params, labels))
    assert verdict in ("clear", "ok"), verdict


@given(forward_case(), st.lists(st.integers(-1, 4), min_size=0, max_size=5))
def test_a_refused_cached_call_leaves_the_cache_bitwise_unchanged(case, slots):
    ids, lengths, total, _ = case
    model = _model()
    cache = model.allocate_inference_cache(4, 12)
    before = snapshot(cache)
    try:
        params = PackedSeqParams.from_lengths(lengths, total_tokens=total)
    except ValueError:
        return
    ids = torch.tensor([ids])
    with torch.no_grad():
        verdict = outcome(lambda: model(ids, packed_seq_params=params, cache=cache, cache_slots=slots),
                          ("total_tokens", "cache_slots", "cu_seqlens", "slot", "max_seqlen"),
                          lambda out: out["logits"].shape == (1, ids.shape[1], VOCAB))
    assert verdict in ("clear", "ok"), verdict
    if verdict == "clear":
        assert same(before, snapshot(cache))


_PACKS = {}


def _packs():
    if "p" not in _PACKS:
        g = torch.Generator().manual_seed(1)
        docs = [torch.randint(0, VOCAB, (n,), generator=g) for n in (3, 30, 2)]
        _PACKS["p"] = list(pack_stream(docs, 8))
    return _PACKS["p"]


@settings(max_examples=8)            # each pack runs the cached path of the model
@given(st.lists(st.integers(0, 5), min_size=1, max_size=4))
def test_carried_states_take_packs_in_order_only(order):
    packs = _packs()
    order = [i % len(packs) for i in order]
    carried = CarriedStates(_model("G"), max_documents=4, max_document_tokens=40)
    last = None
    for i in order:
        before = (snapshot(carried.cache), carried.carried)
        holding = carried.carried is not None
        follows = (not packs[i]["continues"] and not holding) or (packs[i]["continues"] and holding and i == last + 1)
        with torch.no_grad():
            verdict = outcome(lambda: carried(packs[i]), ("the pack continues",), lambda out: True)
        if verdict == "clear":
            assert not follows and same(before[0], snapshot(carried.cache)) and carried.carried == before[1]
        else:
            assert verdict == "ok" and follows, (order, i, verdict)
            last = i


@pytest.mark.parametrize("order", [pytest.param([0, 1, 2, 3, 4], id="in-order"), pytest.param([0, 1, 1], id="twice")])
def test_the_carried_order_property_is_not_vacuous(order):
    """Negative control: a repeated continuing pack is refused, the stream's order accepted."""
    packs = _packs()
    carried = CarriedStates(_model("G"), max_documents=4, max_document_tokens=40)
    verdicts = []
    for i in order:
        with torch.no_grad():
            verdicts.append(outcome(lambda: carried(packs[i]), ("the pack continues",), lambda out: True))
    assert verdicts == (["ok"] * len(order) if order == sorted(set(order)) else ["ok", "ok", "clear"])


_LAYER = {}


@given(st.integers(1, 9), st.lists(st.integers(0, 4), max_size=4), st.one_of(st.none(), st.integers(0, 10)))
def test_a_layer_refuses_clearly_or_matches_each_document_alone(t, lengths, total):
    from mixers import GatedDeltaNetMixer
    if "g" not in _LAYER:
        torch.manual_seed(0)
        _LAYER["g"] = GatedDeltaNetMixer(16, head_dim=8, chunk_size=4).double()
    layer = _LAYER["g"]
    x = torch.randn(1, t, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(t))
    try:
        params = PackedSeqParams.from_lengths(lengths, total_tokens=total)
    except ValueError:
        return

    def alone(out) -> bool:
        cu = params.cu_seqlens_q.tolist()
        return params.total_tokens == t and all(
            torch.allclose(out[0, a:b], layer(x[:, a:b])[0], atol=1e-10, rtol=0) for a, b in zip(cu, cu[1:]) if b > a)

    with torch.no_grad():
        verdict = outcome(lambda: layer(x, packed_seq_params=params), ("total_tokens", "cu_seqlens"), alone)
    assert verdict in ("clear", "ok"), verdict
