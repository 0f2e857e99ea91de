"""LightningMixer (MiniMax's lightning attention): a packed row equals the three steps of its spec run
on each document alone, outputs and every gradient; dropping the packing metadata leaks (the negative
control); decoding with a cache equals recomputing; the slopes are MiniMax's; HybridLM builds 'L'."""

import pytest
import torch
import torch.nn.functional as F

from mixers import HybridLM, LightningMixer
from mixers.layers import LightningConfig
from ssm_pack import PackedSeqParams, get_cu_seqlens
from tests.support.oracles import check_grads

HIDDEN, HEAD = 16, 4


def naive_lightning(module: LightningMixer, h: torch.Tensor) -> torch.Tensor:
    """The spec on ONE document ``h [T, D]``, token by token: q, k, v = silu(qkv_proj(h)) per head;
    S = exp(-slope) S + k^T v, o = q S; out = out_proj(rmsnorm(o) * w * sigmoid(output_gate(h)))."""
    c = module.config
    heads, kd = c.num_heads, c.head_dim
    qkv = F.silu(h @ module.qkv_proj.weight.T).reshape(-1, heads, 3 * kd)
    q, k, v = qkv[..., :kd], qkv[..., kd:2 * kd], qkv[..., 2 * kd:]
    decay = torch.exp(-module.slope.to(h.dtype))
    state = h.new_zeros(heads, kd, kd)
    rows = []
    for t in range(h.shape[0]):
        state = decay[:, None, None] * state + k[t, :, :, None] * v[t, :, None, :]
        rows.append(torch.einsum("hk,hkv->hv", q[t], state).reshape(-1))
    o = torch.stack(rows) if rows else h.new_zeros(0, heads * kd)
    o = o * torch.rsqrt(o.square().mean(-1, keepdim=True) + c.norm_eps) * module.norm.weight
    o = o * torch.sigmoid(h @ module.output_gate.weight.T)
    return o @ module.out_proj.weight.T


def _mixer(seed=0, **overrides):
    torch.manual_seed(seed)
    mixer = LightningMixer(HIDDEN, head_dim=HEAD, chunk_size=8, backend="reference", **overrides).double()
    with torch.no_grad():
        mixer.norm.weight.add_(torch.randn_like(mixer.norm.weight) * 0.1)
    return mixer


CASES = [
    pytest.param([1, 2, 3, 7, 8, 9, 16, 17], 1, 0, {}, id="grid-1-2-odd-chunk-boundaries"),
    pytest.param([5, 0, 1, 33, 0, 9], 4, 3, {}, id="empty-docs-padded-to-4-tail"),
    pytest.param([3, 17, 1, 2], 1, 2, {"layer_idx": 3, "num_layers": 4}, id="last-layer-slopes"),
    pytest.param([1, 2, 1, 3] * 15, 2, 1, {}, id="many-tiny-documents"),
]


@pytest.mark.parametrize(("lengths", "pad", "tail", "overrides"), CASES)
def test_packed_equals_the_spec_per_document(lengths, pad, tail, overrides):
    mixer = _mixer(**overrides)
    params = PackedSeqParams.from_lengths(lengths, pad_to_multiple_of=pad)
    starts = get_cu_seqlens(params).tolist()                       # the physical layout
    total = starts[-1] + tail
    params = PackedSeqParams.from_lengths(lengths, pad_to_multiple_of=pad, total_tokens=total)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, total, HIDDEN, generator=g, dtype=torch.float64, requires_grad=True)
    w_out = torch.randn(1, total, HIDDEN, generator=g, dtype=torch.float64)
    out = mixer(x, params)
    keep = torch.zeros(total, dtype=torch.bool)
    for s, n in zip(starts, lengths):
        keep[s:s + n] = True
    loss = (out[0, keep] * w_out[0, keep]).sum()
    ref_x = x.detach().clone().requires_grad_(True)
    want = torch.cat([naive_lightning(mixer, ref_x[0, s:s + n]) for s, n in zip(starts, lengths)])
    assert float((out[0, keep] - want).abs().max().detach()) <= 1e-12
    ref_loss = (want * w_out[0, keep]).sum()
    named = dict(mixer.named_parameters())
    check_grads(loss, ref_loss, {"x": x, **named}, {"x": ref_x, **named}, torch.float64, what="lightning")


def test_without_the_metadata_the_documents_leak():
    """Negative control of the test above: the same row as one sequence is not the per-document result."""
    mixer = _mixer()
    lengths = [5, 9]
    x = torch.randn(1, sum(lengths), HIDDEN, dtype=torch.float64)
    with torch.no_grad():
        want = torch.cat([naive_lightning(mixer, x[0, :5]), naive_lightning(mixer, x[0, 5:])])
        assert float((mixer(x, PackedSeqParams.from_lengths(lengths))[0] - want).abs().max()) <= 1e-12
        assert float((mixer(x)[0] - want).abs().max()) > 1e-3


@pytest.mark.parametrize("lengths", [pytest.param([1, 6, 2], id="short"), pytest.param([9, 4, 13], id="uneven")])
def test_decoding_with_a_cache_equals_recomputing(lengths):
    """A packed prefill of every sequence but its last 3 tokens, then 3 decode steps (one token per
    slot per step) == the mixer on each whole sequence (fp64)."""
    mixer = _mixer()
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randn(n + 3, HIDDEN, generator=g, dtype=torch.float64) for n in lengths]
    cache = mixer.allocate_inference_cache(len(seqs), max(lengths) + 3)
    slots = torch.arange(len(seqs))
    prompt = torch.cat([s[:-3] for s in seqs])[None]
    with torch.no_grad():
        got = list(mixer(prompt, PackedSeqParams.from_lengths(lengths), cache=cache, cache_slots=slots)[0]
                   .split(lengths))
        steps = [mixer(torch.stack([s[n + k] for s, n in zip(seqs, lengths)])[:, None], cache=cache,
                       cache_slots=slots)[:, 0] for k in range(3)]
        for i, s in enumerate(seqs):
            full = mixer(s[None])[0]
            mine = torch.cat([got[i]] + [step[i:i + 1] for step in steps])
            assert float((mine - full).abs().max()) <= 1e-12, i


@pytest.mark.parametrize(("heads", "layer_idx", "num_layers"), [(4, 0, 1), (8, 0, 6), (8, 5, 6), (64, 2, 80)])
def test_slopes_are_minimax_s(heads, layer_idx, num_layers):
    """The slope formula, written from MiniMax's: (2^(-8/H))^(h+1) * (1 - i/(L-1+1e-5) + 1e-5), fp32."""
    mixer = LightningMixer(heads * 2, head_dim=2, layer_idx=layer_idx, num_layers=num_layers)
    base = 1 / (2 ** (8 / heads))
    want = torch.tensor([base ** (h + 1) for h in range(heads)], dtype=torch.float32) \
        * (1 - layer_idx / (num_layers - 1 + 1e-5) + 1e-5)
    torch.testing.assert_close(mixer.slope, want, rtol=1e-6, atol=0)
    assert mixer.slope.dtype == torch.float32 and not mixer.slope.requires_grad


def test_hybrid_lm_takes_the_letter_with_its_depth():
    """'L' blocks get layer_idx / num_layers from their place in the pattern (the slopes differ)."""
    torch.manual_seed(0)
    model = HybridLM(32, HIDDEN, "LAL", mixer_overrides={"A": {"head_dim": 8}, "L": {"head_dim": 8}}).double()
    first, last = model.blocks[0].mixer, model.blocks[2].mixer
    assert isinstance(first, LightningMixer)
    assert (first.config.layer_idx, last.config.layer_idx, last.config.num_layers) == (0, 2, 3)
    assert not torch.equal(first.slope, last.slope)
    ids = torch.randint(0, 32, (1, 14))
    out = model(ids, PackedSeqParams.from_lengths([6, 8]), labels=ids)
    out["loss"].backward()
    assert torch.isfinite(out["loss"]) and last.qkv_proj.weight.grad is not None


@pytest.mark.parametrize(("overrides", "error", "match"), [
    pytest.param({"head_dim": 0}, ValueError, "head_dim", id="head-dim-0"),
    pytest.param({"layer_idx": 2, "num_layers": 2}, ValueError, r"layer_idx must be an int in \[0, num_layers=2\)",
                 id="layer-past-the-end"),
    pytest.param({"num_layers": 0}, ValueError, "num_layers", id="no-layers"),
    pytest.param({"norm_eps": -1.0}, ValueError, "norm_eps", id="negative-eps"),
])
def test_bad_config_is_refused(overrides, error, match):
    with pytest.raises(error, match=match):
        LightningConfig(hidden_size=HIDDEN, **overrides)
