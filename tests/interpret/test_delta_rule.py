"""fla's Triton chunk kernels (GDN, KDA, Gated DeltaProduct) through ssm-pack's ops
(``backend="kernel"``) vs the reference.

Interpreter lane: see ``shims.py``. fla's kernels chunk by 64 tokens, so the sizes below put a
document across that boundary; every comparison also checks that the real kernel ran.
"""

import pytest
import torch
import torch.nn.functional as F

from mixers.ops import chunk_gated_delta_product, chunk_gated_delta_rule, chunk_kda
from ssm_pack import lengths_to_cu_seqlens
from tests.interpret import shims
from tests.support.oracles import check_close

pytestmark = shims.lane(("fla", "flash-linear-attention"))
OPS = {"gdn": chunk_gated_delta_rule, "kda": chunk_kda}
H, K, V = 2, 16, 16


def inputs(kind, rows, length, heads_v, states, dtype=torch.float32, nh=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    steps = length * nh
    q = torch.randn(rows, length, H, K, generator=g)
    k = torch.randn(rows, steps, H, K, generator=g)
    v = torch.randn(rows, steps, heads_v, V, generator=g)
    gate_shape = (rows, length, heads_v, K) if kind == "kda" else (rows, length, heads_v)
    gate = F.logsigmoid(torch.randn(gate_shape, generator=g) + 2.0)
    beta = torch.rand(rows, steps, heads_v, generator=g)
    h0 = torch.randn(states, heads_v, K, V, generator=g) if states else None
    return [None if t is None else t.to(dtype) for t in (q, k, v, gate, beta, h0)]


def run(kind, backend, tensors, nh=1, **kwargs):
    """Output, final state, and the gradient of a random projection of both, for one backend."""
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in tensors]
    q, k, v, g, beta, h0 = leaves
    if kind == "gdp":
        o, s = chunk_gated_delta_product(q, k, v, g, beta, nh, initial_state=h0, output_final_state=True,
                                         backend=backend, **kwargs)
    else:
        o, s = OPS[kind](q, k, v, g, beta, initial_state=h0, output_final_state=True, backend=backend, **kwargs)
    gen = torch.Generator().manual_seed(7)
    loss = (o.float() * torch.randn(o.shape, generator=gen)).sum() + \
        (s.float() * torch.randn(s.shape, generator=gen)).sum()
    present = [t for t in leaves if t is not None]
    return o, s, torch.autograd.grad(loss, present)


def assert_matches(kernel, reference, dtype):
    (o, s, grads), (ro, rs, rgrads) = kernel, reference
    check_close(o.float(), ro.float(), dtype, what="output")
    check_close(s.float(), rs.float(), dtype, what="final state")
    for name, got, want in zip(("q", "k", "v", "g", "beta", "initial_state"), grads, rgrads):
        check_close(got.float(), want.float(), dtype, grad=True, what=f"d{name}")


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_packed_grouped_values_with_states(upstream_calls, kind):
    """Empty documents, a document across fla's 64-token chunk, a padding tail, one initial state
    per document, grouped value heads (HV = 2 H), l2-normalised q and k in the kernel."""
    lengths = [0, 5, 70, 0, 9]
    cu = lengths_to_cu_seqlens(lengths)
    tensors = inputs(kind, 1, sum(lengths) + 4, 2 * H, len(lengths))
    kwargs = dict(cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    kernel = run(kind, "kernel", tensors, **kwargs)
    assert upstream_calls[kind] == 1
    assert_matches(kernel, run(kind, "reference", tensors, **kwargs), torch.float32)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_rows_with_row_states_and_scale(upstream_calls, kind):
    """Unpacked: two rows, one initial state per row, an explicit scale, no kernel l2 norm."""
    g = torch.Generator().manual_seed(3)
    q, k, v, gate, beta, h0 = inputs(kind, 2, 20, H, 2)
    q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)      # bounded keys without the kernel's norm
    tensors = [q, k, v, gate, beta, h0 + 0.1 * torch.randn(h0.shape, generator=g)]
    kernel = run(kind, "kernel", tensors, scale=0.3)
    assert upstream_calls[kind] == 1
    assert_matches(kernel, run(kind, "reference", tensors, scale=0.3), torch.float32)


def test_gated_delta_product_fp16(upstream_calls):
    """fla's Gated DeltaProduct kernel refuses fp32 and the interpreter cannot do bf16 arithmetic
    (bf16 is stored as uint16 there): fp16 is the dtype the lane can check."""
    lengths = [3, 0, 18]
    cu = lengths_to_cu_seqlens(lengths)
    tensors = inputs("gdp", 1, sum(lengths) + 2, H, len(lengths), dtype=torch.float16, nh=2)
    kwargs = dict(cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    kernel = run("gdp", "kernel", tensors, nh=2, **kwargs)
    assert upstream_calls["gdp"] == 1
    assert_matches(kernel, run("gdp", "reference", tensors, nh=2, **kwargs), torch.float16)


def test_upstream_gated_delta_product_refuses_fp32(upstream_calls):
    """fla asserts on fp32 inputs; dispatch knows: auto takes the reference, "kernel" raises."""
    import mixers.ops.delta_rule.kernel as delta
    cu = lengths_to_cu_seqlens([4, 6])
    q, k, v, g, beta, _ = inputs("gdp", 1, 10, H, 0, nh=2)
    with pytest.raises(AssertionError, match="does not support float32"):
        delta.load_upstream("gdp")(q, k, v, g, beta, num_householder=2, cu_seqlens=cu.long())
    calls = upstream_calls["gdp"]
    chunk_gated_delta_product(q, k, v, g, beta, 2, cu_seqlens=cu)
    assert upstream_calls["gdp"] == calls
    with pytest.raises(ValueError, match="float32"):
        chunk_gated_delta_product(q, k, v, g, beta, 2, cu_seqlens=cu, backend="kernel")


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_fused_recurrent_decode_step(monkeypatch, kind):
    """fla's fused recurrent kernel of each kind (decoding, one token per row; fla alone, no mamba-ssm):
    three rows, per-row initial states, grouped values, in-kernel l2 norm, against the reference step."""
    import mixers.ops.delta_rule.update_kernel as recurrent
    from mixers.ops import fused_recurrent_gated_delta_rule, fused_recurrent_kda
    loaded, load = [], recurrent.load_upstream
    monkeypatch.setattr(recurrent, "load_upstream", lambda name: loaded.append(name) or load(name))
    q, k, v, gate, beta, h0 = inputs(kind, 3, 1, 2 * H, 3)
    op = fused_recurrent_kda if kind == "kda" else fused_recurrent_gated_delta_rule
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    (o, s), (ro, rs) = (op(q, k, v, gate, beta, backend=backend, **kw) for backend in ("kernel", "reference"))
    assert loaded == [kind]
    check_close(o, ro, torch.float32, what="out")
    check_close(s, rs, torch.float32, what="state")
