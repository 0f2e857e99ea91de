"""Layouts causal-conv1d's kernel misreads: the wrapper hands it a copy it reads, forward and backward.

Upstream (csrc/causal_conv1d.cpp, causal-conv1d 1.6.1): channel-last means ``x.stride(1) == 1`` and
``x.stride(2) > 1``; ``x.stride(0)``, ``x.stride(2)`` (and ``dout``'s in the backward) multiples of 8;
whole 16-byte vectors of channels are loaded from the data pointer, which nothing checks. The fake
(``tests/support/fakes.py``) refuses the rest, as the device would.
"""

import pytest
import torch

from mixers.ops import causal_conv1d_fn
from tests.support import fakes
from tests.support.fakes import of_kind
from tests.support.oracles import rel_rms

D, T = 16, 21


def channel_slice_at(offset, dtype):
    """Channels ``offset .. offset + D`` of a channel-last buffer of 48 channels (a strided view)."""
    base = torch.randn(1, T, 48, generator=torch.Generator().manual_seed(0)).to(dtype)
    return base[:, :, offset:offset + D].transpose(1, 2)


def every_other_token(dtype):
    base = torch.randn(1, 2 * T, D, generator=torch.Generator().manual_seed(0)).to(dtype)
    return base.transpose(1, 2)[..., ::2]


def broadcast_over_tokens(dtype):
    return torch.randn(1, 1, D, generator=torch.Generator().manual_seed(0)).to(dtype).transpose(1, 2).expand(1, D, T)


LAYOUTS = [
    pytest.param(lambda dt: channel_slice_at(4, dt), torch.bfloat16, id="channel-slice-mid-vector-bf16"),
    pytest.param(lambda dt: channel_slice_at(2, dt), torch.float32, id="channel-slice-mid-vector-fp32"),
    pytest.param(lambda dt: channel_slice_at(8, dt), torch.bfloat16, id="channel-slice-aligned"),
    pytest.param(every_other_token, torch.float32, id="every-other-token"),
    pytest.param(broadcast_over_tokens, torch.float32, id="broadcast-over-tokens"),
]


def grads(x, backend):
    x = x.detach().requires_grad_()          # the view itself is the leaf
    w = torch.randn(D, 4, generator=torch.Generator().manual_seed(1)).to(x.dtype).requires_grad_()
    seq_idx = torch.tensor([[0] * 9 + [1] * (T - 9)], dtype=torch.int32)
    out = causal_conv1d_fn(x, w, seq_idx=seq_idx, activation="silu", backend=backend)
    loss = (out.float() * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum()
    return (out, *torch.autograd.grad(loss, (x, w)))


@pytest.mark.parametrize("make,dtype", LAYOUTS)
def test_views_reach_the_kernel_as_it_reads_them(monkeypatch, make, dtype):
    x = make(dtype)
    want = grads(x, "reference")
    calls = fakes.install(monkeypatch)
    got = grads(x, "auto")
    assert len(of_kind(calls, "conv")) == 1
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for a, r in zip(got, want):
        assert rel_rms(a.float(), r.float()) < tol


@pytest.mark.parametrize("make,dtype,match", [
    pytest.param(lambda dt: channel_slice_at(4, dt), torch.bfloat16, "misaligned", id="mid-vector"),
    pytest.param(broadcast_over_tokens, torch.float32, "channel last", id="broadcast"),
])
def test_fake_refuses_what_upstream_misreads(make, dtype, match):
    """Negative control: handed the view itself, the fake stops as the device would."""
    x = make(dtype)
    w = torch.randn(D, 4).to(dtype)
    with pytest.raises(AssertionError, match=match):
        fakes.fake_conv([])(x, w, seq_idx=torch.zeros(1, T, dtype=torch.int32))
