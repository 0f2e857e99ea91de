import pytest
import torch
import torch.nn.functional as F

import ssm_pack as sp


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
    got = sp.segment_attention(q, k, v, pos, chunk_size=chunk, local_window=window)
    assert (got - ref).abs().max() < 1e-12
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for a, r in zip(grads, ref_grads):
        assert (a - r).abs().max() < 1e-11


def test_never_builds_the_dense_mask(monkeypatch):
    seen = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, scale=None):
        seen.append(attn_mask.numel())
        return real(q, k, v, attn_mask=attn_mask, scale=scale)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    pos = reset_positions([512] * 8)[None]
    x = torch.randn(1, 2, pos.shape[1], 8)
    sp.segment_attention(x, x, x, pos, chunk_size=256)
    assert max(seen) <= 256 * 512  # one chunk times one segment, not S * S = 4096 ** 2
