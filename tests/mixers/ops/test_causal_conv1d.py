"""causal_conv1d_fn against a per-document F.conv1d oracle: outputs, final states, every gradient."""

import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from mixers.ops import causal_conv1d_fn
from mixers.ops.causal_conv1d import reference
from mixers.ops.common import chunks
from ssm_pack import lengths_to_cu_seqlens
from tests.support.oracles import check_close, conv_oracle, design_lengths

DIM = 8


def make(lengths, tail, width, dtype, *, init=True, channel_last=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    cu = lengths_to_cu_seqlens(lengths)
    total = int(cu[-1]) + tail
    x = torch.randn(1, total, DIM, generator=g, dtype=torch.float64)
    x = x.transpose(1, 2) if channel_last else x.transpose(1, 2).contiguous()
    weight = torch.randn(DIM, width, generator=g, dtype=torch.float64)
    bias = torch.randn(DIM, generator=g, dtype=torch.float64)
    states = torch.randn(len(lengths), DIM, width - 1, generator=g, dtype=torch.float64) if init else None
    leaves = [t.to(dtype).requires_grad_() for t in (x, weight, bias)]
    if states is not None:
        leaves.append(states.to(dtype).requires_grad_())
    return cu, leaves


def run_both(cu, leaves, activation):
    x, weight, bias, *rest = leaves
    init = rest[0] if rest else None
    out, final = causal_conv1d_fn(x, weight, bias, initial_states=init, return_final_states=True,
                                  activation=activation, cu_seqlens=cu)
    ref_leaves = [t.detach().to(torch.float64).requires_grad_() for t in leaves]
    rx, rw, rb, *rrest = ref_leaves
    ref_out, ref_final = conv_oracle(rx, rw, rb, cu, rrest[0] if rrest else None, activation)
    g = torch.Generator().manual_seed(1)
    g_out = torch.randn(ref_out.shape, generator=g, dtype=torch.float64)
    g_fin = torch.randn(ref_final.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out * g_out.to(out.dtype)).sum() + (final * g_fin.to(final.dtype)).sum(), leaves,
                                allow_unused=True, materialize_grads=True)
    ref_grads = torch.autograd.grad((ref_out * g_out).sum() + (ref_final * g_fin).sum(), ref_leaves,
                                    allow_unused=True, materialize_grads=True)
    return (out, final, grads), (ref_out, ref_final, ref_grads)


GRID = [
    pytest.param(design_lengths(8, 4), 5, 4, id="design-grid-w4"),
    pytest.param([0, 15, 100, 300], 0, 4, id="uneven"),
    pytest.param([1, 2, 3] * 700, 3, 4, id="thousands-of-tiny"),
    pytest.param([5, 0, 0, 1, 7], 0, 2, id="width-2-empty-docs"),
    pytest.param([3, 9, 1], 2, 1, id="width-1"),
    pytest.param([2, 11, 6], 4, 6, id="width-6"),
]


@pytest.mark.parametrize("lengths,tail,width", GRID)
@pytest.mark.parametrize("init", [True, False], ids=["init", "zero-init"])
def test_matches_per_document_conv_fp64(lengths, tail, width, init):
    cu, leaves = make(lengths, tail, width, torch.float64, init=init)
    (out, final, grads), (ref_out, ref_final, ref_grads) = run_both(cu, leaves, "silu")
    check_close(out, ref_out, torch.float64, what="out")
    check_close(final, ref_final, torch.float64, what="final states")
    for name, a, r in zip(("x", "weight", "bias", "initial_states"), grads, ref_grads):
        check_close(a, r, torch.float64, grad=True, what=f"grad {name}")


def small_blocks(monkeypatch, elements):
    """The reference's backward over blocks of ``elements`` numbers (``elements / DIM`` rows)."""
    monkeypatch.setattr(reference, "row_blocks", functools.partial(chunks.row_blocks, elements=elements))


@pytest.mark.parametrize("rows", [pytest.param(1, id="1-row-blocks"), pytest.param(2, id="2-row-blocks"),
                                  pytest.param(5, id="5-row-blocks")])
@pytest.mark.parametrize("lengths,tail,width", [GRID[1], GRID[3], GRID[5]])
@pytest.mark.parametrize("activation", ["silu", None], ids=["silu", "no-activation"])
def test_backward_over_blocks_fp64(rows, lengths, tail, width, activation, monkeypatch):
    """The backward runs over blocks of rows, each reading its next W - 1 rows' gradient and its
    W - 1 rows of input before it: blocks shorter than that (1, 2 rows at W = 4, 6) and longer."""
    small_blocks(monkeypatch, rows * DIM)
    cu, leaves = make(lengths, tail, width, torch.float64)
    (out, final, grads), (ref_out, ref_final, ref_grads) = run_both(cu, leaves, activation)
    check_close(out, ref_out, torch.float64, what="out")
    for name, a, r in zip(("x", "weight", "bias", "initial_states"), grads, ref_grads):
        check_close(a, r, torch.float64, grad=True, what=f"grad {name}")


@pytest.mark.parametrize("activation", ["silu", None], ids=["silu", "no-activation"])
def test_backward_over_blocks_without_metadata_fails(activation, monkeypatch):
    """Negative control of the test above: 2-row blocks without ``cu_seqlens`` convolve across the
    document boundaries, so the per-document oracle's output and x gradient cannot match."""
    small_blocks(monkeypatch, 2 * DIM)
    cu, (x, weight, bias) = make([0, 15, 100, 300], 0, 4, torch.float64, init=False)
    out = causal_conv1d_fn(x, weight, bias, activation=activation)
    ref_leaves = [t.detach().clone().requires_grad_() for t in (x, weight, bias)]
    ref_out, _ = conv_oracle(*ref_leaves, cu, None, activation)
    assert (out - ref_out).abs().max() > 1e-3
    g_out = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (g_x,) = torch.autograd.grad((out * g_out).sum(), x)
    (ref_g_x,) = torch.autograd.grad((ref_out * g_out).sum(), ref_leaves[0])
    assert (g_x - ref_g_x).abs().max() > 1e-3


def test_backward_over_blocks_with_padding(monkeypatch):
    """Padding (negative seq_idx) inside and between blocks: zero output, no gradient through it."""
    g = torch.Generator().manual_seed(4)
    seq_idx = torch.tensor([[0, 0, 0, 1, 1, -1, -1, 2, 2, 2, -1, 3]], dtype=torch.int32)
    x = torch.randn(1, DIM, 12, generator=g, dtype=torch.float64)
    w, b = torch.randn(DIM, 4, generator=g, dtype=torch.float64), torch.randn(DIM, generator=g, dtype=torch.float64)
    g_out = torch.randn(1, DIM, 12, generator=g, dtype=torch.float64)
    runs = []
    for elements in (1 << 18, 3 * DIM):                 # one block; blocks of 3 rows
        small_blocks(monkeypatch, elements)
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        out = causal_conv1d_fn(*leaves, seq_idx=seq_idx, activation="silu")
        runs.append((out, torch.autograd.grad((out * g_out).sum(), leaves)))
    (out, grads), (out_blocks, grads_blocks) = runs
    assert torch.equal(out, out_blocks)
    assert (grads_blocks[0][..., seq_idx[0] < 0] == 0).all()
    for name, a, r in zip(("x", "weight", "bias"), grads_blocks, grads):
        check_close(a, r, torch.float64, grad=True, what=f"grad {name}")
    ref = x.detach().clone().requires_grad_()
    pieces = [(0, 3), (3, 5), (7, 10), (11, 12)]
    ref_out = torch.cat([F.silu(F.conv1d(F.pad(ref[..., s:e], (3, 0)), w.unsqueeze(1), b, groups=DIM))
                         for s, e in pieces], -1)
    keep = torch.cat([torch.arange(s, e) for s, e in pieces])
    (ref_g,) = torch.autograd.grad((ref_out * g_out[..., keep]).sum(), ref)
    check_close(grads_blocks[0], ref_g, torch.float64, grad=True, what="grad x against per-document convs")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("channel_last", [True, False], ids=["channel-last", "channel-first"])
def test_low_precision(dtype, channel_last):
    cu, leaves = make([0, 15, 100, 300, 3], 7, 4, dtype, channel_last=channel_last)
    (out, final, grads), (ref_out, ref_final, ref_grads) = run_both(cu, leaves, None)
    assert out.dtype == dtype and final.dtype == dtype
    check_close(out, ref_out, dtype, what="out")
    check_close(final, ref_final, dtype, what="final states")
    for name, a, r in zip(("x", "weight", "bias", "initial_states"), grads, ref_grads):
        check_close(a, r, dtype, grad=True, what=f"grad {name}")


@given(st.lists(st.integers(0, 12), min_size=1, max_size=12), st.integers(0, 4), st.integers(1, 5),
       st.booleans())
def test_random_layouts(lengths, tail, width, init):
    cu, leaves = make(lengths, tail, width, torch.float64, init=init)
    (out, final, grads), (ref_out, ref_final, ref_grads) = run_both(cu, leaves, "silu")
    check_close(out, ref_out, torch.float64, what="out")
    check_close(final, ref_final, torch.float64, what="final")
    for a, r in zip(grads, ref_grads):
        check_close(a, r, torch.float64, grad=True, what="grad")


def test_seq_idx_rows_with_per_row_initial_states_and_padding():
    """Upstream semantics: B rows, seq_idx changes of value, row init feeds each row's first segment,
    negative seq_idx is padding with output zero."""
    g = torch.Generator().manual_seed(3)
    seq_idx = torch.tensor([[0, 0, 0, 1, 1, -1, -1, 2], [5, 5, 5, 5, 5, 6, 6, 6]], dtype=torch.int32)
    x = torch.randn(2, DIM, 8, generator=g, dtype=torch.float64)
    w, b = torch.randn(DIM, 4, generator=g, dtype=torch.float64), torch.randn(DIM, generator=g, dtype=torch.float64)
    init = torch.randn(2, DIM, 3, generator=g, dtype=torch.float64)
    out, final = causal_conv1d_fn(x, w, b, seq_idx=seq_idx, initial_states=init, return_final_states=True,
                                  activation="silu")
    for row, runs in enumerate([[(0, 3), (3, 5), (5, 7), (7, 8)], [(0, 5), (5, 8)]]):
        for k, (s, e) in enumerate(runs):
            start = init[row:row + 1] if k == 0 else x.new_zeros(1, DIM, 3)
            ref = F.silu(F.conv1d(torch.cat([start, x[row:row + 1, :, s:e]], -1), w.unsqueeze(1), b, groups=DIM))
            if seq_idx[row, s] < 0:
                ref = torch.zeros_like(ref)
            check_close(out[row:row + 1, :, s:e], ref, torch.float64, what=f"row {row} run {k}")
        s, e = runs[-1]
        check_close(final[row], torch.cat([x.new_zeros(DIM, 3), x[row, :, s:e]], -1)[:, -3:], torch.float64,
                    what="final state of the row's last segment")


def test_final_states_out_is_filled_in_place():
    cu, (x, w, b) = make([3, 5], 0, 4, torch.float64, init=False)
    buf = torch.empty(2, DIM, 3, dtype=torch.float64)
    _, final = causal_conv1d_fn(x.detach(), w.detach(), b.detach(), return_final_states=True, final_states_out=buf,
                                cu_seqlens=cu)
    assert final is buf and torch.equal(buf[1], x.detach()[0, :, 5:8])


def test_no_metadata_is_one_plain_causal_conv():
    x = torch.randn(2, DIM, 9, dtype=torch.float64)
    w, b = torch.randn(DIM, 4, dtype=torch.float64), torch.randn(DIM, dtype=torch.float64)
    ref = F.conv1d(x, w.unsqueeze(1), b, padding=3, groups=DIM)[..., :9]
    assert (causal_conv1d_fn(x, w, b) - ref).abs().max() < 1e-12


@pytest.mark.parametrize("kwargs,exc,match", [
    pytest.param(dict(activation="relu"), ValueError, "activation must be None, 'silu' or 'swish'", id="activation"),
    pytest.param(dict(seq_idx=torch.zeros(1, 5)), TypeError, "seq_idx must have an integer dtype", id="float-seq-idx"),
    pytest.param(dict(seq_idx=torch.zeros(1, 4, dtype=torch.int32)), ValueError, r"seq_idx must be \[B, T\]",
                 id="seq-idx-shape"),
    pytest.param(dict(cu_seqlens=torch.tensor([0, 9])), ValueError, r"cu_seqlens\[-1\]=9 is beyond the 5 tokens",
                 id="cu-beyond"),
    pytest.param(dict(initial_states=torch.zeros(1, 8, 2)), ValueError, r"initial_states must be \[B, D, W-1\]",
                 id="init-shape"),
    pytest.param(dict(final_states_out=torch.zeros(1, 8, 3)), ValueError, "return_final_states=False",
                 id="out-without-return"),
    pytest.param(dict(return_final_states=True, final_states_out=torch.zeros(2, 8, 3)), ValueError,
                 r"final_states_out must be \[B, D, W-1\] = \[1, 8, 3\]", id="out-rows"),
    pytest.param(dict(cu_seqlens=torch.tensor([0, 2, 5]), return_final_states=True,
                      final_states_out=torch.zeros(1, 8, 3)), ValueError,
                 r"final_states_out must be \[N, D, W-1\] = \[2, 8, 3\]", id="out-rows-per-document"),
    pytest.param(dict(weight=torch.randn(DIM + 1, 4)), ValueError, r"weight must be \[D, W\] = \[8, W>=1\]",
                 id="weight-dim"),
    pytest.param(dict(weight=torch.randn(DIM, 0)), ValueError, r"weight must be \[D, W\] = \[8, W>=1\]",
                 id="weight-width-0"),
    pytest.param(dict(backend="cuda"), ValueError, "backend must be one of", id="backend-name"),
    pytest.param(dict(backend="kernel"), ValueError, "needs CUDA tensors", id="kernel-on-cpu"),
    pytest.param(dict(cu_seqlens=torch.tensor([0, 2, 5]), seq_idx=torch.zeros(1, 5, dtype=torch.int32)),
                 ValueError, "describe different documents", id="inconsistent"),
])
def test_bad_input(kwargs, exc, match):
    x, w = torch.randn(1, DIM, 5), kwargs.pop("weight", torch.randn(DIM, 4))
    with pytest.raises(exc, match=match):
        causal_conv1d_fn(x, w, **kwargs)


def test_batch_with_cu_seqlens_is_refused():
    with pytest.raises(ValueError, match=r"cu_seqlens needs one packed row \(B == 1\), got B=2"):
        causal_conv1d_fn(torch.randn(2, DIM, 5), torch.randn(DIM, 4), cu_seqlens=torch.tensor([0, 5]))


def test_perturbing_a_document_leaves_the_others_bitwise_unchanged():
    from tests.support.leakage import perturbation_report
    from tests.support.oracles import documents
    lengths = [1, 15, 0, 100, 2, 3, 40]
    cu = lengths_to_cu_seqlens(lengths)
    total = int(cu[-1]) + 6                           # a padding tail
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, total, DIM, generator=g).transpose(1, 2)
    w, b = torch.randn(DIM, 4, generator=g), torch.randn(DIM, generator=g)
    spans = documents(cu, total)

    def packed(x):
        return causal_conv1d_fn(x, w, b, activation="silu", cu_seqlens=cu)

    def unpacked(x):                                   # negative control: the metadata dropped
        return causal_conv1d_fn(x, w, b, activation="silu")

    inputs = {"x": (x, 2)}
    assert perturbation_report(packed, inputs, spans, 2) == []
    assert perturbation_report(unpacked, inputs, spans, 2), "the check cannot fail: no leak without metadata"


def test_no_token_call_launches_no_kernel(monkeypatch):
    """T == 0 on (pretended) CUDA with causal-conv1d installed: an empty output, no kernel launched (the fake,
    as the device, refuses a launch over zero tokens)."""
    from tests.support import fakes
    calls = fakes.install(monkeypatch)
    x = torch.randn(1, 0, DIM).transpose(1, 2)
    out = causal_conv1d_fn(x, torch.randn(DIM, 4), activation="silu")
    assert calls == [] and out.shape == (1, DIM, 0)


def test_kernel_without_metadata_reads_one_segment_per_row(monkeypatch):
    """No seq_idx and no cu_seqlens on (pretended) CUDA: causal-conv1d's kernel gets all-zero seq_idx (each row
    one segment) and computes the plain causal conv."""
    from tests.support import fakes
    calls = fakes.install(monkeypatch)
    x = torch.randn(2, 9, DIM, dtype=torch.float64).float().transpose(1, 2)     # channel-last, as the kernel reads
    w, b = torch.randn(DIM, 4), torch.randn(DIM)
    out = causal_conv1d_fn(x, w, b)
    (given,) = fakes.of_kind(calls, "conv")
    assert torch.equal(given["seq_idx"], torch.zeros(2, 9, dtype=torch.int32))
    ref = F.conv1d(x.double(), w.double().unsqueeze(1), b.double(), padding=3, groups=DIM)[..., :9]
    check_close(out, ref, torch.float32, what="out")


def test_fla_conv_gets_the_forwards_layout(monkeypatch):
    """With a ``VarlenBatch`` (width 6: causal-conv1d cannot, fla's Triton conv runs) fla is handed the
    boundaries and chunk indices the forward built once (:attr:`ssm_pack.VarlenBatch.fla_conv_layout`)."""
    from ssm_pack import VarlenBatch
    from tests.support import fakes
    calls = fakes.install(monkeypatch)
    cu, (x, w, b) = make([5, 70], 3, 6, torch.float32, init=False)
    varlen = VarlenBatch.build(cu, 78)
    out = causal_conv1d_fn(x, w, b, cu_seqlens=varlen)
    (given,) = fakes.of_kind(calls, "fla_conv")
    layout_cu, chunk_indices = varlen.fla_conv_layout
    assert given["cu_seqlens"] is layout_cu and given["chunk_indices"] is chunk_indices
    check_close(out, causal_conv1d_fn(x, w, b, cu_seqlens=cu, backend="reference"), torch.float32, what="out")


def test_long_documents_backward_without_warnings():
    """Documents longer than the weight gradient's block of rows (1024): the backward equals autograd
    through ``F.conv1d`` per document and issues no warning (no output buffer of the wrong size)."""
    g = torch.Generator().manual_seed(5)
    lengths = [1300, 2, 1297]
    x = torch.randn(1, 6, sum(lengths), generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(3, 6, 3, generator=g, dtype=torch.float64, requires_grad=True)
    cot = torch.randn(1, 6, sum(lengths), generator=g, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = causal_conv1d_fn(x, w, initial_states=h0, cu_seqlens=lengths_to_cu_seqlens(lengths))
        got = torch.autograd.grad((out * cot).sum(), (x, w, h0))
    starts = [0, 1300, 1302]
    want_out = torch.cat([F.conv1d(torch.cat([h0[i:i + 1], x[:, :, s:s + n]], 2), w[:, None], groups=6)
                          for i, (s, n) in enumerate(zip(starts, lengths))], 2)
    want = torch.autograd.grad((want_out * cot).sum(), (x, w, h0))
    assert (out - want_out).abs().max() < 1e-12
    for name, a, b in zip(("x", "weight", "initial_states"), got, want):
        assert (a - b).abs().max() < 1e-10, f"{name} gradient differs"
