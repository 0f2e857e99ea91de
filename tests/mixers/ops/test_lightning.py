"""chunk_simple_gla (lightning attention): the SSD route against the token-by-token spec, packed == each
document alone (output, per-document final states, every gradient), the decode step, bad input."""

import pytest
import torch

from mixers.ops import chunk_simple_gla, fused_recurrent_simple_gla
from mixers.ops.lightning.naive import simple_gla_naive
from ssm_pack import lengths_to_cu_seqlens
from tests.support.oracles import design_lengths

H, K, V, CHUNK = 3, 4, 5, 8
F64 = dict(dtype=torch.float64)


def make(lengths, tail=0, *, seed=0, rows=1):
    g = torch.Generator().manual_seed(seed)
    cu = lengths_to_cu_seqlens(lengths)
    total = int(cu[-1]) + tail
    rnd = lambda *shape: torch.randn(*shape, generator=g, **F64).requires_grad_()  # noqa: E731
    leaves = {"q": rnd(rows, total, H, K), "k": rnd(rows, total, H, K), "v": rnd(rows, total, H, V),
              "g_gamma": (-torch.rand(H, generator=g, **F64) * 0.5 - 0.01).requires_grad_(),
              "initial_state": rnd(len(lengths) if rows == 1 else rows, H, K, V)}
    return cu, leaves


def grads(out, final, leaves, seed=1):
    g = torch.Generator().manual_seed(seed)
    loss = (out * torch.randn(out.shape, generator=g, **F64)).sum()
    if final is not None:
        loss = loss + (final * torch.randn(final.shape, generator=g, **F64)).sum()
    return torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)


def assert_close(got, want, what, tol=1e-12):
    err = float((got - want).detach().abs().max()) if got.numel() else 0.0
    assert err <= tol, f"{what}: {err:.3e}"


CASES = [
    pytest.param([1], 0, id="one-token"),
    pytest.param([2, 1], 0, id="two-then-one"),
    pytest.param(design_lengths(CHUNK), 3, id="grid-with-tail"),
    pytest.param([0, 0, 5, 0], 0, id="empty-documents"),
    pytest.param([7, CHUNK - 1, CHUNK + 3, 2 * CHUNK + 1], 0, id="straddling-chunks"),
    pytest.param([1, 2, 3] * 7, 1, id="many-tiny"),
]


@pytest.mark.parametrize("lengths, tail", CASES)
def test_chunked_equals_spec(lengths, tail):
    """The SSD route equals the step-by-step recurrence (fp64, 1e-12): output, final states, every gradient."""
    cu, leaves = make(lengths, tail)
    args = dict(scale=0.7, output_final_state=True, cu_seqlens=cu)
    o, f = chunk_simple_gla(leaves["q"], leaves["k"], leaves["v"], g_gamma=leaves["g_gamma"],
                            initial_state=leaves["initial_state"], chunk_size=CHUNK, **args)
    o_ref, f_ref = simple_gla_naive(leaves["q"], leaves["k"], leaves["v"], leaves["g_gamma"],
                                    initial_state=leaves["initial_state"], **args)
    assert o.shape == (1, int(cu[-1]) + tail, H, V) and f.shape == (len(lengths), H, K, V)
    assert_close(o, o_ref, "output")
    assert_close(f, f_ref, "final states")
    for name, got, want in zip(leaves, grads(o, f, leaves), grads(o_ref, f_ref, leaves)):
        assert_close(got, want, f"grad {name}")


@pytest.mark.parametrize("lengths, tail", CASES)
def test_packed_equals_each_document_alone(lengths, tail):
    """Each document run alone (its own row, its own initial state) gives the packed row's output, its
    final state and every gradient; the same row without cu_seqlens differs (negative control)."""
    cu, leaves = make(lengths, tail)
    q, k, v, gg, s0 = leaves.values()
    o, f = chunk_simple_gla(q, k, v, g_gamma=gg, scale=1.0, initial_state=s0, output_final_state=True, cu_seqlens=cu,
                            chunk_size=CHUNK)
    packed_grads = grads(o, f, leaves)
    pieces, finals = [], []
    bounds = cu.tolist()
    for n, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        o_n, f_n = chunk_simple_gla(q[:, s:e], k[:, s:e], v[:, s:e], g_gamma=gg, scale=1.0,
                                    initial_state=s0[n:n + 1], output_final_state=True, chunk_size=CHUNK)
        pieces.append(o_n)
        finals.append(f_n[0])
    if tail:
        pieces.append(chunk_simple_gla(q[:, bounds[-1]:], k[:, bounds[-1]:], v[:, bounds[-1]:], g_gamma=gg,
                                       scale=1.0, chunk_size=CHUNK)[0])
    o_alone, f_alone = torch.cat(pieces, 1), torch.stack(finals)
    assert_close(o, o_alone, "output")
    assert_close(f, f_alone, "final states")
    for name, got, want in zip(leaves, packed_grads, grads(o_alone, f_alone, leaves)):
        assert_close(got, want, f"grad {name}")
    if sum(1 for n in lengths if n) > 1:
        leaked, _ = chunk_simple_gla(q, k, v, g_gamma=gg, scale=1.0, chunk_size=CHUNK)
        assert (leaked - o).abs().max() > 1e-6, "without cu_seqlens the row must differ (negative control)"


def test_rows_without_cu_seqlens():
    """Without cu_seqlens every row is one document from its own state ``[B, H, K, V]``."""
    _, leaves = make([13], rows=3, seed=4)
    o, f = chunk_simple_gla(*list(leaves.values())[:3], g_gamma=leaves["g_gamma"],
                            initial_state=leaves["initial_state"], output_final_state=True, chunk_size=CHUNK)
    o_ref, f_ref = simple_gla_naive(*list(leaves.values())[:3], leaves["g_gamma"],
                                    initial_state=leaves["initial_state"], output_final_state=True)
    assert_close(o, o_ref, "output")
    assert_close(f, f_ref, "final states")


def test_decode_steps_equal_the_whole_sequence():
    """A prefill then token-by-token decode steps (state carried) equals one call over all tokens."""
    _, leaves = make([12], rows=2, seed=5)
    q, k, v, gg, s0 = (t.detach() for t in leaves.values())
    o_all, f_all = chunk_simple_gla(q, k, v, g_gamma=gg, scale=1.0, initial_state=s0, output_final_state=True)
    o, state = chunk_simple_gla(q[:, :7], k[:, :7], v[:, :7], g_gamma=gg, scale=1.0, initial_state=s0,
                                output_final_state=True)
    outs = [o]
    for t in range(7, 12):
        o_t, state = fused_recurrent_simple_gla(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g_gamma=gg, scale=1.0,
                                                initial_state=state, output_final_state=True)
        outs.append(o_t)
    assert_close(torch.cat(outs, 1), o_all, "output")
    assert_close(state, f_all, "final state")


@pytest.mark.parametrize("rows, tokens", [pytest.param(2, 1, id="one-token-two-rows"),
                                          pytest.param(1, 5, id="five-tokens-one-row")])
def test_the_decode_form_from_a_zero_state_equals_the_chunked_op(rows, tokens):
    """Without an initial state, one token (the step) or several (handed to the chunked op) per row:
    the same output and final state as ``chunk_simple_gla`` (rows != heads, so a misordered zero state
    cannot broadcast into the right shape)."""
    _, leaves = make([tokens], rows=rows, seed=8)
    q, k, v, gg, _ = (t.detach() for t in leaves.values())
    o, f = fused_recurrent_simple_gla(q, k, v, g_gamma=gg, output_final_state=True)
    o_ref, f_ref = chunk_simple_gla(q, k, v, g_gamma=gg, output_final_state=True, backend="reference")
    assert o.shape == o_ref.shape == (rows, tokens, H, V) and f.shape == f_ref.shape == (rows, H, K, V)
    assert_close(o, o_ref, "output")
    assert_close(f, f_ref, "final state")


def test_the_default_chunk_is_64_tokens():
    """The SSD route cuts the row into chunks of 64 (``chunk_size``'s default). The chunk changes only
    the rounding, so the default call equals ``chunk_size=64`` bitwise and 63 or 65 do not (negative
    controls, still within 1e-12 of it)."""
    cu, leaves = make([70, 60], seed=9)
    q, k, v, gg, s0 = (t.detach() for t in leaves.values())
    default, _ = chunk_simple_gla(q, k, v, g_gamma=gg, initial_state=s0, cu_seqlens=cu)
    assert torch.equal(default, chunk_simple_gla(q, k, v, g_gamma=gg, initial_state=s0, cu_seqlens=cu,
                                                 chunk_size=64)[0])
    for other in (63, 65):
        got, _ = chunk_simple_gla(q, k, v, g_gamma=gg, initial_state=s0, cu_seqlens=cu, chunk_size=other)
        assert not torch.equal(got, default), other
        assert float((got - default).abs().max() / default.abs().max()) <= 1e-12, other


def test_the_decode_step_returns_a_state_only_when_asked():
    """One token per row without ``output_final_state``: ``(o, None)``, as the chunked op returns."""
    _, leaves = make([1], rows=2, seed=10)
    q, k, v, gg, s0 = (t.detach() for t in leaves.values())
    o, state = fused_recurrent_simple_gla(q, k, v, g_gamma=gg, initial_state=s0)
    assert state is None and o.shape == (2, 1, H, V)
    assert chunk_simple_gla(q, k, v, g_gamma=gg, initial_state=s0)[1] is None


def test_half_precision_state_is_fp32():
    """bf16 inputs: the decode step keeps its state in fp32 and the output stays close to the fp64 spec."""
    _, leaves = make([1], rows=2, seed=6)
    q, k, v, gg, s0 = (t.detach() for t in leaves.values())
    o, f = fused_recurrent_simple_gla(q.bfloat16(), k.bfloat16(), v.bfloat16(), g_gamma=gg.float(),
                                      initial_state=s0.float(), output_final_state=True)
    want, _ = simple_gla_naive(q, k, v, gg, initial_state=s0)
    assert o.dtype == torch.bfloat16 and f.dtype == torch.float32
    assert float((o.double() - want).norm() / want.norm()) < 1e-2


def _bad(**change):
    _, leaves = make([3, 2], seed=7)
    args = dict(q=leaves["q"], k=leaves["k"], v=leaves["v"], g_gamma=leaves["g_gamma"],
                cu_seqlens=lengths_to_cu_seqlens([3, 2]))
    args.update(change)
    return args


@pytest.mark.parametrize("change, error, words", [
    pytest.param(dict(g=torch.zeros(1, 5, H)), ValueError, "per-token gate g", id="per-token-gate"),
    pytest.param(dict(g_gamma=None), ValueError, "g_gamma", id="no-decay"),
    pytest.param(dict(g_gamma=torch.zeros(H + 1)), ValueError, "g_gamma must be [H]", id="decay-shape"),
    pytest.param(dict(k=torch.zeros(1, 5, H, K + 1, **F64)), ValueError, "k must be", id="key-shape"),
    pytest.param(dict(v=torch.zeros(1, 5, H, V)), TypeError, "v must have q's dtype", id="value-dtype"),
    pytest.param(dict(v=torch.zeros(1, 4, H, V, **F64)), ValueError, "v must be [B, T, H, V] = [1, 5, 3, 5], got "
                 "[1, 4, 3, 5]", id="value-tokens"),
    pytest.param(dict(v=torch.zeros(1, 5, H + 1, V, **F64)), ValueError, "v must be [B, T, H, V] = [1, 5, 3, 5], "
                 "got [1, 5, 4, 5]", id="value-heads"),
    pytest.param(dict(initial_state=torch.zeros(3, H, K, V, **F64)), ValueError, "initial_state must be [N",
                 id="states-per-document"),
    pytest.param(dict(cu_seqlens=torch.tensor([0, 3, 9])), ValueError, "cu_seqlens", id="bounds-past-the-row"),
    pytest.param(dict(scale="one"), TypeError, "scale", id="scale-type"),
])
def test_bad_input_is_refused(change, error, words):
    with pytest.raises(error, match=words.replace("[", r"\[")):
        chunk_simple_gla(**_bad(**change))


def test_the_spec_returns_what_the_op_returns():
    """The spec's contract is the op's: no final state unless asked, and ``[B, H, K, V]`` final states
    for zero rows too (key and value dims differ here)."""
    q, k = (torch.randn(2, 6, 2, 4, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, 6, 2, 3, dtype=torch.float64)
    gg = -torch.rand(2, dtype=torch.float64)
    o, final = simple_gla_naive(q, k, v, gg)
    assert final is None and chunk_simple_gla(q, k, v, g_gamma=gg)[1] is None, "a final state nobody asked for"
    assert_close(o, chunk_simple_gla(q, k, v, g_gamma=gg)[0], "output")
    o, final = simple_gla_naive(q[:0], k[:0], v[:0], gg, output_final_state=True)
    assert tuple(o.shape) == (0, 6, 2, 3), f"output {list(o.shape)}"
    assert tuple(final.shape) == (0, 2, 4, 3), f"final states must be [B, H, K, V], got {list(final.shape)}"
