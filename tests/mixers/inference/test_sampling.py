"""What ``generate`` samples: temperature -> 0 is greedy, a fixed generator draws the frequencies of
``softmax(logits / T)`` (chi-square against a full forward's logits, and against the wrong
distributions as negative controls), and ``cache=`` is the cache the run uses."""

import pytest
import torch

from mixers import HybridLM
from mixers.inference import ContinuousBatcher
from tests.mixers.inference.common import SMALL, same, snapshot

VOCAB = 8
DRAWS = 4000
# chi-square with VOCAB - 1 = 7 degrees of freedom: P(X > 30) ~ 1e-4 (the sampler's own bound);
# the wrong distributions must land far beyond it
BOUND, FAR = 30.0, 200.0


def model(pattern="GA", vocab=VOCAB, seed=0):
    torch.manual_seed(seed)
    return HybridLM(vocab, 32, pattern, mixer_overrides=SMALL).double().eval()


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def first_token_logits(m, prompt) -> torch.Tensor:
    with torch.no_grad():
        return m(torch.tensor([prompt]))["logits"][0, -1].double()


@pytest.mark.parametrize("temperature", [pytest.param(0.5, id="T-0.5"), pytest.param(2.0, id="T-2")])
def test_sampled_frequencies_follow_softmax_of_logits_over_temperature(temperature):
    m = model()
    prompt = [3, 1, 4]
    logits = first_token_logits(m, prompt)
    batcher = ContinuousBatcher(m, max_batch_size=DRAWS, temperature=temperature,
                                generator=torch.Generator().manual_seed(7))
    tokens = torch.tensor([out[0] for out in batcher.run([prompt] * DRAWS, max_new_tokens=1)])
    counts = torch.bincount(tokens, minlength=VOCAB).double()
    assert batcher.steps == 1
    assert chi_square(counts, torch.softmax(logits / temperature, -1)) < BOUND
    # negative controls: the draws are not those of other temperatures
    for wrong in (logits * temperature, logits, logits.argmax().eq(torch.arange(VOCAB)).double() * 50):
        assert chi_square(counts, torch.softmax(wrong, -1).clamp_min(1e-12)) > FAR


def test_a_fixed_generator_draws_what_multinomial_draws():
    """One draw per seed equals torch.multinomial of softmax(logits / T) with the same seed."""
    m = model()
    prompt, temperature = [5, 2], 0.7
    probs = torch.softmax(first_token_logits(m, prompt) / temperature, -1)
    got, want = [], []
    for seed in range(24):
        got.append(m.generate([prompt], 1, temperature, generator=torch.Generator().manual_seed(seed))[0][0])
        want.append(int(torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seed))))
    assert got == want and len(set(got)) > 1


@pytest.mark.parametrize("temperature", [pytest.param(1e-6, id="1e-6"), pytest.param(1e-320, id="1e-320-subnormal")])
def test_temperature_towards_zero_is_greedy(temperature):
    m = model("MGA", vocab=64)
    prompts = [[1, 2, 3], [9], [40, 41, 42, 43, 44, 45]]
    greedy = m.generate(prompts, max_new_tokens=6)
    for seed in range(3):
        sampled = m.generate(prompts, max_new_tokens=6, temperature=temperature,
                             generator=torch.Generator().manual_seed(seed))
        assert sampled == greedy
    # negative control: a moderate temperature does not follow the greedy path
    hot = m.generate(prompts, max_new_tokens=6, temperature=5.0, generator=torch.Generator().manual_seed(0))
    assert hot != greedy


def test_greedy_tokens_are_the_full_forwards_argmax():
    m = model("MGA", vocab=64)
    prompt = [7, 8, 9, 10]
    out = m.generate([prompt], max_new_tokens=5)[0]
    seq = list(prompt)
    for token in out:
        assert token == int(first_token_logits(m, seq).argmax())
        seq.append(token)


def test_generate_runs_on_the_given_cache():
    """A cache of 2 slots: five prompts go through those 2 slots (reused), the results equal a run
    on a fresh cache, and the given cache is what was reset and written (its old states are gone)."""
    m = model("MGA", vocab=64)
    prompts = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10], [11]]
    want = m.generate(prompts, max_new_tokens=3)
    cache = m.allocate_inference_cache(2, 7)
    with torch.no_grad():
        m(torch.tensor([[60, 61, 62, 63]]), cache=cache, cache_slots=[1])
    stale = snapshot(cache)
    batcher = ContinuousBatcher(m, cache=cache)
    assert batcher.run(prompts, max_new_tokens=3) == want
    assert batcher.slots_reused == 3 and batcher.admitted == 5
    assert cache.lengths.tolist() == [0, 0] and not same(stale, snapshot(cache))
    # the cache's own max_seqlen is what bounds the run (a cache the run ignored could not refuse)
    with pytest.raises(ValueError, match="holds 7 tokens per slot"):
        m.generate(prompts, max_new_tokens=4, cache=cache)


def test_max_batch_size_bounds_the_slots_of_a_given_cache():
    """A cache of 4 slots with max_batch_size=2: two sequences at a time (three slots reused), the
    same tokens as four at a time."""
    m = model("MGA", vocab=64)
    prompts = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10], [11]]
    cache = m.allocate_inference_cache(4, 8)
    narrow = ContinuousBatcher(m, max_batch_size=2, cache=cache)
    wide = ContinuousBatcher(m, cache=cache)
    assert narrow.run(prompts, max_new_tokens=3) == wide.run(prompts, max_new_tokens=3)
    assert (narrow.slots_reused, wide.slots_reused) == (3, 1)
