"""causal_conv1d_fn's torch backend against its specification (``naive.py``), and the
specification against the per-document ``F.conv1d`` oracle."""

import pytest
import torch

from mixers.ops import causal_conv1d_fn, causal_conv1d_update
from mixers.ops.causal_conv1d.naive import causal_conv1d_naive
from ssm_pack import lengths_to_cu_seqlens
from tests.mixers.ops.naive_compare import assert_same
from tests.support.oracles import check_close, conv_oracle

DIM = 3

CASES = [
    pytest.param([5, 0, 1, 9, 2], 0, 4, "silu", id="uneven-empty-one-token"),
    pytest.param([1, 1, 0, 6], 3, 3, None, id="tail-width-3"),
    pytest.param([0, 4], 0, 1, None, id="width-1"),
]


def _inputs(lengths, tail, width, seed=0):
    g = torch.Generator().manual_seed(seed)
    cu = lengths_to_cu_seqlens(lengths)
    total = sum(lengths) + tail
    x = torch.randn(1, DIM, total, generator=g, dtype=torch.float64)
    weight = torch.randn(DIM, width, generator=g, dtype=torch.float64)
    bias = torch.randn(DIM, generator=g, dtype=torch.float64)
    init = torch.randn(len(lengths), DIM, width - 1, generator=g, dtype=torch.float64)
    return cu, (x, weight, bias, init)


@pytest.mark.parametrize("lengths, tail, width, activation", CASES)
def test_torch_backend_matches_spec(lengths, tail, width, activation):
    cu, inputs = _inputs(lengths, tail, width)

    def backend(x, w, b, s):
        return causal_conv1d_fn(x, w, b, initial_states=s, return_final_states=True, activation=activation,
                                cu_seqlens=cu, backend="reference")

    def spec(x, w, b, s):
        return causal_conv1d_naive(x, w, b, s, True, activation, cu_seqlens=cu)

    assert_same(backend, spec, inputs, what="causal_conv1d")


def test_default_call_matches_spec():
    """No initial states, no final states, the default backend."""
    cu, (x, weight, bias, _) = _inputs([4, 1, 0, 7], 0, 4)
    check_close(causal_conv1d_fn(x, weight, bias, cu_seqlens=cu), causal_conv1d_naive(x, weight, bias, cu_seqlens=cu),
                torch.float64, what="default call")


@pytest.mark.parametrize("lengths, tail, width, activation", CASES)
def test_spec_matches_oracle(lengths, tail, width, activation):
    cu, (x, weight, bias, init) = _inputs(lengths, tail, width, seed=3)
    out, final = causal_conv1d_naive(x, weight, bias, init, True, activation, cu_seqlens=cu)
    want_out, want_final = conv_oracle(x, weight, bias, cu, init, activation)
    check_close(out, want_out, torch.float64, what="out")
    check_close(final, want_final, torch.float64, what="final states")


def test_spec_resets_at_boundaries():
    """Negative control: joining two documents into one changes the second one's output."""
    cu, (x, weight, bias, _) = _inputs([3, 4], 0, 4)
    apart = causal_conv1d_naive(x, weight, bias, cu_seqlens=cu)
    joined = causal_conv1d_naive(x, weight, bias, cu_seqlens=torch.tensor([0, 7], dtype=torch.int32))
    torch.testing.assert_close(apart[..., :3], joined[..., :3])
    assert (apart[..., 3:] - joined[..., 3:]).abs().max() > 1e-3


def test_decode_step_matches_spec():
    """``causal_conv1d_update`` (two new tokens per row, rows as documents): output and state."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, DIM, 2, generator=g, dtype=torch.float64)
    weight, bias = torch.randn(DIM, 4, generator=g, dtype=torch.float64), torch.randn(DIM, dtype=torch.float64)
    state = torch.randn(3, DIM, 3, generator=g, dtype=torch.float64)
    want, want_state = causal_conv1d_naive(x, weight, bias, state, True, "silu")
    got_state = state.clone()
    check_close(causal_conv1d_update(x, got_state, weight, bias, "silu"), want, torch.float64, what="out")
    check_close(got_state, want_state, torch.float64, what="state")
