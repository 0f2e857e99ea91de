"""rg_lru on fla's ``fused_recurrent_hgrn`` (a strict fake, :func:`tests.support.fakes.fake_fla_hgrn`):
what the route hands fla, and the route against the spec and every document alone in fp64, output
and every gradient. The real kernel runs in the interpreter lane (tests/interpret/test_rg_lru.py)."""

import pytest
import torch

from mixers.layers.rg_lru import RGLRUMixer
from mixers.ops import dispatch
from mixers.ops.rg_lru import kernel as hgrn_kernel
from mixers.ops.rg_lru import rg_lru
from mixers.ops.rg_lru.naive import rg_lru_naive
from ssm_pack import lengths_to_cu_seqlens
from tests.mixers.ops.naive_compare import assert_same
from tests.mixers.ops.test_rg_lru import CASES, D, _continues, _inputs
from tests.support import fakes
from tests.support.oracles import check_close


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA pretended, fla's fake installed; fp64 let through to it so the route is checked exactly."""
    calls = fakes.install(monkeypatch)
    monkeypatch.setattr(hgrn_kernel, "KERNEL_DTYPES", hgrn_kernel.KERNEL_DTYPES + (torch.float64,))
    return calls


@pytest.mark.parametrize("lengths, tail", CASES)
@pytest.mark.parametrize("states", ["none", "all-continue", "some-continue"])
def test_kernel_route_matches_spec(fake_cuda, lengths, tail, states):
    cu, (x, gx, ga, lam, h0) = _inputs(lengths, tail)
    cont = _continues(len(lengths)) if states == "some-continue" else None
    kw = {"cu_seqlens": cu, "continues": cont}

    def route(x, gx, ga, lam, h0):
        return rg_lru(x, gx, ga, lam, initial_state=None if states == "none" else h0, output_final_state=True, **kw)

    def spec(x, gx, ga, lam, h0):
        return rg_lru_naive(x, gx, ga, lam, initial_state=None if states == "none" else h0, **kw)

    assert_same(route, spec, (x, gx, ga, lam, h0), what=f"fla route {states}")
    assert [kind for kind, _ in fake_cuda] == ["hgrn"]


def test_kernel_gets_covering_boundaries_and_zero_states_where_nothing_continues(fake_cuda):
    lengths, tail = [3, 0, 1, 4], 2
    cu, (x, gx, ga, lam, h0) = _inputs(lengths, tail)
    cont = torch.tensor([True, True, False, True])
    rg_lru(x, gx, ga, lam, initial_state=h0, continues=cont, cu_seqlens=cu, output_final_state=True)
    (given,) = fakes.of_kind(fake_cuda, "hgrn")
    assert given["cu_seqlens"].dtype == torch.int64
    assert given["cu_seqlens"].tolist() == [0, 3, 3, 4, 8, 10]                # + the tail as a document
    want = torch.cat([h0 * cont[:, None], torch.zeros(1, D, dtype=h0.dtype)])  # the tail starts fresh
    assert torch.equal(given["initial_state"], want)
    assert given["output_final_state"] is True
    starts = [3, 8]                                                             # fresh: doc 2 and the tail
    assert torch.equal(given["g"][0, starts], torch.zeros(2, D, dtype=x.dtype))
    assert (given["g"][0, [0, 1, 2, 4, 5, 9]] < 0).all()                        # log a_t elsewhere


@pytest.mark.parametrize("lengths, tail", [pytest.param([5, 0, 1, 2, 9], 3, id="uneven-empty-one-tail"),
                                           pytest.param([0, 7, 1], 0, id="empty-first")])
def test_kernel_route_equals_each_document_alone(fake_cuda, lengths, tail):
    """Packed on the kernel route == each document through the spec alone: output, final state and the
    gradient of every input (recurrent_param's summed over the documents and the tail)."""
    cu, (x, gx, ga, lam, h0) = _inputs(lengths, tail, seed=1)
    cont = _continues(len(lengths))
    leaves = [t.clone().requires_grad_() for t in (x, gx, ga, lam, h0)]
    out, final = rg_lru(*leaves[:4], initial_state=leaves[4], continues=cont, cu_seqlens=cu, output_final_state=True)
    assert len(fakes.of_kind(fake_cuda, "hgrn")) == 1
    g = torch.Generator().manual_seed(9)
    w_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    w_fin = torch.randn(final.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out * w_out).sum() + (final * w_fin).sum(), leaves)
    lam_grad = torch.zeros(D, dtype=torch.float64)
    bounds = cu.tolist() + [sum(lengths) + tail]
    for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        alone = [t[:, s:e].clone().requires_grad_() for t in (x, gx, ga)]
        lam_i = lam.clone().requires_grad_()
        h_i = h0[i:i + 1].clone().requires_grad_() if i < len(lengths) else None
        goes_on = cont[i:i + 1] if i < len(lengths) else None
        o, f = rg_lru_naive(*alone, lam_i, initial_state=h_i, continues=goes_on)
        check_close(out[:, s:e], o, torch.float64, what=f"doc {i} out")
        loss = (o * w_out[:, s:e]).sum()
        if i < len(lengths):
            check_close(final[i], f[0], torch.float64, what=f"doc {i} final")
            loss = loss + (f * w_fin[i:i + 1]).sum()
        wrt = [*alone, lam_i] + ([h_i] if h_i is not None else [])
        if loss.requires_grad:
            gs = torch.autograd.grad(loss, wrt, allow_unused=True, materialize_grads=True)
        else:                                         # an empty fresh document: nothing reaches it
            gs = [torch.zeros_like(t) for t in wrt]
        for k, name in enumerate(("x", "gate_x", "gate_a")):
            check_close(grads[k][:, s:e], gs[k], torch.float64, grad=True, what=f"doc {i} d{name}")
        if h_i is not None:
            check_close(grads[4][i], gs[4][0], torch.float64, grad=True, what=f"doc {i} dinitial_state")
        lam_grad += gs[3]
    check_close(grads[3], lam_grad, torch.float64, grad=True, what="drecurrent_param")


def test_kernel_route_without_metadata_documents_leak(fake_cuda):
    """Negative control: the same row on the kernel route without cu_seqlens differs after the first document."""
    cu, (x, gx, ga, lam, _) = _inputs([4, 5])
    packed, _ = rg_lru(x, gx, ga, lam, cu_seqlens=cu)
    joined, _ = rg_lru(x, gx, ga, lam)
    assert len(fakes.of_kind(fake_cuda, "hgrn")) == 2
    assert torch.equal(packed[:, :4], joined[:, :4])
    assert (packed[:, 4:] - joined[:, 4:]).abs().min() > 0


def test_rows_on_the_kernel_route_match_spec(fake_cuda):
    """Without cu_seqlens every row is a sequence of fla's batch: per-row states, no boundaries."""
    g = torch.Generator().manual_seed(4)
    x, gx, ga = (torch.randn(3, 10, D, generator=g, dtype=torch.float64) for _ in range(3))
    lam = torch.randn(D, generator=g, dtype=torch.float64)
    h0 = torch.randn(3, D, generator=g, dtype=torch.float64)
    cont = torch.tensor([True, False, True])
    assert_same(lambda *a: rg_lru(*a[:4], initial_state=a[4], continues=cont, output_final_state=True),
                lambda *a: rg_lru_naive(*a[:4], initial_state=a[4], continues=cont), (x, gx, ga, lam, h0),
                what="rows with states")
    assert all(given["cu_seqlens"] is None for given in fakes.of_kind(fake_cuda, "hgrn"))


def test_a_nan_gate_at_a_reset_token_stays_out(fake_cuda):
    """A fresh document's first token does not read its recurrence gate (spec step 3), on fla too."""
    cu, (x, gx, ga, lam, _) = _inputs([3, 4])
    ga = ga.clone()
    ga[0, 3] = float("nan")
    out, final = rg_lru(x, gx, ga, lam, cu_seqlens=cu, output_final_state=True)
    want, want_final = rg_lru_naive(x, gx, ga, lam, cu_seqlens=cu)
    assert not out.isnan().any() and torch.allclose(out, want) and torch.allclose(final, want_final)


def test_half_inputs_hand_fla_fp32_and_keep_an_fp32_state(fake_cuda):
    cu, (x, gx, ga, lam, h0) = _inputs([6, 1, 9], 2)
    half = [t.to(torch.bfloat16) for t in (x, gx, ga)]
    out, final = rg_lru(*half, lam.float(), initial_state=h0.float(), cu_seqlens=cu, output_final_state=True)
    (given,) = fakes.of_kind(fake_cuda, "hgrn")
    assert given["x"].dtype == given["g"].dtype == given["initial_state"].dtype == torch.float32
    assert out.dtype == torch.bfloat16 and final.dtype == torch.float32
    want, want_final = rg_lru(*half, lam.float(), initial_state=h0.float(), cu_seqlens=cu, output_final_state=True,
                              backend="reference")
    check_close(out.float(), want.float(), torch.bfloat16, what="output")
    check_close(final, want_final, torch.float32, what="final state")


def test_backend_choice(monkeypatch):
    """auto: fla on CUDA with fla, fp64 and no-fla on the torch backend; kernel: fla or a clear error."""
    calls = fakes.install(monkeypatch)
    cu, (x, gx, ga, lam, _) = _inputs([3, 4])
    rg_lru(x, gx, ga, lam, cu_seqlens=cu)                                        # fp64: the exact torch backend
    assert calls == []
    with pytest.raises(ValueError, match="cannot do dtype torch.float64"):
        rg_lru(x, gx, ga, lam, cu_seqlens=cu, backend="kernel")
    f32 = [t.float() for t in (x, gx, ga, lam)]
    rg_lru(*f32, cu_seqlens=cu, backend="reference")
    assert calls == []
    rg_lru(*f32, cu_seqlens=cu)
    assert [kind for kind, _ in calls] == ["hgrn"]
    fakes.install(monkeypatch, supported=False, calls=calls)
    rg_lru(*f32, cu_seqlens=cu)
    assert len(calls) == 1                                                        # no fla: the torch backend
    with pytest.raises(RuntimeError, match="rg_lru: backend='kernel' is unavailable: fla_hgrn is not installed"):
        rg_lru(*f32, cu_seqlens=cu, backend="kernel")


def test_cpu_never_asks_for_fla(monkeypatch):
    """On CPU (no interpreter switch) auto is the torch backend without reading any package state."""
    monkeypatch.setattr(dispatch, "cached_support", lambda *a: pytest.fail("CPU call read the support table"))
    x = torch.randn(1, 5, D)
    out, _ = rg_lru(x, x, x, torch.randn(D), cu_seqlens=lengths_to_cu_seqlens([2, 3]))
    with pytest.raises(ValueError, match="backend='kernel' needs CUDA tensors"):
        rg_lru(x, x, x, torch.randn(D), backend="kernel")


def test_no_tokens_call_no_kernel(fake_cuda):
    h0 = torch.randn(2, D, dtype=torch.float64)
    x = torch.zeros(1, 0, D, dtype=torch.float64)
    out, final = rg_lru(x, x, x, torch.randn(D, dtype=torch.float64), initial_state=h0, output_final_state=True,
                        cu_seqlens=torch.tensor([0, 0, 0]))
    assert fake_cuda == [] and out.shape == (1, 0, D) and torch.equal(final, h0)


def test_kernel_layer_needs_the_scan_kernel(monkeypatch):
    """RGLRUMixer(backend='kernel') checks both parts of its plan, the recurrence's included."""
    monkeypatch.setattr(dispatch, "cached_support", lambda kernel, features=(): (
        (False, "flash-linear-attention is not installed") if kernel == "fla_hgrn" else (True, None)))
    with pytest.raises(RuntimeError, match="RG-LRU scan cannot run on fla_hgrn: flash-linear-attention is not"):
        RGLRUMixer(16, backend="kernel")


def test_layer_on_the_kernel_route_matches_its_spec_and_caches(fake_cuda):
    """RGLRUMixer in auto on the (fake) kernel: a packed row == its spec per document (fp64), every
    parameter's gradient == the torch backend's; a cached prefill then a continuing chunk == the whole."""
    from ssm_pack import PackedSeqParams
    from tests.mixers.layers.test_rg_lru import HIDDEN, _mixer, naive_rg_lru_block
    mixer, reference = _mixer(), _mixer()
    mixer.backend = "auto"
    lengths = [5, 0, 1, 9]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, sum(lengths), HIDDEN, generator=g, dtype=torch.float64)
    params = PackedSeqParams.from_lengths(lengths)
    out = mixer(x, params)
    assert len(fakes.of_kind(fake_cuda, "hgrn")) == 1
    with torch.no_grad():
        bounds = lengths_to_cu_seqlens(lengths).tolist()
        for (s, e) in zip(bounds[:-1], bounds[1:]):
            check_close(out[0, s:e], naive_rg_lru_block(mixer, x[0, s:e]), torch.float64, what=f"tokens {s}:{e}")
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((out * w).sum(), list(mixer.parameters()))
    want = torch.autograd.grad((reference(x, params) * w).sum(), list(reference.parameters()))
    for (name, _), a, b in zip(mixer.named_parameters(), got, want):
        check_close(a, b, torch.float64, grad=True, what=f"d{name}")
    seqs = [torch.randn(n, HIDDEN, generator=g, dtype=torch.float64) for n in (7, 4)]
    cache = mixer.allocate_inference_cache(2, 16)
    with torch.no_grad():
        a = mixer(torch.cat([seqs[0][:3], seqs[1][:2]])[None], PackedSeqParams.from_lengths([3, 2]), cache=cache,
                  cache_slots=[0, 1])[0]
        b = mixer(torch.cat([seqs[0][3:], seqs[1][2:]])[None], PackedSeqParams.from_lengths([4, 2]), cache=cache,
                  cache_slots=[0, 1])[0]
        whole = [reference(s[None])[0] for s in seqs]
    assert len(fakes.of_kind(fake_cuda, "hgrn")) >= 3
    check_close(torch.cat([a[:3], b[:4]]), whole[0], torch.float64, what="continuing chunk, sequence 0")
    check_close(torch.cat([a[3:], b[4:]]), whole[1], torch.float64, what="continuing chunk, sequence 1")
