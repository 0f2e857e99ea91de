"""The argument checks every op shares (``mixers.ops.common.checks``), reached the way users call the
ops: one packed row, a ``seq_idx`` that must agree with the boundaries, the delta rule's chunk."""

from __future__ import annotations

import pytest
import torch

from mixers.ops import causal_conv1d_fn, chunk_gated_delta_rule
from mixers.ops.common.checks import check_chunk_size, varlen_of

DIM, T = 6, 5
CU = torch.tensor([0, 2, 5], dtype=torch.int32)


def test_one_packed_row_only():
    with pytest.raises(ValueError, match=r"cu_seqlens needs one packed row \(B == 1\), got B=2; flatten"):
        varlen_of(CU, 2, T, "cpu")
    assert varlen_of(CU, 1, T, "cpu").cu_seqlens.tolist() == [0, 2, 5]


@pytest.mark.parametrize("seq_idx, agrees", [
    pytest.param([[0, 0, 1, 1, 1]], True, id="same-documents"),
    pytest.param([[0, 0, 0, 1, 1]], False, id="boundary-moved"),
    pytest.param([[0, 0, 1, 1, 2]], False, id="one-more-document"),
])
def test_a_seq_idx_given_with_the_boundaries_must_describe_them(seq_idx, agrees):
    """Through the conv op (``seq_idx`` and ``cu_seqlens`` together) and the shared check itself."""
    seq_idx = torch.tensor(seq_idx, dtype=torch.int32)
    x, w = torch.randn(1, DIM, T, dtype=torch.float64), torch.randn(DIM, 4, dtype=torch.float64)
    if agrees:
        torch.testing.assert_close(causal_conv1d_fn(x, w, cu_seqlens=CU, seq_idx=seq_idx),
                                   causal_conv1d_fn(x, w, cu_seqlens=CU), rtol=0, atol=0)
        assert varlen_of(CU, 1, T, "cpu", seq_idx).seq_idx.tolist() == seq_idx.tolist()
        return
    for call in (lambda: causal_conv1d_fn(x, w, cu_seqlens=CU, seq_idx=seq_idx),
                 lambda: varlen_of(CU, 1, T, "cpu", seq_idx)):
        with pytest.raises(ValueError, match="seq_idx and cu_seqlens describe different documents; pass only"):
            call()


@pytest.mark.parametrize("chunk, error", [
    pytest.param(2, None, id="two-the-smallest"),
    pytest.param(64, None, id="sixty-four"),
    pytest.param(1, "chunk_size must be >= 2", id="one"),
    pytest.param(24, "chunk_size must be a power of two, got 24", id="not-a-power-of-two"),
])
def test_the_chunk_is_a_power_of_two_from_two(chunk, error):
    if error is None:
        assert check_chunk_size(chunk) == chunk
        q = k = torch.nn.functional.normalize(torch.randn(1, 4, 2, 4, dtype=torch.float64), dim=-1)
        v, g = torch.randn(1, 4, 2, 4, dtype=torch.float64), -torch.rand(1, 4, 2, dtype=torch.float64)
        beta = torch.rand(1, 4, 2, dtype=torch.float64)
        out, _ = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk)
        want, _ = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=4)
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
        return
    with pytest.raises(ValueError, match=error):
        check_chunk_size(chunk)
