"""Padding on causal-conv1d's kernel path: outputs AND gradients equal the reference's.

causal-conv1d's forward zeroes the outputs of negative ``seq_idx`` tokens, but its backward
(csrc/causal_conv1d_bwd.cu) only compares ``seq_idx`` values: the cotangent at padding reaches
``dx`` at padding, ``dweight`` and ``dbias``. The fake (``tests/support/fakes.py``) does the same,
so these tests fail where the wrapper hands the kernel a negative ``seq_idx``.
"""

import pytest
import torch

from mixers.ops import causal_conv1d_fn
from tests.support import fakes
from tests.support.fakes import of_kind
from tests.support.oracles import rel_rms

PAD = -1


def run(seq_idx, backend, *, dtype=torch.float32, activation="silu", bias=True, initial=False, seed=0):
    """``(out, (dx, dweight, dbias, dinitial))`` of one call with a fixed random cotangent."""
    g = torch.Generator().manual_seed(seed)
    t = len(seq_idx)
    x = torch.randn(1, t, 16, generator=g, dtype=dtype).transpose(1, 2).requires_grad_()   # channel-last
    w = torch.randn(16, 4, generator=g, dtype=dtype, requires_grad=True)
    b = torch.randn(16, generator=g, dtype=dtype, requires_grad=True) if bias else None
    init = torch.randn(1, 16, 3, generator=g, dtype=dtype, requires_grad=True) if initial else None
    cot = torch.randn(1, 16, t, generator=g, dtype=dtype)
    ids = torch.tensor([seq_idx], dtype=torch.int32)
    out = causal_conv1d_fn(x, w, b, seq_idx=ids, initial_states=init, activation=activation, backend=backend)
    leaves = [v for v in (x, w, b, init) if v is not None]
    return out, torch.autograd.grad(out, leaves, cot)


CASES = [
    pytest.param([0] * 5 + [PAD] * 3 + [1] * 9, {}, id="padding-between-documents"),
    pytest.param([PAD] * 2 + [0] * 7 + [1] + [PAD] * 4, {}, id="leading-and-tail-padding"),
    pytest.param([0] * 3 + [PAD] + [1] * 2 + [PAD] * 2 + [2] * 6 + [PAD] * 5, {}, id="uneven-runs"),
    pytest.param([0] * 6 + [PAD] * 2 + [1] * 8, dict(activation=None), id="no-activation"),
    pytest.param([0] * 6 + [PAD] * 2 + [1] * 8, dict(bias=False), id="no-bias"),
    pytest.param([0] * 6 + [PAD] * 2 + [1] * 8, dict(initial=True), id="row-initial-states"),
    pytest.param([4] * 4 + [PAD] * 3 + [4] * 5 + [PAD] * 1, {}, id="one-value-around-padding"),
]


@pytest.mark.parametrize("seq_idx,kwargs", CASES)
def test_padding_outputs_and_gradients_equal_the_reference(monkeypatch, seq_idx, kwargs):
    ref_out, ref_grads = run(seq_idx, "reference", **kwargs)
    calls = fakes.install(monkeypatch)
    out, grads = run(seq_idx, "auto", **kwargs)
    assert torch.equal(out, ref_out) and bool((out[0, :, torch.tensor(seq_idx) < 0] == 0).all())
    for name, a, r in zip(("dx", "dweight", "dbias", "dinitial"), grads, ref_grads):
        assert rel_rms(a, r) < 1e-6, name
    given = of_kind(calls, "conv")
    assert len(given) == 1 and int(given[0]["seq_idx"].min()) >= 0, "the kernel never sees a negative seq_idx"


def test_fake_backward_takes_the_padding_cotangent_in():
    """Negative control: handed a negative ``seq_idx``, the fake's backward (upstream's) differs from
    the reference's where padding is concerned (dbias, dweight, dx at padding), and agrees elsewhere."""
    seq_idx = [0] * 6 + [PAD] * 4 + [1] * 8
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 18, 16, generator=g).transpose(1, 2).requires_grad_()
    w = torch.randn(16, 4, generator=g, requires_grad=True)
    b = torch.randn(16, generator=g, requires_grad=True)
    cot = torch.randn(1, 16, 18, generator=g)
    ids = torch.tensor([seq_idx], dtype=torch.int32)
    upstream = fakes.fake_conv([])(x, w, b, seq_idx=ids, activation="silu")
    reference = causal_conv1d_fn(x, w, b, seq_idx=ids, activation="silu", backend="reference")
    assert torch.allclose(upstream, reference)
    up = torch.autograd.grad(upstream, (x, w, b), cot)
    ref = torch.autograd.grad(reference, (x, w, b), cot)
    pad = torch.tensor(seq_idx) < 0
    assert not torch.allclose(up[2], ref[2]) and not torch.allclose(up[1], ref[1])
    assert not torch.allclose(up[0][..., pad], ref[0][..., pad])
    assert torch.allclose(up[0][..., ~pad], ref[0][..., ~pad], atol=1e-6)
