"""selective_scan_fn (Mamba-1's selective scan): a packed row equals each document run alone, outputs,
per-document final states and every gradient (fp64); the torch backend equals the spec
(``naive.py``); dropping the metadata leaks (negative control); the decode step continues a
prefill exactly; bad input is refused before anything runs.

The per-document oracle below is the op itself on one unpacked row per document (no ``cu_seqlens``),
and its own tiny loop (:func:`step_oracle`), written here: neither shares the packed path's resets.
"""

import pytest
import torch
import torch.nn.functional as F

from mixers.ops import selective_scan_fn, selective_scan_update
from mixers.ops.selective_scan.naive import selective_scan_naive

E, NS = 5, 3
F64 = torch.float64


def step_oracle(u, dt, A, B, C, D, z, h):
    """One document, token by token: u, dt, z ``[E, T]`` (dt already softplus-ed), B, C ``[Ns, T]``."""
    ys = []
    for t in range(u.shape[1]):
        h = torch.exp(dt[:, t, None] * A) * h + dt[:, t, None] * u[:, t, None] * B[None, :, t]
        ys.append((h * C[None, :, t]).sum(-1) + D * u[:, t])
    y = torch.stack(ys, -1) if ys else u[:, :0]
    return y * F.silu(z), h


def _err(a, b) -> float:
    return float((a - b).detach().abs().max()) if a.numel() else 0.0


def _inputs(total, docs, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=F64)  # noqa: E731
    return dict(u=r(1, E, total), delta=r(1, E, total) * scale, A=-torch.rand(E, NS, generator=g, dtype=F64) * 4,
                B=r(1, NS, total), C=r(1, NS, total), D=r(E), z=r(1, E, total), delta_bias=r(E),
                h0=r(docs, E, NS))


CASES = [
    pytest.param([1, 2, 3, 7], 4, 0, id="1-2-odd-7-chunk4"),
    pytest.param([0, 5, 0, 1, 9, 0], 4, 0, id="empty-docs"),
    pytest.param([3, 8, 9, 16, 1], 8, 3, id="chunk-boundaries-tail"),
    pytest.param([1, 2, 1, 3] * 6, 8, 0, id="many-tiny"),
    pytest.param([40], 64, 0, id="one-doc-one-chunk"),
]


def _leaves(inp):
    return {k: v.clone().requires_grad_(True) for k, v in inp.items()}


@pytest.mark.parametrize(("lengths", "chunk", "tail"), CASES)
def test_packed_equals_each_document_alone(lengths, chunk, tail):
    total = sum(lengths) + tail
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    inp = _inputs(total, len(lengths))
    p = _leaves(inp)
    out, last, states = selective_scan_fn(p["u"], p["delta"], p["A"], p["B"], p["C"], p["D"], p["z"], p["delta_bias"],
                                          True, True, initial_states=p["h0"], cu_seqlens=cu,
                                          return_varlen_states=True, chunk_size=chunk)
    g = torch.Generator().manual_seed(9)
    w_out, w_st = torch.randn(out.shape, generator=g, dtype=F64), torch.randn(states.shape, generator=g, dtype=F64)
    loss = (out[..., :cu[-1]] * w_out[..., :cu[-1]]).sum() + (states * w_st).sum()
    q = _leaves(inp)
    ref_out, ref_states = [], []
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        sl = slice(s, e)
        o, h = selective_scan_fn(q["u"][..., sl], q["delta"][..., sl], q["A"], q["B"][..., sl], q["C"][..., sl], q["D"],
                                 q["z"][..., sl], q["delta_bias"], True, True, initial_states=q["h0"][i:i + 1],
                                 chunk_size=chunk)
        dt = F.softplus(q["delta"][0, :, sl] + q["delta_bias"][:, None])
        o2, h2 = step_oracle(q["u"][0, :, sl], dt, q["A"], q["B"][0, :, sl], q["C"][0, :, sl], q["D"],
                             q["z"][0, :, sl], q["h0"][i])
        assert _err(o[0], o2) <= 1e-12 and float((h[0] - h2).abs().max()) <= 1e-12
        ref_out.append(o)
        ref_states.append(h[0])
    want_out, want_states = torch.cat(ref_out, -1), torch.stack(ref_states)
    assert _err(out[..., :cu[-1]], want_out) <= 1e-12
    assert float((states - want_states).abs().max()) <= 1e-12
    ref_loss = (want_out * w_out[..., :cu[-1]]).sum() + (want_states * w_st).sum()
    grads = torch.autograd.grad(loss, list(p.values()))
    ref_grads = torch.autograd.grad(ref_loss, list(q.values()))
    for name, a, b in zip(p, grads, ref_grads):
        assert float((a - b).abs().max()) <= 1e-12, name


@pytest.mark.parametrize(("lengths", "tail"), [
    pytest.param([0, 5, 0, 1, 9, 0], 0, id="empty-docs"),
    pytest.param([4, 0, 7], 3, id="empty-middle-tail"),
])
def test_document_states_without_initial_states(lengths, tail):
    """``initial_states`` left out: every document starts from zero, so an empty document's state is
    zeros and every other one's is the state after its own tokens (the step oracle from zero)."""
    total = sum(lengths) + tail
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    inp = _inputs(total, len(lengths))
    out, states = selective_scan_fn(inp["u"], inp["delta"], inp["A"], inp["B"], inp["C"], inp["D"], inp["z"],
                                    inp["delta_bias"], True, cu_seqlens=cu, return_varlen_states=True)
    assert states.shape == (len(lengths), E, NS), f"one state per document, got {list(states.shape)}"
    dt, zero = F.softplus(inp["delta"][0] + inp["delta_bias"][:, None]), torch.zeros(E, NS, dtype=F64)
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        sl = slice(s, e)
        want_out, want_state = step_oracle(inp["u"][0, :, sl], dt[:, sl], inp["A"], inp["B"][0, :, sl],
                                           inp["C"][0, :, sl], inp["D"], inp["z"][0, :, sl], zero)
        assert _err(out[0, :, sl], want_out) <= 1e-12, f"document {i} ({e - s} tokens): outputs differ"
        assert _err(states[i], want_state) <= 1e-12, f"document {i} ({e - s} tokens): state differs"


@pytest.mark.parametrize(("lengths", "chunk", "tail"), CASES)
def test_backend_equals_the_spec(lengths, chunk, tail):
    total = sum(lengths) + tail
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    inp = _inputs(total, len(lengths), seed=1)
    args = lambda p: (p["u"], p["delta"], p["A"], p["B"], p["C"], p["D"], p["z"], p["delta_bias"], True, True)  # noqa: E731
    p, q = _leaves(inp), _leaves(inp)
    got = selective_scan_fn(*args(p), initial_states=p["h0"], cu_seqlens=cu, return_varlen_states=True,
                            chunk_size=chunk)
    want = selective_scan_naive(*args(q), initial_states=q["h0"], cu_seqlens=cu, return_varlen_states=True)
    for a, b in zip(got, want):
        assert _err(a, b) <= 1e-12
    ws = [torch.randn_like(a) for a in got]
    ga = torch.autograd.grad(sum((a * w).sum() for a, w in zip(got, ws)), list(p.values()))
    gb = torch.autograd.grad(sum((a * w).sum() for a, w in zip(want, ws)), list(q.values()))
    for name, a, b in zip(p, ga, gb):
        assert float((a - b).abs().max()) <= 1e-12, name


@pytest.mark.parametrize("run", [pytest.param(selective_scan_fn, id="backend"),
                                 pytest.param(selective_scan_naive, id="spec")])
def test_without_softplus_delta_is_the_step_as_given(run):
    """``delta_softplus=False``: ``delta + delta_bias`` is the step size itself (the caller applied
    any softplus), as in the token-by-token oracle."""
    inp = _inputs(9, 1, seed=3)
    delta = inp["delta"].abs()                       # positive steps, as a caller's own softplus leaves them
    out, last = run(inp["u"], delta, inp["A"], inp["B"], inp["C"], inp["D"], inp["z"], inp["delta_bias"].abs(),
                    False, True)
    want, want_last = step_oracle(inp["u"][0], delta[0] + inp["delta_bias"].abs()[:, None], inp["A"], inp["B"][0],
                                  inp["C"][0], inp["D"], inp["z"][0], torch.zeros(E, NS, dtype=F64))
    assert _err(out[0], want) <= 1e-12 and _err(last[0], want_last) <= 1e-12


@pytest.mark.parametrize("run", [pytest.param(selective_scan_fn, id="backend"),
                                 pytest.param(selective_scan_naive, id="spec")])
def test_tokens_but_no_document_give_no_document_state(run):
    """``cu_seqlens = [0]``: every token is the tail after the last (absent) document, run from zeros;
    the document states are ``[0, E, Ns]``."""
    inp = _inputs(6, 0, seed=4)
    cu = torch.tensor([0], dtype=torch.int32)
    out, states = run(inp["u"], inp["delta"], inp["A"], inp["B"], inp["C"], inp["D"], inp["z"], inp["delta_bias"],
                      True, cu_seqlens=cu, return_varlen_states=True)
    dt = F.softplus(inp["delta"][0] + inp["delta_bias"][:, None])
    want, _ = step_oracle(inp["u"][0], dt, inp["A"], inp["B"][0], inp["C"][0], inp["D"], inp["z"][0],
                          torch.zeros(E, NS, dtype=F64))
    assert states.shape == (0, E, NS) and _err(out[0], want) <= 1e-12


def test_rows_without_cu_seqlens_are_each_one_document():
    inp = _inputs(11, 1)
    u, d, B, C, z = (torch.cat([inp[k], inp[k].flip(-1)]) for k in ("u", "delta", "B", "C", "z"))
    h0 = torch.cat([inp["h0"], -inp["h0"]])
    got, last = selective_scan_fn(u, d, inp["A"], B, C, inp["D"], z, inp["delta_bias"], True, True, initial_states=h0,
                                  chunk_size=4)
    want, want_last = selective_scan_naive(u, d, inp["A"], B, C, inp["D"], z, inp["delta_bias"], True, True,
                                           initial_states=h0)
    assert float((got - want).abs().max()) <= 1e-12 and float((last - want_last).abs().max()) <= 1e-12


def test_without_the_metadata_the_documents_leak():
    """Negative control: the same row without cu_seqlens differs from the per-document result."""
    inp = _inputs(12, 2)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    args = (inp["u"], inp["delta"], inp["A"], inp["B"], inp["C"], inp["D"], inp["z"], inp["delta_bias"], True)
    packed = selective_scan_fn(*args, cu_seqlens=cu, chunk_size=4)
    second = selective_scan_fn(*(a[..., 5:] if a.dim() == 3 else a for a in args[:-1]), True, chunk_size=4)
    assert float((packed[..., 5:] - second).abs().max()) <= 1e-12
    assert float((selective_scan_fn(*args, chunk_size=4)[..., 5:] - second).abs().max()) > 1e-6


def test_large_steps_stay_finite():
    """A step size of 1e4 (decay exp(-4e4) underflows to 0): no inf / NaN from the chunked scan."""
    inp = _inputs(20, 1, scale=1e4)
    out = selective_scan_fn(inp["u"], inp["delta"], inp["A"], inp["B"], inp["C"], inp["D"], inp["z"],
                            delta_softplus=True, chunk_size=8)
    want = selective_scan_naive(inp["u"], inp["delta"], inp["A"], inp["B"], inp["C"], inp["D"], inp["z"],
                                delta_softplus=True)
    assert torch.isfinite(out).all() and float((out - want).abs().max() / want.abs().max()) <= 1e-12


def test_decode_step_continues_a_prefill():
    """Prefill 6 tokens per row, then 3 steps of selective_scan_update (slots 2 and 0 of a pool of 3)
    == the scan over all 9 tokens."""
    inp = _inputs(9, 1)
    u, d, B, C, z = (torch.cat([inp[k], -inp[k]]) for k in ("u", "delta", "B", "C", "z"))
    A, D, bias = inp["A"], inp["D"], inp["delta_bias"]
    full = selective_scan_fn(u, d, A, B, C, D, z, bias, True)
    _, last = selective_scan_fn(u[..., :6], d[..., :6], A, B[..., :6], C[..., :6], D, z[..., :6], bias, True, True)
    pool = torch.zeros(3, E, NS, dtype=F64)
    slots = torch.tensor([2, 0])
    pool[slots] = last
    for t in range(6, 9):
        y = selective_scan_update(pool, u[..., t], d[..., t], A, B[..., t], C[..., t], D, z[..., t], bias, True,
                                  state_batch_indices=slots)
        assert float((y - full[..., t]).abs().max()) <= 1e-12, t
    assert pool[1].abs().max() == 0


@pytest.mark.parametrize(("change", "error", "match"), [
    pytest.param({"A": torch.zeros(E, NS, 1)}, ValueError, "A must be 2-D", id="A-3d"),
    pytest.param({"A": torch.zeros(E)}, ValueError, r"^A must be 2-D, got shape \(5,\)$", id="A-1d"),
    pytest.param({"A": None}, TypeError, "^A must be a torch.Tensor, got NoneType None$", id="A-none"),
    pytest.param({"B": torch.zeros(1, NS, 7)}, ValueError, r"B must be \[B, N_state, T\] = \[1, 3, 8\]", id="B-len"),
    pytest.param({"B": torch.zeros(1, 1, NS, 8)}, ValueError, "one group", id="B-grouped"),
    pytest.param({"u": torch.zeros(1, E, 8, dtype=torch.int64)}, TypeError, "u must be a floating-point", id="u-int"),
    pytest.param({"cu_seqlens": torch.tensor([0, 3, 9], dtype=torch.int32)}, ValueError, "cu_seqlens", id="cu-long"),
    pytest.param({"initial_states": torch.zeros(3, E, NS)}, ValueError, r"initial_states must be \[N, E, N_state\]",
                 id="h0-rows"),
    pytest.param({"return_varlen_states": True, "cu_seqlens": None}, ValueError, "needs cu_seqlens", id="varlen-no-cu"),
    pytest.param({"chunk_size": 0}, ValueError, "chunk_size must be >= 1", id="chunk-0"),
    pytest.param({"backend": "kernel"}, ValueError, "no seq_idx / cu_seqlens", id="kernel"),
    pytest.param({"backend": "fast"}, ValueError, "backend must be one of", id="backend-name"),
])
def test_bad_input_is_refused(change, error, match):
    kw = dict(u=torch.zeros(1, E, 8), delta=torch.zeros(1, E, 8), A=torch.zeros(E, NS), B=torch.zeros(1, NS, 8),
              C=torch.zeros(1, NS, 8), cu_seqlens=torch.tensor([0, 3, 8], dtype=torch.int32))
    kw.update(change)
    with pytest.raises(error, match=match):
        selective_scan_fn(**kw)


def test_no_token_passes_the_states_through():
    h0 = torch.randn(2, E, NS, dtype=F64)
    out, last, states = selective_scan_fn(torch.zeros(1, E, 0, dtype=F64), torch.zeros(1, E, 0, dtype=F64),
                                          torch.zeros(E, NS, dtype=F64), torch.zeros(1, NS, 0, dtype=F64),
                                          torch.zeros(1, NS, 0, dtype=F64), return_last_state=True,
                                          initial_states=h0, cu_seqlens=torch.tensor([0, 0, 0], dtype=torch.int32),
                                          return_varlen_states=True)
    assert out.shape == (1, E, 0) and torch.equal(states, h0) and last.abs().max() == 0


@pytest.mark.parametrize(("last", "varlen", "want"), [
    pytest.param(False, False, ("out",), id="default-out-only"),
    pytest.param(True, False, ("out", "last"), id="last-state"),
    pytest.param(False, True, ("out", "states"), id="varlen-states"),
    pytest.param(True, True, ("out", "last", "states"), id="both"),
])
def test_no_token_returns_what_was_asked(last, varlen, want):
    """As with tokens: ``out`` alone (a tensor, not a tuple) unless a state is asked for, then
    ``(out, last_state)``, ``(out, doc_states)`` or all three, in that order."""
    h0 = torch.randn(2, E, NS, dtype=F64)
    empty = lambda *s: torch.zeros(*s, 0, dtype=F64)  # noqa: E731
    got = selective_scan_fn(empty(1, E), empty(1, E), torch.zeros(E, NS, dtype=F64), empty(1, NS), empty(1, NS),
                            return_last_state=last, initial_states=h0,
                            cu_seqlens=torch.tensor([0, 0, 0], dtype=torch.int32), return_varlen_states=varlen)
    if want == ("out",):
        assert isinstance(got, torch.Tensor) and got.shape == (1, E, 0)
        return
    assert isinstance(got, tuple) and len(got) == len(want)
    shapes = {"out": (1, E, 0), "last": (1, E, NS), "states": (2, E, NS)}
    assert [tuple(t.shape) for t in got] == [shapes[k] for k in want]
    if varlen:
        assert torch.equal(got[-1], h0)


def test_the_default_chunk_is_64_tokens():
    """docs/ops.md: the backend cuts the row into chunks of 64 tokens. The chunk changes only the
    rounding (the doubling steps combine tokens in another order), so the default call equals
    ``chunk_size=64`` bitwise and a chunk of 63 or 65 does not (negative controls, still within 1e-12)."""
    inp = _inputs(130, 2, seed=4)
    args = (inp["u"], inp["delta"], inp["A"], inp["B"], inp["C"], inp["D"], inp["z"], inp["delta_bias"], True)
    cu = torch.tensor([0, 50, 130], dtype=torch.int32)
    default = selective_scan_fn(*args, cu_seqlens=cu)
    assert torch.equal(default, selective_scan_fn(*args, cu_seqlens=cu, chunk_size=64))
    for other in (63, 65):
        got = selective_scan_fn(*args, cu_seqlens=cu, chunk_size=other)
        assert not torch.equal(got, default) and _err(got, default) <= 1e-12, other


def _saved_bytes(fn) -> int:
    """Bytes of the storages autograd keeps for the backward of ``fn()`` (each storage once)."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


def test_training_keeps_one_state_per_chunk_not_per_token():
    """Counted, not timed: the states kept between chunks must not hold their chunk's
    ``[L, E, Ns]`` storage (a view would keep every token's state alive)."""
    total, channels, state = 256, 16, 32
    g = torch.Generator().manual_seed(0)
    u, delta, z = (torch.randn(1, channels, total, generator=g, requires_grad=True) for _ in range(3))
    B, C = (torch.randn(1, state, total, generator=g, requires_grad=True) for _ in range(2))
    A = (-torch.rand(channels, state, generator=g) - 0.5).requires_grad_()
    cu = torch.tensor([0, 100, 101, 256], dtype=torch.int32)
    kept = _saved_bytes(lambda: selective_scan_fn(u, delta, A, B, C, None, z, None, True, cu_seqlens=cu,
                                                  chunk_size=64))
    every_state = total * channels * state * 4
    assert kept < every_state / 2, (kept, every_state)       # inputs (5 / Ns of it) and 4 chunk states
