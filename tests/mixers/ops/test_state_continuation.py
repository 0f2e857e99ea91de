"""Per-document states carried from one call to the next (what a layer's cache does in chunked
prefill): every document split in two, the first parts run packed with initial states, the
second parts packed from the first parts' final states, equal the whole run.

This is where the gate (the decay) at a document's first token matters: with a zero state
entering a document it multiplies nothing, so layer tests, which start every document from
zero, never see it; here the second part's first token decays a carried state.

    N = documents, T = tokens, H = heads, K/V/P/Ns = state dims
"""

import pytest
import torch
import torch.nn.functional as F

from mixers.ops import (
    causal_conv1d_fn,
    chunk_gated_delta_product,
    chunk_gated_delta_rule,
    chunk_kda,
    mamba_chunk_scan_combined,
)
from ssm_pack import lengths_to_cu_seqlens
from tests.support.oracles import delta_oracle
from tests.support.tolerances import FP64_ABS

CHUNK = 8
# documents around the chunk length, a one-token and an empty one; split points: first token alone,
# last token alone, at a chunk boundary, mid-chunk
LENGTHS = [7, 1, 0, 20, 33, 2, 9]
SPLITS = [1, 1, 0, 8, 13, 1, 8]
H, K, V = 2, 4, 3
KINDS = [pytest.param(kind, id=kind) for kind in ("gdn", "kda", "gdp")]


def split_indices(lengths, splits):
    """Token indices of the first and the second parts of every document, in packed order."""
    first, second, start = [], [], 0
    for n, s in zip(lengths, splits):
        first += range(start, start + s)
        second += range(start + s, start + n)
        start += n
    return torch.tensor(first, dtype=torch.long), torch.tensor(second, dtype=torch.long)


def parts():
    cu = lengths_to_cu_seqlens(LENGTHS)
    cu_a = lengths_to_cu_seqlens(SPLITS)
    cu_b = lengths_to_cu_seqlens([n - s for n, s in zip(LENGTHS, SPLITS)])
    a, b = split_indices(LENGTHS, SPLITS)
    return cu, cu_a, cu_b, a, b


def close(got, want, what):
    err = float((got - want).abs().max()) if got.numel() else 0.0
    assert err <= FP64_ABS, f"{what}: max abs error {err:.3e} > {FP64_ABS}"


def delta_inputs(kind, seed=0):
    g = torch.Generator().manual_seed(seed)
    total, nh = sum(LENGTHS), (2 if kind == "gdp" else 1)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    gate = F.logsigmoid(rnd(1, total, H, K) if kind == "kda" else rnd(1, total, H))
    t = {"q": rnd(1, total, H, K), "k": rnd(1, total * nh, H, K), "v": rnd(1, total * nh, H, V), "g": gate,
         "beta": torch.rand(1, total * nh, H, generator=g, dtype=torch.float64)}
    return t, rnd(len(LENGTHS), H, K, V)


def run_delta(kind, t, cu, init):
    op = {"gdn": chunk_gated_delta_rule, "kda": chunk_kda,
          "gdp": lambda *a, **kw: chunk_gated_delta_product(*a, 2, **kw)}[kind]
    return op(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=init, output_final_state=True,
              use_qk_l2norm_in_kernel=True, cu_seqlens=cu, chunk_size=CHUNK, backend="reference")


def take(t, idx, nh):
    """The tokens ``idx`` of every ``[1, T*, ...]`` tensor (``nh`` sub-steps per token for k, v, beta)."""
    sub = (idx[:, None] * nh + torch.arange(nh)).reshape(-1)
    return {name: x[:, sub if x.shape[1] != t["q"].shape[1] else idx] for name, x in t.items()}


@pytest.mark.parametrize("kind", KINDS)
def test_delta_rule_continues_from_carried_states(kind):
    cu, cu_a, cu_b, a, b = parts()
    t, h0 = delta_inputs(kind)
    nh = 2 if kind == "gdp" else 1
    whole, final = run_delta(kind, t, cu, h0)
    first, carried = run_delta(kind, take(t, a, nh), cu_a, h0)
    second, final_b = run_delta(kind, take(t, b, nh), cu_b, carried)
    close(first, whole[:, a], f"{kind} first parts")
    close(second, whole[:, b], f"{kind} second parts (first token decays the carried state)")
    close(final_b, final, f"{kind} final states")


@pytest.mark.parametrize("kind", KINDS)
def test_first_token_gate_acts_on_the_initial_state(kind):
    """Only the gates at the documents' first tokens change, strongly: the outputs follow the
    token-by-token oracle, and differ from the run with the original gates (the gate is not ignored)."""
    cu = lengths_to_cu_seqlens(LENGTHS)
    t, h0 = delta_inputs(kind, seed=1)
    starts = cu[:-1][torch.tensor(LENGTHS) > 0].long()
    strong = dict(t, g=t["g"].clone())
    strong["g"][:, starts] = -2.5
    out, final = run_delta(kind, strong, cu, h0)
    before, _ = run_delta(kind, t, cu, h0)
    q, k = (x * torch.rsqrt(x.square().sum(-1, keepdim=True) + 1e-6) for x in (strong["q"], strong["k"]))
    gate = strong["g"] if kind == "kda" else strong["g"].unsqueeze(-1)
    ref, ref_final = delta_oracle(q, k, strong["v"], gate, strong["beta"], cu, scale=K ** -0.5,
                                  nh=2 if kind == "gdp" else 1, initial_states=h0)
    close(out, ref, f"{kind} outputs")
    close(final, ref_final, f"{kind} final states")
    assert bool((out[:, starts] - before[:, starts]).abs().amax((-1, -2)).gt(1e-3).all())


def ssd_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    total, P, G, Ns = sum(LENGTHS), 3, 1, 4

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    t = {"x": rnd(1, total, H, P), "dt": rnd(1, total, H), "B": rnd(1, total, G, Ns), "C": rnd(1, total, G, Ns),
         "z": rnd(1, total, H, P)}
    fixed = {"A": -torch.rand(H, generator=g, dtype=torch.float64) - 0.5, "D": rnd(H), "dt_bias": rnd(H)}
    return t, fixed, rnd(len(LENGTHS), H, P, Ns)


def run_ssd(t, fixed, cu, init):
    out, _, states = mamba_chunk_scan_combined(
        t["x"], t["dt"], fixed["A"], t["B"], t["C"], CHUNK, D=fixed["D"], z=t["z"], dt_bias=fixed["dt_bias"],
        initial_states=init, cu_seqlens=cu, dt_softplus=True, return_final_states=True, return_varlen_states=True,
        backend="reference")
    return out, states


def test_ssd_continues_from_carried_states():
    cu, cu_a, cu_b, a, b = parts()
    t, fixed, h0 = ssd_inputs()
    whole, final = run_ssd(t, fixed, cu, h0)
    first, carried = run_ssd({n: x[:, a] for n, x in t.items()}, fixed, cu_a, h0)
    second, final_b = run_ssd({n: x[:, b] for n, x in t.items()}, fixed, cu_b, carried)
    close(first, whole[:, a], "ssd first parts")
    close(second, whole[:, b], "ssd second parts (first token decays the carried state)")
    close(final_b, final, "ssd final states")


def test_conv_continues_from_carried_states():
    cu, cu_a, cu_b, a, b = parts()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 8, sum(LENGTHS), generator=g, dtype=torch.float64)
    w, bias = torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randn(8, generator=g, dtype=torch.float64)
    h0 = torch.randn(len(LENGTHS), 8, 3, generator=g, dtype=torch.float64)

    def run(x, cu, init):
        return causal_conv1d_fn(x, w, bias, initial_states=init, return_final_states=True, activation="silu",
                                cu_seqlens=cu, backend="reference")
    whole, final = run(x, cu, h0)
    first, carried = run(x[:, :, a], cu_a, h0)
    second, final_b = run(x[:, :, b], cu_b, carried)
    close(first, whole[:, :, a], "conv first parts")
    close(second, whole[:, :, b], "conv second parts")
    close(final_b, final, "conv final states")
