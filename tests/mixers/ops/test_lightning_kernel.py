"""chunk_simple_gla's fla route (fla's ``chunk_simple_gla``) on the strict fake: the backend choice, what fla
is handed (int64 boundaries covering T, empty documents last, one fp32 state per segment, an fp32
``g_gamma [H]``, the scale), and packed == each document alone: output, per-document final states and
every gradient.

The fake takes what fla takes (fp32 / fp16 / bf16), so the leaves here are fp32; it computes with the spec
in fp64 and rounds to fp32 as fla returns, and the oracle runs the spec in fp64 on each document alone
from the same fp32 values: they agree to fp32 rounding (``TOL``), far below any misplaced token or state.
"""

import pytest
import torch

from mixers.ops import chunk_simple_gla, dispatch
from mixers.ops.lightning.naive import simple_gla_naive
from ssm_pack import lengths_to_cu_seqlens
from tests.support import fakes
from tests.support.fakes import of_kind

H, K, V = 3, 4, 6
TOL = 4e-6          # relative to the largest value compared: fp32 rounding of fp64 arithmetic

CASES = [
    pytest.param([1], 0, id="one-token"),
    pytest.param([2, 1], 0, id="two-then-one"),
    pytest.param([0, 0, 5, 0], 0, id="empty-documents"),
    pytest.param([0, 7, 1, 0, 0, 3, 0], 2, id="empties-between-with-tail"),
    pytest.param([63, 1, 65, 2], 3, id="across-fla-chunks"),
    pytest.param([1, 2, 3] * 5, 1, id="many-tiny"),
]


@pytest.fixture
def fake_fla(monkeypatch):
    """CUDA pretended, every kernel installed (its fake); the recorded calls."""
    return fakes.install(monkeypatch)


def make(lengths, tail=0, *, rows=1, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    cu = lengths_to_cu_seqlens(lengths)
    total = int(cu[-1]) + tail
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(dtype).requires_grad_()  # noqa: E731
    leaves = {"q": rnd(rows, total, H, K), "k": rnd(rows, total, H, K), "v": rnd(rows, total, H, V),
              "initial_state": rnd(len(lengths) if rows == 1 else rows, H, K, V)}
    g_gamma = -torch.rand(H, generator=g) * 0.5 - 0.01           # a buffer, as MiniMax's slopes
    return cu, leaves, g_gamma


def loss_of(o, final, seed=1):
    g = torch.Generator().manual_seed(seed)
    loss = (o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64)).sum()
    if final is not None:
        loss = loss + (final.double() * torch.randn(final.shape, generator=g, dtype=torch.float64)).sum()
    return loss


def assert_close(got, want, what):
    if not want.numel():
        return
    got, want = got.detach().double(), want.detach().double()
    err = float((got - want).abs().max())
    size = max(1.0, float(want.abs().max()))
    assert err <= TOL * size, f"{what}: {err:.3e} (scale {size:.1f})"


def alone(leaves, g_gamma, cu, tail, scale):
    """The oracle: the spec in fp64 on each document by itself, from its own initial state; the padding
    tail from zeros. ``(o [1, T, H, V], final [N, H, K, V])`` built from the leaves (differentiable)."""
    q, k, v, s0 = (t.double() for t in leaves.values())
    gg, pieces, finals = g_gamma.double(), [], []
    bounds = cu.tolist()
    for n, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        o_n, f_n = simple_gla_naive(q[:, s:e], k[:, s:e], v[:, s:e], gg, scale=scale, initial_state=s0[n:n + 1],
                                    output_final_state=True)
        pieces.append(o_n)
        finals.append(f_n[0])
    if tail:
        end = bounds[-1]
        pieces.append(simple_gla_naive(q[:, end:], k[:, end:], v[:, end:], gg, scale=scale)[0])
    return torch.cat(pieces, 1), torch.stack(finals)


@pytest.mark.parametrize("lengths, tail", CASES)
def test_fla_route_packed_equals_each_document_alone(fake_fla, lengths, tail):
    """The default call on CUDA takes fla's kernel; its output, per-document final states and the gradients
    of q, k, v and the initial states equal each document run alone."""
    cu, leaves, g_gamma = make(lengths, tail)
    o, final = chunk_simple_gla(leaves["q"], leaves["k"], leaves["v"], g_gamma=g_gamma, scale=0.7,
                                initial_state=leaves["initial_state"], output_final_state=True, cu_seqlens=cu)
    assert len(of_kind(fake_fla, "simple_gla")) == 1 and of_kind(fake_fla, "ssd") == []
    assert o.dtype == torch.float32 and final.dtype == torch.float32 and final.shape == (len(lengths), H, K, V)
    o_ref, f_ref = alone(leaves, g_gamma, cu, tail, 0.7)
    assert_close(o, o_ref, "output")
    assert_close(final, f_ref, "final states")
    got = torch.autograd.grad(loss_of(o, final), list(leaves.values()))
    want = torch.autograd.grad(loss_of(o_ref, f_ref), list(leaves.values()))
    for name, a, b in zip(leaves, got, want):
        assert_close(a, b, f"grad {name}")
    for n, length in enumerate(lengths):
        if length == 0:            # an empty document's final state is its own initial state, bit for bit
            assert torch.equal(final[n], leaves["initial_state"][n])
    if sum(1 for n in lengths if n) > 1:
        leaked, _ = chunk_simple_gla(leaves["q"], leaves["k"], leaves["v"], g_gamma=g_gamma, scale=0.7)
        assert (leaked - o).abs().max() > 1e-3, "without cu_seqlens the row must differ (negative control)"


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")])
def test_fla_is_handed_its_contract(fake_fla, dtype):
    """int64 boundaries (a tensor on q's device) covering T, every empty document after the others and the
    tail a segment of its own; one fp32 initial state per segment in that order (the tail's zeros); the
    decay as fp32 ``[H]``; the resolved scale. The output comes back in the inputs' dtype, the states in fp32."""
    lengths, tail = [0, 4, 0, 3, 0], 2
    cu, leaves, g_gamma = make(lengths, tail, dtype=dtype)
    s0 = leaves["initial_state"]
    o, final = chunk_simple_gla(leaves["q"], leaves["k"], leaves["v"], g_gamma=g_gamma.to(dtype), initial_state=s0,
                                output_final_state=True, cu_seqlens=cu)
    assert o.dtype == dtype and final.dtype == torch.float32        # fla's fp32 states, the decode step's dtype
    given, = of_kind(fake_fla, "simple_gla")
    bounds = given["cu_seqlens"]
    assert isinstance(bounds, torch.Tensor) and bounds.dtype == torch.int64 and bounds.device == leaves["q"].device
    assert bounds.tolist() == [0, 4, 7, 9, 9, 9, 9]            # docs 1, 3, the tail; then the empties 0, 2, 4
    init = given["initial_state"]
    assert init.dtype == torch.float32 and init.shape == (len(lengths) + 1, H, K, V)
    for j, source in enumerate([1, 3, None, 0, 2, 4]):
        if source is None:
            assert not init[j].any(), "the padding tail starts from zeros"
        else:
            assert torch.equal(init[j], s0[source].float()), f"segment {j} must get document {source}'s state"
    assert given["g_gamma"].dtype == torch.float32 and given["g_gamma"].shape == (H,)
    assert torch.equal(given["g_gamma"], g_gamma.to(dtype).float())
    assert given["scale"] == K ** -0.5


def test_rows_without_cu_seqlens(fake_fla):
    """Unpacked rows: per-row initial states ``[B, H, K, V]`` straight through, no boundaries."""
    _, leaves, g_gamma = make([9], rows=3, seed=4)
    o, final = chunk_simple_gla(leaves["q"], leaves["k"], leaves["v"], g_gamma=g_gamma, scale=1.0,
                                initial_state=leaves["initial_state"], output_final_state=True)
    given, = of_kind(fake_fla, "simple_gla")
    assert given["cu_seqlens"] is None and given["initial_state"].shape == (3, H, K, V)
    o_ref, f_ref = simple_gla_naive(*(leaves[n].double() for n in ("q", "k", "v")), g_gamma.double(), scale=1.0,
                                    initial_state=leaves["initial_state"].double(), output_final_state=True)
    assert_close(o, o_ref, "output")
    assert_close(final, f_ref, "final states")


@pytest.mark.parametrize("why, change", [
    pytest.param("dtype torch.float64", dict(dtype=torch.float64), id="fp64"),
    pytest.param("odd head dims", dict(dtype=torch.bfloat16, odd=True), id="bf16-odd-value-dim"),
    pytest.param("a gradient for g_gamma", dict(decay_grad=True), id="trained-decay"),
])
def test_what_fla_cannot_do_takes_the_ssd_route(monkeypatch, fake_fla, why, change):
    """``"auto"`` takes the SSD op (mamba-ssm's scan, faked here) where fla cannot; ``"kernel"`` with
    mamba-ssm missing too names fla's reason."""
    dtype = change.get("dtype", torch.float32)
    g = torch.Generator().manual_seed(2)
    q, k = (torch.randn(1, 7, H, K, generator=g).to(dtype) for _ in range(2))
    v = torch.randn(1, 7, H, V + change.get("odd", 0), generator=g).to(dtype)
    g_gamma = (-torch.rand(H, generator=g)).to(dtype).requires_grad_(change.get("decay_grad", False))
    cu = lengths_to_cu_seqlens([3, 4])
    if dtype == torch.float64:          # no kernel takes fp64: auto is the SSD op's torch scan
        chunk_simple_gla(q, k, v, g_gamma=g_gamma, cu_seqlens=cu)
        assert fake_fla == []
    else:
        chunk_simple_gla(q, k, v, g_gamma=g_gamma, cu_seqlens=cu)
        assert [kind for kind, _ in fake_fla] == ["ssd"]
    monkeypatch.setattr(dispatch, "cached_support", lambda name, features=(): (False, f"{name} is not installed"))
    with pytest.raises((RuntimeError, ValueError), match=f"fla's chunk_simple_gla cannot do {why}.*"
                                                         "mamba-ssm's SSD scan: mamba_ssd is not installed"):
        chunk_simple_gla(q, k, v, g_gamma=g_gamma, cu_seqlens=cu, backend="kernel")


def test_auto_without_fla_is_the_ssd_route_and_kernel_names_both(monkeypatch, fake_fla):
    """fla missing: ``"auto"`` runs the SSD op (its mamba-ssm kernel here); with mamba-ssm missing as well,
    the SSD op's torch scan; ``"kernel"`` then raises naming both packages."""
    missing = {"fla_simple_gla"}
    monkeypatch.setattr(dispatch, "cached_support", lambda name, features=(): (
        (False, f"{name} is not installed") if name in missing else (True, None)))
    cu, leaves, g_gamma = make([3, 0, 5])
    args = (leaves["q"], leaves["k"], leaves["v"])
    chunk_simple_gla(*args, g_gamma=g_gamma, cu_seqlens=cu)
    assert [kind for kind, _ in fake_fla] == ["ssd"]
    missing.add("mamba_ssd")
    o, _ = chunk_simple_gla(*args, g_gamma=g_gamma, initial_state=leaves["initial_state"], cu_seqlens=cu)
    assert len(fake_fla) == 1
    assert_close(o, alone(leaves, g_gamma, cu, 0, K ** -0.5)[0], "output")
    with pytest.raises(RuntimeError, match="fla_simple_gla is not installed.*mamba_ssd is not installed"):
        chunk_simple_gla(*args, g_gamma=g_gamma, cu_seqlens=cu, backend="kernel")


def test_reference_never_asks_for_a_kernel(fake_fla):
    cu, leaves, g_gamma = make([2, 5])
    chunk_simple_gla(leaves["q"], leaves["k"], leaves["v"], g_gamma=g_gamma, cu_seqlens=cu, backend="reference")
    assert fake_fla == []


def test_cpu_auto_reads_no_package_and_kernel_needs_cuda(monkeypatch):
    """On CPU the default call is the SSD op's torch scan without asking which packages exist, so CPU
    results and speed are unchanged; ``"kernel"`` on CPU tensors is refused, naming the fix."""
    monkeypatch.setattr(dispatch, "cached_support", lambda *a, **k: pytest.fail("a CPU call read package state"))
    cu, leaves, g_gamma = make([4, 1])
    args = (leaves["q"], leaves["k"], leaves["v"])
    o, _ = chunk_simple_gla(*args, g_gamma=g_gamma, cu_seqlens=cu)
    assert torch.equal(o, chunk_simple_gla(*args, g_gamma=g_gamma, cu_seqlens=cu, backend="reference")[0])
    with pytest.raises(ValueError, match="^chunk_simple_gla: backend='kernel' needs CUDA tensors; use "
                                         "backend='reference' on CPU$"):
        chunk_simple_gla(*args, g_gamma=g_gamma, cu_seqlens=cu, backend="kernel")


@pytest.mark.parametrize("lengths", [pytest.param([0], id="one-empty-document"),
                                     pytest.param([0, 0, 0], id="three-empty-documents")])
def test_the_empty_call_launches_no_kernel(fake_fla, lengths):
    """No token (T == 0) on CUDA: the SSD op's empty result, no kernel launched (a grid with a zero
    dimension); every final state is its document's initial state, bit for bit."""
    cu, leaves, g_gamma = make(lengths)
    o, final = chunk_simple_gla(leaves["q"], leaves["k"], leaves["v"], g_gamma=g_gamma,
                                initial_state=leaves["initial_state"], output_final_state=True, cu_seqlens=cu)
    assert fake_fla == []
    assert o.shape == (1, 0, H, V) and o.dtype == torch.float32
    assert torch.equal(final, leaves["initial_state"])


def test_fla_without_packed_documents_still_runs_unpacked_rows(monkeypatch, fake_fla):
    """The support check asks for fla's ``varlen`` feature only when the call is packed: an fla that cannot
    take ``cu_seqlens`` runs unpacked rows, while a packed call takes the SSD op (``"kernel"`` names why)."""
    too_old = "flash-linear-attention is too old for packed documents"
    asked = []

    def support(name, features=()):
        asked.append((name, tuple(features)))
        return (False, too_old) if name == "fla_simple_gla" and "varlen" in features else (True, None)

    monkeypatch.setattr(dispatch, "cached_support", support)
    cu, leaves, g_gamma = make([3, 4])
    args = [t.detach() for t in (leaves["q"], leaves["k"], leaves["v"])]
    chunk_simple_gla(*args, g_gamma=g_gamma)
    assert [kind for kind, _ in fake_fla] == ["simple_gla"] and asked == [("fla_simple_gla", ())]
    chunk_simple_gla(*args, g_gamma=g_gamma, cu_seqlens=cu)
    assert [kind for kind, _ in fake_fla] == ["simple_gla", "ssd"]
    assert asked[1] == ("fla_simple_gla", ("varlen",))          # then the SSD op asks for mamba-ssm
    monkeypatch.setattr(dispatch, "cached_support", lambda name, features=(): (
        (False, "mamba_ssd is not installed") if name == "mamba_ssd" else support(name, features)))
    with pytest.raises(RuntimeError, match=f"fla's chunk_simple_gla: {too_old}; "
                                           "mamba-ssm's SSD scan: mamba_ssd is not installed"):
        chunk_simple_gla(*args, g_gamma=g_gamma, cu_seqlens=cu, backend="kernel")


def test_context_parallel_calls_are_the_ssd_ops_on_cuda(monkeypatch, fake_fla):
    """A ``VarlenBatch`` carrying a CP run goes to the SSD op (whose CP version is stubbed here: it needs
    several ranks), never to fla's kernel, on CUDA with fla installed and without asking any package."""
    import dataclasses

    from mixers.ops.ssd import cp as ssd_cp_module
    from ssm_pack import VarlenBatch
    monkeypatch.setattr(dispatch, "cached_support", lambda *a, **k: pytest.fail("a CP call read package state"))
    seen = []
    monkeypatch.setattr(ssd_cp_module, "ssd_cp", lambda call, local_op: seen.append(call) or torch.zeros_like(call.x))
    run = object()
    _, leaves, g_gamma = make([3, 4])
    varlen = dataclasses.replace(VarlenBatch.build(lengths_to_cu_seqlens([3, 4]), 7), cp=run)
    o, _ = chunk_simple_gla(leaves["q"], leaves["k"], leaves["v"], g_gamma=g_gamma, cu_seqlens=varlen)
    assert fake_fla == []
    assert len(seen) == 1 and seen[0].varlen.cp is run and o.shape == (1, 7, H, V)


def test_the_fake_has_the_installed_fla_signature():
    """The fake's parameters (names, order, defaults) are those of the installed fla's chunk_simple_gla, so a
    positional argument the wrapper passed would land where fla puts it."""
    import inspect
    simple_gla = pytest.importorskip("fla.ops.simple_gla", reason="flash-linear-attention is not installed")
    shape = lambda f: [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]  # noqa: E731
    assert shape(fakes.fake_simple_gla([])) == shape(simple_gla.chunk_simple_gla)
