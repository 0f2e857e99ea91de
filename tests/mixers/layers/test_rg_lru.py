"""RGLRUMixer (Griffin's recurrent block, RecurrentGemma's RecurrentGemmaRecurrentBlock): a packed row
equals the five steps of its spec run on each document alone, outputs and every gradient; dropping
the packing metadata leaks (the negative control); decoding with a cache equals recomputing the
whole sequence, fresh slots included."""

import pytest
import torch
import torch.nn.functional as F

from mixers import HybridLM, RGLRUMixer
from mixers.layers import RGLRUConfig
from ssm_pack import PackedSeqParams
from tests.mixers.layers.spec_checks import (
    assert_decode_equals_recompute,
    assert_metadata_matters,
    assert_packed_equals_spec,
)

HIDDEN = 16


def naive_rg_lru_block(module: RGLRUMixer, h: torch.Tensor) -> torch.Tensor:
    """The spec on ONE document ``h [T, D]``, token by token and block by block (no shared code)."""
    c = module.config
    y = F.gelu(h @ module.linear_y.weight.T + module.linear_y.bias, approximate="tanh")
    u = h @ module.linear_x.weight.T + module.linear_x.bias
    w = module.conv.weight[:, 0]
    state = torch.zeros(c.lru_width, dtype=h.dtype)
    rows = []
    for t in range(h.shape[0]):
        x = module.conv.bias.clone()
        for j in range(c.conv_size):
            if t - (c.conv_size - 1) + j >= 0:
                x = x + w[:, j] * u[t - (c.conv_size - 1) + j]
        gx, ga = [], []
        for k in range(c.num_heads):
            block = x[k * c.block_width:(k + 1) * c.block_width]
            gx.append(block @ module.input_gate_weight[k] + module.input_gate_bias[k])
            ga.append(block @ module.recurrent_gate_weight[k] + module.recurrent_gate_bias[k])
        i, r = torch.sigmoid(torch.cat(gx)), torch.sigmoid(torch.cat(ga))
        log_a = -c.scale * r * F.softplus(module.recurrent_param)
        if t == 0:
            state = x * i
        else:
            state = torch.exp(log_a) * state + torch.sqrt(1 - torch.exp(2 * log_a)) * (x * i)
        rows.append(state)
    v = torch.stack(rows) if rows else u[:0]
    return (v * y) @ module.linear_out.weight.T + module.linear_out.bias


def _mixer(seed=0, **overrides):
    torch.manual_seed(seed)
    mixer = RGLRUMixer(HIDDEN, backend="reference", **{"num_heads": 4, **overrides}).double()
    with torch.no_grad():                            # biases away from their zero inits
        for p in mixer.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return mixer


CASES = [
    pytest.param([1, 2, 3, 4, 7, 40], 1, 0, {}, id="grid-1-2-W-1-W"),
    pytest.param([5, 0, 1, 33, 0, 9], 4, 3, {}, id="empty-docs-padded-to-4-tail"),
    pytest.param([3, 17, 1, 2], 1, 2, {"lru_width": 24, "num_heads": 3, "conv_size": 3}, id="wider-lru-width3"),
    pytest.param([1, 2, 1, 3] * 15, 2, 1, {}, id="many-tiny-documents"),
]


@pytest.mark.parametrize(("lengths", "pad", "tail", "overrides"), CASES)
def test_packed_equals_the_spec_per_document(lengths, pad, tail, overrides):
    assert_packed_equals_spec(_mixer(**overrides), naive_rg_lru_block, lengths, pad, tail, what="rg_lru block")


def test_without_the_metadata_the_documents_leak():
    """Negative control of the test above: the same row as one sequence is not the per-document result."""
    assert_metadata_matters(_mixer(), naive_rg_lru_block)


@pytest.mark.parametrize("lengths", [pytest.param([1, 6, 2], id="short"), pytest.param([9, 4, 13], id="uneven")])
def test_decoding_with_a_cache_equals_recomputing(lengths):
    """A packed prefill of every sequence but its last 3 tokens, then 3 decode steps == the mixer on
    each whole sequence (fp64); then a fresh slot decoding its first token == the mixer on it."""
    mixer = _mixer()
    assert_decode_equals_recompute(mixer, lengths)
    first = torch.randn(1, 1, HIDDEN, dtype=torch.float64)
    cache = mixer.allocate_inference_cache(2, 4)
    with torch.no_grad():
        mixer(torch.randn(1, 3, HIDDEN, dtype=torch.float64), cache=cache, cache_slots=[0])
        fresh = mixer(first, cache=cache, cache_slots=[1])
        assert float((fresh - mixer(first)).abs().max()) <= 1e-12


@pytest.mark.parametrize("packed", [pytest.param(True, id="packed"), pytest.param(False, id="rows")])
def test_a_prefill_of_fresh_slots_reads_no_state(monkeypatch, packed):
    """Fresh slots start from zero, so a prefill naming only fresh slots reads no RG-LRU state: a
    context-parallel prefill's cache refuses every read (``cp_prefill.ShardedLayerCache.gather``).
    A later call continuing those slots reads them (the spy sees reads)."""
    mixer = _mixer()
    g = torch.Generator().manual_seed(7)
    cache = mixer.allocate_inference_cache(3, 16)
    read = []
    gather = cache.gather
    monkeypatch.setattr(cache, "gather", lambda name, batch: read.append(name) or gather(name, batch))
    x = torch.randn(1 if packed else 2, 6 if packed else 3, HIDDEN, generator=g, dtype=torch.float64)
    params = PackedSeqParams.from_lengths([4, 2]) if packed else None
    with torch.no_grad():
        got = mixer(x, params, cache=cache, cache_slots=[2, 0])
        want = mixer(x, params)
        assert "lru" not in read
        assert float((got - want).abs().max()) <= 1e-12
        mixer(x, params, cache=cache, cache_slots=[2, 0])
    assert "lru" in read


def test_defaults_are_recurrent_gemmas():
    """RecurrentGemma's block: conv1d_width 4 (3 cached inputs per slot), decay exponent 8, one gate
    block, lru_width = hidden, the tanh GeLU."""
    config = RGLRUConfig(HIDDEN)
    assert (config.conv_size, config.scale, config.num_heads, config.lru_width, config.activation) == \
        (4, 8.0, 1, HIDDEN, "gelu_pytorch_tanh")
    mixer = RGLRUMixer(HIDDEN)
    assert tuple(mixer.conv.weight.shape) == (HIDDEN, 1, 4)
    assert tuple(mixer.allocate_inference_cache(2, 8)["conv"].shape) == (2, HIDDEN, 3)


def test_the_decay_init_is_griffins():
    """``a = sigmoid(-recurrent_param)`` with ``a^2`` uniform in [0.9^2, 0.999^2] (RecurrentGemma's
    _init_weights): over 4096 channels every a^2 lies in the range and both ends are reached
    within 5e-4 (a gap that wide at either end has probability ~exp(-4096 * 5e-4 / 0.188))."""
    torch.manual_seed(0)
    mixer = RGLRUMixer(HIDDEN, lru_width=4096, num_heads=64)
    a2 = torch.sigmoid(-mixer.recurrent_param.detach().double()) ** 2
    low, high = 0.9 ** 2, 0.999 ** 2
    assert float(a2.min()) >= low - 1e-6 and float(a2.max()) <= high + 1e-6
    assert float(a2.min()) <= low + 5e-4 and float(a2.max()) >= high - 5e-4


def test_a_continuing_chunk_equals_the_whole():
    """A packed call of two prompts' first halves, then a packed call of their second halves."""
    mixer = _mixer()
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randn(n, HIDDEN, generator=g, dtype=torch.float64) for n in (7, 4)]
    cache = mixer.allocate_inference_cache(2, 16)
    with torch.no_grad():
        a = mixer(torch.cat([seqs[0][:3], seqs[1][:2]])[None], PackedSeqParams.from_lengths([3, 2]), cache=cache,
                  cache_slots=[0, 1])[0]
        b = mixer(torch.cat([seqs[0][3:], seqs[1][2:]])[None], PackedSeqParams.from_lengths([4, 2]), cache=cache,
                  cache_slots=[0, 1])[0]
        whole = [mixer(s[None])[0] for s in seqs]
    assert float((torch.cat([a[:3], b[:4]]) - whole[0]).abs().max()) <= 1e-12
    assert float((torch.cat([a[3:], b[4:]]) - whole[1]).abs().max()) <= 1e-12


def test_hybrid_lm_takes_the_letter():
    torch.manual_seed(0)
    model = HybridLM(32, HIDDEN, "RAR", mixer_overrides={"A": {"head_dim": 8}}).double()
    assert isinstance(model.blocks[0].mixer, RGLRUMixer)
    ids = torch.randint(0, 32, (1, 14))
    out = model(ids, PackedSeqParams.from_lengths([6, 8]), labels=ids)
    out["loss"].backward()
    assert torch.isfinite(out["loss"]) and model.blocks[2].mixer.recurrent_param.grad is not None


@pytest.mark.parametrize(("overrides", "error", "match"), [
    pytest.param({"conv_size": 0}, ValueError, "conv_size", id="width-0"),
    pytest.param({"num_heads": 3}, ValueError, "num_heads=3 must divide lru_width=16", id="heads"),
    pytest.param({"scale": 0.0}, ValueError, "scale must be a positive number", id="scale"),
    pytest.param({"activation": "relu"}, ValueError, "activation must be one of", id="activation"),
    pytest.param({"lru_width": -2}, ValueError, "lru_width must be >= 1", id="width"),
])
def test_bad_config_is_refused(overrides, error, match):
    with pytest.raises(error, match=match):
        RGLRUConfig(hidden_size=HIDDEN, **overrides)
