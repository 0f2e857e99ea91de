"""LightningMixer (MiniMax's lightning attention): a packed row equals the three steps of its spec run
on each document alone, outputs and every gradient; dropping the packing metadata leaks (the negative
control); decoding with a cache equals recomputing; the slopes are MiniMax's; HybridLM builds 'L'."""

import pytest
import torch
import torch.nn.functional as F

from mixers import HybridLM, LightningMixer
from mixers.layers import LightningConfig
from ssm_pack import PackedSeqParams
from tests.mixers.layers.spec_checks import (
    assert_decode_equals_recompute,
    assert_metadata_matters,
    assert_packed_equals_spec,
)

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
    assert_packed_equals_spec(_mixer(**overrides), naive_lightning, lengths, pad, tail, what="lightning")


def test_without_the_metadata_the_documents_leak():
    """Negative control of the test above: the same row as one sequence is not the per-document result."""
    assert_metadata_matters(_mixer(), naive_lightning)


@pytest.mark.parametrize("lengths", [pytest.param([1, 6, 2], id="short"), pytest.param([9, 4, 13], id="uneven")])
def test_decoding_with_a_cache_equals_recomputing(lengths):
    """A packed prefill of every sequence but its last 3 tokens, then 3 decode steps (one token per
    slot per step) == the mixer on each whole sequence (fp64)."""
    assert_decode_equals_recompute(_mixer(), lengths)


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
