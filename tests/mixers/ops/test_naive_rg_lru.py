"""rg_lru's specification (``naive.py``) against RecurrentGemma's own formulation, written here
plainly: one pass over the row with a reset flag per token (``position == 0``), the decay zeroed
and the normalisation switched off where it is set."""

import pytest
import torch
import torch.nn.functional as F

from mixers.ops.rg_lru.naive import rg_lru_naive
from ssm_pack import lengths_to_cu_seqlens
from tests.support.oracles import check_close

D = 4


def _flag_oracle(x, gate_x, gate_a, lam, reset):
    """``x, gate_x, gate_a [T, D]``, ``reset [T]`` bool: the row as RecurrentGemma computes it."""
    log_a = -8.0 * torch.sigmoid(gate_a) * F.softplus(lam)
    a = torch.exp(log_a) * ~reset[:, None]
    mult = torch.where(reset[:, None], torch.ones_like(log_a), torch.sqrt(1 - torch.exp(2 * log_a)))
    inputs = x * torch.sigmoid(gate_x) * mult
    h, out = torch.zeros(x.shape[1], dtype=x.dtype), []
    for t in range(x.shape[0]):
        h = a[t] * h + inputs[t]
        out.append(h)
    return torch.stack(out)


@pytest.mark.parametrize("lengths, tail", [
    pytest.param([5, 0, 1, 2, 9], 0, id="uneven-empty-one-two"),
    pytest.param([3, 1], 4, id="tail"),
    pytest.param([7], 0, id="one-document"),
])
def test_spec_matches_reset_flags(lengths, tail):
    g = torch.Generator().manual_seed(0)
    total = sum(lengths) + tail
    x, gx, ga = (torch.randn(1, total, D, generator=g, dtype=torch.float64) for _ in range(3))
    lam = torch.randn(D, generator=g, dtype=torch.float64)
    cu = lengths_to_cu_seqlens(lengths)
    reset = torch.zeros(total, dtype=torch.bool)
    for start in cu[:-1].tolist() + [sum(lengths)]:
        if start < total:
            reset[start] = True
    out, _ = rg_lru_naive(x, gx, ga, lam, cu_seqlens=cu)
    check_close(out[0], _flag_oracle(x[0], gx[0], ga[0], lam, reset), torch.float64, what="out")


def test_spec_resets_at_boundaries():
    """Negative control: one document instead of two changes the second one's output."""
    g = torch.Generator().manual_seed(1)
    x, gx, ga = (torch.randn(1, 7, D, generator=g, dtype=torch.float64) for _ in range(3))
    lam = torch.randn(D, generator=g, dtype=torch.float64)
    apart, _ = rg_lru_naive(x, gx, ga, lam, cu_seqlens=torch.tensor([0, 3, 7]))
    joined, _ = rg_lru_naive(x, gx, ga, lam, cu_seqlens=torch.tensor([0, 7]))
    assert torch.equal(apart[:, :3], joined[:, :3])
    assert (apart[:, 3:] - joined[:, 3:]).abs().min() > 0


def test_continuing_state_is_one_sequence():
    """A document continuing the state of its first half equals the whole document."""
    g = torch.Generator().manual_seed(2)
    x, gx, ga = (torch.randn(1, 9, D, generator=g, dtype=torch.float64) for _ in range(3))
    lam = torch.randn(D, generator=g, dtype=torch.float64)
    whole, final = rg_lru_naive(x, gx, ga, lam)
    first, h = rg_lru_naive(x[:, :4], gx[:, :4], ga[:, :4], lam)
    second, final2 = rg_lru_naive(x[:, 4:], gx[:, 4:], ga[:, 4:], lam, initial_state=h)
    check_close(torch.cat([first, second], 1), whole, torch.float64, what="out")
    check_close(final2, final, torch.float64, what="final")
