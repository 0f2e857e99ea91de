"""mamba_chunk_scan_combined's torch backend against its specification (``naive.py``), and the
specification against the token-by-token oracle."""

import pytest
import torch
import torch.nn.functional as F

from mixers.ops import mamba_chunk_scan_combined, selective_state_update
from mixers.ops.ssd.naive import mamba_chunk_scan_naive
from ssm_pack import lengths_to_cu_seqlens
from tests.mixers.ops.naive_compare import assert_same
from tests.support.oracles import check_close, ssm_oracle

H, P, G, NS = 2, 3, 1, 4

CASES = [
    pytest.param([5, 0, 1, 9, 2], 0, 4, id="uneven-empty-one-token"),
    pytest.param([1, 0, 11], 3, 4, id="tail"),
    pytest.param([7], 0, 8, id="one-document-shorter-than-chunk"),
]


def _inputs(lengths, tail, seed=0):
    g = torch.Generator().manual_seed(seed)
    cu = lengths_to_cu_seqlens(lengths)
    total = sum(lengths) + tail

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    x, dt, B, C, z = rand(1, total, H, P), rand(1, total, H), rand(1, total, G, NS), rand(1, total, G, NS), \
        rand(1, total, H, P)
    A, D, dt_bias = -torch.rand(H, generator=g, dtype=torch.float64) - 0.5, rand(H), rand(H)
    init = rand(len(lengths), H, P, NS)
    return cu, (x, dt, A, B, C, D, z, dt_bias, init)


@pytest.mark.parametrize("lengths, tail, chunk", CASES)
def test_torch_backend_matches_spec(lengths, tail, chunk):
    cu, inputs = _inputs(lengths, tail)

    def backend(x, dt, A, B, C, D, z, dt_bias, init):
        return mamba_chunk_scan_combined(x, dt, A, B, C, chunk, D=D, z=z, dt_bias=dt_bias, initial_states=init,
                                         cu_seqlens=cu, dt_softplus=True, return_final_states=True,
                                         return_varlen_states=True, backend="reference")

    def spec(x, dt, A, B, C, D, z, dt_bias, init):
        return mamba_chunk_scan_naive(x, dt, A, B, C, chunk, D=D, z=z, dt_bias=dt_bias, initial_states=init,
                                      cu_seqlens=cu, dt_softplus=True, return_final_states=True,
                                      return_varlen_states=True)

    assert_same(backend, spec, inputs, what="ssd")


@pytest.mark.parametrize("lengths, tail, chunk", CASES[:2])
def test_torch_backend_matches_spec_with_dt_limit_and_per_channel_skip(lengths, tail, chunk):
    """A clamped step size (both bounds reached) and a skip ``D`` of one value per head channel ``[H, P]``."""
    cu, (x, dt, A, B, C, _, z, dt_bias, init) = _inputs(lengths, tail, seed=1)
    D = torch.randn(H, P, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    limit = (0.3, 0.9)
    steps = F.softplus(dt + dt_bias)
    assert bool((steps < limit[0]).any() and (steps > limit[1]).any()), "the clamp must act at both bounds"

    def backend(x, dt, A, B, C, D, z, dt_bias, init):
        return mamba_chunk_scan_combined(x, dt, A, B, C, chunk, D=D, z=z, dt_bias=dt_bias, initial_states=init,
                                         cu_seqlens=cu, dt_softplus=True, dt_limit=limit, return_final_states=True,
                                         return_varlen_states=True, backend="reference")

    def spec(x, dt, A, B, C, D, z, dt_bias, init):
        return mamba_chunk_scan_naive(x, dt, A, B, C, chunk, D=D, z=z, dt_bias=dt_bias, initial_states=init,
                                      cu_seqlens=cu, dt_softplus=True, dt_limit=limit, return_final_states=True,
                                      return_varlen_states=True)

    assert_same(backend, spec, (x, dt, A, B, C, D, z, dt_bias, init), what="ssd with dt_limit and D [H, P]")


def test_default_call_matches_spec():
    """The default call: no initial states, no skip, no gate, rows as documents."""
    _, (x, dt, A, B, C, *_rest) = _inputs([5, 5], 0)
    x, dt, B, C = (t.reshape(2, 5, *t.shape[2:]) for t in (x, dt, B, C))
    dt = F.softplus(dt)
    check_close(mamba_chunk_scan_combined(x, dt, A, B, C, 4), mamba_chunk_scan_naive(x, dt, A, B, C, 4),
                torch.float64, what="default call")


@pytest.mark.parametrize("lengths, tail, chunk", CASES)
def test_spec_matches_oracle(lengths, tail, chunk):
    cu, (x, dt, A, B, C, D, z, _, init) = _inputs(lengths, tail, seed=3)
    dt = F.softplus(dt)
    y, states = mamba_chunk_scan_naive(x, dt, A, B, C, chunk, D=D, z=z, initial_states=init, cu_seqlens=cu,
                                       return_varlen_states=True)
    want_y, want_states = ssm_oracle(x, dt, A, B, C, cu, D=D, z=z, initial_states=init)
    check_close(y, want_y, torch.float64, what="out")
    check_close(states, want_states, torch.float64, what="states")


def test_spec_leaves_step_sizes_unclamped_under_the_default_limit():
    """``dt_limit=(0, inf)`` (the default) is no clamp: raw step sizes, negative ones included
    (``dt_softplus=False``), reach the recurrence as given, as in the oracle and upstream's kernels."""
    cu, (x, dt, A, B, C, D, z, _, init) = _inputs([4, 6], 1, seed=4)
    assert bool((dt < 0).any())
    want_y, _ = ssm_oracle(x, dt, A, B, C, cu, D=D, z=z, initial_states=init)
    for run in (mamba_chunk_scan_naive, lambda *a, **k: mamba_chunk_scan_combined(*a, **k, backend="reference")):
        y = run(x, dt, A, B, C, 4, D=D, z=z, initial_states=init, cu_seqlens=cu)
        check_close(y, want_y, torch.float64, what="out")


def test_spec_resets_at_boundaries():
    """Negative control: joining two documents into one changes the second one's output."""
    cu, (x, dt, A, B, C, *_rest) = _inputs([3, 4], 0)
    dt = F.softplus(dt)
    apart = mamba_chunk_scan_naive(x, dt, A, B, C, 4, cu_seqlens=cu)
    joined = mamba_chunk_scan_naive(x, dt, A, B, C, 4, cu_seqlens=torch.tensor([0, 7], dtype=torch.int32))
    torch.testing.assert_close(apart[:, :3], joined[:, :3])
    assert (apart[:, 3:] - joined[:, 3:]).abs().max() > 1e-3


def test_decode_step_matches_spec():
    """``selective_state_update`` (one token per row, rows as documents, Mamba2's tied ``dt`` and
    ``A``): output and state."""
    _, (x, dt, A, B, C, D, z, dt_bias, _) = _inputs([3], 0)
    x, dt, B, C, z = (t.reshape(3, 1, *t.shape[2:]) for t in (x, dt, B, C, z))
    state = torch.randn(3, H, P, NS, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    want, want_state = mamba_chunk_scan_naive(x, dt, A, B, C, 4, D=D, z=z, dt_bias=dt_bias, initial_states=state,
                                              dt_softplus=True, return_final_states=True)
    got_state = state.clone()
    dt_hp, A_hpn = dt[:, 0, :, None].expand(3, H, P), A[:, None, None].expand(H, P, NS)
    got = selective_state_update(got_state, x[:, 0], dt_hp, A_hpn, B[:, 0], C[:, 0], D=D[:, None].expand(H, P),
                                 z=z[:, 0], dt_bias=dt_bias[:, None].expand(H, P), dt_softplus=True)
    check_close(got, want[:, 0], torch.float64, what="out")
    check_close(got_state, want_state, torch.float64, what="state")
