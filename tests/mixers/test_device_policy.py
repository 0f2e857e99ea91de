"""The device policy: CPU tensors take the row-blocked passes, the CUDA shape runs whole-tensor,
and both compute the same numbers.

    N = rows, D = width

Each layer function runs with blocks forced small (a few rows) under both policies; the CUDA
policy (forced on CPU tensors) must run one block and still match autograd through the plain
steps (fp64 1e-12), the CPU policy must run several (the control that the blocks are small).
"""

import functools
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixers import HybridLM
from mixers.layers.blocks import decay_gate as gate_module
from mixers.layers.blocks import mlp, norm, norm_linear
from mixers.layers.blocks.decay_gate import decay_gate
from mixers.layers.blocks.norm import GatedRMSNorm, RMSNorm
from mixers.layers.blocks.norm_linear import norm_linear as norm_linear_fn
from mixers.ops.common import chunks
from mixers.ops.delta_rule import l2norm
from mixers.ops.delta_rule.l2norm import l2_normalize
from mixers.ops.device_policy import ENV_VAR, device_policy, policy_for, read_environment, whole_tensor
from ssm_pack import PackedSeqParams
from tests.support.oracles import check_close

ROWS, WIDTH = 37, 16


def counting_blocks(monkeypatch, module, rows_per_block=3):
    """Replace ``module.row_blocks`` by one with ``rows_per_block``-row CPU blocks that records how
    many ranges each call yielded."""
    counts = []

    def spy(rows, width, _elements=None, *, device=None):
        ranges = list(chunks.row_blocks(rows, width, rows_per_block * width, device=device))
        counts.append(len(ranges))
        return iter(ranges)

    monkeypatch.setattr(module, "row_blocks", spy)
    return counts


def _randn(*shape):
    return torch.randn(*shape, dtype=torch.float64)


def _swiglu():
    layer = mlp.SwiGLU(24).double()
    plain = lambda x: F.linear(F.silu(F.linear(x, layer.gate_up.weight).chunk(2, -1)[0])  # noqa: E731
                               * F.linear(x, layer.gate_up.weight).chunk(2, -1)[1], layer.down.weight)
    return mlp, [_randn(1, ROWS, 24)], layer, plain


def _rms():
    layer = RMSNorm(WIDTH).double()
    nn.init.normal_(layer.weight)
    return norm, [_randn(1, ROWS, WIDTH)], layer, lambda x: x * torch.rsqrt(x.square().mean(-1, True) + layer.eps) \
        * layer.weight


def _gated(norm_before_gate):
    def build():
        layer = GatedRMSNorm(WIDTH, norm_before_gate=norm_before_gate, group_size=None if norm_before_gate else 8)
        layer = layer.double()
        nn.init.normal_(layer.weight)

        def plain(x, gate):
            y = x if norm_before_gate else x * F.silu(gate)
            g = y.reshape(*y.shape[:-1], -1, layer.group_size)
            o = (g * torch.rsqrt(g.square().mean(-1, keepdim=True) + layer.eps)).reshape(y.shape) * layer.weight
            return o * F.silu(gate) if norm_before_gate else o
        return norm, [_randn(1, ROWS, WIDTH), _randn(1, ROWS, WIDTH)], layer, plain
    return build


def _norm_linear():
    gated, linear = GatedRMSNorm(8).double(), nn.Linear(WIDTH, 5).double()
    nn.init.normal_(gated.weight)
    fn = functools.partial(norm_linear_fn, gated, linear=linear)

    def plain(x, gate):
        heads, g = x.reshape(1, ROWS, 2, 8), gate.reshape(1, ROWS, 2, 8)
        o = heads * torch.rsqrt(heads.square().mean(-1, keepdim=True) + gated.eps) * gated.weight * F.silu(g)
        return linear(o.reshape(1, ROWS, WIDTH))
    module = nn.Module()
    module.forward = lambda x, gate: fn(x, gate)
    module.extra = nn.ModuleList([gated, linear])
    return norm_linear, [_randn(1, ROWS, WIDTH), _randn(1, ROWS, WIDTH)], module, plain


def _decay_gate():
    bias, a_log = nn.Parameter(_randn(WIDTH)), nn.Parameter(_randn(WIDTH))
    module = nn.Module()
    module.bias, module.a_log = bias, a_log
    module.forward = lambda pre: decay_gate(pre, bias, a_log)
    return gate_module, [_randn(1, ROWS, WIDTH)], module, lambda pre: -torch.exp(a_log) * F.softplus(pre + bias)


def _l2norm():
    module = nn.Module()
    module.forward = l2_normalize
    return l2norm, [_randn(1, ROWS, 4, WIDTH)], module, lambda x: x / torch.sqrt(x.square().sum(-1, True) + 1e-6)


CASES = [pytest.param(_swiglu, id="swiglu"), pytest.param(_rms, id="rms-norm"),
         pytest.param(_gated(True), id="gated-norm-fla"), pytest.param(_gated(False), id="gated-norm-mamba"),
         pytest.param(_norm_linear, id="norm-linear"), pytest.param(_decay_gate, id="decay-gate"),
         pytest.param(_l2norm, id="l2norm")]


@pytest.mark.parametrize("policy", [pytest.param("cpu", id="cpu-policy"), pytest.param("cuda", id="forced-cuda")])
@pytest.mark.parametrize("case", CASES)
def test_layer_function_blocks_by_policy_and_matches_autograd(monkeypatch, case, policy):
    torch.manual_seed(0)
    module, inputs, layer, plain = case()
    counts = counting_blocks(monkeypatch, module)
    leaves = [t.clone().requires_grad_() for t in inputs]
    params = [p for p in layer.parameters()]
    with device_policy(policy):
        got = layer(*leaves)
        g_out = torch.randn_like(got)
        got_grads = torch.autograd.grad(got, leaves + params, g_out)
    want = plain(*leaves)
    want_grads = torch.autograd.grad(want, leaves + params, g_out)
    check_close(got, want, torch.float64, what="out")
    for i, (a, b) in enumerate(zip(got_grads, want_grads)):
        check_close(a, b, torch.float64, grad=True, what=f"grad {i}")
    assert counts, "the function ran no row_blocks pass"
    if policy == "cuda":
        assert set(counts) == {1}, f"forced CUDA policy: every pass must be one block, got {counts}"
    else:
        assert min(counts) > 1, f"CPU policy: small blocks must split {ROWS} rows, got {counts}"


@pytest.mark.parametrize("case", CASES)
def test_no_grad_path_under_forced_cuda_policy(monkeypatch, case):
    torch.manual_seed(0)
    module, inputs, layer, plain = case()
    counts = counting_blocks(monkeypatch, module)
    with torch.no_grad(), device_policy("cuda"):
        got = layer(*inputs)
    check_close(got, plain(*inputs).detach(), torch.float64, what="out")
    assert set(counts) <= {1}, f"forced CUDA policy: at most one block per pass, got {counts}"


def test_policy_follows_the_device():
    assert policy_for(torch.zeros(1)) == "cpu" and not whole_tensor(torch.device("cpu"))
    assert policy_for(torch.empty(1, device="meta")) == "cuda" and whole_tensor("cuda")


def test_context_manager_forces_nests_and_restores():
    x = torch.zeros(1)
    with device_policy("cuda"):
        assert whole_tensor(x)
        with device_policy("cpu"):
            assert not whole_tensor("cuda")
        assert whole_tensor(x)
    assert not whole_tensor(x)


@pytest.fixture
def environment(monkeypatch):
    def set_to(value):
        monkeypatch.setenv(ENV_VAR, value)
        read_environment()
    yield set_to
    monkeypatch.delenv(ENV_VAR, raising=False)
    read_environment()


def test_environment_variable_forces_and_context_manager_wins(environment):
    environment("cuda")
    assert whole_tensor(torch.zeros(1))
    with device_policy("cpu"):
        assert not whole_tensor(torch.zeros(1))
    environment("gpu")
    with pytest.raises(ValueError, match=f"{ENV_VAR} must be one of .*'gpu'"):
        policy_for("cpu")
    environment("")
    assert not whole_tensor(torch.zeros(1))


@pytest.mark.parametrize("bad", [pytest.param("gpu", id="unknown-name"), pytest.param(None, id="none")])
def test_bad_policy_is_refused(bad):
    with pytest.raises(ValueError, match="policy must be one of"):
        with device_policy(bad):
            pass


def test_env_var_is_not_set_by_default():
    assert os.environ.get(ENV_VAR) in (None, "")


def test_hybrid_model_step_is_the_same_under_both_policies(monkeypatch):
    counts = {}
    for module in (mlp, norm, norm_linear, gate_module, l2norm):
        counts[module.__name__] = counting_blocks(monkeypatch, module)
    torch.manual_seed(0)
    small = {"M": {"head_dim": 16, "state_size": 8, "chunk_size": 16}, "G": {"head_dim": 8, "chunk_size": 16},
             "K": {"head_dim": 8, "chunk_size": 16}, "P": {"head_dim": 8, "chunk_size": 16}, "A": {"head_dim": 8}}
    model = HybridLM(256, 32, "MGKPA", mixer_overrides=small).double()
    lengths = [5, 30, 1, 0, 44]
    params = PackedSeqParams.from_lengths(lengths)
    ids = torch.randint(0, 256, (1, sum(lengths)))
    results, blocks = {}, {}
    for policy in ("cpu", "cuda"):
        for c in counts.values():
            c.clear()
        with device_policy(policy):
            out = model(ids, params, labels=ids)
            grads = torch.autograd.grad(out["loss"], list(model.parameters()))
        results[policy] = (out["logits"], out["loss"], grads)
        blocks[policy] = {name: set(c) for name, c in counts.items()}
    ran = [name for name, b in blocks["cpu"].items() if b]
    assert len(ran) >= 4, blocks["cpu"]              # l2norm: the delta-rule scans normalise q, k themselves
    assert all(blocks["cuda"][name] == {1} for name in ran), blocks["cuda"]
    assert all(max(blocks["cpu"][name]) > 1 for name in ran), blocks["cpu"]
    (lc, sc, gc), (lw, sw, gw) = results["cpu"], results["cuda"]
    check_close(lw, lc, torch.float64, what="logits")
    check_close(sw, sc, torch.float64, what="loss")
    for (name, _), a, b in zip(model.named_parameters(), gw, gc):
        check_close(a, b, torch.float64, grad=True, what=name)


def test_census_counts_the_same_ops_at_two_lengths_under_the_cuda_policy():
    from benchmarks.bench_census import census_step

    found = {(policy, t): census_step(t, policy, block_elements=512) for policy in ("cpu", "cuda") for t in (64, 256)}
    assert found["cuda", 64].ops == found["cuda", 256].ops
    assert all(found["cuda", t].min_rows >= t for t in (64, 256))
    # control: the CPU policy's row blocks (shrunk) add ops with T and serve fewer rows than T
    assert found["cpu", 256].ops > found["cpu", 64].ops
    assert found["cpu", 256].min_rows < 256


@pytest.mark.parametrize("policy", [pytest.param("cpu", id="cpu-policy"), pytest.param("cuda", id="forced-cuda")])
@pytest.mark.parametrize("grad", [pytest.param(True, id="training"), pytest.param(False, id="no-grad")])
@pytest.mark.parametrize("case", CASES)
def test_no_rows(case, policy, grad):
    # a [1, 0, D] input: an empty output, empty input gradients and zero parameter gradients
    torch.manual_seed(0)
    _, inputs, layer, _ = case()
    empty = [t[:, :0].clone().requires_grad_(grad) for t in inputs]
    with device_policy(policy), torch.set_grad_enabled(grad):
        out = layer(*empty)
    assert out.shape[1] == 0 and out.numel() == 0
    if grad:
        params = [p for p in layer.parameters()]
        grads = torch.autograd.grad(out, empty + params, torch.ones_like(out), allow_unused=True)
        assert all(g is None or not g.any() for g in grads)
