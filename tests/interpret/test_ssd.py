"""mamba-ssm's Triton SSD scan through ``mamba_chunk_scan_combined(backend="kernel")`` vs the reference.

Interpreter lane: see ``shims.py``. Every comparison also checks that the real kernel ran.
"""

import math

import pytest
import torch

from mixers.ops import mamba_chunk_scan_combined
from ssm_pack import lengths_to_cu_seqlens
from ssm_pack.formats.seq_idx import seq_idx_from_cu_seqlens
from tests.interpret import shims
from tests.support.oracles import check_close, rel_rms

pytestmark = shims.lane(("mamba_ssm", "mamba-ssm"), ("einops", "einops"))
H, P, G, N, CHUNK = 4, 8, 2, 8, 16          # 2 heads per group, so the split dB backward runs


def inputs(rows, length, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, length, H, P, generator=g)
    dt = torch.randn(rows, length, H, generator=g) - 1.0
    A = -torch.rand(H, generator=g) - 0.5
    B, C = torch.randn(rows, length, G, N, generator=g), torch.randn(rows, length, G, N, generator=g)
    return [t.to(dtype) for t in (x, dt, B, C)][:2] + [A] + [t.to(dtype) for t in (B, C)]


def extras(rows, length, dtype, D=None, z=False, dt_bias=False, init=None, seed=1):
    """Optional arguments: D ``"head"`` [H] or ``"head_dim"`` [H, P], z, dt_bias, ``init`` rows."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    if D is not None:
        out["D"] = torch.randn(H, generator=g) if D == "head" else torch.randn(H, P, generator=g)
    if z:
        out["z"] = torch.randn(rows, length, H, P, generator=g).to(dtype)
    if dt_bias:
        out["dt_bias"] = torch.randn(H, generator=g)
    if init is not None:
        out["initial_states"] = torch.randn(init, H, P, N, generator=g).to(dtype)
    return out


def run(backend, tensors, named, **kwargs):
    """Forward, then the gradient of a random projection of every output, for one backend."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    named = {k: v.detach().clone().requires_grad_() for k, v in named.items()}
    outs = mamba_chunk_scan_combined(*leaves, CHUNK, **named, backend=backend, **kwargs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    g = torch.Generator().manual_seed(7)
    loss = sum((o.float() * torch.randn(o.shape, generator=g)).sum() for o in outs)
    grads = torch.autograd.grad(loss, leaves + list(named.values()))
    return outs, dict(zip(["x", "dt", "A", "B", "C"] + list(named), grads))


def assert_matches(kernel, reference, dtype):
    (k_outs, k_grads), (r_outs, r_grads) = kernel, reference
    for i, (k, r) in enumerate(zip(k_outs, r_outs)):
        check_close(k.float(), r.float(), dtype, what=f"output {i}")
    for name in r_grads:
        check_close(k_grads[name].float(), r_grads[name].float(), dtype, grad=True, what=f"d{name}")


CASES = [
    pytest.param(dict(lengths=[0, 5, 17, 0, 20], tail=6, D="head", z=True, dt_bias=True, dt_limit=(0.05, 3.0)),
                 id="cu_seqlens-empty-docs-tail-D-z-dt_bias-dt_limit"),
    pytest.param(dict(lengths=[0, 0, 30, 1, 17], tail=0, init=1, D="head_dim", final=True),
                 id="leading-empty-docs-row-initial-final"),
    pytest.param(dict(lengths=[20, 28], tail=0, init=1, final=True, z=True), id="row-initial-final-z"),
]


@pytest.mark.parametrize("case", CASES)
def test_packed_scan_matches_reference(upstream_calls, case):
    case = dict(case)
    lengths, tail = case.pop("lengths"), case.pop("tail")
    length = sum(lengths) + tail
    cu = lengths_to_cu_seqlens(lengths)
    kwargs = dict(cu_seqlens=cu, dt_softplus=True, return_final_states=case.pop("final", False),
                  dt_limit=case.pop("dt_limit", (0.0, math.inf)))
    named = extras(1, length, torch.float32, **case)
    tensors = inputs(1, length)
    kernel = run("kernel", tensors, named, **kwargs)
    assert upstream_calls["ssd"] == 1
    assert_matches(kernel, run("reference", tensors, named, **kwargs), torch.float32)


def test_rows_with_seq_idx_and_row_initial_states(upstream_calls):
    length = 40
    seq_idx = torch.tensor([[0] * 9 + [1] * 31, [4] * 25 + [7] * 15], dtype=torch.int32)
    tensors = inputs(2, length)
    named = extras(2, length, torch.float32, D="head", init=2)
    kwargs = dict(seq_idx=seq_idx, dt_softplus=True, return_final_states=True)
    kernel = run("kernel", tensors, named, **kwargs)
    assert upstream_calls["ssd"] == 1
    assert_matches(kernel, run("reference", tensors, named, **kwargs), torch.float32)


def test_fp16(upstream_calls):
    lengths = [3, 0, 25, 14]
    length = sum(lengths) + 6
    kwargs = dict(cu_seqlens=lengths_to_cu_seqlens(lengths), dt_softplus=True)
    tensors = inputs(1, length, torch.float16)
    named = extras(1, length, torch.float16, D="head", z=True)
    kernel = run("kernel", tensors, named, **kwargs)
    assert upstream_calls["ssd"] == 1
    assert_matches(kernel, run("reference", tensors, named, **kwargs), torch.float16)


def test_varlen_states_forward(upstream_calls):
    lengths = [0, 5, 0, 21, 16, 1]
    cu = lengths_to_cu_seqlens(lengths)
    x, dt, A, B, C = inputs(1, sum(lengths) + 5)
    with torch.no_grad():
        kernel = mamba_chunk_scan_combined(x, dt, A, B, C, CHUNK, cu_seqlens=cu, dt_softplus=True,
                                           return_final_states=True, return_varlen_states=True, backend="kernel")
        reference = mamba_chunk_scan_combined(x, dt, A, B, C, CHUNK, cu_seqlens=cu, dt_softplus=True,
                                              return_final_states=True, return_varlen_states=True,
                                              backend="reference")
    assert upstream_calls["ssd"] == 1
    for what, k, r in zip(("out", "final", "varlen"), kernel, reference):
        check_close(k, r, torch.float32, what=what)
    assert bool((kernel[2][[0, 2]] == 0).all())                     # empty documents: no state


# What upstream does differently, each pinned by calling it directly, and how dispatch handles it.

def upstream():
    import mixers.ops.ssd.kernel as ssd
    return ssd.load_upstream()


def test_upstream_does_not_reset_at_cu_seqlens_without_seq_idx(upstream_calls):
    """Upstream reads ``cu_seqlens`` only for the varlen states; ssm-pack always passes ``seq_idx``."""
    lengths = [10, 22, 16]
    cu = lengths_to_cu_seqlens(lengths)
    x, dt, A, B, C = inputs(1, 48)
    with torch.no_grad():
        raw, _ = upstream()(x, dt, A, B, C, CHUNK, cu_seqlens=cu, dt_softplus=True, return_varlen_states=True)
        ours = mamba_chunk_scan_combined(x, dt, A, B, C, CHUNK, cu_seqlens=cu, dt_softplus=True, backend="kernel")
        ref = mamba_chunk_scan_combined(x, dt, A, B, C, CHUNK, cu_seqlens=cu, dt_softplus=True, backend="reference")
    assert rel_rms(raw, ref) > 1e-2 and rel_rms(ours, ref) < 1e-5


@pytest.mark.parametrize("given", [
    pytest.param([1] * 30 + [2] * 18, id="starts-at-1"),
    pytest.param([0] * 6 + [1] * 4 + [0] * 38, id="value-used-again"),
])
def test_upstream_seq_idx_is_not_changes_of_value(upstream_calls, given):
    """Upstream takes the value before a row to be 0 (a row starting at 1 loses its initial state)
    and compares values only (a value used again in a chunk joins two segments); ssm-pack hands
    it the canonical form (mixers/ops/ssd/kernel.py)."""
    x, dt, A, B, C = inputs(1, 48)
    seq_idx = torch.tensor([given], dtype=torch.int32)
    init = torch.randn(1, H, P, N)
    with torch.no_grad():
        raw = upstream()(x, dt, A, B, C, CHUNK, initial_states=init, seq_idx=seq_idx, dt_softplus=True)
        ours = mamba_chunk_scan_combined(x, dt, A, B, C, CHUNK, initial_states=init, seq_idx=seq_idx,
                                         dt_softplus=True, backend="kernel")
        ref = mamba_chunk_scan_combined(x, dt, A, B, C, CHUNK, initial_states=init, seq_idx=seq_idx,
                                        dt_softplus=True, backend="reference")
    assert rel_rms(raw, ref) > 1e-2 and rel_rms(ours, ref) < 1e-5


def test_upstream_varlen_states_miss_the_initial_state_inside_the_first_chunk(upstream_calls):
    """With ``initial_states``, upstream's state of a first document that ends inside the first
    chunk leaves the initial state out; dispatch never asks it for varlen states with initial states."""
    lengths = [7, 23, 18]
    cu = lengths_to_cu_seqlens(lengths)
    x, dt, A, B, C = inputs(1, 48)
    init = torch.randn(1, H, P, N)
    per_doc = torch.cat([init, torch.zeros(2, H, P, N)])
    with torch.no_grad():
        _, raw = upstream()(x, dt, A, B, C, CHUNK, initial_states=init, seq_idx=seq_idx_from_cu_seqlens(cu, 48),
                            cu_seqlens=cu, dt_softplus=True, return_varlen_states=True)
        _, ref = mamba_chunk_scan_combined(x, dt, A, B, C, CHUNK, initial_states=per_doc, cu_seqlens=cu,
                                           dt_softplus=True, return_varlen_states=True, backend="reference")
        assert rel_rms(raw[0], ref[0]) > 1e-2 and rel_rms(raw[1:], ref[1:]) < 1e-5
        with pytest.raises(ValueError, match="varlen states together with initial states"):
            mamba_chunk_scan_combined(x, dt, A, B, C, CHUNK, initial_states=init, cu_seqlens=cu, dt_softplus=True,
                                      return_varlen_states=True, backend="kernel")
        calls = upstream_calls["ssd"]
        mamba_chunk_scan_combined(x, dt, A, B, C, CHUNK, initial_states=init, cu_seqlens=cu, dt_softplus=True,
                                  return_varlen_states=True)                        # auto: the reference
        assert upstream_calls["ssd"] == calls


def test_upstream_refuses_a_backward_through_varlen_states(upstream_calls):
    cu = lengths_to_cu_seqlens([20, 28])
    x, dt, A, B, C = inputs(1, 48)
    x.requires_grad_()
    _, states = upstream()(x, dt, A, B, C, CHUNK, seq_idx=seq_idx_from_cu_seqlens(cu, 48), cu_seqlens=cu,
                           return_varlen_states=True)
    with pytest.raises(AssertionError, match="not supported in backward"):
        states.sum().backward()
    calls = upstream_calls["ssd"]
    with pytest.raises(ValueError, match="a backward pass through varlen states"):
        mamba_chunk_scan_combined(x, dt, A, B, C, CHUNK, cu_seqlens=cu, return_varlen_states=True, backend="kernel")
    _, states = mamba_chunk_scan_combined(x, dt, A, B, C, CHUNK, cu_seqlens=cu, return_varlen_states=True)
    grad, = torch.autograd.grad(states.sum(), x)                      # auto: the reference, differentiable
    assert upstream_calls["ssd"] == calls and grad.abs().sum() > 0
