"""The shared next-token loss (mixers.model.loss) called directly: the mean over counted targets
(``-100`` ignored) against a loop oracle, outputs and gradients, zero with no target, fp32 at least,
and the context-parallel share handed the sum and the counted mask."""

import pytest
import torch

import mixers.model.loss as loss_module
from mixers.model.loss import IGNORE_INDEX, next_token_loss


def oracle(logits, targets):
    """Mean of -log softmax at each target that is not -100, one position at a time (0 with none)."""
    terms = [-torch.log_softmax(row.double(), -1)[t] for row, t in zip(logits.reshape(-1, logits.shape[-1]),
                                                                       targets.reshape(-1).tolist()) if t != -100]
    return torch.stack(terms).mean() if terms else logits.double().sum() * 0


@pytest.mark.parametrize("shape, ignored", [
    pytest.param((1, 7, 5), [1, 4], id="row-some-ignored"),
    pytest.param((2, 3, 11), [], id="two-rows-none-ignored"),
    pytest.param((9, 4), [0, 1, 2, 3, 4, 5, 6, 7], id="flat-one-counted"),
    pytest.param((1, 5, 3), [0, 1, 2, 3, 4], id="all-ignored"),
])
def test_mean_over_counted_targets_matches_the_oracle(shape, ignored):
    torch.manual_seed(0)
    logits = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, shape[-1], shape[:-1])
    targets.view(-1)[ignored] = -100
    got = next_token_loss(logits, targets)
    want = oracle(logits, targets)
    torch.testing.assert_close(got, want.to(got.dtype))
    (g_got,) = torch.autograd.grad(got, logits)
    (g_want,) = torch.autograd.grad(want, logits)
    torch.testing.assert_close(g_got, g_want)
    assert torch.isfinite(got) and (got != 0) == (len(ignored) < targets.numel())


def test_ignore_index_is_pytorchs():
    assert IGNORE_INDEX == -100                         # what collators write for "no target"


def test_low_precision_logits_are_reduced_in_fp32():
    logits = torch.randn(1, 6, 7).to(torch.bfloat16)
    targets = torch.tensor([[1, 2, 3, -100, 5, 6]])
    assert next_token_loss(logits, targets).dtype == torch.float32


@pytest.mark.parametrize("cp", [pytest.param(None, id="single-process"), pytest.param(object(), id="cp-run")])
def test_context_parallel_share_gets_the_sum_and_the_counted_mask(monkeypatch, cp):
    seen = []

    def share(run, total, counted):
        seen.append((run, total, counted))
        return total * 0 + 123.0

    monkeypatch.setattr(loss_module, "mean_share", share)
    logits = torch.randn(1, 4, 3, dtype=torch.float64)
    targets = torch.tensor([[2, -100, 0, 1]])
    got = next_token_loss(logits, targets, cp)
    if cp is None:
        assert not seen
        torch.testing.assert_close(got, oracle(logits, targets))
    else:
        ((run, total, counted),) = seen
        assert run is cp and float(got) == 123.0
        torch.testing.assert_close(total, oracle(logits, targets) * 3)
        assert counted.tolist() == [True, False, True, True]
