import pytest
import torch
import torch.nn.functional as F

import ssm_pack as sp
from mixers.ops import segment_attention


def reset_positions(lengths):
    return torch.cat([torch.arange(n) for n in lengths])


@pytest.mark.parametrize("lengths,chunk,window,hk", [
    pytest.param([[1, 15, 100, 300]], 64, None, 4, id="uneven"),
    pytest.param([[50, 50], [100]], 7, None, 4, id="two-rows"),
    pytest.param([[3] * 40], 16, None, 2, id="many-short-gqa"),
    pytest.param([[200, 56]], 32, 17, 4, id="window"),
])
def test_matches_sdpa_with_the_dense_mask(lengths, chunk, window, hk):
    pos = torch.stack([reset_positions(row) for row in lengths])
    b, s = pos.shape
    q = torch.randn(b, 4, s, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, hk, s, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, hk, s, 8, dtype=torch.float64, requires_grad=True)
    keep = sp.dense_segment_keep(pos)
    if window is not None:
        i = torch.arange(s)
        keep = keep & (i[None, :] > i[:, None] - window)
    g = 4 // hk
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), attn_mask=keep)
    got = segment_attention(q, k, v, pos, chunk_size=chunk, local_window=window)
    assert (got - ref).abs().max() < 1e-12
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for a, r in zip(grads, ref_grads):
        assert (a - r).abs().max() < 1e-11


def test_never_builds_the_dense_mask(monkeypatch):
    """Each block of queries only sees a window of keys sized by the longest segment, not the row."""
    widths = []
    real = torch.logsumexp

    def spy(scores, dim, keepdim=False):
        widths.append(scores.shape[-1])
        return real(scores, dim, keepdim=keepdim)

    monkeypatch.setattr(torch, "logsumexp", spy)
    for segments in (8, 16):                              # the row doubles, the window does not
        pos = reset_positions([512] * segments)[None]
        x = torch.randn(1, 2, pos.shape[1], 8)
        segment_attention(x, x, x, pos, chunk_size=256)
    assert set(widths) == {512 + 256}    # 511 keys back (rounded to 2 blocks) + the block itself, not 4096


def test_non_finite_values_stay_in_their_segment():
    pos = reset_positions([30, 50, 20])[None]
    q, k, v = (torch.randn(1, 2, 100, 8, requires_grad=True) for _ in range(3))
    k_bad = k.detach().clone()
    k_bad[0, 1, 45, 3] = float("inf")
    clean = segment_attention(q, k, v, pos, chunk_size=16)
    dirty = segment_attention(q, k_bad.requires_grad_(), v, pos, chunk_size=16)
    others = torch.cat([torch.arange(30), torch.arange(80, 100)])
    assert torch.equal(clean[:, :, others], dirty[:, :, others])
    assert torch.isnan(dirty[:, :, 45:80]).all() and torch.isfinite(dirty[:, :, 30:45]).all()
    g = torch.randn_like(clean)
    grads_clean = torch.autograd.grad(clean, (q, k, v), g)
    grads_dirty = torch.autograd.grad(dirty, (q, k_bad, v), g)
    for a, b in zip(grads_clean, grads_dirty):
        assert torch.equal(a[:, :, others], b[:, :, others])


def test_a_window_of_one_token_attends_only_itself():
    """``local_window=1``: each query sees its own key alone, so the output is its own value (each
    query head reading its key/value head)."""
    pos = reset_positions([3, 9, 1, 5]).unsqueeze(0)
    q = torch.randn(1, 4, 18, 8, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 18, 8, dtype=torch.float64) for _ in range(2))
    got = segment_attention(q, k, v, pos, local_window=1)
    assert (got - v.repeat_interleave(2, 1)).abs().max() < 1e-12, "a one-token window must return v itself"
