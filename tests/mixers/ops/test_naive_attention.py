"""varlen_attention's torch backend against its specification (``naive.py``), and the
specification against one dense masked ``scaled_dot_product_attention`` over the whole row."""

import pytest
import torch
import torch.nn.functional as F

from mixers.ops import varlen_attention
from mixers.ops.attention.naive import varlen_attention_naive
from ssm_pack import lengths_to_cu_seqlens
from tests.mixers.ops.naive_compare import assert_same
from tests.support.oracles import check_close, documents

D = 4

CASES = [
    pytest.param([5, 0, 1, 9, 2], 0, 2, 1, True, None, id="causal-uneven-empty-one-token-gqa"),
    pytest.param([1, 0, 11], 3, 2, 2, False, None, id="bidirectional-tail"),
    pytest.param([6, 1, 8], 0, 1, 1, True, (2, 0), id="causal-window-2"),
    pytest.param([7, 4], 2, 2, 2, False, (1, 3), id="window-1-3"),
]


def _inputs(lengths, tail, hq, hk, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cu = lengths_to_cu_seqlens(lengths)
    total = sum(lengths) + tail
    q = torch.randn(total, hq, D, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(total, hk, D, generator=gen, dtype=torch.float64) for _ in range(2))
    return cu, (q, k, v)


@pytest.mark.parametrize("lengths, tail, hq, hk, causal, window", CASES)
def test_torch_backend_matches_spec(lengths, tail, hq, hk, causal, window):
    cu, inputs = _inputs(lengths, tail, hq, hk)

    def backend(q, k, v):
        return (varlen_attention(q, k, v, cu, causal=causal, window_size=window, backend="reference"),)

    def spec(q, k, v):
        return (varlen_attention_naive(q, k, v, cu, causal=causal, window_size=window),)

    assert_same(backend, spec, inputs, what="attention")


def test_default_call_matches_spec():
    cu, (q, k, v) = _inputs([3, 1, 0, 6], 0, 2, 2)
    check_close(varlen_attention(q, k, v, cu), varlen_attention_naive(q, k, v, cu), torch.float64,
                what="default call")


def _dense_oracle(q, k, v, cu, causal, window):
    """One ``[T, T]`` mask (same document, causal, window) and PyTorch's own attention."""
    total = q.shape[0]
    doc = torch.empty(total, dtype=torch.long)
    for i, (s, e) in enumerate(documents(cu, total)):
        doc[s:e] = i
    i, j = torch.arange(total)[:, None], torch.arange(total)[None, :]
    keep = doc[:, None] == doc[None, :]
    if causal:
        keep &= j <= i
    if window is not None:
        keep &= (j >= i - window[0]) & (j <= i + window[1])
    groups = q.shape[1] // k.shape[1]
    kk, vv = (t.repeat_interleave(groups, dim=1).transpose(0, 1) for t in (k, v))
    return F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=keep).transpose(0, 1)


@pytest.mark.parametrize("lengths, tail, hq, hk, causal, window", CASES)
def test_spec_matches_oracle(lengths, tail, hq, hk, causal, window):
    cu, (q, k, v) = _inputs(lengths, tail, hq, hk, seed=3)
    check_close(varlen_attention_naive(q, k, v, cu, causal=causal, window_size=window),
                _dense_oracle(q, k, v, cu, causal, window), torch.float64, what="out")


def test_spec_resets_at_boundaries():
    """Negative control: joining two documents into one changes the second one's output."""
    cu, (q, k, v) = _inputs([3, 4], 0, 1, 1)
    apart = varlen_attention_naive(q, k, v, cu)
    joined = varlen_attention_naive(q, k, v, torch.tensor([0, 7], dtype=torch.int32))
    torch.testing.assert_close(apart[:3], joined[:3])
    assert (apart[3:] - joined[3:]).abs().max() > 1e-3
