"""Slots as a model's calls use them: packed calls (tight and padded) continue the slots they name,
and row calls of several tokens per row continue each slot from its own length. Oracle: each
sequence alone through the model, no cache (HybridLM "MA": a recurrent state and a KV cache)."""

import pytest
import torch

from mixers import HybridLM
from ssm_pack import PackedSeqParams
from tests.mixers.inference.common import SMALL, max_error
from tests.support.tolerances import FP64_ABS

EXACT = FP64_ABS
VOCAB = 64
FIRST, SECOND = [5, 1, 9], [3, 6, 2]           # uneven pieces; slot 1 is never named
SLOTS = [2, 0, 3]
LAYOUTS = [pytest.param({}, id="tight"), pytest.param({"pad_to_multiple_of": 4}, id="padded-4"),
           pytest.param({"pad_to_multiple_of": 4, "total_tokens": 40}, id="padded-4-tail")]


def model():
    torch.manual_seed(0)
    return HybridLM(VOCAB, 32, "MA", mixer_overrides=SMALL).double().eval()


def tokens(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def alone(m, seq):
    with torch.no_grad():
        return m(torch.tensor([seq]))["logits"][0]


def packed(m, cache, pieces, slots, **layout):
    """One packed call of ``pieces`` (one slot each) -> the logits of each piece's tokens."""
    p = PackedSeqParams.from_lengths([len(x) for x in pieces], **layout)
    ids = torch.zeros(1, p.total_tokens, dtype=torch.long)
    starts = p.cu_seqlens.tolist()
    for piece, start in zip(pieces, starts):
        ids[0, start:start + len(piece)] = torch.tensor(piece)
    with torch.no_grad():
        out = m(ids, p, cache=cache, cache_slots=slots)["logits"][0]
    return [out[s:s + len(x)] for s, x in zip(starts, pieces)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_calls_continue_their_slots(layout):
    """A prefill then a continuation, both packed in ``layout``: each sequence's logits equal its run
    alone (padding neither enters a slot's states nor its keys and values)."""
    m = model()
    seqs = tokens([a + b for a, b in zip(FIRST, SECOND)], seed=3)
    cache = m.allocate_inference_cache(4, 24)
    one = packed(m, cache, [s[:a] for s, a in zip(seqs, FIRST)], SLOTS, **layout)
    two = packed(m, cache, [s[a:] for s, a in zip(seqs, FIRST)], SLOTS, **layout)
    for i, seq in enumerate(seqs):
        err = max_error(torch.cat([one[i], two[i]]), alone(m, seq))
        assert err <= EXACT, f"sequence {i} ({len(seq)} tokens, slot {SLOTS[i]}): error {err:.3g}"
    assert cache.lengths.tolist() == [7, 0, 8, 11]


@pytest.mark.parametrize("steps", [pytest.param(2, id="2-tokens-per-row"), pytest.param(3, id="3-tokens-per-row")])
def test_row_calls_of_several_tokens_continue_each_slot(steps):
    """Rows of ``steps`` tokens after a packed prefill of uneven lengths: each row's tokens take the
    positions after its slot's own tokens, so the logits equal the sequence run alone."""
    m = model()
    seqs = tokens([a + 2 * steps for a in FIRST], seed=4)
    cache = m.allocate_inference_cache(4, 24)
    outs = packed(m, cache, [s[:a] for s, a in zip(seqs, FIRST)], SLOTS)
    for k in range(2):
        rows = torch.tensor([s[a + k * steps:a + (k + 1) * steps] for s, a in zip(seqs, FIRST)])
        with torch.no_grad():
            step = m(rows, cache=cache, cache_slots=SLOTS)["logits"]
        outs = [torch.cat([o, step[i]]) for i, o in enumerate(outs)]
    for i, seq in enumerate(seqs):
        err = max_error(outs[i], alone(m, seq))
        assert err <= EXACT, f"sequence {i} (prefill {FIRST[i]}, rows of {steps}): error {err:.3g}"
