"""HybridLM("MGKPA") with a cache, fp64: packed prefill and decoding equal a full forward of each
sequence, continuous batching equals solo runs, untouched slots stay bitwise, bad input leaves the
cache unchanged."""

import pytest
import torch

from mixers import HybridLM
from mixers.inference import ContinuousBatcher, check_against_recompute
from ssm_pack import PackedSeqParams
from tests.mixers.inference.common import CHUNK, SMALL, max_error, same, snapshot
from tests.support.tolerances import FP32_REL, FP64_ABS

EXACT = FP64_ABS


def model(pattern="MGKPA", dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    return HybridLM(64, 32, pattern, mixer_overrides=SMALL).to(dtype).eval()


def prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (n,), generator=g).tolist() for n in lengths]


def logits_alone(m, tokens):
    with torch.no_grad():
        return m(torch.tensor(tokens).unsqueeze(0))["logits"][0]


def prefill(m, cache, pieces, slots):
    p = PackedSeqParams.from_lengths([len(x) for x in pieces])
    with torch.no_grad():
        out = m(torch.tensor([t for x in pieces for t in x]).unsqueeze(0), p, cache=cache, cache_slots=slots)
    cu = p.cu_seqlens_q.tolist()
    return [out["logits"][0, a:b] for a, b in zip(cu[:-1], cu[1:])]


@pytest.mark.parametrize("pattern", [pytest.param("MGKPA", id="MGKPA"), pytest.param("CAC", id="lfm2-like-CAC")])
def test_packed_prefill_then_decode_steps_equal_full_forward(pattern):
    m = model(pattern)
    seqs = prompts([CHUNK + 5, 1, 3, 2 * CHUNK + 1])
    slots = [3, 1, 0, 4]
    cache = m.allocate_inference_cache(5, 40)
    outs = prefill(m, cache, seqs, slots)
    g = torch.Generator().manual_seed(2)
    for _ in range(5):
        new = torch.randint(0, 64, (len(seqs), 1), generator=g)
        with torch.no_grad():
            step = m(new, cache=cache, cache_slots=slots)["logits"]
        for i, s in enumerate(seqs):
            s.append(int(new[i]))
            outs[i] = torch.cat([outs[i], step[i]])
    for s, out in zip(seqs, outs):
        assert max_error(out, logits_alone(m, s)) <= EXACT
    assert cache.lengths.tolist() == [8, 6, 0, 18, 22]
    # negative control: the last step without the cache
    with torch.no_grad():
        alone = m(torch.tensor([[seqs[0][-1]]]))["logits"][0, -1]
    assert max_error(alone, logits_alone(m, seqs[0])[-1]) > 1e-3


def test_continuous_batching_equals_solo_runs():
    """Seven prompts through three slots, prefill chunks of 5 mixed with decodes, slots reused: every
    sequence equals its solo run and a full recompute."""
    m = model()
    ps = prompts([12, 1, 7, 19, 3, 9, 2], seed=4)
    batcher = ContinuousBatcher(m, max_batch_size=3, prefill_chunk=5, record_logits=True)
    outputs = batcher.run(ps, max_new_tokens=6)
    assert batcher.slots_reused >= 4 and batcher.packed_steps > 0 and batcher.decode_steps > 0
    for p, out in zip(ps, outputs):
        assert len(out) == 6 and m.generate([p], max_new_tokens=6, max_batch_size=1) == [out]
    check = check_against_recompute(m, ps, outputs, batcher.logits)
    assert check["greedy_match"] and check["max_abs"] <= EXACT and check["tokens"] == 42
    # negative control: logits from the wrong sequence do not pass the check
    swapped = check_against_recompute(m, ps[:2], outputs[:2], [batcher.logits[1][:1].expand(6, -1), batcher.logits[0]])
    assert swapped["max_abs"] > 1e-3


def test_check_against_recompute_flags_tokens_that_are_not_the_argmax():
    """``greedy_match`` is whether every generated token is the full forward's argmax: a last token
    swapped for another (its logits unchanged, so the differences stay 0) turns it False."""
    m = model("MGA")
    ps = prompts([6, 1, 9], seed=12)
    batcher = ContinuousBatcher(m, max_batch_size=2, record_logits=True)
    outputs = batcher.run(ps, max_new_tokens=4)
    check = check_against_recompute(m, ps, outputs, batcher.logits)
    assert check["greedy_match"] and check["tokens"] == 12 and check["sequences"] == 3
    swapped = [out[:-1] + [(out[-1] + 1) % 64] if i == 1 else out for i, out in enumerate(outputs)]
    bad = check_against_recompute(m, ps, swapped, batcher.logits)
    assert not bad["greedy_match"], "a token that is not the argmax passed as greedy"
    assert bad["max_abs"] == check["max_abs"] and bad["tokens"] == 12


def test_check_against_recompute_skips_sequences_without_tokens():
    """A sequence that generated nothing (``max_new_tokens=0``, or an empty output next to others)
    adds no token and no difference; the others are compared as before."""
    m = model("MGA")
    ps = prompts([5, 8, 2], seed=13)
    none = ContinuousBatcher(m, record_logits=True)
    empty = check_against_recompute(m, ps, none.run(ps, max_new_tokens=0), none.logits)
    assert empty == {"sequences": 0, "tokens": 0, "max_abs": 0.0, "rel_rms": 0.0, "greedy_match": True}
    batcher = ContinuousBatcher(m, record_logits=True)
    outputs = batcher.run(ps, max_new_tokens=3)
    logits = list(batcher.logits)
    outputs[1], logits[1] = [], torch.zeros(0)
    check = check_against_recompute(m, ps, outputs, logits)
    assert check["sequences"] == 2 and check["tokens"] == 6 and check["greedy_match"]
    assert check["max_abs"] <= EXACT


def test_continuous_batching_fp32_within_tolerance():
    m = model(dtype=torch.float32)
    ps = prompts([9, 2, 14], seed=5)
    batcher = ContinuousBatcher(m, max_batch_size=2, prefill_chunk=4, record_logits=True)
    outputs = batcher.run(ps, max_new_tokens=5)
    check = check_against_recompute(m, ps, outputs, batcher.logits)
    assert check["rel_rms"] <= FP32_REL and check["tokens"] == 15


def test_mixed_steps_keep_unnamed_slots_bitwise():
    """Prefill chunks, decodes and a reused slot interleaved by hand: each sequence equals its solo
    forward, and a slot no call names keeps every bit."""
    m = model()
    a, b, c, d = prompts([11, 4, 6, 9], seed=6)
    cache = m.allocate_inference_cache(4, 32)
    prefill(m, cache, [d[:5]], [2])                       # slot 2 holds d[:5] and is never named again
    held = snapshot(cache)
    held = {k: v[2] if k != "lengths" else v for k, v in held.items()}
    got = {"a": prefill(m, cache, [a[:3], b], [0, 1])[0]}
    got["b"] = None
    got["a"] = torch.cat([got["a"], prefill(m, cache, [a[3:], c[:2]], [0, 3])[0]])
    with torch.no_grad():
        step = m(torch.tensor([[a[-1]], [c[2]]]), cache=cache, cache_slots=[0, 3])["logits"]
    cache.reset([1])                                      # b is done; its slot takes d
    rest = prefill(m, cache, [c[3:], d], [3, 1])
    assert max_error(torch.cat([got["a"], step[0]]), logits_alone(m, a + [a[-1]])) <= EXACT
    assert max_error(torch.cat([step[1], rest[0]]), logits_alone(m, c)[2:]) <= EXACT
    assert max_error(rest[1], logits_alone(m, d)) <= EXACT
    now = snapshot(cache)
    for k, v in held.items():
        if k == "lengths":
            assert int(now[k][2]) == 5
        else:
            assert torch.equal(now[k][2], v), k


def test_generate_sampling_is_reproducible_and_eos_stops():
    m = model("GA")
    ps = prompts([3, 5], seed=8)
    runs = [m.generate(ps, max_new_tokens=4, temperature=0.8, generator=torch.Generator().manual_seed(3))
            for _ in range(2)]
    assert runs[0] == runs[1] and all(0 <= t < 64 for out in runs[0] for t in out)
    greedy = m.generate(ps, max_new_tokens=4)
    stop = greedy[0][1]
    stopped = m.generate(ps, max_new_tokens=4, eos_token_id=stop)
    assert stopped[0] == greedy[0][:greedy[0].index(stop) + 1]


def bad_call(case, m, cache):
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    p = PackedSeqParams.from_lengths([2, 3])
    return {
        "slot-out-of-range": lambda: m(ids, p, cache=cache, cache_slots=[0, 9]),
        "same-slot-twice": lambda: m(ids, p, cache=cache, cache_slots=[2, 2]),
        "max-seqlen-exceeded": lambda: m(torch.zeros(2, 7, dtype=torch.long), cache=cache, cache_slots=[0, 1]),
        "slots-vs-documents": lambda: m(ids, p, cache=cache, cache_slots=[0, 1, 2]),
        "slots-vs-rows": lambda: m(torch.zeros(3, 1, dtype=torch.long), cache=cache, cache_slots=[0, 1]),
        "other-model": lambda: model()(ids, p, cache=cache, cache_slots=[0, 1]),
        "other-dtype": lambda: m.float()(ids, p, cache=cache, cache_slots=[0, 1]),
        "other-device": lambda: m(ids, p, cache=m.allocate_inference_cache(4, 8, device="meta"), cache_slots=[0, 1]),
        "no-slots": lambda: m(ids, p, cache=cache),
        "float-slots": lambda: m(ids, p, cache=cache, cache_slots=torch.tensor([0.0, 1.0])),
        "slots-without-cache": lambda: m(ids, p, cache_slots=[0, 1]),
        "layer-cache-to-model": lambda: m(ids, p, cache=cache.layers[0], cache_slots=[0, 1]),
    }[case]


BAD = [
    pytest.param("slot-out-of-range", ValueError, r"cache_slots\[1\]=9 is out of range for a cache of 4 slots",
                 id="slot-out-of-range"),
    pytest.param("same-slot-twice", ValueError, "names slot 2 twice", id="same-slot-twice"),
    pytest.param("max-seqlen-exceeded", ValueError,
                 r"slot 0 would hold 9 tokens \(2 cached \+ 7 new\) but the cache was allocated with max_seqlen=8",
                 id="max-seqlen-exceeded"),
    pytest.param("slots-vs-documents", ValueError, "names 3 slots but the call has 2 documents",
                 id="slots-vs-documents"),
    pytest.param("slots-vs-rows", ValueError, "names 2 slots but the call has 3 rows", id="slots-vs-rows"),
    pytest.param("other-model", ValueError, "allocated by another HybridLM", id="other-model"),
    pytest.param("other-dtype", ValueError,
                 "allocated for torch.float64 activations but the model now runs torch.float32", id="other-dtype"),
    pytest.param("other-device", ValueError, "the cache lives on meta but input_ids on cpu", id="other-device"),
    pytest.param("no-slots", ValueError, "cache_slots is required with cache=", id="no-slots"),
    pytest.param("float-slots", TypeError, "cache_slots must be a 1-D integer tensor", id="float-slots"),
    pytest.param("slots-without-cache", TypeError, "cache must be the InferenceCache", id="slots-without-cache"),
    pytest.param("layer-cache-to-model", TypeError, "cache must be the InferenceCache", id="layer-cache-to-model"),
]


@pytest.mark.parametrize("case,error,match", BAD)
def test_bad_input_is_refused_and_leaves_the_cache_unchanged(case, error, match):
    m = model()
    cache = m.allocate_inference_cache(4, 8)
    prefill(m, cache, [[5, 6], [7]], [0, 3])
    before = snapshot(cache)
    with pytest.raises(error, match=match):
        bad_call(case, m, cache)()
    assert same(before, snapshot(cache))


def test_reset_errors_and_the_snapshot_sees_a_reset():
    m = model("GA")
    cache = m.allocate_inference_cache(4, 8)
    prefill(m, cache, [[5, 6], [7]], [0, 3])
    with pytest.raises(ValueError, match=r"slots\[0\]=4 is out of range"):
        cache.reset([4])
    with pytest.raises(ValueError, match="part of a model's InferenceCache"):
        cache.layers[0].reset([0])
    before = snapshot(cache)                      # negative control: the comparison does see a change
    cache.reset([3])
    assert not same(before, snapshot(cache)) and cache.free_slots() == [1, 2, 3]


@pytest.mark.parametrize("prompt,new,match", [
    pytest.param([[]], 2, "prompts\\[0\\] is empty", id="empty-prompt"),
    pytest.param([[1, 99]], 2, r"prompts\[0\]\[1\]=99 is outside the vocabulary of 64 tokens \(0..63\)",
                 id="out-of-vocabulary"),
    pytest.param([[1]], -1, "max_new_tokens must be >= 0", id="negative-new-tokens"),
])
def test_generate_bad_input(prompt, new, match):
    with pytest.raises(ValueError, match=match):
        model("G").generate(prompt, max_new_tokens=new)


def test_inference_mode():
    """Under torch.inference_mode (what servers use), packing metadata, caches and generate work, and
    give what no_grad gives."""
    m = model("MGA")
    ps = prompts([4, 7], seed=9)
    want = m.generate(ps, max_new_tokens=3)
    with torch.inference_mode():
        assert m.generate(ps, max_new_tokens=3) == want
        cache = m.allocate_inference_cache(2, 16)
        inside = prefill(m, cache, ps, [1, 0])
    outside = prefill(m, m.allocate_inference_cache(2, 16), ps, [1, 0])
    assert all(torch.equal(a, b) for a, b in zip(inside, outside))


def test_generate_resumes_prefilled_slots():
    """Prompts already in slots of the cache (``prefilled=``, what a context-parallel prefill leaves;
    here a packed prefill) generate from there next to prompts the batcher admits itself, through 3
    slots with chunks and slot reuse: the same tokens and logits as generating them all from scratch."""
    m = model()
    ps = prompts([11, 3, 6, 9, 2], seed=6)
    want = ContinuousBatcher(m, max_batch_size=3, prefill_chunk=4, record_logits=True)
    expected = want.run(ps, max_new_tokens=5)
    cache = m.allocate_inference_cache(3, 32)
    last = prefill(m, cache, [ps[3], ps[0]], [2, 0])               # prompts 3 and 0 are in slots 2 and 0
    batcher = ContinuousBatcher(m, prefill_chunk=4, record_logits=True, cache=cache)
    got = batcher.run(ps, max_new_tokens=5, prefilled={3: (2, last[0][-1]), 0: (0, last[1][-1])})
    assert got == expected and batcher.slots_reused >= 2
    assert batcher.admitted == len(ps), f"{batcher.admitted} prompts admitted, {len(ps)} given (2 of them prefilled)"
    assert max(max_error(a, b) for a, b in zip(batcher.logits, want.logits)) <= EXACT
    # negative control: the slots' tokens taken as fresh prompts' logits (wrong logits) change the tokens
    cache = m.allocate_inference_cache(3, 32)
    last = prefill(m, cache, [ps[3], ps[0]], [2, 0])
    wrong = m.generate(ps, 5, cache=cache, max_batch_size=3, prefilled={3: (2, last[1][-1]), 0: (0, last[0][-1])})
    assert wrong != expected


@pytest.mark.parametrize("prefilled,error,match", [
    pytest.param({0: (1, None)}, TypeError, r"prefilled\[0\] must be \(slot, logits", id="no-logits"),
    pytest.param({5: (1, torch.zeros(64))}, ValueError, "prefilled names prompt 5 but there are 2", id="index"),
    pytest.param({0: (0, torch.zeros(64))}, ValueError, "slot 0 holds 0 tokens but prompts\\[0\\] has 3",
                 id="slot-not-filled"),
    pytest.param({0: (1, torch.zeros(64)), 1: (1, torch.zeros(64))}, ValueError, "in slot 1; one slot each",
                 id="same-slot"),
    pytest.param({0: (1, torch.zeros(63))}, ValueError, r"logits must be \[V\] \(V=64\)", id="logits-shape"),
    pytest.param({0: (4, torch.zeros(64))}, ValueError, "uses slots 0..1", id="slot-beyond-max-batch-size"),
])
def test_generate_refuses_bad_prefilled_slots(prefilled, error, match):
    m = model("G")
    cache = m.allocate_inference_cache(2, 16) if 4 not in [s for s, _ in prefilled.values()] else \
        m.allocate_inference_cache(6, 16)
    prefill(m, cache, [[1, 2, 3]], [1])
    before = snapshot(cache)
    with pytest.raises(error, match=match):
        m.generate([[1, 2, 3], [4]], 2, cache=cache, max_batch_size=2, prefilled=prefilled)
    assert same(before, snapshot(cache))
    with pytest.raises(ValueError, match="pass that cache"):
        m.generate([[1, 2, 3]], 2, prefilled={0: (1, torch.zeros(64))})
