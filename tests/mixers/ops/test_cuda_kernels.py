"""Real kernels vs the reference on a GPU (skipped without CUDA; on a CUDA machine: ``python -m pytest -m cuda``).

On a CPU machine ``SSM_PACK_FAKE_CUDA=1`` runs every test here up to its first kernel call
(``tests/support/fake_device.py``; CI does, in ``test_cuda_start.py``), so a test that could not start on a
GPU fails there. The tensors live on :data:`DEVICE` (``"cuda"``, the CPU in that mode).
"""

import pytest
import torch

from mixers.ops import causal_conv1d_fn, dispatch, mamba_chunk_scan_combined
from ssm_pack import lengths_to_cu_seqlens
from ssm_pack.support import requirements
from tests.support.fake_device import DEVICE
from tests.support.oracles import rel_rms

pytestmark = pytest.mark.cuda
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}   # kernel and reference round differently in low precision


@pytest.fixture(autouse=True)
def _ieee_fp32(monkeypatch):
    """fp32 ``tl.dot`` in Triton kernels defaults to TF32 (10-bit mantissa, relative error ~1e-3), which the
    fp32 tolerance above would not hold: the Triton kernels compiled here use IEEE fp32."""
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")


def need(name, features=()):
    """Skip unless kernel ``name`` of the requirements table (with ``features``) can run here."""
    ok, reason = dispatch.cached_support(name, tuple(features))
    if not ok:
        pytest.skip(reason)


def need_conv():
    """A layer's short convolution: causal-conv1d with seq_idx, else fla's Triton conv."""
    ok, reason = requirements.conv_support(("seq_idx",))
    if not ok:
        pytest.skip(reason)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_conv_kernel_matches_reference(dtype, packed):
    need("causal_conv1d", ("seq_idx",))
    cu = lengths_to_cu_seqlens([0, 15, 100, 300, 1], device=DEVICE) if packed else None
    x = torch.randn(1, 416, 256, device=DEVICE).transpose(1, 2).to(dtype).requires_grad_()
    w = torch.randn(256, 4, device=DEVICE, dtype=dtype, requires_grad=True)
    b = torch.randn(256, device=DEVICE, dtype=dtype, requires_grad=True)
    outs = []
    for backend in ("kernel", "reference"):
        out = causal_conv1d_fn(x, w, b, activation="silu", cu_seqlens=cu, backend=backend)
        grads = torch.autograd.grad(out.float().square().sum(), (x, w, b))
        outs.append((out, grads))
    (ko, kg), (ro, rg) = outs
    assert rel_rms(ko.float(), ro.float()) < TOL[dtype]
    for a, r in zip(kg, rg):
        assert rel_rms(a.float(), r.float()) < 2 * TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_ssd_kernel_matches_reference(dtype, packed):
    need("mamba_ssd", ("seq_idx",))
    t, h, p, g, n = 416, 8, 64, 1, 64
    cu = lengths_to_cu_seqlens([0, 15, 100, 300, 1], device=DEVICE) if packed else None
    mk = lambda *s: torch.randn(*s, device=DEVICE, dtype=dtype).requires_grad_()  # noqa: E731
    x, dt, B, C = mk(1, t, h, p), mk(1, t, h), mk(1, t, g, n), mk(1, t, g, n)
    A = (-torch.rand(h, device=DEVICE)).requires_grad_()
    outs = []
    for backend in ("kernel", "reference"):
        out = mamba_chunk_scan_combined(x, dt, A, B, C, 64, cu_seqlens=cu, dt_softplus=True, backend=backend)
        grads = torch.autograd.grad(out.float().square().sum(), (x, dt, A, B, C))
        outs.append((out, grads))
    (ko, kg), (ro, rg) = outs
    assert rel_rms(ko.float(), ro.float()) < TOL[dtype]
    for a, r in zip(kg, rg):
        assert rel_rms(a.float(), r.float()) < 2 * TOL[dtype]


@pytest.mark.parametrize("kind", ["gdn", "kda", "gdp"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_delta_rule_kernels_match_reference(kind, packed):
    from mixers.ops import chunk_gated_delta_product, chunk_gated_delta_rule, chunk_kda
    need("fla")
    dtype = torch.bfloat16
    t, h, d, nh = 416, 4, 64, 2
    cu = lengths_to_cu_seqlens([0, 15, 100, 300, 1], device=DEVICE) if packed else None
    steps = t * nh if kind == "gdp" else t
    mk = lambda *s: torch.randn(*s, device=DEVICE, dtype=dtype).requires_grad_()  # noqa: E731
    q, k, v = mk(1, t, h, d), mk(1, steps, h, d), mk(1, steps, h, d)
    beta = torch.rand(1, steps, h, device=DEVICE, dtype=dtype).requires_grad_()
    shape = (1, t, h, d) if kind == "kda" else (1, t, h)
    g = torch.nn.functional.logsigmoid(torch.randn(*shape, device=DEVICE)).to(dtype).requires_grad_()
    op = {"gdn": chunk_gated_delta_rule, "kda": chunk_kda}.get(kind)
    outs = []
    for backend in ("kernel", "reference"):
        kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu, backend=backend)
        o, s = chunk_gated_delta_product(q, k, v, g, beta, nh, **kw) if op is None else op(q, k, v, g, beta, **kw)
        grads = torch.autograd.grad(o.float().square().sum() + s.float().sum(), (q, k, v, g, beta))
        outs.append((o, s, grads))
    (ko, ks, kg), (ro, rs, rg) = outs
    assert rel_rms(ko.float(), ro.float()) < TOL[dtype] and rel_rms(ks.float(), rs.float()) < TOL[dtype]
    for a, r in zip(kg, rg):
        assert rel_rms(a.float(), r.float()) < 2 * TOL[dtype]


@pytest.mark.parametrize("window", [None, (64, 0)], ids=["full", "window"])
def test_flash_attention_matches_reference(window):
    from mixers.ops import varlen_attention
    need("flash_attn")
    cu = lengths_to_cu_seqlens([0, 15, 100, 300, 1], device=DEVICE)
    q, k, v = (torch.randn(416, 8, 64, device=DEVICE, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    outs = [varlen_attention(q, k, v, cu, 300, window_size=window, backend=b) for b in ("kernel", "reference")]
    assert rel_rms(outs[0].float(), outs[1].float()) < TOL[torch.bfloat16]


@pytest.mark.parametrize("name", ["mamba2", "gdn", "kda", "gdp", "attention", "lightning"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_layer_kernel_matches_layer_reference(name, dtype):
    from ssm_pack.pytest_plugin import layout
    from tests.mixers.layers.test_layers import HIDDEN, LAYERS
    if name == "attention" and dtype == torch.float32:
        pytest.skip("flash-attn takes fp16 / bf16 only")
    if name == "gdp" and dtype == torch.float32:
        pytest.skip("fla's Gated DeltaProduct kernel takes fp16 / bf16 only (backend='kernel' refuses fp32)")
    for k in {"mamba2": ("mamba_ssd",), "attention": ("flash_attn",), "lightning": ("fla_simple_gla",)}.get(name,
                                                                                                         ("fla",)):
        need(k)
    if name not in ("attention", "lightning"):
        need_conv()
    torch.manual_seed(0)
    kernel = LAYERS[name](backend="kernel").to(DEVICE, dtype)
    reference = LAYERS[name](backend="reference").to(DEVICE, dtype)
    reference.load_state_dict(kernel.state_dict())
    x, params = layout([0, 15, 100, 300, 1], hidden=HIDDEN, dtype=dtype, pad_to_multiple_of=8)
    x = x.to(DEVICE)
    params = params.replace(cu_seqlens_q=params.cu_seqlens_q.to(DEVICE), cu_seqlens_kv=params.cu_seqlens_kv.to(DEVICE),
                            cu_seqlens_q_padded=params.cu_seqlens_q_padded.to(DEVICE),
                            cu_seqlens_kv_padded=params.cu_seqlens_kv_padded.to(DEVICE))
    for packed in (params, None):
        a, b = kernel(x, packed_seq_params=packed), reference(x, packed_seq_params=packed)
        assert rel_rms(a.float(), b.float()) < 2 * TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_simple_gla_kernel_matches_spec(dtype):
    """fla's chunk_simple_gla through the op vs the spec in fp64: packed documents (empty and one-token ones,
    one across fla's 64-token chunk, a tail), per-document states; output, final states, every gradient."""
    from mixers.ops import chunk_simple_gla
    from mixers.ops.lightning.naive import simple_gla_naive
    need("fla_simple_gla", (requirements.BACKWARD,))
    lengths, h, kd = [0, 15, 100, 300, 1], 4, 64
    cu = lengths_to_cu_seqlens(lengths, device=DEVICE)
    total = int(cu[-1]) + 5
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, total, h, kd, generator=g) * kd ** -0.5 for _ in range(2))
    v, h0 = torch.randn(1, total, h, kd, generator=g), torch.randn(len(lengths), h, kd, kd, generator=g)
    gamma = -torch.linspace(0.01, 0.5, h)
    leaves = [t.to(DEVICE, dtype).requires_grad_() for t in (q, k, v)] + [h0.to(DEVICE).requires_grad_()]
    o, final = chunk_simple_gla(*leaves[:3], g_gamma=gamma.to(DEVICE), scale=1.0, initial_state=leaves[3],
                                output_final_state=True, cu_seqlens=cu, backend="kernel")
    spec_leaves = [t.detach().cpu().double().requires_grad_() for t in leaves]
    o_ref, f_ref = simple_gla_naive(*spec_leaves[:3], gamma.double(), scale=1.0, initial_state=spec_leaves[3],
                                    output_final_state=True, cu_seqlens=cu.cpu())
    _close_to_spec(o.float(), o_ref.detach(), dtype, "output")
    _close_to_spec(final, f_ref.detach(), dtype, "final states")
    w_o, w_f = torch.randn(o.shape, generator=g), torch.randn(final.shape, generator=g)
    got = torch.autograd.grad((o.float() * w_o.to(DEVICE)).sum() + (final * w_f.to(DEVICE)).sum(), leaves)
    want = torch.autograd.grad((o_ref * w_o.double()).sum() + (f_ref * w_f.double()).sum(), spec_leaves)
    for name, a, b in zip(("q", "k", "v", "initial_state"), got, want):
        _close_to_spec(a.float(), b, dtype, f"grad {name}")


def _naive_inputs(*tensors):
    """The kernel's inputs as fp64 CPU tensors, for the specifications (``naive.py``)."""
    return [None if t is None else t.detach().cpu().double() for t in tensors]


def _close_to_spec(got, want, dtype, what):
    err = rel_rms(got.detach().cpu().double(), want)
    assert err < TOL[dtype], f"{what}: relative RMS error {err:.3e} against naive.py ({dtype})"


@pytest.mark.parametrize("op", ["conv", "ssd"])
def test_conv_and_ssd_kernels_match_spec(op):
    """Each kernel against the op's specification, on the packed lengths above (empty and 1-token documents)."""
    from mixers.ops.causal_conv1d.naive import causal_conv1d_naive
    from mixers.ops.ssd.naive import mamba_chunk_scan_naive
    cu = lengths_to_cu_seqlens([0, 15, 100, 300, 1], device=DEVICE)
    dtype = torch.float32
    if op == "conv":
        need("causal_conv1d", ("seq_idx",))
        x = torch.randn(1, 416, 64, device=DEVICE).transpose(1, 2)
        w, b = torch.randn(64, 4, device=DEVICE), torch.randn(64, device=DEVICE)
        out = causal_conv1d_fn(x, w, b, activation="silu", cu_seqlens=cu, backend="kernel")
        want = causal_conv1d_naive(*_naive_inputs(x, w, b), activation="silu", cu_seqlens=cu.cpu())
    else:
        need("mamba_ssd", ("seq_idx",))
        t, h, p, n = 416, 4, 32, 32
        x, dt, B, C = (torch.randn(*s, device=DEVICE) for s in ((1, t, h, p), (1, t, h), (1, t, 1, n), (1, t, 1, n)))
        A = -torch.rand(h, device=DEVICE)
        out = mamba_chunk_scan_combined(x, dt, A, B, C, 64, cu_seqlens=cu, dt_softplus=True, backend="kernel")
        want = mamba_chunk_scan_naive(*_naive_inputs(x, dt, A, B, C), 64, cu_seqlens=cu.cpu(), dt_softplus=True)
    _close_to_spec(out, want, dtype, op)


@pytest.mark.parametrize("kind", ["gdn", "kda", "gdp", "attention"])
def test_delta_rule_and_attention_kernels_match_spec(kind):
    """fla's kernels (bf16) and flash attention against the specifications, outputs and final states."""
    from mixers.ops import chunk_gated_delta_product, chunk_gated_delta_rule, chunk_kda, varlen_attention
    from mixers.ops.attention.naive import varlen_attention_naive
    from mixers.ops.delta_rule.naive import gated_delta_rule_naive
    cu = lengths_to_cu_seqlens([0, 15, 100, 300, 1], device=DEVICE)
    dtype, t, h, d = torch.bfloat16, 416, 4, 64
    if kind == "attention":
        need("flash_attn")
        q, k, v = (torch.randn(t, h, d, device=DEVICE, dtype=dtype) for _ in range(3))
        out = varlen_attention(q, k, v, cu, 300, backend="kernel")
        _close_to_spec(out, varlen_attention_naive(*_naive_inputs(q, k, v), cu.cpu()), dtype, kind)
        return
    need("fla")
    nh = 2 if kind == "gdp" else 1
    q, k, v = (torch.randn(1, t * (1 if i == 0 else nh), h, d, device=DEVICE, dtype=dtype) for i in range(3))
    beta = torch.rand(1, t * nh, h, device=DEVICE, dtype=dtype)
    shape = (1, t, h, d) if kind == "kda" else (1, t, h)
    g = torch.nn.functional.logsigmoid(torch.randn(*shape, device=DEVICE)).to(dtype)
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu, backend="kernel")
    if kind == "gdp":
        o, s = chunk_gated_delta_product(q, k, v, g, beta, nh, **kw)
    else:
        o, s = {"gdn": chunk_gated_delta_rule, "kda": chunk_kda}[kind](q, k, v, g, beta, **kw)
    want_o, want_s = gated_delta_rule_naive(*_naive_inputs(q, k, v, g, beta), output_final_state=True,
                                            use_qk_l2norm_in_kernel=True, cu_seqlens=cu.cpu(), num_householder=nh)
    _close_to_spec(o, want_o, dtype, f"{kind} out")
    _close_to_spec(s, want_s, dtype, f"{kind} final state")
