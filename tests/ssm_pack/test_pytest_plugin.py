"""``ssm_pack.pytest_plugin``: the ``layout`` helper's defaults (no padding, no tail, seed 0, fp32)."""

import torch

from ssm_pack.pytest_plugin import layout


def _randn(total, hidden, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, total, hidden, generator=g, dtype=torch.float64)


def test_layout_defaults_pack_the_documents_back_to_back():
    x, params = layout([3, 0, 5], hidden=2)
    assert params.cu_seqlens_q.tolist() == [0, 3, 3, 8]
    assert params.cu_seqlens_q_padded is None and params.total_tokens == 8
    assert x.shape == (1, 8, 2) and x.dtype == torch.float32
    assert torch.equal(x, _randn(8, 2, seed=0).to(torch.float32))
    assert not torch.equal(x, layout([3, 0, 5], hidden=2, seed=1)[0])        # control: the seed matters


def test_layout_pads_and_adds_the_tail_when_asked():
    x, params = layout([3, 5], hidden=2, dtype=torch.float64, pad_to_multiple_of=4, tail=2, seed=3)
    assert params.cu_seqlens_q.tolist() == [0, 3, 8]
    assert params.cu_seqlens_q_padded.tolist() == [0, 4, 12] and params.total_tokens == 14
    assert torch.equal(x, _randn(14, 2, seed=3))

