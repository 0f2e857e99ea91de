"""Every mixer's cache, fp64, against a full recompute: packed prefill then decoding, chunked prefill
at every split point (rows and packed), padded layouts, untouched slots; each with a negative
control that must fail."""

import pytest
import torch

from mixers.layers.registry import MIXERS
from tests.mixers.inference.common import (
    CHUNK,
    HIDDEN,
    LETTERS,
    WIDTH,
    full,
    make_mixer,
    max_error,
    packed_call,
    same,
    sequences,
    slot_states,
    snapshot,
)
from tests.support.oracles import rel_rms
from tests.support.tolerances import FP32_REL, FP64_ABS

EXACT = FP64_ABS
# 1, W-1, chunk-1, chunk, chunk+1, across two chunk boundaries, inside the conv window
PROMPTS = [5, 1, WIDTH - 1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 3]


def states_close(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and all(a[k].shape == b[k].shape for k in a)
    return max(max_error(a[k], b[k]) for k in a)


def one_shot_states(letter, seqs):
    """Each whole sequence prefilled in one packed call into a fresh cache: the states to match."""
    layer = make_mixer(letter)
    cache = layer.allocate_inference_cache(len(seqs), max(s.shape[0] for s in seqs))
    with torch.no_grad():
        packed_call(layer, seqs, cache, list(range(len(seqs))))
    return [slot_states(cache, i) for i in range(len(seqs))]


@pytest.mark.parametrize("letter", LETTERS)
def test_packed_prefill_then_decode_equals_full_forward(letter):
    layer = make_mixer(letter)
    steps = 4
    seqs = sequences([n + steps for n in PROMPTS])
    slots = [6, 0, 3, 1, 5, 2, 7]                       # slot 4 is never named: bitwise untouched
    cache = layer.allocate_inference_cache(8, 40)
    with torch.no_grad():
        packed_call(layer, [sequences([9], seed=9)[0]], cache, [4])
        held = slot_states(cache, 4)
        outs = packed_call(layer, [s[:n] for s, n in zip(seqs, PROMPTS)], cache, slots)
        for step in range(steps):
            token = torch.stack([s[n + step] for s, n in zip(seqs, PROMPTS)]).unsqueeze(1)   # [N, 1, D]
            out = layer(token, cache=cache, cache_slots=slots)
            outs = [torch.cat([o, out[i]]) for i, o in enumerate(outs)]
    for seq, out in zip(seqs, outs):
        assert max_error(out, full(layer, seq)) <= EXACT
    want = one_shot_states(letter, seqs)
    assert max(states_close(slot_states(cache, s), w) for s, w in zip(slots, want)) <= EXACT
    assert same(slot_states(cache, 4), held) and int(cache.table.lengths[4]) == 9
    # negative control: the last token decoded without its slot's state is not the full forward's
    seq, n = seqs[2], PROMPTS[2] + steps - 1
    with torch.no_grad():
        alone = layer(seq[n:n + 1].unsqueeze(0))[0]
    assert max_error(alone, full(layer, seq)[n:n + 1]) > 1e-3


@pytest.mark.parametrize("letter", LETTERS)
def test_chunked_prefill_at_every_split_point(letter):
    """A prompt split at every point (length-1 pieces, inside the conv window, across chunk
    boundaries), one slot per split, two packed calls: equals the one-shot prefill, states included."""
    layer = make_mixer(letter)
    length = 2 * CHUNK + 5
    prompt = sequences([length])[0]
    splits = list(range(1, length))
    cache = layer.allocate_inference_cache(len(splits), length)
    with torch.no_grad():
        first = packed_call(layer, [prompt[:s] for s in splits], cache, list(range(len(splits))))
        second = packed_call(layer, [prompt[s:] for s in splits], cache, list(range(len(splits))))
        whole = full(layer, prompt)
    want = one_shot_states(letter, [prompt])[0]
    for i, s in enumerate(splits):
        assert max_error(torch.cat([first[i], second[i]]), whole) <= EXACT, f"split at {s}"
        assert states_close(slot_states(cache, i), want) <= EXACT, f"states, split at {s}"
    # negative control: the second piece without the first piece's state
    fresh = layer.allocate_inference_cache(1, length)
    with torch.no_grad():
        alone = packed_call(layer, [prompt[WIDTH:]], fresh, [0])[0]
    assert max_error(alone, whole[WIDTH:]) > 1e-3


@pytest.mark.parametrize("letter", LETTERS)
def test_rows_chunks_and_three_piece_prefill(letter):
    """Rows ``[N, t]`` of uneven chunk sizes (1, W-1, across chunks) continue their slots, and a
    packed three-piece split with length-1 pieces equals one shot."""
    layer = make_mixer(letter)
    schedule = [1, WIDTH - 1, CHUNK + 1, 1, CHUNK - 2]
    seqs = sequences([sum(schedule)] * 3, seed=3)
    cache = layer.allocate_inference_cache(4, sum(schedule))
    slots, outs, at = [2, 0, 3], [], 0
    with torch.no_grad():
        for t in schedule:
            outs.append(layer(torch.stack([s[at:at + t] for s in seqs]), cache=cache, cache_slots=slots))
            at += t
    out = torch.cat(outs, dim=1)
    want = one_shot_states(letter, seqs)
    for i, (seq, slot) in enumerate(zip(seqs, slots)):
        assert max_error(out[i], full(layer, seq)) <= EXACT
        assert states_close(slot_states(cache, slot), want[i]) <= EXACT
    cuts = [(1, 2), (WIDTH - 1, WIDTH), (CHUNK - 1, CHUNK + 1), (2, CHUNK + 5)]
    cache = layer.allocate_inference_cache(len(cuts), sum(schedule))
    seq = seqs[0]
    with torch.no_grad():
        parts = [packed_call(layer, [seq[lo:hi] for lo, hi in spans], cache, list(range(len(cuts))))
                 for spans in ([(0, a) for a, _ in cuts], list(cuts), [(b, seq.shape[0]) for _, b in cuts])]
    for i in range(len(cuts)):
        assert max_error(torch.cat([p[i] for p in parts]), full(layer, seq)) <= EXACT


@pytest.mark.parametrize("letter", LETTERS)
def test_padded_layout_keeps_padding_out_of_the_slots(letter):
    """Per-document padding (``cu_seqlens_q_padded``), an empty document and a tail: the real
    tokens' outputs and every slot's state equal the tight layout's."""
    layer = make_mixer(letter)
    seqs = sequences([5, 0, 11, 1, 3], seed=5)
    tight = layer.allocate_inference_cache(5, 32)
    padded = layer.allocate_inference_cache(5, 32)
    with torch.no_grad():
        want = packed_call(layer, seqs, tight, [0, 1, 2, 3, 4])
        got = packed_call(layer, seqs, padded, [0, 1, 2, 3, 4], pad_to_multiple_of=4, total_tokens=40)
        again = [layer(s[-1:].unsqueeze(0), cache=padded, cache_slots=[i])[0] for i, s in enumerate(seqs) if len(s)]
        again_tight = [layer(s[-1:].unsqueeze(0), cache=tight, cache_slots=[i])[0]
                       for i, s in enumerate(seqs) if len(s)]
    for g, w in zip(got + again, want + again_tight):
        assert max_error(g, w) <= EXACT
    for i in range(5):
        assert states_close(slot_states(padded, i), slot_states(tight, i)) <= EXACT
    # negative control: were the padding tokens real, what follows would change
    leaky = layer.allocate_inference_cache(1, 32)
    with torch.no_grad():
        packed_call(layer, [torch.cat([seqs[0], torch.randn(3, HIDDEN, dtype=torch.float64)])], leaky, [0])
        after = layer(seqs[0][-1:].unsqueeze(0), cache=leaky, cache_slots=[0])[0]
    assert max_error(after, again_tight[0]) > 1e-3


@pytest.mark.parametrize("letter", LETTERS)
def test_reset_makes_a_slot_fresh(letter):
    layer = make_mixer(letter)
    a, b = sequences([7, 6], seed=7)
    cache = layer.allocate_inference_cache(2, 16)
    with torch.no_grad():
        packed_call(layer, [a], cache, [1])
        stale = packed_call(layer, [b], cache, [1])[0]          # negative control: no reset, a's state leaks in
        cache.reset([1])
        fresh = packed_call(layer, [b], cache, [1])[0]
    assert max_error(fresh, full(layer, b)) <= EXACT
    assert max_error(stale, full(layer, b)) > 1e-3
    assert int(cache.table.lengths[1]) == 6 and int(cache.table.lengths[0]) == 0


@pytest.mark.parametrize("letter", LETTERS)
def test_fp32_within_tolerance(letter):
    layer = make_mixer(letter, torch.float32)
    seqs = sequences([CHUNK + 3, 3, 1], torch.float32)
    cache = layer.allocate_inference_cache(3, 32)
    with torch.no_grad():
        outs = packed_call(layer, [seqs[0][:-2], seqs[1][:-2], seqs[2]], cache, [0, 1, 2])
        tail = torch.stack([seqs[0][-2:], seqs[1][-2:]])
        rows = layer(tail[:, :1], cache=cache, cache_slots=[0, 1])
        rows2 = layer(tail[:, 1:], cache=cache, cache_slots=[0, 1])
    got = [torch.cat([outs[0], rows[0], rows2[0]]), torch.cat([outs[1], rows[1], rows2[1]]), outs[2]]
    want = [full(layer, seqs[0]), full(layer, seqs[1]), full(layer, seqs[2])]
    for g, w in zip(got, want):
        assert rel_rms(g, w) <= FP32_REL


def test_sliding_window_attention_cache():
    """A window of 3 keys back: packed prefill, a packed continuation, a decode row."""
    torch.manual_seed(0)
    layer = MIXERS["A"].mixer(HIDDEN, head_dim=8, window_size=(3, 0)).double()
    seqs = sequences([9, 2, 5])
    cache = layer.allocate_inference_cache(3, 16)
    with torch.no_grad():
        first = packed_call(layer, [s[:-2] for s in seqs], cache, [0, 1, 2])
        second = packed_call(layer, [s[-2:-1] for s in seqs], cache, [0, 1, 2])
        last = layer(torch.stack([s[-1:] for s in seqs]), cache=cache, cache_slots=[0, 1, 2])
    for i, s in enumerate(seqs):
        assert max_error(torch.cat([first[i], second[i], last[i]]), full(layer, s)) <= EXACT
    unwindowed = make_mixer("A")                          # negative control: the same weights, no window
    unwindowed.load_state_dict(layer.state_dict())
    assert max_error(full(unwindowed, seqs[0]), full(layer, seqs[0])) > 1e-3


@pytest.mark.parametrize("letter", LETTERS)
def test_calls_without_tokens_change_nothing(letter):
    layer = make_mixer(letter)
    cache = layer.allocate_inference_cache(3, 16)
    with torch.no_grad():
        packed_call(layer, sequences([4]), cache, [1])
        before = snapshot(cache)
        rows = layer(torch.zeros(2, 0, HIDDEN, dtype=torch.float64), cache=cache, cache_slots=[0, 1])
        empty = packed_call(layer, [torch.zeros(0, HIDDEN, dtype=torch.float64)] * 2, cache, [1, 2])
    assert rows.shape == (2, 0, HIDDEN) and [e.shape[0] for e in empty] == [0, 0]
    assert same(before, snapshot(cache))


def test_untouched_cache_snapshot_helper_detects_a_change():
    """The bitwise snapshot the tests rely on does see a change (so it cannot pass vacuously)."""
    layer = make_mixer("G")
    cache = layer.allocate_inference_cache(2, 8)
    before = snapshot(cache)
    with torch.no_grad():
        packed_call(layer, sequences([2]), cache, [1])
    assert not same(before, snapshot(cache))


@pytest.mark.parametrize("letter", LETTERS)
def test_mixer_refuses_a_foreign_cache_and_leaves_it_unchanged(letter):
    layer, other = make_mixer(letter), make_mixer(letter)
    cache = layer.allocate_inference_cache(2, 8)
    with torch.no_grad():
        packed_call(layer, sequences([3]), cache, [0])
    x = torch.randn(1, 2, HIDDEN, dtype=torch.float64)
    calls = [
        (lambda: other(x, cache=cache, cache_slots=[1]), ValueError, "allocated by another"),
        (lambda: layer(x.float(), cache=cache, cache_slots=[1]), ValueError,
         "allocated for torch.float64 but hidden_states are torch.float32"),
        (lambda: layer(x.repeat(1, 3, 1), cache=cache, cache_slots=[0]), ValueError,
         r"slot 0 would hold 9 tokens \(3 cached \+ 6 new\)"),
        (lambda: layer(x, cache={"conv": None}, cache_slots=[1]), TypeError, "cache must be the LayerCache"),
        (lambda: layer(x.expand(3, 2, HIDDEN), cache=cache, cache_slots=[0, 1]), ValueError,
         "names 2 slots but the call has 3 rows"),
    ]
    for call, error, match in calls:
        before = snapshot(cache)
        with pytest.raises(error, match=match):
            call()
        assert same(before, snapshot(cache)), match
