"""GatedShortConvMixer (LFM2's gated short convolution): a packed row equals the three steps of its
spec run on each document alone, outputs and every gradient; dropping the packing metadata leaks
(the negative control); decoding with a cache equals recomputing the whole sequence."""

import pytest
import torch

from mixers import GatedShortConvMixer, HybridLM
from mixers.layers import GatedShortConvConfig
from ssm_pack import PackedSeqParams, get_cu_seqlens
from tests.support.oracles import check_grads

HIDDEN = 16


def naive_gated_short_conv(module: GatedShortConvMixer, h: torch.Tensor) -> torch.Tensor:
    """The spec on ONE document ``h [T, D]``: B, C, x = in_proj(h); v[t] = sum_j w[:, j] * (B x)[t-(W-1)+j]
    (zero before the document) + conv bias; out = out_proj(C * v). Written out tap by tap."""
    d, width = module.config.hidden_size, module.config.conv_size
    bcx = h @ module.in_proj.weight.T + (0 if module.in_proj.bias is None else module.in_proj.bias)
    B, C, x = bcx[:, :d], bcx[:, d:2 * d], bcx[:, 2 * d:]
    bx = B * x
    w = module.conv.weight[:, 0]                                   # [D, W]; tap W-1 is the current token
    rows = []
    for t in range(h.shape[0]):
        v = 0 if module.conv.bias is None else module.conv.bias
        for j in range(width):
            src = t - (width - 1) + j
            if src >= 0:
                v = v + w[:, j] * bx[src]
        rows.append(v)
    v = torch.stack(rows) if rows else bx[:0]
    out = (C * v) @ module.out_proj.weight.T
    return out + (0 if module.out_proj.bias is None else module.out_proj.bias)


def _mixer(seed=0, **overrides):
    torch.manual_seed(seed)
    mixer = GatedShortConvMixer(HIDDEN, backend="reference", **overrides).double()
    with torch.no_grad():                            # biases away from their inits
        for p in mixer.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return mixer


CASES = [
    pytest.param([1, 2, 2, 3, 7, 40], 1, 0, {}, id="width3-grid-1-2-W-1-W"),
    pytest.param([5, 0, 1, 33, 0, 9], 4, 3, {}, id="empty-docs-padded-to-4-tail"),
    pytest.param([3, 17, 1, 2], 1, 2, {"proj_bias": True, "conv_bias": True}, id="biases"),
    pytest.param([4, 1, 12, 6], 1, 0, {"conv_size": 4, "conv_bias": True}, id="width4-conv-bias"),
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
    ref = [naive_gated_short_conv(mixer, ref_x[0, s:s + n]) for s, n in zip(starts, lengths)]
    want = torch.cat(ref)
    assert float((out[0, keep] - want).abs().max().detach()) <= 1e-12
    ref_loss = (want * w_out[0, keep]).sum()
    named = dict(mixer.named_parameters())
    check_grads(loss, ref_loss, {"x": x, **named}, {"x": ref_x, **named}, torch.float64, what="gated short conv")


def test_without_the_metadata_the_documents_leak():
    """Negative control of the test above: the same row as one sequence is not the per-document result."""
    mixer = _mixer()
    lengths = [5, 9]
    x = torch.randn(1, sum(lengths), HIDDEN, dtype=torch.float64)
    with torch.no_grad():
        want = torch.cat([naive_gated_short_conv(mixer, x[0, :5]), naive_gated_short_conv(mixer, x[0, 5:])])
    with torch.no_grad():
        assert float((mixer(x, PackedSeqParams.from_lengths(lengths))[0] - want).abs().max()) <= 1e-12
        assert float((mixer(x)[0] - want).abs().max()) > 1e-3


@pytest.mark.parametrize("lengths", [pytest.param([1, 6, 2], id="short"), pytest.param([9, 4, 13], id="uneven")])
def test_decoding_with_a_cache_equals_recomputing(lengths):
    """A packed prefill of every sequence but its last 3 tokens, then 3 decode steps (one token per
    slot per step) == the mixer on each whole sequence (fp64)."""
    mixer = _mixer(conv_bias=True)
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


def test_hybrid_lm_takes_the_letter():
    torch.manual_seed(0)
    model = HybridLM(32, HIDDEN, "CAC", mixer_overrides={"A": {"head_dim": 8}}).double()
    assert isinstance(model.blocks[0].mixer, GatedShortConvMixer)
    ids = torch.randint(0, 32, (1, 14))
    out = model(ids, PackedSeqParams.from_lengths([6, 8]), labels=ids)
    out["loss"].backward()
    assert torch.isfinite(out["loss"]) and model.blocks[2].mixer.conv.weight.grad is not None


@pytest.mark.parametrize(("overrides", "error", "match"), [
    pytest.param({"conv_size": 0}, ValueError, "conv_size", id="width-0"),
    pytest.param({"conv_bias": 1}, TypeError, "conv_bias must be a bool, got 1", id="bias-int"),
    pytest.param({"proj_bias": "yes"}, TypeError, "proj_bias must be a bool", id="bias-str"),
])
def test_bad_config_is_refused(overrides, error, match):
    with pytest.raises(error, match=match):
        GatedShortConvConfig(hidden_size=HIDDEN, **overrides)
