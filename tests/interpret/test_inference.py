"""The inference kernels that are Triton, for real on CPU (interpreter lane, see ``shims.py``):
mamba-ssm's ``selective_state_update``, fla's ``fused_recurrent_*`` and ``causal_conv1d_update``,
causal-conv1d's ``causal_conv1d_varlen_states``; then cached mixers built with ``backend="kernel"``
(prefill, decode steps, a chunk of rows) against the same mixers on the reference."""

import importlib.util

import pytest
import torch
import torch.nn.functional as F

import mixers.ops.causal_conv1d.kernel as conv_kernel
import mixers.ops.causal_conv1d.update_kernel as conv_update
import mixers.ops.delta_rule.update_kernel as recurrent_kernel
import mixers.ops.ssd.update_kernel as ssd_update
from mixers.ops import (
    causal_conv1d_fn,
    causal_conv1d_update,
    fused_recurrent_gated_delta_product,
    fused_recurrent_gated_delta_rule,
    fused_recurrent_kda,
    selective_state_update,
)
from ssm_pack import PackedSeqParams, lengths_to_cu_seqlens
from tests.interpret import shims
from tests.mixers.inference.common import make_mixer
from tests.support.oracles import check_close

pytestmark = shims.lane(("fla", "flash-linear-attention"), ("mamba_ssm", "mamba-ssm"), ("einops", "einops"))


@pytest.fixture
def decode_calls(monkeypatch):
    """Counts of the real decode kernels (run unchanged), so a silent reference fails the test."""
    counts = {"state_update": 0, "fused_recurrent": 0, "fla_conv_update": 0}

    def counted(kind, function):
        def run(*args, **kwargs):
            counts[kind] += 1
            return function(*args, **kwargs)
        return run

    load_ssd, load_rec, load_fla = ssd_update.load_upstream, recurrent_kernel.load_upstream, conv_update.load_fla
    monkeypatch.setattr(ssd_update, "load_upstream", lambda: counted("state_update", load_ssd()))
    monkeypatch.setattr(recurrent_kernel, "load_upstream", lambda kind: counted("fused_recurrent", load_rec(kind)))
    monkeypatch.setattr(conv_update, "load_fla", lambda: counted("fla_conv_update", load_fla()))
    monkeypatch.setattr(conv_update, "load_causal_conv1d", lambda: pytest.fail("causal-conv1d's CUDA kernel ran"))
    return counts


def both(fn, *tensors):
    """``fn(backend, *copies)`` on the kernel and on the reference, each on its own copies."""
    return [fn(backend, *[t.clone() for t in tensors]) for backend in ("kernel", "reference")]


@pytest.mark.parametrize("dt_bias", [pytest.param(True, id="dt-bias"), pytest.param(False, id="no-dt-bias")])
def test_selective_state_update(decode_calls, dt_bias):
    """Grouped B / C, D, z, stride-0 per-head dt / A / D (Mamba2's call), two of four slots."""
    g = torch.Generator().manual_seed(0)
    heads, p, n = 4, 3, 5
    state, x, z = torch.randn(4, heads, p, n, generator=g), torch.randn(2, heads, p, generator=g), \
        torch.randn(2, heads, p, generator=g)
    dt, B, C = (torch.randn(*shape, generator=g) for shape in ((2, heads, 1), (2, 2, n), (2, 2, n)))
    A, D, bias = -torch.rand(heads, 1, 1, generator=g), torch.randn(heads, 1, generator=g), torch.randn(heads, 1)

    def run(backend, state):
        out = selective_state_update(state, x, dt.expand(2, heads, p), A.expand(heads, p, n), B, C,
                                     D=D.expand(heads, p), z=z, dt_bias=bias.expand(heads, p) if dt_bias else None,
                                     dt_softplus=True, state_batch_indices=torch.tensor([3, 1]), backend=backend)
        return out, state
    (out, st), (ref, ref_st) = both(run, state)
    assert decode_calls["state_update"] == 1
    check_close(out, ref, torch.float32, what="out")
    check_close(st, ref_st, torch.float32, what="state")
    assert torch.equal(st[[0, 2]], state[[0, 2]])


@pytest.mark.parametrize("kind", ["gdn", "kda", "gdp"])
def test_fused_recurrent_step(decode_calls, kind):
    """One token per row, per-row initial states, in-kernel l2 norm; grouped values (GDN, KDA);
    Gated DeltaProduct through GDN's kernel on its sub-step layout, fp32."""
    g = torch.Generator().manual_seed(1)
    rows, h, kd, vd = 3, 2, 16, 16
    nh, hv = (2, h) if kind == "gdp" else (1, 2 * h)
    q, k = torch.randn(rows, 1, h, kd, generator=g), torch.randn(rows, nh, h, kd, generator=g)
    v, beta = torch.randn(rows, nh, hv, vd, generator=g), torch.rand(rows, nh, hv, generator=g)
    gate = F.logsigmoid(torch.randn((rows, 1, hv, kd) if kind == "kda" else (rows, 1, hv), generator=g) + 2)
    h0 = torch.randn(rows, hv, kd, vd, generator=g)
    op = {"gdn": fused_recurrent_gated_delta_rule, "kda": fused_recurrent_kda,
          "gdp": lambda *a, **kw: fused_recurrent_gated_delta_product(*a[:5], 2, **kw)}[kind]
    run = lambda backend: op(q, k, v, gate, beta, initial_state=h0, output_final_state=True,  # noqa: E731
                             use_qk_l2norm_in_kernel=True, backend=backend)
    (o, s), (ro, rs) = run("kernel"), run("reference")
    assert decode_calls["fused_recurrent"] == 1
    check_close(o, ro, torch.float32, what="out")
    check_close(s, rs, torch.float32, what="state")


@pytest.mark.parametrize("width", [2, 4, 5])
def test_fla_conv_update(decode_calls, width):
    """causal-conv1d's CUDA kernel cannot run here, so the op takes fla's Triton update on the named
    rows (its ``[N, D, W]`` cache mapped to ours), widths 2-5."""
    g = torch.Generator().manual_seed(2)
    pool, x = torch.randn(5, 16, width - 1, generator=g), torch.randn(2, 16, generator=g)
    w, b = torch.randn(16, width, generator=g), torch.randn(16, generator=g)

    def run(backend, pool):
        return causal_conv1d_update(x, pool, w, b, "silu", conv_state_indices=torch.tensor([4, 0]),
                                    backend=backend), pool
    (out, st), (ref, ref_st) = both(run, pool)
    assert decode_calls["fla_conv_update"] == 1
    check_close(out, ref, torch.float32, what="out")
    check_close(st, ref_st, torch.float32, what="state")
    assert torch.equal(st[1:4], pool[1:4])


def test_causal_conv1d_varlen_states(monkeypatch):
    """causal-conv1d's Triton ``causal_conv1d_varlen_states`` (what the conv op uses for a fresh packed
    prefill's states): zeros ahead of a document shorter than W-1, as ours. Its module is loaded from
    its file (the package ``__init__`` imports the CUDA extension, absent here)."""
    spec = importlib.util.find_spec("causal_conv1d")
    if spec is None:
        pytest.skip("causal-conv1d is not installed (the lane's packages: see docs/testing.md)")
    path = spec.submodule_search_locations[0] + "/causal_conv1d_varlen.py"
    module_spec = importlib.util.spec_from_file_location("_lane_causal_conv1d_varlen", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    monkeypatch.setattr(conv_kernel, "load_upstream", lambda: (None, module.causal_conv1d_varlen_states))
    g = torch.Generator().manual_seed(3)
    cu = lengths_to_cu_seqlens([1, 0, 9, 2, 5])
    x, w = torch.randn(1, 8, 20, generator=g), torch.randn(8, 4, generator=g)
    states = conv_kernel.varlen_states_kernel(x, cu, 3)
    _, want = causal_conv1d_fn(x, w, return_final_states=True, cu_seqlens=cu, backend="reference")
    assert torch.equal(states, want)


# (mixer letter, dtype): Gated DeltaProduct's chunk kernel refuses fp32, the interpreter cannot do bf16
LAYERS = [pytest.param("M", torch.float32, id="mamba2"), pytest.param("G", torch.float32, id="gdn"),
          pytest.param("K", torch.float32, id="kda"), pytest.param("P", torch.float16, id="gdp-fp16")]


def cached_run(layer, dtype):
    """Packed prefill of fresh slots, two decode steps, a chunk of rows: outputs and final states."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 14, 32, generator=g).to(dtype)
    steps = torch.randn(2, 5, 32, generator=g).to(dtype)
    cache = layer.allocate_inference_cache(3, 24)
    outs = [layer(x, PackedSeqParams.from_lengths([5, 9]), cache=cache, cache_slots=[2, 0])]
    outs += [layer(steps[:, i:i + 1], cache=cache, cache_slots=[2, 0]) for i in range(2)]
    outs.append(layer(steps[:, 2:], cache=cache, cache_slots=[2, 0]))
    return outs, cache


@pytest.mark.parametrize("letter,dtype", LAYERS)
def test_cached_kernel_mixer_matches_reference(upstream_calls, decode_calls, letter, dtype):
    kernel = make_mixer(letter, dtype, backend="kernel")     # construction checks every kernel is there
    reference = make_mixer(letter, dtype, backend="reference")
    with torch.no_grad():
        got, cache = cached_run(kernel, dtype)
        want, ref_cache = cached_run(reference, dtype)
    assert decode_calls["fla_conv_update"] == (2 if letter == "M" else 6)
    assert decode_calls["state_update" if letter == "M" else "fused_recurrent"] == 2
    assert upstream_calls["ssd" if letter == "M" else {"G": "gdn", "K": "kda", "P": "gdp"}[letter]] == 2
    for a, b in zip(got, want):
        check_close(a.float(), b.float(), dtype, what="output")
    for name, state in cache.states.items():
        check_close(state.float(), ref_cache[name].float(), dtype, what=name)
