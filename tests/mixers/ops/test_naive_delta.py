"""The delta-rule ops' torch backend against their specification (``naive.py``), and the
specification against the token-by-token oracle."""

import pytest
import torch
import torch.nn.functional as F

from mixers.ops import (
    chunk_gated_delta_product,
    chunk_gated_delta_rule,
    chunk_kda,
    fused_recurrent_gated_delta_product,
    fused_recurrent_gated_delta_rule,
    fused_recurrent_kda,
)
from mixers.ops.delta_rule.naive import gated_delta_rule_naive
from ssm_pack import lengths_to_cu_seqlens
from tests.mixers.ops.naive_compare import assert_same
from tests.support.oracles import check_close, delta_oracle

K, V = 4, 3


def _inputs(kind, lengths, tail, heads, value_heads, nh=1, gate=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cu = lengths_to_cu_seqlens(lengths)
    total = sum(lengths) + tail

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v = rand(1, total, heads, K), rand(1, total * nh, heads, K), rand(1, total * nh, value_heads, V)
    k = F.normalize(k, dim=-1)
    beta = torch.rand(1, total * nh, value_heads, generator=gen, dtype=torch.float64)
    g_shape = (1, total, value_heads, K) if kind == "kda" else (1, total, value_heads)
    g = -torch.rand(*g_shape, generator=gen, dtype=torch.float64) if gate else None
    init = rand(len(lengths), value_heads, K, V)
    return cu, (q, k, v, g, beta, init)


OPS = {"gdn": chunk_gated_delta_rule, "kda": chunk_kda}

CASES = [
    pytest.param("gdn", [5, 0, 1, 9, 2], 0, 1, 1, True, False, id="gdn-uneven-empty-one-token"),
    pytest.param("gdn", [1, 0, 11], 3, 2, 4, True, True, id="gdn-grouped-values-tail-l2norm"),
    pytest.param("kda", [6, 1, 0, 10], 2, 2, 2, True, False, id="kda-per-channel-gate"),
    pytest.param("gdp", [3, 0, 1, 6], 1, 2, 2, True, False, id="gdp-two-householder"),
    pytest.param("gdp", [4, 1, 5], 0, 1, 1, False, True, id="gdp-no-gate-l2norm"),
]


def _backend(kind, cu, nh, l2norm):
    def run(q, k, v, g, beta, init):
        kwargs = dict(initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=l2norm,
                      cu_seqlens=cu, chunk_size=4, backend="reference")
        if kind == "gdp":
            return chunk_gated_delta_product(q, k, v, g, beta, nh, **kwargs)
        return OPS[kind](q, k, v, g, beta, **kwargs)
    return run


@pytest.mark.parametrize("kind, lengths, tail, heads, value_heads, gate, l2norm", CASES)
def test_torch_backend_matches_spec(kind, lengths, tail, heads, value_heads, gate, l2norm):
    nh = 2 if kind == "gdp" else 1
    cu, inputs = _inputs(kind, lengths, tail, heads, value_heads, nh, gate)

    def spec(q, k, v, g, beta, init):
        return gated_delta_rule_naive(q, k, v, g, beta, initial_state=init, output_final_state=True,
                                      use_qk_l2norm_in_kernel=l2norm, cu_seqlens=cu, num_householder=nh)

    assert_same(_backend(kind, cu, nh, l2norm), spec, inputs, what=kind)


def test_default_call_matches_spec():
    """The default call: rows as documents, no initial state, no final state, the default chunk."""
    _, (q, k, v, g, beta, _) = _inputs("gdn", [6, 6], 0, 1, 1)
    q, k, v, g, beta = (t.reshape(2, 6, *t.shape[2:]) for t in (q, k, v, g, beta))
    got, _ = chunk_gated_delta_rule(q, k, v, g, beta)
    want, _ = gated_delta_rule_naive(q, k, v, g, beta)
    check_close(got, want, torch.float64, what="default call")


@pytest.mark.parametrize("kind, lengths, tail, heads, value_heads, gate, l2norm",
                         [c for c in CASES if c.values[3] == c.values[4] and not c.values[6]])
def test_spec_matches_oracle(kind, lengths, tail, heads, value_heads, gate, l2norm):
    nh = 2 if kind == "gdp" else 1
    cu, (q, k, v, g, beta, init) = _inputs(kind, lengths, tail, heads, value_heads, nh, gate, seed=3)
    o, states = gated_delta_rule_naive(q, k, v, g, beta, initial_state=init, output_final_state=True, cu_seqlens=cu,
                                       num_householder=nh)
    g_oracle = None if g is None else (g if kind == "kda" else g.unsqueeze(-1))
    want_o, want_states = delta_oracle(q, k, v, g_oracle, beta, cu, scale=K ** -0.5, nh=nh, initial_states=init)
    check_close(o, want_o, torch.float64, what="out")
    check_close(states, want_states, torch.float64, what="states")


def test_spec_resets_at_boundaries():
    """Negative control: joining two documents into one changes the second one's output."""
    cu, (q, k, v, g, beta, _) = _inputs("gdn", [3, 4], 0, 1, 1)
    apart, _ = gated_delta_rule_naive(q, k, v, g, beta, cu_seqlens=cu)
    joined, _ = gated_delta_rule_naive(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 7], dtype=torch.int32))
    torch.testing.assert_close(apart[:, :3], joined[:, :3])
    assert (apart[:, 3:] - joined[:, 3:]).abs().max() > 1e-3


@pytest.mark.parametrize("kind", [pytest.param("gdn", id="gdn"), pytest.param("kda", id="kda"),
                                  pytest.param("gdp", id="gdp")])
def test_decode_step_matches_spec(kind):
    """The decode form (one token per row, ``fused_recurrent_*``): rows are documents."""
    nh = 2 if kind == "gdp" else 1
    _, (q, k, v, g, beta, _) = _inputs(kind, [3], 0, 2, 2, nh)
    q, g = q.reshape(3, 1, *q.shape[2:]), g.reshape(3, 1, *g.shape[2:])
    k, v, beta = (t.reshape(3, nh, *t.shape[2:]) for t in (k, v, beta))
    init = torch.randn(3, 2, K, V, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    step = {"gdn": fused_recurrent_gated_delta_rule, "kda": fused_recurrent_kda}

    def backend(q, k, v, g, beta, s):
        if kind == "gdp":
            return fused_recurrent_gated_delta_product(q, k, v, g, beta, nh, initial_state=s, output_final_state=True)
        return step[kind](q, k, v, g, beta, initial_state=s, output_final_state=True)

    def spec(q, k, v, g, beta, s):
        return gated_delta_rule_naive(q, k, v, g, beta, initial_state=s, output_final_state=True, num_householder=nh)

    assert_same(backend, spec, (q, k, v, g, beta, init), what=f"{kind} decode step")
