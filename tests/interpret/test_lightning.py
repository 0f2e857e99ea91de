"""fla's Triton ``chunk_simple_gla`` (MiniMax's lightning attention) through ssm-pack's op
(``backend="kernel"``) vs the token-by-token spec in fp64.

Interpreter lane: see ``shims.py``. fla chunks by 64 tokens, so one document crosses that boundary;
empty documents (first, between, last), a one-token document and a padding tail check the wrapper's
reordered boundaries and states; every comparison also checks that the real kernel ran.
"""

import pytest
import torch

from mixers.ops import chunk_simple_gla
from mixers.ops.lightning.naive import simple_gla_naive
from ssm_pack import lengths_to_cu_seqlens
from tests.interpret import shims
from tests.support.oracles import check_close

pytestmark = shims.lane(("fla", "flash-linear-attention"))
H, K, V = 2, 16, 16


def leaves(rows, total, states, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(rows, total, H, K, generator=g) * 0.5 for _ in range(2))
    v = torch.randn(rows, total, H, V, generator=g)
    h0 = torch.randn(states, H, K, V, generator=g)
    return [t.requires_grad_() for t in (q, k, v, h0)]


def outputs(o, final, tensors):
    """``(o, final, grads of q, k, v, h0)`` for a fixed random projection of o and final."""
    g = torch.Generator().manual_seed(7)
    loss = (o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64)).sum() + \
        (final.double() * torch.randn(final.shape, generator=g, dtype=torch.float64)).sum()
    return (o, final, *torch.autograd.grad(loss, tensors))


def assert_matches(kernel, spec, dtype=torch.float32):
    for name, got, want in zip(("output", "final state", "dq", "dk", "dv", "dh0"), kernel, spec):
        check_close(got.double(), want.double(), dtype, grad=name.startswith("d"), what=name)


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16")])
@pytest.mark.parametrize("lengths, tail", [
    pytest.param([0, 1, 70, 0, 9, 0], 3, id="empties-one-token-across-a-chunk-tail"),
])
def test_packed_documents_with_states(upstream_calls, lengths, tail, dtype):
    """Per-document initial states (fp32, any input dtype) and final states; the spec runs in fp64 on the
    same values."""
    cu = lengths_to_cu_seqlens(lengths)
    gamma = -torch.linspace(0.05, 0.6, H)
    q, k, v, h0 = leaves(1, int(cu[-1]) + tail, len(lengths))
    tensors = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)] + [h0]
    q, k, v, h0 = tensors
    o, final = chunk_simple_gla(q, k, v, g_gamma=gamma, scale=0.5, initial_state=h0, output_final_state=True,
                                cu_seqlens=cu, backend="kernel")
    assert upstream_calls["simple_gla"] == 1 and upstream_calls["ssd"] == 0
    kernel = outputs(o, final, tensors)
    o_ref, f_ref = simple_gla_naive(*(t.double() for t in (q, k, v)), gamma.double(), scale=0.5,
                                    initial_state=h0.double(), output_final_state=True, cu_seqlens=cu)
    assert o.dtype == dtype and final.dtype == torch.float32
    assert_matches(kernel, outputs(o_ref, f_ref, tensors), dtype)


def test_rows_with_row_states_default_scale(upstream_calls):
    """Unpacked: two rows, one initial state per row, fla's default scale ``1 / sqrt(K)``."""
    gamma = -torch.linspace(0.02, 0.3, H)
    tensors = leaves(2, 20, 2, seed=3)
    q, k, v, h0 = tensors
    o, final = chunk_simple_gla(q, k, v, g_gamma=gamma, initial_state=h0, output_final_state=True, backend="kernel")
    assert upstream_calls["simple_gla"] == 1
    kernel = outputs(o, final, tensors)
    o_ref, f_ref = simple_gla_naive(*(t.double() for t in (q, k, v)), gamma.double(), initial_state=h0.double(),
                                    output_final_state=True)
    assert_matches(kernel, outputs(o_ref, f_ref, tensors))
