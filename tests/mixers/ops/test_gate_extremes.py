"""Gates at the extremes: ``g = -inf`` (a full reset) and log-decays of very large magnitude.

The chunked delta rule must give what the token-step recurrence gives: a reset is exact and
finite (fla's naive recurrences and our step forms multiply the state by ``exp(-inf) = 0``), and a
gate of ``|g| ~ 1e4`` elsewhere in a chunk costs no precision (decays are sums over their own
interval, never differences of large cumulative sums).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mixers.ops import (
    chunk_gated_delta_product,
    chunk_gated_delta_rule,
    chunk_kda,
    gated_delta_product_step,
    gated_delta_rule_step,
    kda_step,
)
from ssm_pack import lengths_to_cu_seqlens

H, K, V, NH = 2, 8, 4, 2
CHUNK = 16
LENGTHS = [5, 0, 32, 3, 50]          # an empty document, documents straddling chunks
NEG_INF = float("-inf")
# own numbers: fp64 max abs error, fp32 relative RMS error
FP64_ABS, FP32_REL = 1e-10, 1e-5


def _inputs(kind, gate, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cu = lengths_to_cu_seqlens(LENGTHS)
    t = int(cu[-1])
    steps = t * (NH if kind == "gdp" else 1)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    g = gate(kind, t, gen)
    leaves = {"q": rnd(1, t, H, K), "k": F.normalize(rnd(1, steps, H, K), dim=-1), "v": rnd(1, steps, H, V),
              "g": g, "beta": torch.rand(1, steps, H, generator=gen, dtype=torch.float64),
              "initial_state": rnd(len(LENGTHS), H, K, V)}
    return cu, {name: x.to(dtype).requires_grad_() for name, x in leaves.items()}


def _chunked(kind, cu, x):
    fn = {"gdn": chunk_gated_delta_rule, "kda": chunk_kda}.get(kind)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    kw = dict(initial_state=x["initial_state"], output_final_state=True, cu_seqlens=cu, chunk_size=CHUNK,
              backend="reference")
    return fn(*args, **kw) if fn is not None else chunk_gated_delta_product(*args, NH, **kw)


def _stepped(kind, cu, x):
    """Our token-step forms (``mixers.ops.delta_rule.step``), one document at a time, fp64."""
    x = {name: t.detach().to(torch.float64).requires_grad_() for name, t in x.items()}
    bounds = cu.tolist()
    outs, finals = [], []
    for doc, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        state = x["initial_state"][doc:doc + 1]
        for t in range(s, e):
            if kind == "gdp":
                sub = slice(t * NH, (t + 1) * NH)
                o, state = gated_delta_product_step(x["q"][:, t], x["k"][:, sub], x["v"][:, sub], x["g"][:, t],
                                                    x["beta"][:, sub], state)
            else:
                step = kda_step if kind == "kda" else gated_delta_rule_step
                o, state = step(x["q"][:, t], x["k"][:, t], x["v"][:, t], x["g"][:, t], x["beta"][:, t], state)
            outs.append(o)
        finals.append(state)
    return x, torch.stack(outs, dim=1), torch.cat(finals)


def _compare(kind, cu, x, dtype):
    o, final = _chunked(kind, cu, x)
    assert torch.isfinite(o).all() and torch.isfinite(final).all()
    ref, ref_o, ref_final = _stepped(kind, cu, x)
    gen = torch.Generator().manual_seed(1)
    g_o = torch.randn(ref_o.shape, generator=gen, dtype=torch.float64)
    g_f = torch.randn(ref_final.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad((o * g_o.to(dtype)).sum() + (final * g_f.to(dtype)).sum(), list(x.values()))
    ref_grads = torch.autograd.grad((ref_o * g_o).sum() + (ref_final * g_f).sum(), list(ref.values()))
    pairs = [("out", o, ref_o), ("final state", final, ref_final)] + \
        [(f"grad {name}", a, b) for name, a, b in zip(x, grads, ref_grads)]
    for what, got, want in pairs:
        assert torch.isfinite(got).all(), f"{kind} {what}: non-finite"
        got = got.detach().to(torch.float64)
        if dtype == torch.float64:
            err = float((got - want).abs().max())
            assert err <= FP64_ABS, f"{kind} {what}: max abs error {err:.3e}"
        else:
            err = float((got - want).square().mean().sqrt() / want.square().mean().sqrt())
            assert err <= FP32_REL, f"{kind} {what}: relative RMS error {err:.3e}"


def _gate_shape(kind, t):
    return (1, t, H, K) if kind == "kda" else (1, t, H)


def resets(kind, t, gen):
    """Ordinary gates with ``-inf`` at a document's first and last token, on chunk boundaries,
    twice in a row, and (KDA) in some channels only."""
    g = F.logsigmoid(torch.randn(*_gate_shape(kind, t), generator=gen, dtype=torch.float64))
    for pos in (0, 5, 15, 16, 17, 30, 31, 40, 48, 63, 89):
        if kind == "kda":
            g[0, pos, pos % H, : 1 + pos % K] = NEG_INF
        else:
            g[0, pos, pos % H] = NEG_INF
    g[0, 70] = NEG_INF                                              # every head (and channel)
    return g


def large(kind, t, gen):
    """Small gates with, on ~10% of tokens, log-decays from -90 (not an underflow in fp32) to -3e4."""
    shape = _gate_shape(kind, t)
    g = 0.1 * F.logsigmoid(torch.randn(*shape, generator=gen, dtype=torch.float64))
    big = torch.tensor([-90.0, -300.0, -1e3, -1e4, -3e4], dtype=torch.float64)
    pick = big[torch.randint(0, big.numel(), shape, generator=gen)]
    return torch.where(torch.rand(*shape, generator=gen) < 0.1, pick, g)


KINDS = [pytest.param(kind, id=kind) for kind in ("gdn", "kda", "gdp")]
DTYPES = [pytest.param(torch.float64, id="fp64"), pytest.param(torch.float32, id="fp32")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_reset_gate_is_exact_and_finite(kind, dtype):
    cu, x = _inputs(kind, resets, dtype)
    _compare(kind, cu, x, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_large_gates_lose_no_precision(kind, dtype):
    cu, x = _inputs(kind, large, dtype, seed=3)
    _compare(kind, cu, x, dtype)


@pytest.mark.parametrize("kind", [pytest.param("gdn", id="gdn"), pytest.param("kda", id="kda")])
def test_reset_gate_matches_fla_naive(kind):
    """fla's own naive recurrence (fp32), one document at a time: the same finite result."""
    naive = pytest.importorskip(f"fla.ops.{'kda' if kind == 'kda' else 'gated_delta_rule'}.naive")
    cu, x = _inputs(kind, resets, torch.float32)
    o, final = _chunked(kind, cu, {name: t.detach() for name, t in x.items()})
    bounds = cu.tolist()
    for doc, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        q, k, v, g, beta = (x[name][:, s:e].detach() for name in ("q", "k", "v", "g", "beta"))
        init = x["initial_state"][doc:doc + 1].detach()
        if kind == "kda":
            ref_o, ref_s = naive.naive_recurrent_kda(q, k, v, g, beta, initial_state=init, output_final_state=True)
        else:
            ref_o, ref_s = naive.naive_recurrent_gated_delta_rule(q, k, v, beta, g, initial_state=init,
                                                                  output_final_state=True)
        assert torch.isfinite(ref_o).all() and torch.isfinite(ref_s).all()
        torch.testing.assert_close(o[:, s:e], ref_o, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(final[doc:doc + 1], ref_s, rtol=1e-5, atol=1e-5)
