"""What ops return for a call of no token (mixers.ops.common.empty), called directly: the check,
the final states passed through as a differentiable copy in the asked dtype, or zeros, and the
empty output on the source's graph."""

import pytest
import torch

from mixers.ops.common.empty import empty_output, no_tokens, passed_through


@pytest.mark.parametrize("tokens, want", [pytest.param(0, True, id="none"), pytest.param(1, False, id="one"),
                                          pytest.param(5, False, id="some")])
def test_no_tokens(tokens, want):
    assert no_tokens(tokens) is want


@pytest.mark.parametrize("dtype, want", [pytest.param(None, torch.float16, id="like-dtype"),
                                         pytest.param(torch.float32, torch.float32, id="asked-dtype")])
def test_without_initial_state_the_final_states_are_zeros(dtype, want):
    like = torch.ones(0, 3, dtype=torch.float16)
    got = passed_through(None, (2, 3, 4), like, dtype)
    assert got.shape == (2, 3, 4) and got.dtype == want and not got.any()


@pytest.mark.parametrize("dtype, want", [pytest.param(None, torch.float16, id="like-dtype"),
                                         pytest.param(torch.float32, torch.float32, id="asked-dtype")])
def test_an_initial_state_is_passed_through_as_a_differentiable_copy(dtype, want):
    initial = torch.arange(6, dtype=torch.float64).reshape(2, 3).requires_grad_()
    like = torch.ones(0, 3, dtype=torch.float16)
    got = passed_through(initial, (9, 9), like, dtype)
    assert got.dtype == want and got.shape == (2, 3)
    torch.testing.assert_close(got.double(), initial.detach())
    with torch.no_grad():
        got.add_(1)                                              # a copy: writing into it changes nothing else
    assert initial[1, 2].item() == 5
    (grad,) = torch.autograd.grad(passed_through(initial, (9, 9), like, dtype).sum(), initial)
    torch.testing.assert_close(grad, torch.ones_like(initial))


@pytest.mark.parametrize("dtype, want", [pytest.param(None, torch.bfloat16, id="source-dtype"),
                                         pytest.param(torch.float32, torch.float32, id="asked-dtype")])
def test_the_empty_output_is_on_the_sources_graph(dtype, want):
    source = torch.zeros(0, 4, dtype=torch.bfloat16, requires_grad=True)
    got = empty_output(source, (0, 4, 2), dtype)
    assert got.shape == (0, 4, 2) and got.dtype == want and got.requires_grad
    (grad,) = torch.autograd.grad(got.sum(), source)
    assert grad.shape == source.shape
