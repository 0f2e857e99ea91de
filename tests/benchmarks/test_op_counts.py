"""``benchmarks.op_counts.MatmulCounter`` against multiply-adds worked out by hand.

A linear's forward + backward is three products of its size (``y = x W^T``, ``dx = dy W``,
``dW = dy^T x``), filed under the projections; a ``bmm`` of ``[b, m, k] @ [b, k, n]`` is ``b m k n``
once forward and twice backward, filed under the rest; fused SDPA follows its formula; a
product-like op without a rule is reported, not dropped.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks.op_counts import MatmulCounter, count_training_step


class _Toy(torch.nn.Module):
    def __init__(self, bias: bool):
        super().__init__()
        self.proj = torch.nn.Linear(4, 3, bias=bias)
        self.low_rank = torch.nn.Sequential(torch.nn.Linear(4, 2, bias=False), torch.nn.Linear(2, 6, bias=False))

    def forward(self, x, other):
        y = self.proj(x)                                             # [2, 5, 3]
        z = torch.bmm(y.transpose(1, 2), other)                      # [2, 3, 5] @ [2, 5, 7]
        return z.sum() + self.low_rank(x).sum() + F.linear(x, self.proj.weight).sum()


@pytest.mark.parametrize("bias", [pytest.param(False, id="mm"), pytest.param(True, id="addmm")])
@pytest.mark.parametrize("other_grad", [pytest.param(True, id="both_grads"), pytest.param(False, id="one_grad")])
def test_counts_by_hand(bias, other_grad):
    toy = _Toy(bias)
    x = torch.randn(2, 5, 4, requires_grad=True)
    other = torch.randn(2, 5, 7, requires_grad=other_grad)
    with MatmulCounter(toy) as counter:
        toy(x, other).backward()
    tokens = 10
    linear = 3 * tokens * (4 * 3 + 4 * 2 + 2 * 6 + 4 * 3)      # proj, the low-rank pair, F.linear on proj's weight
    bmm = 2 * 3 * 5 * 7
    assert counter.macs == {"projections": linear, "other": bmm * (3 if other_grad else 2)}
    assert not counter.unknown


def test_a_wrong_size_changes_the_count():
    """Negative control: the count follows the shapes (one token more, more multiply-adds)."""
    counts = []
    for tokens in (5, 6):
        lin = torch.nn.Linear(4, 3, bias=False)
        with MatmulCounter(lin) as counter:
            lin(torch.randn(tokens, 4, requires_grad=True)).sum().backward()
        counts.append(counter.macs["projections"])
    assert counts == [3 * 5 * 12, 3 * 6 * 12]


@pytest.mark.parametrize("route", [pytest.param("fused", id="fused"), pytest.param("math", id="math")])
def test_sdpa_either_route(route):
    """Fused CPU SDPA by its formula (forward q k and p v, backward the scores again, dV, dP, dQ,
    dK); the math route decomposes into ``bmm`` (2 forward, 4 backward) and counts them."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = (torch.randn(1, 2, n, 8, requires_grad=True) for n in (6, 9, 9))
    backend = SDPBackend.FLASH_ATTENTION if route == "fused" else SDPBackend.MATH
    with sdpa_kernel(backend), MatmulCounter(torch.nn.Module()) as counter:
        F.scaled_dot_product_attention(q, k, v).sum().backward()
    pairs = 2 * 6 * 9
    names = {name for _, name in counter.by_op}
    if route == "fused":
        assert names == {"_scaled_dot_product_flash_attention_for_cpu",
                         "_scaled_dot_product_flash_attention_for_cpu_backward"}
        assert counter.macs["other"] == pairs * (8 + 8) + pairs * (3 * 8 + 2 * 8)
    else:
        assert names == {"bmm"} and counter.macs["other"] == pairs * 8 * (2 + 4)
    assert not counter.unknown


def test_a_product_without_a_rule_is_reported():
    with MatmulCounter(torch.nn.Module()) as counter:
        torch.mv(torch.randn(3, 4), torch.randn(4))
    assert counter.unknown == {"mv.default"} and counter.macs == {"projections": 0, "other": 0}


class _Layer(torch.nn.Module):
    """A mixer's calling convention: ``config.hidden_size``, ``forward(x, packed_seq_params=...)``."""

    def __init__(self, rule_less: bool):
        super().__init__()
        self.config = type("Config", (), {"hidden_size": 4})()
        self.proj = torch.nn.Linear(4, 4, bias=False)
        self.rule_less = rule_less

    def forward(self, x, packed_seq_params=None):
        y = self.proj(x)
        return y * torch.mv(self.proj.weight, y[0, 0]).sum() if self.rule_less else y


def test_a_training_step_is_counted_or_refused():
    """``count_training_step``: a linear's three products over the row; a product without a rule
    makes it raise, naming the op, instead of returning a short count."""
    assert count_training_step(_Layer(False), None, 5) == {"projections": 3 * 5 * 4 * 4, "other": 0}
    with pytest.raises(RuntimeError, match=r"_Layer: products the counter has no rule for: \['mv.default'\]"):
        count_training_step(_Layer(True), None, 5)
