"""fla's Triton ``causal_conv1d`` through ``causal_conv1d_fn(backend="kernel")`` vs the reference.

Interpreter lane: see ``shims.py``. causal-conv1d's CUDA kernel cannot run here, so the dispatch
takes fla's conv (the ``upstream_calls`` fixture fails the test if causal-conv1d is chosen and
counts fla's calls, so no comparison is the reference against itself).
"""

import pytest
import torch

from mixers.ops import causal_conv1d_fn
from ssm_pack import lengths_to_cu_seqlens
from tests.interpret import shims
from tests.support.oracles import check_close

pytestmark = shims.lane(("fla", "flash-linear-attention"))


def run(backend, x, weight, bias, init, **kwargs):
    """Output, final states and the gradient of a random projection of both, for one backend."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, weight, bias, init) if t is not None]
    x_, w_, *rest = leaves
    b_ = rest.pop(0) if bias is not None else None
    i_ = rest.pop(0) if init is not None else None
    out, final = causal_conv1d_fn(x_, w_, b_, initial_states=i_, return_final_states=True, backend=backend, **kwargs)
    g = torch.Generator().manual_seed(7)
    loss = (out.float() * torch.randn(out.shape, generator=g)).sum() + \
        (final.float() * torch.randn(final.shape, generator=g)).sum()
    return out, final, torch.autograd.grad(loss, leaves)


def assert_matches(kernel, reference, dtype):
    out, final, grads = kernel
    ref_out, ref_final, ref_grads = reference
    check_close(out.float(), ref_out.float(), dtype, what="out")
    check_close(final.float(), ref_final.float(), dtype, what="final states")
    for i, (got, want) in enumerate(zip(grads, ref_grads)):
        check_close(got.float(), want.float(), dtype, grad=True, what=f"grad {i} (x, weight, bias, init)")


def tensors(dim, length, width, rows=1, states=None, bias=True, dtype=torch.float32, channel_last=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, length, dim, generator=g).transpose(1, 2) if channel_last else \
        torch.randn(rows, dim, length, generator=g)
    w = torch.randn(dim, width, generator=g) / width
    b = torch.randn(dim, generator=g) if bias else None
    init = torch.randn(states, dim, width - 1, generator=g) if states else None
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    return cast(x), cast(w), cast(b), cast(init)


@pytest.mark.parametrize("lengths,tail,width,dim,per_doc_states,activation", [
    pytest.param([0, 3, 20, 0, 1, 45], 5, 4, 16, True, "silu", id="empty-docs-tail-doc-states-w4"),
    pytest.param([2, 1, 30], 0, 2, 16, True, None, id="w2-no-activation"),
    pytest.param([0, 7, 9], 3, 3, 8, False, "swish", id="w3-no-states"),
    pytest.param([1, 4, 11], 2, 5, 12, True, "silu", id="w5-12-channels-causal-conv1d-cannot"),
])
def test_packed_conv_matches_reference(upstream_calls, lengths, tail, width, dim, per_doc_states, activation):
    cu = lengths_to_cu_seqlens(lengths)
    x, w, b, init = tensors(dim, sum(lengths) + tail, width, states=len(lengths) if per_doc_states else None)
    kernel = run("kernel", x, w, b, init, cu_seqlens=cu, activation=activation)
    assert upstream_calls["fla_conv"] == 1
    assert_matches(kernel, run("reference", x, w, b, init, cu_seqlens=cu, activation=activation), torch.float32)


def test_rows_seq_idx_padding_and_row_states(upstream_calls):
    """Two rows, negative seq_idx padding (output 0), a row initial state for each first segment."""
    seq_idx = torch.tensor([[0] * 6 + [-1] * 3 + [1] * 11, [2] * 2 + [3] * 15 + [-1] * 3], dtype=torch.int32)
    x, w, b, init = tensors(16, 20, 4, rows=2, states=2, channel_last=False)
    kernel = run("kernel", x, w, b, init, seq_idx=seq_idx, activation="silu")
    assert upstream_calls["fla_conv"] == 1 and bool((kernel[0][0, :, 6:9] == 0).all())
    assert_matches(kernel, run("reference", x, w, b, init, seq_idx=seq_idx, activation="silu"), torch.float32)


def test_fp16(upstream_calls):
    lengths = [5, 0, 17, 2]
    cu = lengths_to_cu_seqlens(lengths)
    x, w, b, init = tensors(16, sum(lengths) + 4, 4, states=len(lengths), dtype=torch.float16)
    kernel = run("kernel", x, w, b, init, cu_seqlens=cu, activation="silu")
    assert upstream_calls["fla_conv"] == 1
    assert_matches(kernel, run("reference", x, w, b, init, cu_seqlens=cu, activation="silu"), torch.float16)


def test_short_convolution_layer_takes_fla(upstream_calls):
    from mixers.layers.blocks.short_conv import ShortConvolution
    from ssm_pack import PackedSeqParams, VarlenBatch
    params = PackedSeqParams.from_lengths([0, 9, 14, 1], total_tokens=28)
    torch.manual_seed(0)
    layers = [ShortConvolution(16, 4, bias=True, backend=backend) for backend in ("kernel", "reference")]
    layers[1].load_state_dict(layers[0].state_dict())
    x = torch.randn(1, 28, 16)
    outs = []
    for layer in layers:
        leaf = x.clone().requires_grad_()
        out = layer(leaf, VarlenBatch.build(params, 28))
        outs.append((out, torch.autograd.grad(out.square().sum(), [leaf, *layer.parameters()])))
    assert upstream_calls["fla_conv"] == 1
    check_close(outs[0][0], outs[1][0], torch.float32, what="out")
    for got, want in zip(outs[0][1], outs[1][1]):
        check_close(got, want, torch.float32, grad=True, what="grad")


def test_upstream_refuses_fp64(upstream_calls):
    """fla accumulates in fp32 and its output cast refuses an fp64 destination: dispatch never
    offers it fp64 (auto takes the reference, ``backend="kernel"`` raises naming both kernels)."""
    from mixers.ops.causal_conv1d.kernel_fla import load_upstream
    cu = lengths_to_cu_seqlens([9, 23])
    x, w, b, _ = tensors(16, 32, 4, dtype=torch.float64)
    with pytest.raises(Exception, match="fp_downcast_rounding"):
        load_upstream()(x.transpose(1, 2), w, b, cu_seqlens=cu.long(), backend="triton")
    calls = upstream_calls["fla_conv"]
    out = causal_conv1d_fn(x, w, b, cu_seqlens=cu)
    assert upstream_calls["fla_conv"] == calls and out.dtype == torch.float64
    with pytest.raises(ValueError, match="fla's Triton conv cannot do dtype torch.float64"):
        causal_conv1d_fn(x, w, b, cu_seqlens=cu, backend="kernel")


def test_upstream_leaves_the_tail_after_cu_seqlens_uncomputed(upstream_calls):
    """Tokens after ``cu_seqlens[-1]`` get no output from fla (NaN-filled memory stays NaN here);
    ssm-pack's segments always end at the row's length, so the tail is computed as its own segment."""
    import fla.modules.causal_conv1d.ops as fla_ops

    from mixers.ops.causal_conv1d.kernel_fla import load_upstream
    cu = lengths_to_cu_seqlens([9, 13])
    x, w, b, _ = tensors(16, 30, 4)
    empty_like = torch.empty_like
    nan_like = lambda t, **kw: empty_like(t, **kw).fill_(float("nan"))  # noqa: E731
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fla_ops.torch, "empty_like", nan_like)
        raw, _ = load_upstream()(x.transpose(1, 2), w, b, cu_seqlens=cu.long(), backend="triton")
        ours = causal_conv1d_fn(x, w, b, cu_seqlens=cu, backend="kernel")
    assert bool(raw[0, 22:].isnan().all()) and not bool(raw[0, :22].isnan().any())
    check_close(ours, causal_conv1d_fn(x, w, b, cu_seqlens=cu, backend="reference"), torch.float32, what="out")
