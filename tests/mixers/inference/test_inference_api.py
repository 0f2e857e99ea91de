"""The inference API's refusals: ``generate(cache=)`` checks the cache before touching it, token ids
outside the vocabulary, non-finite temperatures, prompts of the wrong form, and a cache under context
parallelism; each refused call leaves the cache bitwise unchanged."""

import math

import pytest
import torch

from mixers import HybridLM
from ssm_pack import PackedSeqParams, shard_for_context_parallel
from tests.mixers.inference.common import SMALL, make_mixer, same, sequences, snapshot

VOCAB = 64


def model(pattern="MGKPA", dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    return HybridLM(VOCAB, 32, pattern, mixer_overrides=SMALL).to(dtype).eval()


def filled_cache(m, slots=4, max_seqlen=16):
    """A cache whose slots 0 and 3 hold tokens (non-zero states everywhere a reset would zero)."""
    cache = m.allocate_inference_cache(slots, max_seqlen)
    p = PackedSeqParams.from_lengths([3, 2])
    with torch.no_grad():
        m(torch.tensor([[5, 6, 7, 8, 9]]), p, cache=cache, cache_slots=[0, 3])
    return cache


def generate_call(case, m, cache):
    prompts = [[1, 2, 3], [4]]
    return {
        "other-model": lambda: model().generate(prompts, 2, cache=cache),
        "other-dtype": lambda: m.float().generate(prompts, 2, cache=cache),
        "other-device": lambda: m.generate(prompts, 2, cache=m.allocate_inference_cache(4, 16, device="meta")),
        "too-short": lambda: m.generate(prompts, 14, cache=cache),
        "too-few-slots": lambda: m.generate(prompts, 2, max_batch_size=5, cache=cache),
        "layer-cache": lambda: m.generate(prompts, 2, cache=cache.layers[0]),
        "bad-prompt": lambda: m.generate([[1, 2], [3, VOCAB]], 2, cache=cache),
        "nan-temperature": lambda: m.generate(prompts, 2, temperature=math.nan, cache=cache),
        "other-model-no-work": lambda: model().generate([], 2, cache=cache),
    }[case]


GENERATE_BAD = [
    pytest.param("other-model", ValueError, "allocated by another HybridLM", id="other-model"),
    pytest.param("other-dtype", ValueError, "allocated for torch.float64 activations but the model now runs "
                 "torch.float32", id="other-dtype"),
    pytest.param("other-device", ValueError, "the cache lives on meta but the model on cpu", id="other-device"),
    pytest.param("too-short", ValueError, "holds 16 tokens per slot but a prompt plus max_new_tokens needs 17",
                 id="too-short"),
    pytest.param("too-few-slots", ValueError, r"max_batch_size=5 but the cache has 4 slots", id="too-few-slots"),
    pytest.param("layer-cache", TypeError, "cache must be an InferenceCache", id="layer-cache"),
    pytest.param("bad-prompt", ValueError, r"prompts\[1\]\[1\]=64 is outside the vocabulary", id="bad-prompt"),
    pytest.param("nan-temperature", ValueError, "temperature must be a finite number", id="nan-temperature"),
    pytest.param("other-model-no-work", ValueError, "allocated by another HybridLM", id="other-model-no-work"),
]


@pytest.mark.parametrize("case,error,match", GENERATE_BAD)
def test_generate_refuses_a_bad_cache_before_touching_it(case, error, match):
    m = model()
    cache = filled_cache(m)
    before = snapshot(cache)
    with pytest.raises(error, match=match):
        generate_call(case, m, cache)()
    assert same(before, snapshot(cache))


def test_generate_with_a_good_cache_resets_it_first():
    """Negative control of the bitwise comparison: the accepted call does change the cache."""
    m = model()
    cache = filled_cache(m)
    before = snapshot(cache)
    m.generate([[1, 2, 3]], 2, cache=cache)
    assert not same(before, snapshot(cache))


@pytest.mark.parametrize("ids,where,value", [
    pytest.param([[1, 2, VOCAB]], r"\[0, 2\]", VOCAB, id="one-past-the-end"),
    pytest.param([[1, -1, 3]], r"\[0, 1\]", -1, id="negative"),
    pytest.param([[1, 2, 3], [4, 5, 1000]], r"\[1, 2\]", 1000, id="second-row"),
])
@pytest.mark.parametrize("cached", [pytest.param(False, id="plain"), pytest.param(True, id="cached")])
def test_token_ids_outside_the_vocabulary_are_refused(ids, where, value, cached):
    m = model("GA")
    ids = torch.tensor(ids)
    cache = filled_cache(m)
    before = snapshot(cache)
    extra = dict(cache=cache, cache_slots=list(range(ids.shape[0]))) if cached else {}
    with pytest.raises(ValueError, match=rf"input_ids{where}={value} is outside the vocabulary of {VOCAB} tokens"):
        m(ids, **extra)
    assert same(before, snapshot(cache))


def test_token_ids_at_the_vocabulary_edges_are_accepted():
    m = model("G")
    out = m(torch.tensor([[0, VOCAB - 1]]))["logits"]
    assert out.shape == (1, 2, VOCAB) and torch.isfinite(out).all()


@pytest.mark.parametrize("temperature,error", [
    pytest.param(math.nan, ValueError, id="nan"),
    pytest.param(math.inf, ValueError, id="inf"),
    pytest.param(-0.5, ValueError, id="negative"),
    pytest.param(True, TypeError, id="bool"),
    pytest.param("0.5", TypeError, id="string"),
])
def test_generate_refuses_bad_temperatures(temperature, error):
    with pytest.raises(error, match="temperature must be a finite number >= 0"):
        model("G").generate([[1, 2]], 2, temperature=temperature)


@pytest.mark.parametrize("form", [
    pytest.param(torch.tensor, id="int64-tensor"),
    pytest.param(lambda p: torch.tensor(p, dtype=torch.int32), id="int32-tensor"),
    pytest.param(tuple, id="tuple"),
    pytest.param(bytes, id="bytes"),
])
def test_generate_takes_prompts_as_tensors_and_sequences(form):
    """A prompt may be a 1-D integer tensor or any sequence of ints: the same tokens as a list."""
    m = model("GA")
    ps = [[5, 17, 3, 40, 9], [2], [33, 8, 61]]
    want = m.generate(ps, max_new_tokens=3)
    got = m.generate([form(p) for p in ps], max_new_tokens=3)
    assert got == want, f"prompts given as {form} generated {got}, as lists {want}"


@pytest.mark.parametrize("prompt", [
    pytest.param(torch.tensor([[1, 2, 3]]), id="2-D-tensor"),
    pytest.param(torch.tensor([1.0, 2.0]), id="float-tensor"),
    pytest.param(torch.tensor(4), id="0-D-tensor"),
])
def test_generate_refuses_prompt_tensors_of_the_wrong_form(prompt):
    with pytest.raises(TypeError, match=r"prompts\[1\] must be a 1-D integer tensor or a sequence of ints"):
        model("G").generate([[1, 2], prompt], 2)


def cp_shard():
    """Rank 0's shard of a row of two documents (3 and 5 tokens, padded to 4) split over two ranks."""
    return shard_for_context_parallel(PackedSeqParams.from_lengths([3, 5], pad_to_multiple_of=4), 0, 2)


def test_model_refuses_a_padded_context_parallel_prefill():
    """A CP prefill needs tight boundaries; the padding is seen in the params, before the group is
    used (every rank raises the same). The exact CP prefill itself: tests/context_parallel/test_cp_prefill.py."""
    m = model("MGA")
    cache = filled_cache(m)
    start, end, local = cp_shard()
    local.cp_group = object()           # refused before the group is ever used
    ids = torch.arange(8).unsqueeze(0)[:, start:end]
    before = snapshot(cache)
    with pytest.raises(ValueError, match="context-parallel prefill needs tight boundaries"):
        m(ids, local, cache=cache, cache_slots=[0, 1])
    assert same(before, snapshot(cache))


@pytest.mark.parametrize("letter", [pytest.param(x, id=x) for x in "MGKPAC"])
def test_mixer_refuses_a_padded_context_parallel_prefill(letter):
    layer = make_mixer(letter)
    cache = layer.allocate_inference_cache(2, 16)
    with torch.no_grad():
        layer(sequences([3])[0].unsqueeze(0), cache=cache, cache_slots=[0])
    start, end, local = cp_shard()
    local.cp_group = object()
    before = snapshot(cache)
    x = sequences([end - start])[0].unsqueeze(0)
    with pytest.raises(ValueError, match="context-parallel prefill needs tight boundaries"):
        layer(x, local, cache=cache, cache_slots=[0, 1])
    assert same(before, snapshot(cache))
