"""GatedShortConvMixer (LFM2's gated short convolution): a packed row equals the three steps of its
spec run on each document alone, outputs and every gradient; dropping the packing metadata leaks
(the negative control); decoding with a cache equals recomputing the whole sequence."""

import pytest
import torch

from mixers import GatedShortConvMixer, HybridLM
from mixers.layers import GatedShortConvConfig
from ssm_pack import PackedSeqParams
from tests.mixers.layers.spec_checks import (
    assert_decode_equals_recompute,
    assert_metadata_matters,
    assert_packed_equals_spec,
)

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
    assert_packed_equals_spec(_mixer(**overrides), naive_gated_short_conv, lengths, pad, tail, what="gated short conv")


def test_without_the_metadata_the_documents_leak():
    """Negative control of the test above: the same row as one sequence is not the per-document result."""
    assert_metadata_matters(_mixer(), naive_gated_short_conv, leak=1e-3)


@pytest.mark.parametrize("lengths", [pytest.param([1, 6, 2], id="short"), pytest.param([9, 4, 13], id="uneven")])
def test_decoding_with_a_cache_equals_recomputing(lengths):
    assert_decode_equals_recompute(_mixer(conv_bias=True), lengths)


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
