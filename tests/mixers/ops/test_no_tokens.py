"""T == 0 (an empty pack or context-parallel shard) or B == 0 (a batch of no unpacked row): every op
returns empty outputs of the right shape and dtype and passes its initial states through as final
states, without calling a kernel (the fakes in ``tests/support/fakes.py`` refuse a launch over zero
tokens, as the device would)."""

import pytest
import torch

from mixers.ops import (
    causal_conv1d_fn,
    chunk_gated_delta_product,
    chunk_gated_delta_rule,
    chunk_kda,
    chunk_simple_gla,
    mamba_chunk_scan_combined,
    selective_scan_fn,
    varlen_attention,
)
from tests.support import fakes

CU = torch.tensor([0, 0, 0], dtype=torch.int32)          # two empty documents
BF16 = torch.bfloat16


def conv(dtype, per_doc):
    init = torch.randn(2 if per_doc else 1, 16, 3, dtype=dtype, requires_grad=True)
    x = torch.randn(1, 16, 0, dtype=dtype, requires_grad=True)
    out, final = causal_conv1d_fn(x, torch.randn(16, 4, dtype=dtype), initial_states=init, return_final_states=True,
                                  cu_seqlens=CU if per_doc else None)
    return out, (1, 16, 0), init, final


def ssd(dtype, per_doc):
    init = torch.randn(2 if per_doc else 1, 2, 4, 8, dtype=dtype, requires_grad=True)
    x = torch.randn(1, 0, 2, 4, dtype=dtype, requires_grad=True)
    b, c = torch.randn(1, 0, 1, 8, dtype=dtype), torch.randn(1, 0, 1, 8, dtype=dtype)
    out, final = mamba_chunk_scan_combined(x, torch.rand(1, 0, 2, dtype=dtype), -torch.rand(2), b, c, 16,
                                           initial_states=init,
                                           cu_seqlens=CU if per_doc else None, seq_idx=None,
                                           return_varlen_states=per_doc, return_final_states=not per_doc)
    return out, (1, 0, 2, 4), init, final


def delta(op, gate, nh=1):
    def run(dtype, per_doc):
        init = torch.randn(2 if per_doc else 1, 2, 8, 8, requires_grad=True)     # fp32 states, as fla keeps them
        q = torch.randn(1, 0, 2, 8, dtype=dtype, requires_grad=True)
        k, v = torch.randn(1, 0, 2, 8, dtype=dtype), torch.randn(1, 0, 2, 8, dtype=dtype)
        extra = (nh,) if op is chunk_gated_delta_product else ()
        g = -torch.rand(1, 0, 2, *gate).to(dtype)
        out, final = op(q, k, v, g, torch.rand(1, 0, 2, dtype=dtype), *extra, initial_state=init,
                        output_final_state=True, cu_seqlens=CU.long() if per_doc else None)
        return out, (1, 0, 2, 8), init, final
    return run


OPS = [
    pytest.param(conv, id="causal_conv1d"),
    pytest.param(ssd, id="mamba_ssd"),
    pytest.param(delta(chunk_gated_delta_rule, ()), id="gated_delta_rule"),
    pytest.param(delta(chunk_kda, (8,)), id="kda"),
    pytest.param(delta(chunk_gated_delta_product, (), nh=2), id="gated_delta_product"),
]


@pytest.mark.parametrize("path", ["kernel", "cpu"])
@pytest.mark.parametrize("per_doc", [True, False], ids=["per-document", "per-row"])
@pytest.mark.parametrize("run", OPS)
def test_no_token_passes_initial_states_through(monkeypatch, run, per_doc, path):
    calls = fakes.install(monkeypatch) if path == "kernel" else None
    out, shape, init, final = run(BF16, per_doc)
    assert tuple(out.shape) == shape and out.dtype == BF16
    assert torch.equal(final.to(init.dtype), init.detach()) and final.data_ptr() != init.data_ptr()
    cotangent = torch.randn(final.shape, dtype=final.dtype)
    (grad,) = torch.autograd.grad(final, init, cotangent)
    assert torch.equal(grad, cotangent.to(grad.dtype))
    if calls is not None:
        assert calls == [], "no kernel is launched over zero tokens"


def no_rows(op, *, nh=1, gate=()):
    """``op`` over zero rows of 5 tokens, 2 heads: ``(output, want shape, initial states [0, ...], final)``."""
    def run(dtype):
        init = torch.randn(0, 2, 8, 8, requires_grad=True)
        q = torch.randn(0, 5, 2, 8, dtype=dtype, requires_grad=True)
        k, v = torch.randn(0, 5 * nh, 2, 8, dtype=dtype), torch.randn(0, 5 * nh, 2, 8, dtype=dtype)
        if op is chunk_simple_gla:
            out, final = op(q, k, v, None, g_gamma=-torch.rand(2), initial_state=init, output_final_state=True)
            return out, (0, 5, 2, 8), init, final
        extra = (nh,) if op is chunk_gated_delta_product else ()
        g = -torch.rand(0, 5, 2, *gate).to(dtype)
        out, final = op(q, k, v, g, torch.rand(0, 5 * nh, 2, dtype=dtype), *extra, initial_state=init,
                        output_final_state=True)
        return out, (0, 5, 2, 8), init, final
    return run


def ssd_no_rows(dtype):
    init = torch.randn(0, 2, 4, 8, dtype=dtype, requires_grad=True)
    x = torch.randn(0, 5, 2, 4, dtype=dtype, requires_grad=True)
    b, c = torch.randn(0, 5, 1, 8, dtype=dtype), torch.randn(0, 5, 1, 8, dtype=dtype)
    out, final = mamba_chunk_scan_combined(x, torch.rand(0, 5, 2, dtype=dtype), -torch.rand(2), b, c, 16,
                                           initial_states=init, return_final_states=True)
    return out, (0, 5, 2, 4), init, final


def conv_no_rows(dtype):
    init = torch.randn(0, 16, 3, dtype=dtype, requires_grad=True)
    x = torch.randn(0, 16, 5, dtype=dtype, requires_grad=True)
    out, final = causal_conv1d_fn(x, torch.randn(16, 4, dtype=dtype), initial_states=init, return_final_states=True)
    return out, (0, 16, 5), init, final


def scan_no_rows(dtype):
    init = torch.randn(0, 6, 4, dtype=dtype, requires_grad=True)
    u = torch.randn(0, 6, 5, dtype=dtype, requires_grad=True)
    bc = torch.randn(0, 4, 5, dtype=dtype)
    out, final = selective_scan_fn(u, torch.rand(0, 6, 5, dtype=dtype), -torch.rand(6, 4), bc, bc,
                                   return_last_state=True, initial_states=init)
    return out, (0, 6, 5), init, final


NO_ROWS = [
    pytest.param(conv_no_rows, id="causal_conv1d"),
    pytest.param(ssd_no_rows, id="mamba_ssd"),
    pytest.param(scan_no_rows, id="selective_scan"),
    pytest.param(no_rows(chunk_simple_gla), id="simple_gla"),
    pytest.param(no_rows(chunk_gated_delta_rule), id="gated_delta_rule"),
    pytest.param(no_rows(chunk_kda, gate=(8,)), id="kda"),
    pytest.param(no_rows(chunk_gated_delta_product, nh=2), id="gated_delta_product"),
]


@pytest.mark.parametrize("path", ["kernel", "cpu"])
@pytest.mark.parametrize("run", NO_ROWS)
def test_no_rows_give_empty_outputs_and_states(monkeypatch, run, path):
    """A batch of no row (B == 0, unpacked), called as users call it: empty outputs and final states,
    gradients of the inputs' shapes, and no kernel launched."""
    calls = fakes.install(monkeypatch) if path == "kernel" else None
    out, shape, init, final = run(torch.float32)
    assert tuple(out.shape) == shape and out.dtype == torch.float32
    assert tuple(final.shape) == tuple(init.shape), f"final states {list(final.shape)}"
    (grad,) = torch.autograd.grad((out.sum() + final.sum()), init)
    assert tuple(grad.shape) == tuple(init.shape)
    if calls is not None:
        assert calls == [], "no kernel is launched over zero rows"


@pytest.mark.parametrize("path", ["kernel", "cpu"])
def test_no_token_attention(monkeypatch, path):
    calls = fakes.install(monkeypatch) if path == "kernel" else None
    q = torch.randn(0, 4, 8, dtype=BF16, requires_grad=True)
    out = varlen_attention(q, torch.randn(0, 2, 8, dtype=BF16), torch.randn(0, 2, 16, dtype=BF16), CU, 0)
    assert tuple(out.shape) == (0, 4, 16) and out.dtype == BF16
    if calls is not None:
        assert calls == []


def test_no_token_conv_without_metadata(monkeypatch):
    calls = fakes.install(monkeypatch)
    out = causal_conv1d_fn(torch.randn(1, 16, 0), torch.randn(16, 4), seq_idx=torch.zeros(1, 0, dtype=torch.int32))
    assert tuple(out.shape) == (1, 16, 0) and calls == []


def test_no_row_conv_on_fla(monkeypatch):
    """Zero rows of 5 tokens, 6 channels (causal-conv1d needs a multiple of 8, so fla's conv is the
    kernel): ``[0, D, T]`` outputs and ``[0, D, W-1]`` final states, as the reference returns."""
    calls = fakes.install(monkeypatch)
    x, w = torch.randn(0, 6, 5), torch.randn(6, 4)
    out, final = causal_conv1d_fn(x, w, return_final_states=True)
    ref_out, ref_final = causal_conv1d_fn(x, w, return_final_states=True, backend="reference")
    assert tuple(out.shape) == tuple(ref_out.shape) == (0, 6, 5), f"output {list(out.shape)}"
    assert tuple(final.shape) == tuple(ref_final.shape) == (0, 6, 3), f"final states {list(final.shape)}"
    assert calls == []


def test_fakes_refuse_zero_tokens():
    """Negative control: the fakes stop a launch over T == 0 as the device would."""
    x = torch.randn(1, 0, 16).transpose(1, 2)
    with pytest.raises(AssertionError, match="T = 0"):
        fakes.fake_conv([])(x, torch.randn(16, 4), seq_idx=torch.zeros(1, 0, dtype=torch.int32))
    q = torch.randn(1, 0, 2, 8, dtype=BF16)
    with pytest.raises(AssertionError, match="T = 0"):
        fakes.fake_fla([])("gdn")(q, q, q, torch.zeros(1, 0, 2, dtype=BF16), torch.zeros(1, 0, 2, dtype=BF16))
