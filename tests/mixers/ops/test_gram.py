"""The per-channel decayed Grams (``mixers.ops.delta_rule.gram.channel_grams``) and the running
products its levels leave behind, against a pair-by-pair oracle in fp64.

The oracle forms every decay ``prod_{s < u <= t} exp(g_u)`` one pair at a time (a Python loop over
pairs, test-only); the function under test takes them from the halving recursion.
"""

from __future__ import annotations

import pytest
import torch

from mixers.ops.delta_rule.gram import channel_grams
from tests.support.tolerances import FP32_REL, FP64_ABS

N, K = 3, 5


def _oracle(left, k, step, seg):
    """``(S2 [N, 2, L, L], prefix, suffix)`` pair by pair (fp64)."""
    n, length, _ = k.shape
    s2 = torch.zeros(n, 2, length, length, dtype=torch.float64)
    for t in range(length):
        for s in range(t + 1):
            if seg[t] != seg[s]:
                continue
            decay = step[:, s + 1:t + 1].prod(1)                                 # [N, K]
            s2[:, 0, t, s] = (left[:, t] * decay * k[:, s]).sum(-1)
            if s < t:
                s2[:, 1, t, s] = (left[:, length + t] * decay * k[:, s]).sum(-1)
    prefix = torch.stack([step[:, :t + 1].prod(1) for t in range(length)], 1)
    suffix = torch.stack([step[:, t + 1:].prod(1) for t in range(length)], 1)
    return s2, prefix, suffix


def _inputs(length, bounds, dtype, zero_at=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    left = torch.randn(N, 2 * length, K, generator=gen, dtype=torch.float64)
    k = torch.randn(N, length, K, generator=gen, dtype=torch.float64)
    step = torch.rand(N, length, K, generator=gen, dtype=torch.float64) * 0.6 + 0.4
    if zero_at is not None:
        step[:, zero_at] = 0.0                                                   # a reset: exp(-inf)
    seg = torch.zeros(length, dtype=torch.long)
    for b in bounds:
        seg[b:] += 1
    keep = ((seg[:, None] == seg[None, :]) & torch.ones(length, length, dtype=torch.bool).tril()).to(dtype)
    cast = [x.to(dtype) for x in (left, k, step)]
    return cast, (left, k, step), seg, keep.expand(N, 1, length, length)


@pytest.mark.parametrize("length, bounds, zero_at", [
    pytest.param(16, [], None, id="one-segment-L16"),
    pytest.param(16, [5, 6, 11], None, id="segments-L16"),
    pytest.param(64, [0, 15, 40], None, id="segments-L64"),
    pytest.param(32, [9], 20, id="zero-decay-L32"),
    pytest.param(2, [], None, id="L2"),
])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_channel_grams_and_running_products_match_pair_by_pair(length, bounds, zero_at, dtype):
    (left, k, step), exact, seg, keep = _inputs(length, bounds, dtype, zero_at)
    s2, prefix, suffix = channel_grams(left, k, step, keep)
    want_s2, want_prefix, want_suffix = _oracle(*exact, seg)
    # Akk's diagonal is not meaningful (the WY solve treats it as unit): compare its strict part
    s2 = s2.clone()
    s2[:, 1].diagonal(dim1=-2, dim2=-1).zero_()
    for got, want in ((s2, want_s2), (prefix, want_prefix), (suffix, want_suffix)):
        assert got.dtype == dtype and got.shape == want.shape
        err = (got.double() - want).abs().max().item()
        bound = FP64_ABS if dtype == torch.float64 else FP32_REL * max(want.abs().max().item(), 1.0)
        assert err <= bound, (err, bound)
    # cross-segment pairs are exact zeros, the last token's suffix is exactly 1
    cross = (keep[0, 0] == 0).expand_as(s2[:, 0])
    assert (s2[:, 0][cross] == 0).all() and (s2[:, 1][cross] == 0).all()
    assert (suffix[:, -1] == 1).all()
    if zero_at is not None:                      # a zero decay zeroes exactly what lies across it
        assert (prefix[:, zero_at:] == 0).all() and (suffix[:, :zero_at] == 0).all()
        assert torch.isfinite(s2).all()
