"""rg_lru (Griffin's RG-LRU, packed): the torch backend against its spec, every document alone,
states, the decode step and bad input."""

import pytest
import torch

from mixers.ops.rg_lru import rg_lru
from mixers.ops.rg_lru.gates import MAX_SQRT_GRADIENT, bounded_sqrt
from mixers.ops.rg_lru.naive import rg_lru_naive
from mixers.ops.rg_lru.update import rg_lru_update
from ssm_pack import lengths_to_cu_seqlens
from tests.mixers.ops.naive_compare import assert_same
from tests.support.oracles import check_close, design_lengths

D = 6

CASES = [
    pytest.param([5, 0, 1, 2, 9], 0, id="uneven-empty-one-two"),
    pytest.param(design_lengths(8), 0, id="grid-around-powers-of-two"),
    pytest.param([1, 0, 11], 3, id="tail"),
    pytest.param([1] * 40 + [2, 3] * 10, 0, id="many-tiny"),
    pytest.param([0, 0, 4, 0], 0, id="empty-first-and-last"),
    pytest.param([17], 0, id="one-odd-document"),
]


def _inputs(lengths, tail=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths) + tail
    x, gx, ga = (torch.randn(1, total, D, generator=g, dtype=torch.float64) for _ in range(3))
    lam = torch.randn(D, generator=g, dtype=torch.float64)
    h0 = torch.randn(len(lengths), D, generator=g, dtype=torch.float64)
    return lengths_to_cu_seqlens(lengths), (x, gx, ga, lam, h0)


def _continues(n):
    return torch.arange(n) % 3 != 1


@pytest.mark.parametrize("lengths, tail", CASES)
@pytest.mark.parametrize("states", ["none", "all-continue", "some-continue"])
def test_torch_backend_matches_spec(lengths, tail, states):
    cu, (x, gx, ga, lam, h0) = _inputs(lengths, tail)
    cont = _continues(len(lengths)) if states == "some-continue" else None
    kw = {"cu_seqlens": cu, "continues": cont}

    def backend(x, gx, ga, lam, h0):
        return rg_lru(x, gx, ga, lam, initial_state=None if states == "none" else h0, output_final_state=True,
                      backend="reference", **kw)

    def spec(x, gx, ga, lam, h0):
        return rg_lru_naive(x, gx, ga, lam, initial_state=None if states == "none" else h0, **kw)

    assert_same(backend, spec, (x, gx, ga, lam, h0), what=f"rg_lru {states}")


def test_rows_match_spec():
    """Without cu_seqlens every row is one sequence (the default call)."""
    g = torch.Generator().manual_seed(4)
    x, gx, ga = (torch.randn(3, 10, D, generator=g, dtype=torch.float64) for _ in range(3))
    lam = torch.randn(D, generator=g, dtype=torch.float64)
    h0 = torch.randn(3, D, generator=g, dtype=torch.float64)
    assert_same(lambda *a: rg_lru(*a, output_final_state=True), lambda *a: rg_lru_naive(*a),
                (x, gx, ga, lam), what="rows")
    assert_same(lambda *a: rg_lru(*a[:4], initial_state=a[4], output_final_state=True),
                lambda *a: rg_lru_naive(*a[:4], initial_state=a[4]), (x, gx, ga, lam, h0), what="rows with states")


@pytest.mark.parametrize("lengths, tail", CASES)
def test_packed_equals_each_document_alone(lengths, tail):
    """Output, final states and the gradient of every input equal running each document alone."""
    cu, (x, gx, ga, lam, h0) = _inputs(lengths, tail, seed=1)
    cont = _continues(len(lengths))
    leaves = [t.clone().requires_grad_() for t in (x, gx, ga, lam, h0)]
    out, final = rg_lru(*leaves[:4], initial_state=leaves[4], continues=cont, cu_seqlens=cu, output_final_state=True)
    g = torch.Generator().manual_seed(9)
    w_out, w_fin = torch.randn(out.shape, generator=g, dtype=torch.float64), torch.randn(final.shape, generator=g,
                                                                                         dtype=torch.float64)
    grads = torch.autograd.grad((out * w_out).sum() + (final * w_fin).sum(), leaves)
    lam_grad = torch.zeros(D, dtype=torch.float64)
    bounds = cu.tolist()
    for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        alone = [t[:, s:e].clone().requires_grad_() for t in (x, gx, ga)]
        lam_i, h_i = lam.clone().requires_grad_(), h0[i:i + 1].clone().requires_grad_()
        o, f = rg_lru(*alone, lam_i, initial_state=h_i, continues=cont[i:i + 1], output_final_state=True)
        check_close(out[:, s:e], o, torch.float64, what=f"doc {i} out")
        check_close(final[i], f[0], torch.float64, what=f"doc {i} final")
        gs = torch.autograd.grad((o * w_out[:, s:e]).sum() + (f * w_fin[i:i + 1]).sum(), [*alone, lam_i, h_i],
                                 allow_unused=True, materialize_grads=True)
        for k, name in enumerate(("x", "gate_x", "gate_a")):
            check_close(grads[k][:, s:e], gs[k], torch.float64, grad=True, what=f"doc {i} d{name}")
        check_close(grads[4][i], gs[4][0], torch.float64, grad=True, what=f"doc {i} dinitial_state")
        lam_grad += gs[3]
    total = sum(lengths)
    if tail:
        alone = [t[:, total:].clone() for t in (x, gx, ga)]
        lam_t = lam.clone().requires_grad_()
        o, _ = rg_lru(*alone, lam_t)
        check_close(out[:, total:], o, torch.float64, what="tail out")
        lam_grad += torch.autograd.grad((o * w_out[:, total:]).sum(), lam_t)[0]
    check_close(grads[3], lam_grad, torch.float64, grad=True, what="drecurrent_param")


def test_without_metadata_documents_leak():
    """Negative control: the same row without cu_seqlens differs after the first document."""
    cu, (x, gx, ga, lam, _) = _inputs([4, 5])
    packed, _ = rg_lru(x, gx, ga, lam, cu_seqlens=cu)
    joined, _ = rg_lru(x, gx, ga, lam)
    assert torch.equal(packed[:, :4], joined[:, :4])
    assert (packed[:, 4:] - joined[:, 4:]).abs().min() > 0


def test_a_nan_stays_in_its_document():
    cu, (x, gx, ga, lam, _) = _inputs([4, 5, 3])
    clean = [t.clone().requires_grad_() for t in (x, gx, ga)]
    dirty = [t.clone() for t in (x, gx, ga)]
    dirty[0][0, 6, 1] = float("nan")
    dirty = [t.requires_grad_() for t in dirty]
    outs, grads = [], []
    for leaves in (clean, dirty):
        out, fin = rg_lru(*leaves, lam, cu_seqlens=cu, output_final_state=True)
        outs.append((out, fin))
        grads.append(torch.autograd.grad(out.sum() + fin.sum(), leaves))
    for keep in (slice(0, 4), slice(9, 12)):
        assert torch.equal(outs[0][0][:, keep], outs[1][0][:, keep])
        for a, b in zip(grads[0], grads[1]):
            assert torch.equal(a[:, keep], b[:, keep])
    assert torch.equal(outs[0][1][[0, 2]], outs[1][1][[0, 2]])
    assert outs[1][0][:, 6:9].isnan().any()


def test_decode_equals_recompute():
    """A prefill's final states, then 4 decode steps per document, equal the whole sequences."""
    g = torch.Generator().manual_seed(5)
    lengths, steps = [3, 1, 6], 4
    whole = [[torch.randn(1, n + steps, D, generator=g, dtype=torch.float64) for _ in range(3)] for n in lengths]
    lam = torch.randn(D, generator=g, dtype=torch.float64)
    cu = lengths_to_cu_seqlens(lengths)
    prompt = [torch.cat([w[k][:, :n] for w, n in zip(whole, lengths)], 1) for k in range(3)]
    _, final = rg_lru(*prompt, lam, cu_seqlens=cu, output_final_state=True)
    pool = torch.zeros(5, D, dtype=torch.float64)
    slots = torch.tensor([4, 0, 2])
    pool[slots] = final
    for t in range(steps):
        got = rg_lru_update(pool, *[torch.cat([w[k][:, n + t] for w, n in zip(whole, lengths)]) for k in range(3)],
                            lam, state_indices=slots)
        for i, (w, n) in enumerate(zip(whole, lengths)):
            want, _ = rg_lru(*[w[k][:, :n + t + 1] for k in range(3)], lam)
            check_close(got[i], want[0, -1], torch.float64, what=f"doc {i} step {t}")


def test_decode_of_a_fresh_sequence_resets():
    g = torch.Generator().manual_seed(6)
    x, gx, ga = (torch.randn(2, 1, D, generator=g, dtype=torch.float64) for _ in range(3))
    lam = torch.randn(D, generator=g, dtype=torch.float64)
    pool = torch.randn(2, D, dtype=torch.float64)
    got = rg_lru_update(pool, x[:, 0], gx[:, 0], ga[:, 0], lam, continues=torch.tensor([False, False]))
    want, final = rg_lru(x, gx, ga, lam, output_final_state=True)
    check_close(got, want[:, 0], torch.float64, what="fresh step")
    check_close(pool, final, torch.float64, what="state")


def test_no_tokens():
    cu, (x, gx, ga, lam, h0) = _inputs([0, 0])
    out, final = rg_lru(x, gx, ga, lam, cu_seqlens=cu, initial_state=h0, output_final_state=True)
    assert out.shape == (1, 0, D) and torch.equal(final, h0)


def test_the_sqrt_gradient_is_bounded_as_recurrent_gemma_bounds_it():
    """RecurrentGemma's SqrtBoundDerivative: the value is sqrt(u); its gradient 1 / sqrt(4u) takes
    4u no smaller than 1 / MAX_SQRT_GRADIENT ** 2, so it is MAX_SQRT_GRADIENT (1000) for every
    u <= 1 / (4 * 1000 ** 2) = 2.5e-7, and 1 / (2 sqrt(u)) above (fp64)."""
    assert MAX_SQRT_GRADIENT == 1000.0
    u = torch.tensor([0.0, 1e-8, 2e-7, 1e-6, 0.25, 1.0], dtype=torch.float64, requires_grad=True)
    out = bounded_sqrt(u)
    assert torch.equal(out, torch.sqrt(u.detach()))
    upstream = torch.tensor([1.0, 2.0, -1.0, 3.0, 4.0, 5.0], dtype=torch.float64)
    (grad,) = torch.autograd.grad(out, u, upstream)
    want = upstream * torch.tensor([1000.0, 1000.0, 1000.0, 500.0, 1.0, 0.5], dtype=torch.float64)
    assert torch.allclose(grad, want, rtol=1e-12, atol=0.0), (grad, want)


def test_half_inputs_keep_an_fp32_state():
    cu, (x, gx, ga, lam, _) = _inputs([3, 4])
    out, final = rg_lru(x.bfloat16(), gx.bfloat16(), ga.bfloat16(), lam.float(), cu_seqlens=cu,
                        output_final_state=True)
    want, want_final = rg_lru_naive(x, gx, ga, lam, cu_seqlens=cu)
    assert out.dtype == torch.bfloat16 and final.dtype == torch.float32
    check_close(out.double(), want, torch.bfloat16, what="bf16 out")


@pytest.mark.parametrize("change, error, words", [
    pytest.param({"x": torch.zeros(1, 5)}, ValueError, "x must", id="x-2d"),
    pytest.param({"gate_x": torch.zeros(1, 5, D + 1, dtype=torch.float64)}, ValueError, "gate_x must be [B, T, D]",
                 id="gate-shape"),
    pytest.param({"gate_a": torch.zeros(1, 5, D - 1, dtype=torch.float64)}, ValueError,
                 "gate_a must be [B, T, D] = [1, 5, 6], got [1, 5, 5]", id="recurrence-gate-shape"),
    pytest.param({"recurrent_param": torch.zeros(D + 1, dtype=torch.float64)}, ValueError, "recurrent_param",
                 id="param-shape"),
    pytest.param({"scale": -1.0}, ValueError, "scale must be a positive", id="scale"),
    pytest.param({"initial_state": torch.zeros(3, D, dtype=torch.float64)}, ValueError, "initial_state must be [N, D]",
                 id="state-rows"),
    pytest.param({"continues": torch.ones(2)}, TypeError, "continues must be a bool", id="continues-dtype"),
    pytest.param({"continues": torch.ones(3, dtype=torch.bool)}, ValueError, "continues must be [documents]",
                 id="continues-rows"),
    pytest.param({"backend": "kernel"}, ValueError, "cannot do dtype torch.float64", id="kernel-fp64"),
    pytest.param({"backend": "fast"}, ValueError, "backend must be one of", id="backend"),
])
def test_bad_input(change, error, words):
    cu, (x, gx, ga, lam, _) = _inputs([2, 3])
    args = {"x": x, "gate_x": gx, "gate_a": ga, "recurrent_param": lam, "cu_seqlens": cu} | change
    with pytest.raises(error, match=words.replace("[", r"\[").replace("]", r"\]")):
        rg_lru(args.pop("x"), args.pop("gate_x"), args.pop("gate_a"), args.pop("recurrent_param"), **args)


def test_bad_decode_input():
    pool = torch.zeros(2, D)
    with pytest.raises(ValueError, match="state has 2 rows but x has 3"):
        rg_lru_update(pool, torch.zeros(3, D), torch.zeros(3, D), torch.zeros(3, D), torch.zeros(D))
    with pytest.raises(ValueError, match="state_indices must name rows 0..1"):
        rg_lru_update(pool, torch.zeros(1, D), torch.zeros(1, D), torch.zeros(1, D), torch.zeros(D),
                      state_indices=torch.tensor([2]))
    assert torch.equal(pool, torch.zeros(2, D))


def test_the_decode_step_refuses_the_kernel_backend():
    """No upstream kernel computes the step: ``backend="kernel"`` is refused with the fix, the state untouched."""
    pool = torch.zeros(2, D)
    step = torch.ones(2, D)
    with pytest.raises(ValueError, match=r"rg_lru_update: no upstream kernel computes the RG-LRU step .*"
                                         r"use backend='reference' \(or 'auto', which picks it\)"):
        rg_lru_update(pool, step, step, step, torch.ones(D), backend="kernel")
    assert torch.equal(pool, torch.zeros(2, D))
