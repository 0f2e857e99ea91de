"""varlen_attention against SDPA on each document alone (the dense per-document oracle)."""

import pytest
import torch
import torch.nn.functional as F

from mixers.ops import varlen_attention
from ssm_pack import lengths_to_cu_seqlens
from tests.support.oracles import check_close, documents


def oracle(q, k, v, cu, causal, window, scale=None):
    groups = q.shape[1] // k.shape[1]
    outs = []
    for s, e in documents(cu, q.shape[0]):
        if e == s:
            continue
        i = torch.arange(e - s)
        keep = torch.ones(e - s, e - s, dtype=torch.bool)
        if causal:
            keep &= i[None, :] <= i[:, None]
        if window is not None:
            left, right = window
            if left >= 0:
                keep &= i[None, :] >= i[:, None] - left
            if right >= 0 and not causal:
                keep &= i[None, :] <= i[:, None] + right
        qs, ks, vs = q[s:e].transpose(0, 1), k[s:e].repeat_interleave(groups, 1).transpose(0, 1), \
            v[s:e].repeat_interleave(groups, 1).transpose(0, 1)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=keep, scale=scale).transpose(0, 1))
    return torch.cat(outs) if outs else q[:0]


CASES = [
    pytest.param([0, 15, 100, 300], 0, True, None, id="uneven-causal"),
    pytest.param([1, 2, 3] * 300, 4, True, None, id="many-tiny-tail"),
    pytest.param([300, 260], 0, True, (17, -1), id="sliding-window"),
    pytest.param([40, 0, 90], 3, False, None, id="bidirectional"),
    pytest.param([40, 90], 0, False, (5, 7), id="bidirectional-window"),
    pytest.param([128, 0, 200, 56], 0, True, None, id="whole-blocks"),      # T = 3 * 128: nothing padded
]


@pytest.mark.parametrize("lengths,tail,causal,window", CASES)
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
def test_matches_per_document_sdpa(lengths, tail, causal, window, heads):
    cu = lengths_to_cu_seqlens(lengths)
    total = int(cu[-1]) + tail
    g = torch.Generator().manual_seed(0)
    hq, hk = heads
    q, k, v = (torch.randn(total, h, 16, generator=g, dtype=torch.float64).requires_grad_() for h in (hq, hk, hk))
    out = varlen_attention(q, k, v, cu, max(lengths), causal=causal, window_size=window)
    ref = oracle(q, k, v, cu, causal, window)
    check_close(out, ref, torch.float64, what="out")
    g_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out * g_out).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * g_out).sum(), (q, k, v))
    for a, r in zip(grads, ref_grads):
        check_close(a, r, torch.float64, grad=True, what="grad")
    if sum(1 for n in lengths if n) > 1:            # the negative control: one document over everything
        whole = torch.tensor([0, total], dtype=torch.int32)
        blind = varlen_attention(q, k, v, whole, total, causal=causal, window_size=window)
        assert (blind - ref).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_low_precision(dtype):
    cu = lengths_to_cu_seqlens([5, 70, 300])
    q, k, v = (torch.randn(375, 4, 32).to(dtype) for _ in range(3))
    out = varlen_attention(q, k, v, cu, 300, softmax_scale=0.2)
    assert out.dtype == dtype
    check_close(out, oracle(q.double(), k.double(), v.double(), cu, True, None, 0.2), dtype, what="out")


def test_perturbing_a_document_leaves_the_others_bitwise_unchanged():
    from tests.support.leakage import perturbation_report
    cu = lengths_to_cu_seqlens([1, 15, 0, 300, 2, 3, 40])
    total = int(cu[-1]) + 5
    q, k, v = (torch.randn(total, 4, 8) for _ in range(3))
    spans = documents(cu, total)
    inputs = {"q": (q, 0), "k": (k, 0), "v": (v, 0)}
    packed = lambda q, k, v: varlen_attention(q, k, v, cu, 300)                                  # noqa: E731
    one_document = torch.tensor([0, total], dtype=torch.int32)
    unpacked = lambda q, k, v: varlen_attention(q, k, v, one_document, total)                     # noqa: E731
    assert perturbation_report(packed, inputs, spans, 0) == []
    assert perturbation_report(unpacked, inputs, spans, 0), "the check cannot fail: no leak without boundaries"


@pytest.mark.parametrize("kwargs,match", [
    pytest.param(dict(window_size=(3,)), r"window_size must be \(left, right\)", id="window"),
    pytest.param(dict(backend="kernel"), "cannot do dtype torch.float32", id="kernel-fp32"),
    pytest.param(dict(backend="kernel", dtype=torch.bfloat16), "needs CUDA tensors", id="kernel-on-cpu"),
])
def test_bad_input(kwargs, match):
    q = torch.randn(6, 2, 4, dtype=kwargs.pop("dtype", torch.float32))
    with pytest.raises(ValueError, match=match):
        varlen_attention(q, q, q, torch.tensor([0, 6]), 6, **kwargs)


def test_heads_must_group():
    with pytest.raises(ValueError, match="query heads Hq=3 must be a multiple of key/value heads Hk=2"):
        varlen_attention(torch.randn(6, 3, 4), torch.randn(6, 2, 4), torch.randn(6, 2, 4), torch.tensor([0, 6]), 6)


def test_no_token_call_is_empty_without_a_kernel(monkeypatch):
    """T == 0: ``[0, Hq, Dv]`` zeros on the graph of q (Hq, D and Dv all differ here), no kernel launched."""
    from tests.support import fakes
    calls = fakes.install(monkeypatch)
    q = torch.randn(0, 4, 8, dtype=torch.bfloat16, requires_grad=True)
    k, v = torch.randn(0, 2, 8, dtype=torch.bfloat16), torch.randn(0, 2, 16, dtype=torch.bfloat16)
    out = varlen_attention(q, k, v, torch.tensor([0, 0], dtype=torch.int32), 0)
    assert calls == []
    assert out.shape == (0, 4, 16) and out.dtype == torch.bfloat16 and out.grad_fn is not None


def test_context_parallel_call_goes_to_the_cp_path_with_the_op(monkeypatch):
    """A ``VarlenBatch`` carrying a CP run is handed to the CP version (stubbed: it needs several ranks) as
    ``(call, varlen_attention)``: the op itself runs each rank's local pieces."""
    import dataclasses

    from mixers.ops.attention import cp
    from ssm_pack import VarlenBatch
    seen = []
    monkeypatch.setattr(cp, "varlen_attention_cp", lambda call, local_op: seen.append((call, local_op)) or "cp")
    run = object()
    varlen = dataclasses.replace(VarlenBatch.build(lengths_to_cu_seqlens([3, 4]), 7), cp=run)
    q = torch.randn(7, 2, 4)
    assert varlen_attention(q, q, q, varlen) == "cp"
    (call, local_op), = seen
    assert call.varlen.cp is run and call.q is q and local_op is varlen_attention


@pytest.mark.parametrize("lengths", [pytest.param([7, 200, 0, 41], id="longest-200"),
                                     pytest.param([130, 3], id="longest-130")])
def test_compiles_over_documents_longer_than_a_key_block(lengths):
    """``torch.compile`` traces the op over a document longer than 129 tokens (the key reach, a
    power-of-two multiple of 128 while compiling, grows past one block) within a time limit, and
    the compiled call equals eager."""
    import signal

    import torch._dynamo as dynamo

    from ssm_pack import PackedSeqParams, VarlenBatch
    total = sum(lengths) + 3
    varlen = VarlenBatch.build(PackedSeqParams.from_lengths(lengths, total_tokens=total), total).materialize()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(total, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    step = lambda q, k, v: varlen_attention(q, k, v, varlen)                                     # noqa: E731
    eager = step(q, k, v)
    dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="eager")

    def too_slow(signum, frame):
        raise TimeoutError(f"compiling varlen_attention over documents {lengths} took over {limit} s")
    limit = 60
    previous = signal.signal(signal.SIGALRM, too_slow)
    signal.alarm(limit)
    try:
        got = compiled(q, k, v)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert (got - eager).abs().max() < 1e-12, "the compiled call differs from eager"


@pytest.mark.parametrize("left", [pytest.param(-1, id="causal"), pytest.param(5, id="window-5")])
def test_a_continuing_document_is_attended_block_by_block_as_a_whole(monkeypatch, left):
    """The context-parallel reference path for a document that began on earlier ranks: its ``T1``
    queries sit at key positions ``offset ..`` and run in blocks of ``BLOCK`` queries. With blocks of
    4 and 11 queries (three blocks, the last short), it equals the spec on the whole document."""
    from mixers.ops.attention import cp
    from mixers.ops.attention.naive import varlen_attention_naive
    monkeypatch.setattr(cp, "BLOCK", 4)
    g = torch.Generator().manual_seed(0)
    offset, t1, hq, hk, d = 6, 11, 4, 2, 8
    q = torch.randn(offset + t1, hq, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(offset + t1, hk, d, generator=g, dtype=torch.float64) for _ in range(2))
    got = cp._continuing(q[offset:], k, v, offset, left, d ** -0.5)
    want = varlen_attention_naive(q, k, v, torch.tensor([0, offset + t1], dtype=torch.int32), causal=True,
                                  window_size=None if left < 0 else (left, 0), softmax_scale=d ** -0.5)[offset:]
    check_close(got, want, torch.float64, what="continuing document")
