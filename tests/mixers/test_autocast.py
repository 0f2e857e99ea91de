"""torch.autocast: every op computes in the dtype its inputs arrive in, every layer and HybridLM
run forward and backward under CPU autocast, packed or not, and packing stays exact there.

    T = packed tokens, D = hidden
"""

import pytest
import torch

from mixers import AttentionMixer, GatedDeltaNetMixer, GatedDeltaProductMixer, HybridLM, KDAMixer, Mamba2Mixer
from mixers.ops import (
    causal_conv1d_fn,
    chunk_gated_delta_product,
    chunk_gated_delta_rule,
    chunk_kda,
    mamba_chunk_scan_combined,
    varlen_attention,
)
from ssm_pack import PackedSeqParams

BF16 = torch.bfloat16
LENGTHS = [5, 19, 1, 8]
# the tests' own numbers: bf16 relative RMS, packed vs each document alone
FORWARD_RTOL, GRAD_RTOL = 5e-3, 1e-2


def autocast(enabled=True):
    return torch.autocast("cpu", dtype=BF16, enabled=enabled)


def rel_rms(got, want):
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).square().mean().sqrt() / want.square().mean().sqrt())


# ----------------------------------------------------------------------------- ops
def _op_inputs(op, cu, t, gen):
    """Inputs as a layer hands them to the op under autocast: projections' outputs in bf16,
    parameters (conv weight, A, D, dt_bias) in fp32."""
    def act(*shape):
        return torch.randn(*shape, generator=gen).to(BF16).requires_grad_()

    def param(*shape):
        return torch.randn(*shape, generator=gen).requires_grad_()

    def log_gate(*shape):
        return (-torch.rand(*shape, generator=gen) - 0.05).requires_grad_()

    if op == "conv":
        return (act(1, 16, t), param(16, 4), param(16)), {"activation": "silu", "cu_seqlens": cu}
    if op == "ssd":
        return (act(1, t, 2, 8), act(1, t, 2), (-torch.rand(2, generator=gen) - 0.5).requires_grad_(),
                act(1, t, 1, 8), act(1, t, 1, 8), 16), \
            {"D": param(2), "z": act(1, t, 2, 8), "dt_bias": param(2), "dt_softplus": True, "cu_seqlens": cu}
    if op == "attention":
        return (act(t, 4, 8), act(t, 2, 8), act(t, 2, 8), cu), {}
    common = {"use_qk_l2norm_in_kernel": True, "cu_seqlens": cu, "chunk_size": 16}
    if op == "gdn":
        return (act(1, t, 2, 8), act(1, t, 2, 8), act(1, t, 4, 8), log_gate(1, t, 4),
                torch.rand(1, t, 4, generator=gen).to(BF16).requires_grad_()), common
    if op == "kda":
        return (act(1, t, 2, 8), act(1, t, 2, 8), act(1, t, 2, 8), log_gate(1, t, 2, 8),
                torch.rand(1, t, 2, generator=gen).to(BF16).requires_grad_()), common
    nh = 2                                                                            # gdp
    return (act(1, t, 2, 8), act(1, t * nh, 2, 8), act(1, t * nh, 2, 8), log_gate(1, t, 2),
            torch.rand(1, t * nh, 2, generator=gen).to(BF16).requires_grad_(), nh), common


OPS = {"conv": causal_conv1d_fn, "ssd": mamba_chunk_scan_combined, "gdn": chunk_gated_delta_rule,
       "kda": chunk_kda, "gdp": chunk_gated_delta_product, "attention": varlen_attention}


def _run_op(op, enabled, backward_inside=False):
    params = PackedSeqParams.from_lengths(LENGTHS)
    args, kwargs = _op_inputs(op, params.cu_seqlens_q, params.total_tokens, torch.Generator().manual_seed(0))
    with autocast(enabled):
        out = OPS[op](*args, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        if backward_inside:
            out.float().square().sum().backward()
    if not backward_inside:
        out.float().square().sum().backward()
    grads = [a.grad for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.requires_grad]
    return out, grads


@pytest.mark.parametrize("op", [pytest.param(name, id=name) for name in OPS])
def test_op_computes_the_same_bits_under_autocast(op):
    """Autocast recasts the projections; it must not reach inside an op (the upstream kernels
    compute in their own precision): same output and gradients, bit for bit, in the input's dtype."""
    plain, plain_grads = _run_op(op, enabled=False)
    cast, cast_grads = _run_op(op, enabled=True)
    assert cast.dtype == plain.dtype == BF16
    assert torch.equal(cast, plain)
    assert len(cast_grads) == len(plain_grads) >= 3
    for got, want in zip(cast_grads, plain_grads):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_conv_backward_inside_autocast_computes_like_its_forward():
    """PyTorch recommends backward outside autocast; inside it, the conv's hand-written backward
    (an ``index_add_`` of fp32 edge gradients) used to fail on autocast's bf16 convolution output."""
    _, outside = _run_op("conv", enabled=True)
    _, inside = _run_op("conv", enabled=True, backward_inside=True)
    assert all(torch.equal(got, want) for got, want in zip(inside, outside))


# ----------------------------------------------------------------------------- layers
SMALL = {"M": {"head_dim": 16, "state_size": 8, "chunk_size": 16}, "G": {"head_dim": 8, "chunk_size": 16},
         "K": {"head_dim": 8, "chunk_size": 16}, "P": {"head_dim": 8, "chunk_size": 16}, "A": {"head_dim": 8}}
LAYERS = {"M": Mamba2Mixer, "G": GatedDeltaNetMixer, "K": KDAMixer, "P": GatedDeltaProductMixer, "A": AttentionMixer}


def _layer(letter):
    torch.manual_seed(0)
    return LAYERS[letter](32, **SMALL[letter])


@pytest.mark.parametrize("letter", [pytest.param(k, id=v.__name__) for k, v in LAYERS.items()])
def test_layer_packed_under_autocast_equals_each_document_alone(letter):
    layer = _layer(letter)
    params = PackedSeqParams.from_lengths(LENGTHS, pad_to_multiple_of=4, total_tokens=44)
    x = torch.randn(1, params.total_tokens, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    g_out = torch.zeros(1, params.total_tokens, 32)           # no gradient into the padding's outputs
    starts = params.cu_seqlens_q_padded.tolist()
    for start, n in zip(starts, LENGTHS):
        g_out[:, start:start + n] = torch.randn(n, 32, generator=torch.Generator().manual_seed(start))
    with autocast():
        packed = layer(x, packed_seq_params=params)
    assert packed.dtype == BF16
    (packed.float() * g_out).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.parameters())
    for start, n in zip(starts, LENGTHS):
        alone_x = x.detach()[:, start:start + n].clone().requires_grad_()
        with autocast():
            alone = layer(alone_x)                                              # unpacked, under autocast too
        (alone.float() * g_out[:, start:start + n]).sum().backward()
        assert rel_rms(packed[:, start:start + n], alone) <= FORWARD_RTOL
        assert rel_rms(x.grad[:, start:start + n], alone_x.grad) <= GRAD_RTOL


@pytest.mark.parametrize("packed", [pytest.param(True, id="packed"), pytest.param(False, id="padded-batch")])
def test_hybrid_lm_trains_under_autocast(packed):
    torch.manual_seed(0)
    model = HybridLM(256, 32, "MGKPA", mixer_overrides=SMALL)
    params = PackedSeqParams.from_lengths(LENGTHS, pad_to_multiple_of=4) if packed else None
    ids = torch.randint(0, 256, (1, params.total_tokens) if packed else (2, 18))
    labels = ids.clone()
    if packed:                                             # the alignment padding predicts nothing
        labels[:] = -100
        for start, n in zip(params.cu_seqlens_q_padded.tolist(), LENGTHS):
            labels[:, start:start + n] = ids[:, start:start + n]
    with autocast():
        out = model(ids, params, labels=labels)
    assert out["logits"].dtype == BF16 and torch.isfinite(out["loss"])
    out["loss"].backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values()), \
        [n for n, g in grads.items() if g is None or not torch.isfinite(g).all()]
    if packed:      # the packed loss is still the token-weighted loss of the documents alone
        total, count = 0.0, 0
        starts = params.cu_seqlens_q_padded.tolist()
        with torch.no_grad(), autocast():
            for start, n in zip(starts, LENGTHS):
                if n > 1:
                    doc = ids[:, start:start + n]
                    total += float(model(doc, labels=doc)["loss"]) * (n - 1)
                    count += n - 1
        assert abs(float(out["loss"].detach()) - total / count) <= FORWARD_RTOL * total / count


# ----------------------------------------------------------------------------- the switch itself
def test_op_called_by_keyword_finds_its_tensors_device():
    """The device is that of the first tensor argument, whatever comes before it (here a string, by keyword):
    under CPU autocast the fp32 op then computes in fp32, as outside it."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 8, 6, generator=g), torch.randn(8, 4, generator=g)
    plain = causal_conv1d_fn(activation="silu", x=x, weight=w)
    with autocast():
        cast = causal_conv1d_fn(activation="silu", x=x, weight=w)
    assert cast.dtype == torch.float32 and torch.equal(cast, plain)


@pytest.mark.parametrize("device", [None, "meta"], ids=["no-tensor", "meta"])
def test_autocasting_is_false_where_autocast_does_not_exist(device):
    from mixers.ops.common.autocast import autocasting
    with autocast():
        assert autocasting(device) is False
        assert autocasting("cpu") is True
    assert autocasting("cpu") is False


@pytest.mark.parametrize("args", [pytest.param((), id="no-tensor"),
                                  pytest.param((torch.empty(2, device="meta"),), id="meta")])
def test_decorated_op_off_cpu_and_cuda_runs_as_it_is(args):
    """Without a CPU or CUDA tensor there is no autocast to switch off: the op runs unwrapped
    (``torch.autocast`` itself refuses such a device)."""
    from mixers.ops.common.autocast import outside_autocast
    op = outside_autocast(lambda *a, **k: (a, k, torch.is_autocast_enabled("cpu")))
    with autocast():
        assert op(*args, scale=2) == (args, {"scale": 2}, True)
        assert op(torch.ones(1))[2] is False         # a CPU tensor: switched off for the body
