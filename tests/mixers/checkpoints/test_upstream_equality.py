"""Converted mixers compute what the upstream layers compute: outputs and gradients, fp32, unpacked.

The upstream side is the real upstream layer on CPU (transformers' torch paths; fla's layers on
fla's naive recurrences, see ``upstream.py``). Gradients are compared for the input and for every
weight: upstream's weight gradients go through the same converter as the weights (it only moves
entries), so they must equal ours.
"""

import pytest
import torch

from mixers.checkpoints import from_module, source_of
from tests.mixers.checkpoints.upstream import BUILDERS, HIDDEN

# fp32 tolerances on the relative RMS error ||ours - upstream|| / ||upstream||: (forward, gradients
# of the input and the weights, gradients of the decay parameters A_log and dt_bias).
# Loose entries: the decay parameters' gradients are one sum over every token (and key channel)
# of terms that cancel, so fp32 rounding alone moves them by ~1e-5..7e-5 (ours in fp64 differs
# from ours in fp32 by as much as from upstream); Qwen3-Next's a_proj feeds that decay too.
TOLERANCES_FP32 = {
    "hf_mamba2": (1e-6, 1e-5, 2e-4),
    "hf_bamba": (1e-6, 1e-5, 2e-4),
    "hf_nemotron_h": (1e-6, 1e-5, 2e-4),
    "hf_granite": (1e-6, 1e-5, 2e-4),
    "hf_falcon_h1": (1e-6, 1e-5, 2e-4),
    "hf_qwen3_next": (1e-5, 1e-4, 5e-4),
    "hf_qwen3_5": (1e-5, 1e-4, 1e-3),        # Qwen3-Next's computation: the same fp32 spread (a_proj, decay)
    "hf_qwen3_5_moe": (1e-5, 5e-4, 5e-3),    # its draw: a_proj 2.2e-4, A_log 2.5e-3; ours fp32 vs fp64: 2.0e-4, 2.2e-3
    "hf_kimi_linear": (1e-5, 1e-5, 5e-4),
    "fla_gdn": (1e-5, 1e-5, 2e-4),
    "fla_gdn_neg": (1e-5, 1e-5, 2e-4),
    "fla_kda": (1e-5, 1e-5, 2e-4),
    "fla_gdp": (1e-5, 1e-5, 2e-4),
    "hf_lfm2": (1e-6, 1e-5, 0.0),            # no decay parameter
    "hf_lfm3": (1e-6, 1e-5, 0.0),
    "hf_olmo_hybrid": (1e-6, 1e-5, 2e-4),
    "hf_lfm2_moe": (1e-6, 1e-5, 0.0),
    "hf_recurrent_gemma": (1e-6, 1e-5, 1e-5),      # measured 1.3e-7, 2.7e-7, 2.0e-7
    "hf_zamba2": (1e-6, 1e-5, 2e-4),
    "hf_mamba": (1e-6, 1e-5, 2e-4),
    "hf_falcon_mamba": (1e-6, 1e-5, 2e-4),
    "hf_jamba": (1e-6, 1e-5, 2e-4),
    "hf_minimax": (1e-6, 1e-5, 0.0),         # its decay is a buffer, not a parameter
}
DECAY = ("A_log", "dt_bias", "recurrent_param")


def _length(name):
    """Unpacked rows (upstream cannot pack) that cross chunks: Mamba2 layers use chunk 8, delta rules 64."""
    return 21 if name in ("hf_mamba2", "hf_bamba", "hf_nemotron_h", "hf_granite", "hf_falcon_h1", "hf_zamba2") else 70


def _rel(a, b):
    """Relative RMS error ``||a - b|| / ||b||`` (fp64 sums)."""
    return float((a.double() - b.double()).norm() / b.double().norm())


def _run(module, x):
    y = module(x)
    return y[0] if isinstance(y, tuple) else y


def measure(upstream, ours, length):
    """(forward, worst input / weight gradient, worst decay gradient) errors between ``upstream``
    and ``ours`` on one random input and output gradient."""
    x = torch.randn(2, length, HIDDEN)
    grad_out = torch.randn(2, length, HIDDEN)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    outs = [_run(upstream, xs[0]), _run(ours, xs[1])]
    for out in outs:
        out.backward(grad_out)
    source = source_of(upstream)
    theirs = source.to_ours({k: p.grad for k, p in upstream.named_parameters()}, ours.config)
    weights = [_rel(xs[1].grad, xs[0].grad)]
    weights += [_rel(p.grad, theirs[k]) for k, p in ours.named_parameters() if k not in DECAY]
    decay = [_rel(p.grad, theirs[k]) for k, p in ours.named_parameters() if k in DECAY]
    return _rel(outs[1], outs[0]), max(weights), max(decay, default=0.0)


CASES = [pytest.param(name, id=name) for name in BUILDERS]


@pytest.mark.parametrize("name", CASES)
def test_converted_mixer_equals_upstream(monkeypatch, name):
    upstream = BUILDERS[name](monkeypatch)
    ours = from_module(upstream, backend="reference")
    errors = measure(upstream, ours, _length(name))
    assert all(e <= tol for e, tol in zip(errors, TOLERANCES_FP32[name])), (errors, TOLERANCES_FP32[name])


@pytest.mark.parametrize("name", CASES)
def test_a_misplaced_head_is_caught(monkeypatch, name):
    """Negative control: the plausible converter bug (one head's rows of the first projection in
    the wrong place; LFM2: its B, C and x chunks in another order; RecurrentGemma: one gate block of
    linear_x) must break the comparison above."""
    upstream = BUILDERS[name](monkeypatch)
    ours = from_module(upstream, backend="reference")
    first = next(getattr(ours, n) for n in ("in_proj", "q_proj", "qkv_proj", "linear_x") if hasattr(ours, n))
    weight = first.weight
    head = getattr(ours.config, "head_dim", None) or getattr(ours.config, "block_width", None) \
        or ours.config.hidden_size               # LFM2: in_proj's [B | C | x] rotated; RG-LRU: a gate block
    with torch.no_grad():
        weight.copy_(torch.roll(weight, head, dims=0))
    forward, _, _ = measure(upstream, ours, _length(name))
    assert forward > 100 * TOLERANCES_FP32[name][0], forward


def test_qwen3_next_is_not_a_plain_split(monkeypatch):
    """Negative control for the interleave: reading in_proj_qkvz as [q | k | v | z] blocks (what
    a converter that ignores the per-key-head grouping would do) is wrong."""
    upstream = BUILDERS["hf_qwen3_next"](monkeypatch)
    ours = from_module(upstream, backend="reference")
    c = ours.config
    q, k, v, z = upstream.in_proj_qkvz.weight.detach().split([c.key_dim, c.key_dim, c.value_dim, c.value_dim])
    with torch.no_grad():
        for proj, w in ((ours.q_proj, q), (ours.k_proj, k), (ours.v_proj, v), (ours.g_proj, z)):
            proj.weight.copy_(w)
    forward, _, _ = measure(upstream, ours, _length("hf_qwen3_next"))
    assert forward > 100 * TOLERANCES_FP32["hf_qwen3_next"][0], forward


def test_qwen3_next_needs_its_eps(monkeypatch):
    """The converted config carries Qwen3-Next's 1e-6 norm eps (ours defaults to 1e-5)."""
    upstream = BUILDERS["hf_qwen3_next"](monkeypatch)
    ours = from_module(upstream, backend="reference")
    assert ours.config.norm_eps == upstream.norm.variance_epsilon == 1e-6



@pytest.mark.parametrize("neg", [pytest.param(True, id="beta-in-0-2"), pytest.param(False, id="beta-in-0-1")])
def test_olmo_hybrid_carries_its_eigenvalue_range(monkeypatch, neg):
    """OLMo-hybrid doubles beta when ``linear_allow_neg_eigval`` is set (its default); the converted
    config carries it as ``allow_neg_eigval`` and matches upstream either way. Negative control: the
    same weights with the other range compute something else."""
    import dataclasses

    from mixers import GatedDeltaNetMixer
    from tests.mixers.checkpoints.upstream import hf_olmo_hybrid
    upstream = hf_olmo_hybrid(monkeypatch, linear_allow_neg_eigval=neg)
    ours = from_module(upstream, backend="reference")
    assert ours.config.allow_neg_eigval is neg
    tolerances = TOLERANCES_FP32["hf_olmo_hybrid"]
    assert all(e <= tol for e, tol in zip(measure(upstream, ours, 70), tolerances))
    other = GatedDeltaNetMixer(config=dataclasses.replace(ours.config, allow_neg_eigval=not neg), backend="reference")
    other.load_state_dict(ours.state_dict())
    forward, _, _ = measure(upstream, other, 70)
    assert forward > 100 * tolerances[0], forward


def test_zamba2_needs_its_dt_floor(monkeypatch):
    """Zamba2's scan clamps dt from below at ``time_step_min``; the converted config carries it as
    ``dt_limit``. Negative control: the same weights without the floor compute something else."""
    import dataclasses

    from mixers import Mamba2Mixer
    upstream = BUILDERS["hf_zamba2"](monkeypatch)
    ours = from_module(upstream, backend="reference")
    assert ours.config.dt_limit == (1.0, float("inf"))
    unclamped = Mamba2Mixer(config=dataclasses.replace(ours.config, dt_limit=(0.0, float("inf"))), backend="reference")
    unclamped.load_state_dict(ours.state_dict())
    forward, _, _ = measure(upstream, unclamped, _length("hf_zamba2"))
    assert forward > 100 * TOLERANCES_FP32["hf_zamba2"][0], forward
