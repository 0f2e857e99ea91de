"""fla's Triton ``fused_recurrent_hgrn`` (the RG-LRU's recurrence) through ``rg_lru(backend="kernel")``
against the spec (:mod:`mixers.ops.rg_lru.naive`, fp64): outputs, final states, every gradient.

Interpreter lane: see ``shims.py``. fla's kernel runs one program per document and block of
channels, so the cases below give it documents of 1 and 0 tokens, a padding tail, initial states
that some documents continue and a channel count that is not a multiple of its block.
"""

import pytest
import torch

from mixers.ops.rg_lru import rg_lru
from mixers.ops.rg_lru.naive import rg_lru_naive
from ssm_pack import lengths_to_cu_seqlens
from tests.interpret import shims
from tests.support.oracles import check_close

pytestmark = shims.lane(("fla", "flash-linear-attention"))
D = 37


def inputs(rows, length, states, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, gate_x, gate_a = (torch.randn(rows, length, D, generator=g) for _ in range(3))
    lam = torch.randn(D, generator=g)
    h0 = torch.randn(states, D, generator=g) if states else None
    return [x, gate_x, gate_a, lam, h0]


def run(op, tensors, dtype, **kwargs):
    """Output, final state, and the gradients of a random projection of both."""
    leaves = [None if t is None else t.detach().to(dtype).requires_grad_() for t in tensors]
    x, gate_x, gate_a, lam, h0 = leaves
    out, final = op(x, gate_x, gate_a, lam, initial_state=h0, **kwargs)
    gen = torch.Generator().manual_seed(7)
    loss = (out.double() * torch.randn(out.shape, generator=gen, dtype=torch.float64)).sum() + \
        (final.double() * torch.randn(final.shape, generator=gen, dtype=torch.float64)).sum()
    present = [t for t in leaves if t is not None]
    return out, final, torch.autograd.grad(loss, present)


def kernel(*args, **kwargs):
    return rg_lru(*args, output_final_state=True, backend="kernel", **kwargs)


def assert_matches(got, want):
    (o, s, grads), (ro, rs, rgrads) = got, want
    check_close(o.double(), ro, torch.float32, what="output")
    check_close(s.double(), rs, torch.float32, what="final state")
    for name, a, b in zip(("x", "gate_x", "gate_a", "recurrent_param", "initial_state"), grads, rgrads):
        check_close(a.double(), b, torch.float32, grad=True, what=f"d{name}")


@pytest.mark.parametrize("states", ["none", "some-continue"])
def test_packed_documents_match_spec(upstream_calls, states):
    lengths, tail = [1, 0, 9, 2, 0, 5], 3
    cu = lengths_to_cu_seqlens(lengths)
    tensors = inputs(1, sum(lengths) + tail, len(lengths) if states != "none" else 0)
    continues = torch.tensor([True, False, True, False, True, True]) if states != "none" else None
    kwargs = dict(cu_seqlens=cu, continues=continues)
    got = run(kernel, tensors, torch.float32, **kwargs)
    assert upstream_calls["hgrn"] == 1
    assert_matches(got, run(rg_lru_naive, tensors, torch.float64, **kwargs))


def test_rows_with_row_states_match_spec(upstream_calls):
    tensors = inputs(2, 7, 2, seed=3)
    got = run(kernel, tensors, torch.float32)
    assert upstream_calls["hgrn"] == 1
    assert_matches(got, run(rg_lru_naive, tensors, torch.float64))
