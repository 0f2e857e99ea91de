"""Kernel dispatch on CPU: fake upstream kernels assert upstream's input contract and compute
through the reference. They prove the ops hand upstream exactly what it needs, and that what it
cannot do takes the reference path (or raises when a kernel was demanded)."""

import pytest
import torch

import mixers.ops.causal_conv1d.kernel as conv_kernel
import mixers.ops.causal_conv1d.kernel_fla as fla_conv_kernel
import mixers.ops.ssd.kernel as ssd_kernel
from mixers.ops import causal_conv1d_fn, dispatch, mamba_chunk_scan_combined
from ssm_pack import lengths_to_cu_seqlens
from tests.support import fakes
from tests.support.fakes import of_kind


@pytest.fixture
def fake_cuda(monkeypatch):
    """Pretend the tensors are on CUDA and every support check passes (``features`` recorded)."""
    asked = []

    def support(name, features=()):
        asked.append((name, features))
        return (True, None)

    monkeypatch.setattr(dispatch, "is_cuda", lambda t: True)
    monkeypatch.setattr(dispatch, "cached_support", support)
    return asked


@pytest.fixture
def fake_conv(monkeypatch):
    """causal-conv1d's kernels ("conv", "states") and fla's Triton conv ("fla_conv"), recorded."""
    calls = []
    monkeypatch.setattr(conv_kernel, "load_upstream",
                        lambda: (fakes.fake_conv(calls), fakes.fake_conv_states(calls)))
    monkeypatch.setattr(fla_conv_kernel, "load_upstream", lambda: fakes.fake_fla_conv(calls))
    return calls


def support_without(monkeypatch, missing: dict):
    """Pretend CUDA; the support check of each name in ``missing`` fails with its reason."""
    monkeypatch.setattr(dispatch, "is_cuda", lambda t: True)
    monkeypatch.setattr(dispatch, "cached_support", lambda name, features=(): (
        (False, missing[name]) if name in missing else (True, None)))


def conv_case(dtype=torch.float32, width=4, dim=16):
    g = torch.Generator().manual_seed(0)
    cu = lengths_to_cu_seqlens([3, 0, 9, 1, 12])
    x = torch.randn(1, dim, 25, generator=g).to(dtype)              # channel-first on purpose
    return x, torch.randn(dim, width, generator=g).to(dtype), torch.randn(dim, generator=g).to(dtype), cu


def test_conv_hands_upstream_channel_last_int32_seq_idx(fake_cuda, fake_conv):
    x, w, b, cu = conv_case()
    out = causal_conv1d_fn(x, w, b, activation="silu", cu_seqlens=cu)
    ref = causal_conv1d_fn(x, w, b, activation="silu", cu_seqlens=cu, backend="reference")
    assert len(of_kind(fake_conv, "conv")) == 1 and torch.allclose(out, ref)
    assert of_kind(fake_conv, "conv")[0]["seq_idx"].tolist() == [[0] * 3 + [1] * 9 + [2] + [3] * 12]


def test_conv_final_states_use_varlen_states_without_grad(fake_cuda, fake_conv):
    x, w, b, cu = conv_case()
    with torch.no_grad():
        _, states = causal_conv1d_fn(x, w, b, return_final_states=True, cu_seqlens=cu)
    _, ref = causal_conv1d_fn(x, w, b, return_final_states=True, cu_seqlens=cu, backend="reference")
    assert len(of_kind(fake_conv, "states")) == 1 and torch.equal(states, ref)


@pytest.mark.parametrize("grad", [pytest.param(False, id="no-grad"), pytest.param(True, id="grad")])
def test_conv_final_states_without_upstream_varlen_states(fake_cuda, monkeypatch, grad):
    """A causal-conv1d release without ``causal_conv1d_varlen_states``: the kernel runs the conv and the
    per-document final states (an empty document's: zeros) are gathered from ``x`` as the reference does."""
    calls = []
    monkeypatch.setattr(conv_kernel, "load_upstream", lambda: (fakes.fake_conv(calls), None))
    x, w, b, cu = conv_case()
    x = x.requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        out, states = causal_conv1d_fn(x, w, b, return_final_states=True, cu_seqlens=cu)
    ref_out, ref = causal_conv1d_fn(x, w, b, return_final_states=True, cu_seqlens=cu, backend="reference")
    assert len(of_kind(calls, "conv")) == 1, calls
    assert states is not None and states.shape == ref.shape == (5, 16, 3), "final states must come back"
    assert torch.allclose(out, ref_out) and torch.equal(states, ref)


def test_conv_row_initial_states_need_the_1_7_feature(fake_cuda, fake_conv):
    x, w, b, _ = conv_case()
    init = torch.randn(1, 16, 3)
    causal_conv1d_fn(x, w, b, seq_idx=torch.zeros(1, 25, dtype=torch.int32), initial_states=init)
    assert ("causal_conv1d", ("seq_idx", "initial_states_with_seq_idx")) in fake_cuda
    assert of_kind(fake_conv, "conv")[0]["initial_states"] is not None


@pytest.mark.parametrize("case,why", [
    pytest.param(dict(width=5), "kernel width 5", id="width-5"),
    pytest.param(dict(dim=12), "12 channels", id="dim-not-multiple-of-8"),
])
def test_conv_shapes_causal_conv1d_refuses_run_on_fla(fake_cuda, fake_conv, monkeypatch, case, why):
    x, w, b, cu = conv_case(**case)
    for backend in ("auto", "kernel"):
        out = causal_conv1d_fn(x, w, b, activation="silu", cu_seqlens=cu, backend=backend)
        assert torch.allclose(out, causal_conv1d_fn(x, w, b, activation="silu", cu_seqlens=cu, backend="reference"))
    assert of_kind(fake_conv, "conv") == [] and len(of_kind(fake_conv, "fla_conv")) == 2
    support_without(monkeypatch, {"fla_conv": "flash-linear-attention is not installed"})
    causal_conv1d_fn(x, w, b, cu_seqlens=cu)                   # auto: the reference, silently exact
    assert len(of_kind(fake_conv, "fla_conv")) == 2
    with pytest.raises(RuntimeError, match=f"causal-conv1d cannot do {why}.*flash-linear-attention is not installed"):
        causal_conv1d_fn(x, w, b, cu_seqlens=cu, backend="kernel")


def test_conv_fp64_has_no_kernel(fake_cuda, fake_conv):
    x, w, b, cu = conv_case(dtype=torch.float64)
    causal_conv1d_fn(x, w, b, cu_seqlens=cu)
    assert fake_conv == []
    with pytest.raises(ValueError, match="causal-conv1d cannot do dtype torch.float64.*fla's Triton conv cannot do"):
        causal_conv1d_fn(x, w, b, cu_seqlens=cu, backend="kernel")


def test_conv_per_document_initial_states_run_on_fla(fake_cuda, fake_conv, monkeypatch):
    x, w, b, cu = conv_case()
    init = torch.randn(5, 16, 3)
    out, states = causal_conv1d_fn(x, w, b, initial_states=init, return_final_states=True, cu_seqlens=cu)
    ref, ref_states = causal_conv1d_fn(x, w, b, initial_states=init, return_final_states=True, cu_seqlens=cu,
                                       backend="reference")
    assert of_kind(fake_conv, "conv") == [] and len(of_kind(fake_conv, "fla_conv")) == 1
    given = of_kind(fake_conv, "fla_conv")[0]
    assert given["cu_seqlens"].tolist() == [0, 3, 12, 13, 25]          # the empty document is not passed
    assert torch.equal(given["initial_state"][:, :, 1:], init[[0, 2, 3, 4]])
    assert torch.allclose(out, ref) and torch.equal(states, ref_states)  # states: the empty document's own
    support_without(monkeypatch, {"fla_conv": "flash-linear-attention is not installed"})
    causal_conv1d_fn(x, w, b, initial_states=init, cu_seqlens=cu)
    assert len(of_kind(fake_conv, "fla_conv")) == 1
    with pytest.raises(RuntimeError, match="per-document initial states.*flash-linear-attention is not installed"):
        causal_conv1d_fn(x, w, b, initial_states=init, cu_seqlens=cu, backend="kernel")


def test_conv_padding_needs_no_kernel_feature_and_no_negative_seq_idx(monkeypatch, fake_conv):
    """The kernel never sees a negative seq_idx (its backward would take padding in), so padding asks for
    no kernel feature: a causal-conv1d too old for negative seq_idx runs it, and the output is zeroed."""
    too_old = "causal-conv1d 1.4.0 is too old for negative seq_idx"
    asked = []

    def support(name, features=()):
        asked.append((name, features))
        return (False, too_old) if "padding_seq_idx" in features else (True, None)

    monkeypatch.setattr(dispatch, "is_cuda", lambda t: True)
    monkeypatch.setattr(dispatch, "cached_support", support)
    x, w, b, _ = conv_case()
    seq_idx = torch.tensor([[0] * 10 + [-1] * 5 + [1] * 10], dtype=torch.int32)
    out = causal_conv1d_fn(x, w, b, seq_idx=seq_idx, activation="silu", backend="kernel")
    ref = causal_conv1d_fn(x, w, b, seq_idx=seq_idx, activation="silu", backend="reference")
    assert asked == [("causal_conv1d", ("seq_idx",))] and of_kind(fake_conv, "fla_conv") == []
    assert of_kind(fake_conv, "conv")[0]["seq_idx"].tolist() == [[0] * 10 + [1] * 5 + [2] * 10]
    assert bool((out[..., 10:15] == 0).all()) and torch.allclose(out, ref)


def test_conv_padding_on_fla_is_zeroed(monkeypatch, fake_conv):
    support_without(monkeypatch, {"causal_conv1d": "causal-conv1d is not installed"})
    x, w, b, _ = conv_case()
    seq_idx = torch.tensor([[0] * 10 + [-1] * 5 + [1] * 10], dtype=torch.int32)
    out = causal_conv1d_fn(x, w, b, seq_idx=seq_idx, activation="silu")
    ref = causal_conv1d_fn(x, w, b, seq_idx=seq_idx, activation="silu", backend="reference")
    assert of_kind(fake_conv, "fla_conv")[0]["cu_seqlens"].tolist() == [0, 10, 15, 25]
    assert bool((out[..., 10:15] == 0).all()) and torch.allclose(out, ref)


def test_conv_rows_of_a_batch_are_segments_for_fla(monkeypatch, fake_conv):
    support_without(monkeypatch, {"causal_conv1d": "causal-conv1d is not installed"})
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(2, 16, 9, generator=g), torch.randn(16, 4, generator=g), torch.randn(16, generator=g)
    seq_idx = torch.tensor([[0] * 4 + [1] * 5, [0] * 9], dtype=torch.int32)
    init = torch.randn(2, 16, 3, generator=g)
    out, states = causal_conv1d_fn(x, w, b, seq_idx=seq_idx, initial_states=init, return_final_states=True,
                                   backend="kernel")
    ref, ref_states = causal_conv1d_fn(x, w, b, seq_idx=seq_idx, initial_states=init, return_final_states=True,
                                       backend="reference")
    given = of_kind(fake_conv, "fla_conv")[0]
    assert given["cu_seqlens"].tolist() == [0, 4, 9, 18]                # row starts are boundaries
    assert torch.equal(given["initial_state"][[0, 2], :, 1:], init)      # each row's state: its first segment
    assert bool((given["initial_state"][1] == 0).all())
    assert torch.allclose(out, ref) and torch.equal(states, ref_states)


def test_auto_without_support_is_the_reference(monkeypatch, fake_conv):
    monkeypatch.setattr(dispatch, "is_cuda", lambda t: True)
    monkeypatch.setattr(dispatch, "cached_support",
                        lambda name, features=(): (False, f"{name} is not installed"))
    x, w, b, cu = conv_case()
    causal_conv1d_fn(x, w, b, cu_seqlens=cu)
    assert fake_conv == []
    with pytest.raises(RuntimeError, match="causal_conv1d is not installed.*fla_conv is not installed"):
        causal_conv1d_fn(x, w, b, cu_seqlens=cu, backend="kernel")


@pytest.fixture
def fake_ssd(monkeypatch):
    calls = []
    monkeypatch.setattr(ssd_kernel, "load_upstream", lambda: fakes.fake_ssd(calls))
    return calls


def ssd_case(dtype=torch.float32, grad=False):
    g = torch.Generator().manual_seed(0)
    cu = lengths_to_cu_seqlens([5, 0, 11, 4])
    t = 20
    tensors = [torch.randn(1, t, 4, 3, generator=g), torch.rand(1, t, 4, generator=g), -torch.rand(4, generator=g),
               torch.randn(1, t, 2, 5, generator=g), torch.randn(1, t, 2, 5, generator=g)]
    return [v.to(dtype).requires_grad_(grad) for v in tensors], cu


@pytest.mark.parametrize("given,canonical", [
    pytest.param([[1] * 6 + [2] * 14], [[0] * 6 + [1] * 14], id="leading-empty-document"),
    pytest.param([[3] * 4 + [1] * 4 + [3] * 12], [[0] * 4 + [1] * 4 + [2] * 12], id="value-used-again"),
    pytest.param([[0] * 20, [5] * 10 + [-1] * 10], [[0] * 20, [0] * 10 + [1] * 10], id="rows"),
])
def test_ssd_hands_upstream_canonical_seq_idx(fake_cuda, fake_ssd, given, canonical):
    """mamba-ssm takes the value before a row to be 0 and compares values for equality only (see
    mixers/ops/ssd/kernel.py): it gets 0 for each row's first segment and +1 at every change."""
    (x, dt, A, B, C), _ = ssd_case()
    rows = len(given)
    x, dt, B, C = (t.expand(rows, *t.shape[1:]) for t in (x, dt, B, C))
    init = torch.randn(rows, 4, 3, 5)
    seq_idx = torch.tensor(given, dtype=torch.int32)
    mamba_chunk_scan_combined(x, dt, A, B, C, 8, seq_idx=seq_idx, initial_states=init)
    assert of_kind(fake_ssd, "ssd")[0]["seq_idx"].tolist() == canonical


def test_ssd_cu_seqlens_alone_still_resets(fake_cuda, fake_ssd):
    (x, dt, A, B, C), cu = ssd_case()
    out = mamba_chunk_scan_combined(x, dt, A, B, C, 8, cu_seqlens=cu)
    assert of_kind(fake_ssd, "ssd")[0]["seq_idx"].tolist() == [[0] * 5 + [1] * 11 + [2] * 4]   # canonical
    assert of_kind(fake_ssd, "ssd")[0]["cu_seqlens"] is None      # upstream only takes cu_seqlens with varlen states
    ref = mamba_chunk_scan_combined(x, dt, A, B, C, 8, cu_seqlens=cu, backend="reference")
    assert torch.allclose(out, ref)


def test_ssd_varlen_states_forward_only_is_the_kernel(fake_cuda, fake_ssd):
    (x, dt, A, B, C), cu = ssd_case()
    with torch.no_grad():
        mamba_chunk_scan_combined(x, dt, A, B, C, 8, cu_seqlens=cu, return_varlen_states=True)
    assert len(fake_ssd) == 1 and of_kind(fake_ssd, "ssd")[0]["cu_seqlens"] is not None


@pytest.mark.parametrize("what,kwargs,grad", [
    pytest.param("a backward pass through varlen states", dict(return_varlen_states=True), True, id="varlen-grad"),
    pytest.param("per-document initial states", dict(initial_states=torch.zeros(4, 4, 3, 5)), False, id="per-doc"),
    pytest.param("varlen states together with initial states",
                 dict(initial_states=torch.ones(1, 4, 3, 5), return_varlen_states=True), False, id="row-init-varlen"),
])
def test_ssd_features_upstream_lacks(fake_cuda, fake_ssd, what, kwargs, grad):
    (x, dt, A, B, C), cu = ssd_case(grad=grad)
    mamba_chunk_scan_combined(x, dt, A, B, C, 8, cu_seqlens=cu, **kwargs)
    assert fake_ssd == []
    with pytest.raises(ValueError, match=what):
        mamba_chunk_scan_combined(x, dt, A, B, C, 8, cu_seqlens=cu, backend="kernel", **kwargs)


@pytest.mark.parametrize("kwargs,grad,match", [
    pytest.param(dict(initial_states=torch.ones(1, 4, 3, 5)), False, "does not read initial_states", id="row-init"),
    pytest.param({}, True, "not supported in backward", id="backward"),
])
def test_the_ssd_fake_refuses_what_upstream_gets_wrong_with_varlen_states(kwargs, grad, match):
    """Negative control for the row above: the fake fails where mamba-ssm's varlen states would lose
    the initial state or its backward asserts."""
    (x, dt, A, B, C), cu = ssd_case(grad=grad)
    seq_idx = torch.tensor([[0] * 5 + [1] * 11 + [2] * 4], dtype=torch.int32)
    scan = fakes.fake_ssd([])
    with pytest.raises(AssertionError, match=match):
        out, states = scan(x, dt, A, B, C, 8, seq_idx=seq_idx, cu_seqlens=cu, return_varlen_states=True, **kwargs)
        (out.sum() + states.sum()).backward()


def test_select_backend_is_pure():
    never = lambda: pytest.fail("support must not be read on CPU")  # noqa: E731
    assert dispatch.select_backend("op", "auto", on_cuda=False, support_state=never) == "reference"
    assert dispatch.select_backend("op", "reference", on_cuda=True, support_state=never) == "reference"
    assert dispatch.select_backend("op", "auto", on_cuda=True, support_state=lambda: (True, None)) == "kernel"
    assert dispatch.select_backend("op", "auto", on_cuda=True, support_state=lambda: (False, "x")) == "reference"


@pytest.fixture
def fake_fla(monkeypatch):
    import mixers.ops.delta_rule.kernel as fla_kernel
    calls = []
    monkeypatch.setattr(fla_kernel, "load_upstream", fakes.fake_fla(calls))
    return calls                                           # (kind, cu_seqlens) per call


def delta_case(dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    cu = lengths_to_cu_seqlens([4, 0, 9, 0, 3])
    t = 19                                                     # 3 tokens of padding tail
    q, k = torch.randn(1, t, 2, 8, generator=g).to(dtype), torch.randn(1, t, 2, 8, generator=g).to(dtype)
    v = torch.randn(1, t, 2, 8, generator=g).to(dtype)
    gate = torch.nn.functional.logsigmoid(torch.randn(1, t, 2, generator=g)).to(dtype)
    beta, h0 = torch.rand(1, t, 2, generator=g).to(dtype), torch.randn(5, 2, 8, 8, generator=g)
    return q, k, v, gate, beta, h0, cu


def test_fla_gets_clean_boundaries_and_empty_documents_keep_their_state(fake_cuda, fake_fla):
    from mixers.ops import chunk_gated_delta_rule
    q, k, v, gate, beta, h0, cu = delta_case()
    out, final = chunk_gated_delta_rule(q, k, v, gate, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    # the documents 4, 9, 3, the 3-token padding tail, then the two empty documents (moved last)
    assert fake_fla[0][1].tolist() == [0, 4, 13, 16, 19, 19, 19]
    ref, ref_final = chunk_gated_delta_rule(q, k, v, gate, beta, initial_state=h0, output_final_state=True,
                                            cu_seqlens=cu, backend="reference")
    assert torch.allclose(out.float(), ref.float()) and torch.allclose(final.float(), ref_final.float())
    assert torch.equal(final[1].float(), h0[1]) and torch.equal(final[3].float(), h0[3])


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_fla_unpacked_rows_with_row_states_match_the_reference(fake_cuda, fake_fla, kind):
    """No cu_seqlens: two rows of 9 and one initial state per row go to fla as given (no layout)."""
    from mixers.ops import chunk_gated_delta_rule, chunk_kda
    op = chunk_kda if kind == "kda" else chunk_gated_delta_rule
    q, k, v, gate, beta, h0, _ = delta_case(torch.float32)
    q, k, v, beta = (t[:, :18].reshape(2, 9, *t.shape[2:]) for t in (q, k, v, beta))
    gate = gate[:, :18].reshape(2, 9, 2)
    if kind == "kda":
        gate = gate.unsqueeze(-1).expand(2, 9, 2, 8) * torch.linspace(0.5, 1.5, 8)
    out, final = op(q, k, v, gate, beta, initial_state=h0[:2], output_final_state=True)
    assert [(name, cu) for name, cu in fake_fla] == [(kind, None)]
    ref, ref_final = op(q, k, v, gate, beta, initial_state=h0[:2], output_final_state=True, backend="reference")
    torch.testing.assert_close(out, ref, msg=f"{kind} output through fla")
    torch.testing.assert_close(final, ref_final, msg=f"{kind} final states through fla")


def test_fla_gated_delta_product_fp32_is_the_reference(fake_cuda, fake_fla):
    from mixers.ops import chunk_gated_delta_product
    q, k, v, gate, beta, _, cu = delta_case(torch.float32)
    k2, v2, b2 = (x.repeat_interleave(2, dim=1) for x in (k, v, beta))
    chunk_gated_delta_product(q, k2, v2, gate, b2, 2, cu_seqlens=cu)
    assert fake_fla == []
    with pytest.raises(ValueError, match="float32"):
        chunk_gated_delta_product(q, k2, v2, gate, b2, 2, cu_seqlens=cu, backend="kernel")
    chunk_gated_delta_product(q.bfloat16(), k2.bfloat16(), v2.bfloat16(), gate.bfloat16(), b2.bfloat16(), 2,
                              cu_seqlens=cu)
    assert fake_fla[0][0] == "gdp"


def test_flash_attn_gets_int32_boundaries_covering_every_token(fake_cuda, monkeypatch):
    import mixers.ops.attention.kernel as attn_kernel
    from mixers.ops import varlen_attention
    seen = []

    def flash(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False, window_size=(-1, -1)):
        assert q.dtype in (torch.float16, torch.bfloat16) and cu_q.dtype == torch.int32
        assert int(cu_q[-1]) == q.shape[0] and torch.equal(cu_q, cu_k) and max_q >= int((cu_q[1:] - cu_q[:-1]).max())
        seen.append(cu_q)
        return varlen_attention(q, k, v, cu_q, max_q, causal=causal, window_size=window_size,
                                softmax_scale=softmax_scale, backend="reference")

    monkeypatch.setattr(attn_kernel, "load_upstream", lambda: flash)
    q = torch.randn(20, 4, 8, dtype=torch.bfloat16)
    cu = lengths_to_cu_seqlens([5, 0, 9])
    out = varlen_attention(q, q, q, cu, 9, window_size=(4, 0))
    assert seen[0].tolist() == [0, 5, 5, 14, 20]
    assert torch.equal(out, varlen_attention(q, q, q, cu, 9, window_size=(4, 0), backend="reference"))
