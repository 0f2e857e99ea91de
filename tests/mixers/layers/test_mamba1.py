"""Mamba1Mixer (Mamba-1's selective-scan block): a packed row equals its spec run on each document
alone, outputs and every gradient (fp64), with each norm option; dropping the packing metadata
leaks (the negative control); decoding with a cache equals recomputing the whole sequence;
HybridLM builds the letter 'S'; bad configs are refused."""

import pytest
import torch
import torch.nn.functional as F

from mixers import HybridLM, Mamba1Mixer
from mixers.layers import Mamba1Config
from mixers.ops.selective_scan.naive import selective_scan_naive
from ssm_pack import PackedSeqParams
from tests.mixers.layers.spec_checks import (
    assert_decode_equals_recompute,
    assert_metadata_matters,
    assert_packed_equals_spec,
)

HIDDEN = 16


def _rms(x, w, eps):
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x if w is None else x * w


def naive_mamba1(m: Mamba1Mixer, h: torch.Tensor) -> torch.Tensor:
    """The spec on ONE document ``h [T, D]``: in_proj -> x, z; silu(causal conv(x)) by F.conv1d with
    W-1 zeros in front; x_proj -> dt_low, B, C (normed if configured); dt_proj; the naive scan; out_proj."""
    c = m.config
    if h.shape[0] == 0:
        return h.new_zeros(0, m.config.hidden_size)
    xz = F.linear(h, m.in_proj.weight, m.in_proj.bias)
    x, z = xz[:, :c.d_inner], xz[:, c.d_inner:]
    conv = F.conv1d(F.pad(x.T[None], (c.conv_size - 1, 0)), m.conv.weight, m.conv.bias, groups=c.d_inner)
    x = F.silu(conv[0].T)
    dbc = x @ m.x_proj.weight.T
    dt, B, C = dbc[:, :c.dt_rank], dbc[:, c.dt_rank:c.dt_rank + c.state_size], dbc[:, c.dt_rank + c.state_size:]
    if c.dt_bc_norm is not None:
        w = c.dt_bc_norm == "weighted"
        dt, B, C = (_rms(t, getattr(m, n) if w else None, c.norm_eps) for t, n in
                    ((dt, "dt_norm"), (B, "b_norm"), (C, "c_norm")))
    dt = dt @ m.dt_proj.weight.T
    y = selective_scan_naive(x.T[None], dt.T[None], -torch.exp(m.A_log), B.T[None], C.T[None], m.D, z.T[None],
                             m.dt_proj.bias, True)
    return F.linear(y[0].T, m.out_proj.weight, m.out_proj.bias)


def _mixer(seed=0, **overrides):
    torch.manual_seed(seed)
    mixer = Mamba1Mixer(HIDDEN, backend="reference", state_size=4, chunk_size=8, **overrides).double()
    with torch.no_grad():                            # every parameter away from its init
        for p in mixer.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return mixer


CASES = [
    pytest.param([1, 2, 3, 4, 7, 17], 1, 0, {}, id="grid-1-2-W-1-W-odd-chunks"),
    pytest.param([5, 0, 1, 9, 0, 16], 4, 3, {}, id="empty-docs-padded-to-4-tail"),
    pytest.param([3, 8, 9, 1], 1, 2, {"proj_bias": True, "dt_bc_norm": "weightless"}, id="falcon-mamba-norms"),
    pytest.param([4, 1, 12, 6], 1, 0, {"dt_bc_norm": "weighted", "conv_size": 3}, id="jamba-norms-width3"),
    pytest.param([1, 2, 1, 3] * 10, 2, 1, {}, id="many-tiny-documents"),
]


@pytest.mark.parametrize(("lengths", "pad", "tail", "overrides"), CASES)
def test_packed_equals_the_spec_per_document(lengths, pad, tail, overrides):
    assert_packed_equals_spec(_mixer(**overrides), naive_mamba1, lengths, pad, tail, what="mamba1")


def test_without_the_metadata_the_documents_leak():
    """Negative control of the test above: the same row as one sequence is not the per-document result."""
    assert_metadata_matters(_mixer(), naive_mamba1, leak=1e-6)


@pytest.mark.parametrize("lengths", [pytest.param([1, 6, 2], id="short"), pytest.param([9, 4, 13], id="uneven")])
def test_decoding_with_a_cache_equals_recomputing(lengths):
    assert_decode_equals_recompute(_mixer(dt_bc_norm="weighted"), lengths)


def test_hybrid_lm_takes_the_letter():
    torch.manual_seed(0)
    model = HybridLM(32, HIDDEN, "SAS", mixer_overrides={"A": {"head_dim": 8}, "S": {"state_size": 4}}).double()
    assert isinstance(model.blocks[0].mixer, Mamba1Mixer)
    ids = torch.randint(0, 32, (1, 14))
    out = model(ids, PackedSeqParams.from_lengths([6, 8]), labels=ids)
    out["loss"].backward()
    assert torch.isfinite(out["loss"]) and model.blocks[2].mixer.A_log.grad is not None


def test_config_derives_mamba_ssm_defaults():
    c = Mamba1Config(hidden_size=40)
    assert (c.d_inner, c.dt_rank, c.state_size, c.conv_size) == (80, 3, 16, 4)


@pytest.mark.parametrize(("overrides", "error", "match"), [
    pytest.param({"state_size": 0}, ValueError, "state_size must be >= 1", id="state-0"),
    pytest.param({"dt_rank": 0}, ValueError, "dt_rank must be >= 1", id="rank-0"),
    pytest.param({"conv_bias": 1}, TypeError, "conv_bias must be a bool, got 1", id="bias-int"),
    pytest.param({"dt_bc_norm": "rms"}, ValueError, r"dt_bc_norm must be one of \(None, 'weightless', 'weighted'\), "
                                                    "got 'rms'", id="norm-name"),
    pytest.param({"norm_eps": 0}, ValueError, "norm_eps must be a positive number, got 0", id="eps-0"),
])
def test_bad_config_is_refused(overrides, error, match):
    with pytest.raises(error, match=match):
        Mamba1Config(hidden_size=HIDDEN, **overrides)
