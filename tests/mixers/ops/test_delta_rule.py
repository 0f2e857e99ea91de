"""GDN, KDA and Gated DeltaProduct against a token-by-token recurrence: outputs, states, gradients."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from mixers.ops import (
    chunk_gated_delta_product,
    chunk_gated_delta_rule,
    chunk_kda,
    gated_delta_product_step,
    gated_delta_rule_step,
    kda_step,
)
from mixers.ops.delta_rule import blocked
from ssm_pack import lengths_to_cu_seqlens
from tests.support.oracles import check_close, check_grads, delta_oracle, design_lengths, documents
from tests.support.output_shapes import OutputShapes

H, HV, K, V = 2, 4, 4, 3
NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def l2(x):
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + 1e-6)


def make(kind, lengths, tail, dtype, *, nh=2, init=True, seed=0):
    g_ = torch.Generator().manual_seed(seed)
    cu = lengths_to_cu_seqlens(lengths)
    total = int(cu[-1]) + tail
    heads_v = H if kind == "gdp" else HV
    steps = total * (nh if kind == "gdp" else 1)

    def rnd(*shape):
        return torch.randn(*shape, generator=g_, dtype=torch.float64)

    leaves = {"q": rnd(1, total, H, K), "k": rnd(1, steps, H, K), "v": rnd(1, steps, heads_v, V)}
    gate_shape = (1, total, heads_v, K) if kind == "kda" else (1, total, heads_v)
    leaves["g"] = F.logsigmoid(rnd(*gate_shape))
    leaves["beta"] = torch.rand(1, steps, heads_v, generator=g_, dtype=torch.float64)
    if init:
        leaves["initial_state"] = rnd(len(lengths), heads_v, K, V)
    return cu, {name: t.to(dtype).requires_grad_() for name, t in leaves.items()}


def call(kind, leaves, cu, chunk, nh=2, l2norm=True, final=True, **kw):
    args = (leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"])
    common = dict(initial_state=leaves.get("initial_state"), output_final_state=final,
                  use_qk_l2norm_in_kernel=l2norm, cu_seqlens=cu, chunk_size=chunk, **kw)
    if kind == "gdn":
        return chunk_gated_delta_rule(*args, **common)
    if kind == "kda":
        return chunk_kda(*args, **common)
    return chunk_gated_delta_product(*args, nh, **common)


def oracle(kind, leaves, cu, nh=2, l2norm=True):
    ref = {name: t.detach().to(torch.float64).requires_grad_() for name, t in leaves.items()}
    q, k = (l2(ref["q"]), l2(ref["k"])) if l2norm else (ref["q"], ref["k"])
    groups = ref["v"].shape[2] // q.shape[2]
    q, k = q.repeat_interleave(groups, 2), k.repeat_interleave(groups, 2)
    g = ref["g"] if kind == "kda" else ref["g"].unsqueeze(-1)
    out, states = delta_oracle(q, k, ref["v"], g, ref["beta"], cu, scale=K ** -0.5,
                               nh=nh if kind == "gdp" else 1, initial_states=ref.get("initial_state"))
    return ref, out, states


def compare(kind, cu, leaves, chunk, dtype, nh=2, l2norm=True):
    compare_training_path(kind, cu, leaves, chunk, dtype, nh, l2norm)
    out, final = call(kind, leaves, cu, chunk, nh, l2norm)
    ref, ref_out, ref_states = oracle(kind, leaves, cu, nh, l2norm)
    check_close(out, ref_out, dtype, what=f"{kind} out")
    check_close(final, ref_states, dtype, what=f"{kind} final states")
    gen = torch.Generator().manual_seed(1)
    g_out = torch.randn(ref_out.shape, generator=gen, dtype=torch.float64)
    g_fin = torch.randn(ref_states.shape, generator=gen, dtype=torch.float64)
    loss = (out * g_out.to(out.dtype)).sum() + (final * g_fin.to(final.dtype)).sum()
    ref_loss = (ref_out * g_out).sum() + (ref_states * g_fin).sum()
    check_grads(loss, ref_loss, leaves, ref, dtype, what=kind)


def compare_training_path(kind, cu, leaves, chunk, dtype, nh=2, l2norm=True):
    """Without per-document states the blocked fast path runs: output and every gradient."""
    leaves = {name: t for name, t in leaves.items() if name != "initial_state"}
    out, final = call(kind, leaves, cu, chunk, nh, l2norm, final=False)
    assert final is None
    ref, ref_out, _ = oracle(kind, leaves, cu, nh, l2norm)
    check_close(out, ref_out, dtype, what=f"{kind} out (fast path)")
    g_out = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    loss, ref_loss = (out * g_out.to(out.dtype)).sum(), (ref_out * g_out).sum()
    check_grads(loss, ref_loss, leaves, ref, dtype, what=f"{kind} (fast path)")


KINDS = [pytest.param("gdn", id="gdn"), pytest.param("kda", id="kda"), pytest.param("gdp", id="gdp2")]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("chunk", [16, 32, 64], ids=["chunk16", "chunk32", "chunk64"])
def test_design_grid_fp64(kind, chunk):
    cu, leaves = make(kind, design_lengths(chunk), 3, torch.float64)
    compare(kind, cu, leaves, chunk, torch.float64)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("lengths,tail,chunk", [
    pytest.param([0, 15, 100, 300], 0, 64, id="uneven"),
    pytest.param([1, 2, 3] * 700, 2, 32, id="thousands-of-tiny"),
    pytest.param([0, 0], 5, 16, id="only-empty-and-tail"),
    pytest.param([5, 10], 0, 16, id="one-token-short-of-a-chunk"),     # one token of chunk padding
])
def test_layouts_fp64(kind, lengths, tail, chunk):
    cu, leaves = make(kind, lengths, tail, torch.float64)
    compare(kind, cu, leaves, chunk, torch.float64)


@pytest.mark.parametrize("nh,chunk", [pytest.param(3, 16, id="nh3-chunk16"), pytest.param(4, 8, id="nh4-chunk8")])
def test_gated_delta_product_more_householders_fp64(nh, chunk):
    """Sub-step groups that straddle chunks (3 does not divide 16): the fast path lays each block's
    zero query sub-steps out itself and writes the output per token."""
    cu, leaves = make("gdp", [0, 15, 100, 37], 2, torch.float64, nh=nh)
    compare("gdp", cu, leaves, chunk, torch.float64, nh=nh)


# the default block holds every chunk of these small heads at once; this many numbers per block
# gives 3 chunks per block for 4 value heads, 6 for Gated DeltaProduct's 2 (chunk 8, width 4)
FEW_CHUNKS = 3 * 8 * 4 * 4


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("numbers", [pytest.param(1, id="one-chunk-blocks"),
                                     pytest.param(FEW_CHUNKS, id="few-chunk-blocks")])
def test_many_blocks_fp64(kind, numbers, monkeypatch):
    """The fast path over many blocks: the state carried from block to block, forward and
    backward (Gated DeltaProduct's sub-step groups straddle the block ends), against the oracle."""
    monkeypatch.setattr(blocked, "_BLOCK_NUMBERS", numbers)
    monkeypatch.setattr(blocked, "_MIN_CHUNKS", 1)
    cu, leaves = make(kind, [0, 15, 100, 300, 90], 3, torch.float64)
    assert len(blocked._blocks(1, 2 if kind == "gdp" else HV, 64, 8, max(K, V))) > 8
    compare_training_path(kind, cu, leaves, 8, torch.float64)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("numbers", [pytest.param(1 << 18, id="one-block"),
                                     pytest.param(FEW_CHUNKS, id="few-chunk-blocks")])
def test_one_head_l2norm_in_blocks_fp64(kind, numbers, monkeypatch):
    """One key and value head (the chunk-major copy of k is then k itself): q and k are
    normalized block by block on new buffers, the inputs stay untouched, and output and every
    gradient match the oracle, over one block and over many."""
    monkeypatch.setattr(blocked, "_BLOCK_NUMBERS", numbers)
    monkeypatch.setattr(blocked, "_MIN_CHUNKS", 1)
    monkeypatch.setitem(globals(), "H", 1)
    monkeypatch.setitem(globals(), "HV", 1)
    cu, leaves = make(kind, [0, 15, 100, 300, 90], 3, torch.float64)
    before = {name: t.detach().clone() for name, t in leaves.items()}
    compare_training_path(kind, cu, leaves, 8, torch.float64)
    for name, t in leaves.items():
        assert torch.equal(t.detach(), before[name]), f"{name} was written"


@pytest.mark.parametrize("kind", KINDS)
def test_one_head_l2norm_in_blocks_without_metadata_fails(kind, monkeypatch):
    """Negative control of the test above: the same blocked run without ``cu_seqlens`` carries the
    state across documents, so the per-document oracle (output and q's gradient) cannot match."""
    monkeypatch.setattr(blocked, "_BLOCK_NUMBERS", FEW_CHUNKS)
    monkeypatch.setattr(blocked, "_MIN_CHUNKS", 1)
    monkeypatch.setitem(globals(), "H", 1)
    monkeypatch.setitem(globals(), "HV", 1)
    cu, leaves = make(kind, [0, 15, 100, 300, 90], 3, torch.float64)
    leaves = {name: t for name, t in leaves.items() if name != "initial_state"}
    out, _ = call(kind, leaves, None, 8, final=False)
    ref, ref_out, _ = oracle(kind, leaves, cu)
    assert (out - ref_out).abs().max() > 1e-3
    g_out = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    (dq,) = torch.autograd.grad((out * g_out).sum(), leaves["q"])
    (ref_dq,) = torch.autograd.grad((ref_out * g_out).sum(), ref["q"])
    assert (dq - ref_dq).abs().max() > 1e-3


@pytest.mark.parametrize("rows,heads,chunks,width,step", [
    pytest.param(1, 8, 128, 64, 8, id="budget-gives-8"),
    pytest.param(1, 8, 128, 128, 8, id="4-widened-to-8"),
    pytest.param(1, 16, 128, 128, 4, id="2-widened-to-4-only"),
    pytest.param(1, 1, 128, 128, 32, id="budget-gives-32"),
    pytest.param(2, 64, 5, 128, 2, id="1-widened-to-2-few-chunks"),
])
def test_blocks_cover_the_chunks_in_order(rows, heads, chunks, width, step):
    """Blocks hold about _BLOCK_NUMBERS numbers per [N, L, width] tensor, widened towards
    _MIN_CHUNKS chunks by at most 2x; they tile the chunks in order."""
    blocks = blocked._blocks(rows, heads, chunks, 64, width)
    assert blocks[0] == (0, min(step, chunks)) and blocks[-1][1] == chunks
    assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
    assert all(c1 - c0 == step for c0, c1 in blocks[:-1])


@pytest.mark.parametrize("kind", KINDS)
def test_forward_without_gradients_matches(kind, monkeypatch):
    """Without gradients the forward reuses one block's state buffer (blocks of a few chunks here):
    outputs and final states equal the training forward's bitwise, and the oracle's."""
    monkeypatch.setattr(blocked, "_BLOCK_NUMBERS", FEW_CHUNKS)
    monkeypatch.setattr(blocked, "_MIN_CHUNKS", 1)
    cu, leaves = make(kind, [0, 15, 100, 300, 90], 3, torch.float64)
    leaves = {name: t for name, t in leaves.items() if name != "initial_state"}
    out, _ = call(kind, leaves, cu, 8, final=False)
    with torch.no_grad():
        plain = {name: t.detach() for name, t in leaves.items()}
        out_ng, _ = call(kind, plain, cu, 8, final=False)
        rows = {name: t.detach().expand(2, *t.shape[1:]) for name, t in plain.items()}
        o_rows, s_rows = call(kind, rows, None, 8, final=True)
    assert torch.equal(out_ng, out.detach())
    # leaves that require grad, under no_grad: still no per-chunk WY inverses [C H, L, L] are kept
    chunks_by_heads = -(-leaves["k"].shape[1] // 8) * leaves["v"].shape[2]
    with torch.no_grad(), OutputShapes() as shapes:
        out_leaves, _ = call(kind, leaves, cu, 8, final=False)
    assert torch.equal(out_leaves, out_ng) and (chunks_by_heads, 8, 8) not in shapes.seen
    with OutputShapes() as shapes:
        call(kind, leaves, cu, 8, final=False)
    assert (chunks_by_heads, 8, 8) in shapes.seen                       # the control: training keeps them
    _, ref_out, _ = oracle(kind, leaves, cu)
    check_close(out_ng, ref_out, torch.float64, what=f"{kind} out (no gradients)")
    assert torch.equal(o_rows[0], o_rows[1]) and torch.equal(s_rows[0], s_rows[1])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_low_precision(kind, dtype):
    cu, leaves = make(kind, [0, 15, 100, 300, 3], 4, dtype)
    compare(kind, cu, leaves, 64, dtype)


@given(st.lists(st.integers(0, 40), min_size=1, max_size=6), st.integers(0, 5), st.sampled_from([4, 8, 16]),
       st.sampled_from(["gdn", "kda", "gdp"]), st.booleans())
def test_random_layouts(lengths, tail, chunk, kind, init):
    cu, leaves = make(kind, lengths, tail, torch.float64, init=init)
    compare(kind, cu, leaves, chunk, torch.float64)


@pytest.mark.parametrize("kind", KINDS)
def test_rows_without_cu_seqlens(kind):
    """Plain batch (the fast path): each row is one document with its own initial and final state."""
    _, leaves = make(kind, [21], 0, torch.float64)
    rows = {n: torch.cat([t.detach(), t.detach() * 0.5]).requires_grad_() for n, t in leaves.items()}
    out, final = call(kind, rows, None, 8)
    g_out, g_fin = torch.randn(out.shape, dtype=torch.float64), torch.randn(final.shape, dtype=torch.float64)
    grads = torch.autograd.grad((out * g_out).sum() + (final * g_fin).sum(), list(rows.values()))
    for r in range(2):
        one = {n: t[r:r + 1].detach().requires_grad_() for n, t in rows.items()}
        ref, ref_out, ref_states = oracle(kind, one, lengths_to_cu_seqlens([21]))
        check_close(out[r:r + 1], ref_out, torch.float64, what=f"row {r}")
        check_close(final[r:r + 1], ref_states, torch.float64, what=f"state of row {r}")
        ref_grads = torch.autograd.grad((ref_out * g_out[r:r + 1]).sum() + (ref_states * g_fin[r:r + 1]).sum(),
                                        list(ref.values()))
        for name, a, b in zip(rows, grads, ref_grads):
            check_close(a[r:r + 1], b, torch.float64, grad=True, what=f"row {r} grad {name}")


def test_no_l2norm_and_custom_scale():
    cu, leaves = make("gdn", [5, 12], 0, torch.float64)
    out, _ = call("gdn", leaves, cu, 8, l2norm=False, scale=0.3)
    ref = {n: t.detach() for n, t in leaves.items()}
    g = ref["g"].unsqueeze(-1)
    q, k = ref["q"].repeat_interleave(2, 2), ref["k"].repeat_interleave(2, 2)
    ref_out, _ = delta_oracle(q, k, ref["v"], g, ref["beta"], cu, scale=0.3, initial_states=ref["initial_state"])
    check_close(out, ref_out, torch.float64, what="scale 0.3")


def test_gated_delta_product_without_gate():
    cu, leaves = make("gdp", [7, 4], 2, torch.float64)
    leaves["g"] = None
    out, final = call("gdp", leaves, cu, 8)
    ref = {n: t.detach() for n, t in leaves.items() if t is not None}
    ref_out, states = delta_oracle(l2(ref["q"]), l2(ref["k"]), ref["v"], None, ref["beta"], cu, scale=K ** -0.5,
                                   nh=2, initial_states=ref["initial_state"])
    check_close(out, ref_out, torch.float64, what="no gate")
    check_close(final, states, torch.float64, what="no gate states")


@pytest.mark.parametrize("kind", KINDS)
def test_step_form_decodes_like_the_chunked_op(kind):
    cu, leaves = make(kind, [13], 0, torch.float64)
    out, final = call(kind, leaves, cu, 8)
    t = {n: v.detach() for n, v in leaves.items()}
    state = t["initial_state"]
    step = {"gdn": gated_delta_rule_step, "kda": kda_step}.get(kind)
    for i in range(13):
        if kind == "gdp":
            o, state = gated_delta_product_step(t["q"][:, i], t["k"][:, 2 * i:2 * i + 2], t["v"][:, 2 * i:2 * i + 2],
                                                t["g"][:, i], t["beta"][:, 2 * i:2 * i + 2], state,
                                                use_qk_l2norm_in_kernel=True)
        else:
            o, state = step(t["q"][:, i], t["k"][:, i], t["v"][:, i], t["g"][:, i], t["beta"][:, i], state,
                            use_qk_l2norm_in_kernel=True)
        check_close(o, out[:, i], torch.float64, what=f"token {i}")
    check_close(state, final, torch.float64, what="state after decoding")


@pytest.mark.parametrize("kind", KINDS)
def test_perturbing_a_document_leaves_the_others_bitwise_unchanged(kind):
    from tests.support.leakage import perturbation_report
    lengths = [1, 15, 0, 70, 2, 3, 40]
    cu, leaves = make(kind, lengths, 5, torch.float32, init=False)
    total = leaves["q"].shape[1]
    spans = documents(cu, total)
    nh = 2 if kind == "gdp" else 1
    inputs = {name: (leaves[name].detach(), 1, nh if name in ("k", "v", "beta") else 1)
              for name in ("q", "k", "v", "g", "beta")}

    def run(cu_seqlens):
        def f(q, k, v, g, beta):      # perturbed values are mapped back to valid log-decays and betas
            o, _ = call(kind, {"q": q, "k": k, "v": v, "g": -g.abs(), "beta": beta.abs() % 1}, cu_seqlens, 16,
                        final=False)
            return o
        return f

    assert perturbation_report(run(cu), inputs, spans, 1) == []
    assert perturbation_report(run(None), inputs, spans, 1), "the check cannot fail: no leak without metadata"


def test_kda_positive_gates_are_refused():
    cu, leaves = make("kda", [4], 0, torch.float64)
    with pytest.raises(ValueError, match="log-decays <= 0"):
        chunk_kda(leaves["q"], leaves["k"], leaves["v"], leaves["g"].detach().abs() + 1, leaves["beta"],
                  cu_seqlens=cu)


@pytest.mark.parametrize("kwargs,exc,match", [
    pytest.param(dict(chunk_size=24), ValueError, "chunk_size must be a power of two, got 24", id="chunk"),
    pytest.param(dict(initial_state=torch.zeros(3, HV, K, V)), ValueError, r"initial_state must be \[N, HV, K, V\]",
                 id="init-rows"),
    pytest.param(dict(cu_seqlens=torch.tensor([0, 9])), ValueError, r"cu_seqlens\[-1\]=9 is beyond the 6 tokens",
                 id="cu-beyond"),
    pytest.param(dict(cu_seqlens=None, initial_state=torch.zeros(3, HV, K, V)), ValueError,
                 r"initial_state must be \[B, HV, K, V\] = \[1, 4, 4, 3\]", id="init-rows-no-cu-seqlens"),
    pytest.param(dict(backend="kernel"), ValueError, "needs CUDA tensors", id="kernel-on-cpu"),
    pytest.param(dict(q=torch.randn(1, 6, H * K)), ValueError, r"^q must be 4-D, got shape \(1, 6, 8\)",
                 id="q-3d"),
    *[pytest.param({name: [0.5] * 6}, TypeError, rf"^{name} must be a torch.Tensor, got list \[0.5, ",
                   id=f"{name}-list") for name in ("k", "v", "g", "beta")],
])
def test_bad_input(kwargs, exc, match):
    q, k, v = (kwargs.pop(name, torch.randn(1, 6, heads, dim))
               for name, heads, dim in (("q", H, K), ("k", H, K), ("v", HV, V)))
    g, beta = kwargs.pop("g", torch.randn(1, 6, HV).clamp(max=0)), kwargs.pop("beta", torch.rand(1, 6, HV))
    kwargs.setdefault("cu_seqlens", torch.tensor([0, 2, 6]))
    with pytest.raises(exc, match=match):
        chunk_gated_delta_rule(q, k, v, g, beta, **kwargs)


@pytest.mark.parametrize("nh,steps,label", [
    pytest.param(1, 5, "T", id="one-householder"),
    pytest.param(2, 9, r"T\*num_householder", id="two-householders"),
])
def test_gated_delta_product_bad_key_steps(nh, steps, label):
    """k, v and beta carry ``num_householder`` sub-steps per token; a wrong count is named as such."""
    q, k, v = torch.randn(1, 4, H, K), torch.randn(1, steps, H, K), torch.randn(1, 4 * nh, H, V)
    g, beta = torch.randn(1, 4, H).clamp(max=0), torch.rand(1, 4 * nh, H)
    with pytest.raises(ValueError, match=rf"^k must be \[B, {label}, H, K\] = \[1, {4 * nh}, 2, 4\], got"):
        chunk_gated_delta_product(q, k, v, g, beta, nh)


def test_heads_must_group():
    with pytest.raises(ValueError, match="value heads HV=3 must be a multiple of key heads H=2"):
        chunk_gated_delta_rule(torch.randn(1, 4, 2, K), torch.randn(1, 4, 2, K), torch.randn(1, 4, 3, V),
                               torch.zeros(1, 4, 3), torch.rand(1, 4, 3))


def test_peer_fla_naive_agrees_fp32():
    naive = pytest.importorskip("fla.ops.gated_delta_rule.naive")
    kda_naive = pytest.importorskip("fla.ops.kda.naive")
    cu, leaves = make("gdn", [5, 33, 20], 0, torch.float32)
    t = {n: v.detach() for n, v in leaves.items()}
    out, final = call("gdn", leaves, cu, 16)
    for i, (s, e) in enumerate(documents(cu, t["q"].shape[1])):
        q, k = l2(t["q"][:, s:e]).repeat_interleave(2, 2), l2(t["k"][:, s:e]).repeat_interleave(2, 2)
        ref, st = naive.naive_recurrent_gated_delta_rule(q, k, t["v"][:, s:e], t["beta"][:, s:e], t["g"][:, s:e],
                                                         initial_state=t["initial_state"][i:i + 1].clone(),
                                                         output_final_state=True)
        check_close(out[:, s:e].detach(), ref.to(torch.float64), torch.float32, what=f"fla GDN doc {i}")
        check_close(final[i].detach(), st[0].to(torch.float64), torch.float32, what=f"fla GDN state {i}")
    cu, leaves = make("kda", [5, 33, 20], 0, torch.float32)
    t = {n: v.detach() for n, v in leaves.items()}
    out, _ = call("kda", leaves, cu, 16)
    for i, (s, e) in enumerate(documents(cu, t["q"].shape[1])):
        ref, _ = kda_naive.naive_recurrent_kda(l2(t["q"][:, s:e]), l2(t["k"][:, s:e]), t["v"][:, s:e],
                                               t["g"][:, s:e], t["beta"][:, s:e],
                                               initial_state=t["initial_state"][i:i + 1].clone())
        check_close(out[:, s:e].detach(), ref.to(torch.float64), torch.float32, what=f"fla KDA doc {i}")


OPS = {"gdn": chunk_gated_delta_rule, "kda": chunk_kda, "gdp": chunk_gated_delta_product}


@pytest.mark.parametrize("kind", KINDS)
def test_context_parallel_call_goes_to_the_cp_path_with_its_op(kind, monkeypatch):
    """A ``VarlenBatch`` carrying a CP run is handed to the CP version (stubbed: it needs several ranks) with
    the public op of its kind, which runs each rank's local pieces; its result is the op's."""
    import dataclasses

    from mixers.ops.delta_rule import cp
    from ssm_pack import VarlenBatch
    seen = []
    monkeypatch.setattr(cp, "delta_rule_cp", lambda call, local_op: seen.append((call, local_op)) or "cp")
    run = object()
    cu, leaves = make(kind, [3, 4], 0, torch.float64, init=False)
    varlen = dataclasses.replace(VarlenBatch.build(cu.long(), 7), cp=run)
    assert call(kind, leaves, varlen, 16) == "cp"
    (given, local_op), = seen
    assert given.varlen.cp is run and given.kind == kind and local_op is OPS[kind]


@pytest.mark.parametrize("heads,grouped", [
    pytest.param((2, 2, 4, 4), False, id="HV==H"),        # V != H and HV != K: only HV against H counts
    pytest.param((2, 4, 4, 2), True, id="HV>H"),          # V == H and HV == K: likewise
])
@pytest.mark.parametrize("varlen", [True, False], ids=["cu_seqlens", "rows"])
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no-grad"])
def test_kernel_support_is_asked_for_the_calls_features(heads, grouped, varlen, grad, monkeypatch):
    """On (pretended) CUDA fla is asked for exactly the features the call needs: varlen with cu_seqlens,
    grouped values when HV != H, the backward minimum when autograd records."""
    from ssm_pack.support import requirements
    from tests.support import fakes
    h, hv, kd, vd = heads
    calls = fakes.install(monkeypatch)
    asked = []
    monkeypatch.setattr(fakes.dispatch, "cached_support", lambda name, features=(): asked.append((name, features))
                        or (True, None))
    g_ = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 7, h, kd, generator=g_) for _ in range(2))
    v = torch.randn(1, 7, hv, vd, generator=g_).requires_grad_(grad)
    g, beta = F.logsigmoid(torch.randn(1, 7, hv, generator=g_)), torch.rand(1, 7, hv, generator=g_)
    cu = torch.tensor([0, 3, 7]) if varlen else None
    o, _ = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu)
    want = (("varlen",) if varlen else ()) + (("grouped_values",) if grouped else ()) \
        + ((requirements.BACKWARD,) if grad else ())
    assert [f for name, f in asked if name == "fla"] == [want]
    assert [kind for kind, _ in calls] == ["gdn"] and o.shape == (1, 7, hv, vd)
