"""Slots continued by a second packed call, tight and padded, for every mixer; and cached forwards in
grad mode: outputs keep their graph, cache tensors never do. Oracle: each sequence run alone
without a cache (no code of the cache path)."""

import pytest
import torch

from mixers import HybridLM
from ssm_pack import PackedSeqParams
from tests.mixers.inference.common import (
    CHUNK,
    HIDDEN,
    LETTERS,
    SMALL,
    WIDTH,
    full,
    make_mixer,
    max_error,
    packed_call,
    same,
    sequences,
    slot_states,
)
from tests.support.tolerances import FP64_ABS

EXACT = FP64_ABS
# first piece, second piece per sequence: a fresh slot continued, length-1 pieces, pieces inside
# the conv window and across chunk boundaries, an empty second piece (the slot is left as it is)
FIRST = [5, 1, CHUNK + 1, WIDTH - 1, 2]
SECOND = [4, CHUNK, 3, 1, 0]
SLOTS = [3, 0, 5, 1, 2]                          # not in order; slot 4 is never named
LAYOUTS = [pytest.param({}, id="tight"), pytest.param({"pad_to_multiple_of": 4}, id="padded-4"),
           pytest.param({"pad_to_multiple_of": 4, "total_tokens": 64}, id="padded-4-tail")]


def continued(layer, seqs, layout, first_layout=None):
    """Prefill FIRST, continue with SECOND (both packed, ``layout``), decode one token per row."""
    cache = layer.allocate_inference_cache(6, 40)
    with torch.no_grad():
        packed_call(layer, [sequences([7], seed=8)[0]], cache, [4])
        held = slot_states(cache, 4)
        one = packed_call(layer, [s[:a] for s, a in zip(seqs, FIRST)], cache, SLOTS,
                          **(layout if first_layout is None else first_layout))
        two = packed_call(layer, [s[a:a + b] for s, a, b in zip(seqs, FIRST, SECOND)], cache, SLOTS, **layout)
        last = torch.stack([s[-1:] for s in seqs])
        three = layer(last, cache=cache, cache_slots=SLOTS)
    outs = [torch.cat([o, t, three[i]]) for i, (o, t) in enumerate(zip(one, two))]
    return outs, cache, held


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("letter", LETTERS)
def test_packed_continuation_equals_each_sequence_alone(letter, layout):
    layer = make_mixer(letter)
    seqs = sequences([a + b + 1 for a, b in zip(FIRST, SECOND)], seed=11)
    outs, cache, held = continued(layer, seqs, layout)
    for i, (seq, out) in enumerate(zip(seqs, outs)):
        assert max_error(out, full(layer, seq)) <= EXACT, f"sequence {i}"
    assert cache.table.lengths.tolist() == [10, 5, 3, 10, 7, 13]
    assert same(slot_states(cache, 4), held)
    # negative control: the continuation from fresh slots is not the sequences' continuation
    fresh = layer.allocate_inference_cache(6, 40)
    with torch.no_grad():
        alone = packed_call(layer, [s[a:a + b] for s, a, b in zip(seqs, FIRST, SECOND)], fresh, SLOTS, **layout)
    assert max_error(alone[0], full(layer, seqs[0])[FIRST[0]:FIRST[0] + SECOND[0]]) > 1e-3


@pytest.mark.parametrize("letter", LETTERS)
def test_padded_continuation_of_a_tight_prefill(letter):
    """The layouts of the two calls need not match: a tight prefill continued by a padded call."""
    layer = make_mixer(letter)
    seqs = sequences([a + b + 1 for a, b in zip(FIRST, SECOND)], seed=12)
    outs, _, _ = continued(layer, seqs, {"pad_to_multiple_of": 4}, first_layout={})
    for i, (seq, out) in enumerate(zip(seqs, outs)):
        assert max_error(out, full(layer, seq)) <= EXACT, f"sequence {i}"


def graph_free(cache) -> list[str]:
    """Names of the cache tensors that require grad or hold a graph (should be none)."""
    layers = cache.layers if hasattr(cache, "layers") else [cache]
    return [f"{i}.{k}" for i, layer in enumerate(layers) for k, v in layer.states.items()
            if v.requires_grad or v.grad_fn is not None]


@pytest.mark.parametrize("letter", LETTERS)
def test_cached_forward_in_grad_mode_keeps_no_graph_in_the_cache(letter):
    """Inputs that require grad, outside no_grad: prefill, continuation and decode give what
    no_grad gives, their outputs differentiate to the inputs, and no cache tensor holds a graph."""
    layer = make_mixer(letter)
    seqs = [s.requires_grad_() for s in sequences([CHUNK + 3, CHUNK + 2], seed=13)]
    cache = layer.allocate_inference_cache(2, 32)
    plain = layer.allocate_inference_cache(2, 32)
    assert torch.is_grad_enabled()
    outs, want = [], []
    for lo, hi in ((0, 3), (3, CHUNK + 1)):
        pieces = [s[lo:hi] for s in seqs]
        outs.append(packed_call(layer, pieces, cache, [1, 0]))
        with torch.no_grad():
            want.append(packed_call(layer, pieces, plain, [1, 0]))
        assert graph_free(cache) == [], f"after tokens {lo}:{hi}"
    row = torch.stack([s[CHUNK + 1:CHUNK + 2] for s in seqs])
    outs.append(list(layer(row, cache=cache, cache_slots=[1, 0])))
    with torch.no_grad():
        want.append(list(layer(row, cache=plain, cache_slots=[1, 0])))
    assert graph_free(cache) == []
    for got, w in zip(outs, want):
        assert all(g.requires_grad for g in got)
        assert all(max_error(g, x) <= EXACT for g, x in zip(got, w))
    assert all(same(slot_states(cache, i), slot_states(plain, i)) for i in range(2))
    sum(o.sum() for group in outs for o in group).backward()
    assert all(s.grad is not None and s.grad.abs().sum() > 0 for s in seqs)


def test_model_cached_forward_in_grad_mode_keeps_no_graph_in_the_cache():
    """HybridLM's parameters require grad: a cached forward outside no_grad (packed, then rows)
    keeps no graph in any cache tensor, and the logits equal no_grad's."""
    torch.manual_seed(0)
    m = HybridLM(64, HIDDEN, "MGKPA", mixer_overrides=SMALL).double()
    ids = torch.randint(0, 64, (1, 9))
    p = PackedSeqParams.from_lengths([4, 5], pad_to_multiple_of=4)
    ids_padded = torch.zeros(1, p.total_tokens, dtype=torch.long)
    starts = p.cu_seqlens.tolist()
    ids_padded[0, starts[0]:starts[0] + 4], ids_padded[0, starts[1]:starts[1] + 5] = ids[0, :4], ids[0, 4:]
    cache, plain = m.allocate_inference_cache(2, 8), m.allocate_inference_cache(2, 8)
    got = m(ids_padded, p, cache=cache, cache_slots=[0, 1])["logits"]
    assert got.requires_grad and graph_free(cache) == []
    step = m(torch.tensor([[3], [7]]), cache=cache, cache_slots=[0, 1])["logits"]
    assert step.requires_grad and graph_free(cache) == []
    with torch.no_grad():
        want = m(ids_padded, p, cache=plain, cache_slots=[0, 1])["logits"]
        want_step = m(torch.tensor([[3], [7]]), cache=plain, cache_slots=[0, 1])["logits"]
    assert max_error(got, want) <= EXACT and max_error(step, want_step) <= EXACT
    step.sum().backward()
    assert m.embed.weight.grad is not None and m.embed.weight.grad.abs().sum() > 0
