"""Layouts causal-conv1d's kernel misreads: the wrapper hands it a copy it reads, forward and backward.

Upstream (csrc/causal_conv1d.cpp, causal-conv1d 1.6.1): channel-last means ``x.stride(1) == 1`` and
``x.stride(2) > 1``; ``x.stride(0)``, ``x.stride(2)`` (and ``dout``'s in the backward) multiples of 8;
whole 16-byte vectors of channels are loaded from the data pointer, which nothing checks. The fake
(``tests/support/fakes.py``) refuses the rest, as the device would.
"""

import pytest
import torch

import mixers.ops.causal_conv1d.kernel as conv_kernel
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


def odd_row_pitch(dtype):
    """Two channel-last rows of a flat buffer ``T * D + 1`` elements apart (``stride(0) % 8 == 1``)."""
    base = torch.randn(2 * (T * D + 1), generator=torch.Generator().manual_seed(0)).to(dtype)
    return base.as_strided((2, D, T), (T * D + 1, 1, D))


LAYOUTS = [
    pytest.param(lambda dt: channel_slice_at(4, dt), torch.bfloat16, id="channel-slice-mid-vector-bf16"),
    pytest.param(lambda dt: channel_slice_at(2, dt), torch.float32, id="channel-slice-mid-vector-fp32"),
    pytest.param(lambda dt: channel_slice_at(8, dt), torch.bfloat16, id="channel-slice-aligned"),
    pytest.param(every_other_token, torch.float32, id="every-other-token"),
    pytest.param(broadcast_over_tokens, torch.float32, id="broadcast-over-tokens"),
    pytest.param(odd_row_pitch, torch.float32, id="odd-row-pitch"),
]


def grads(x, backend):
    x = x.detach().requires_grad_()          # the view itself is the leaf
    w = torch.randn(D, 4, generator=torch.Generator().manual_seed(1)).to(x.dtype).requires_grad_()
    seq_idx = torch.tensor([[0] * 9 + [1] * (T - 9)], dtype=torch.int32).expand(x.shape[0], T).contiguous()
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


def test_a_channel_last_input_reaches_the_kernel_uncopied(monkeypatch):
    """A channel-last view the kernel reads as it is (channels 8..24 of 48: aligned, strides multiples of
    8, not dense) goes in itself: no copy of the activations, and its gradient still arrives."""
    calls, given = fakes.install(monkeypatch), []
    conv, states = conv_kernel.load_upstream()
    monkeypatch.setattr(conv_kernel, "load_upstream",
                        lambda: (lambda x, *a, **kw: given.append(x.data_ptr()) or conv(x, *a, **kw), states))
    x = channel_slice_at(8, torch.float32)
    got = grads(x, "auto")
    want = grads(x, "reference")
    assert len(of_kind(calls, "conv")) == 1 and given == [x.data_ptr()], "the kernel got a copy"
    for a, r in zip(got, want):
        assert rel_rms(a.float(), r.float()) < 1e-5
