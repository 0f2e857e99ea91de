"""Forward and backward minimums of the requirements table, and the support decision for training.

The rows' minimums come from upstream's tags (each row's ``why``); these tests pin the ones a
wrong answer would cost a training run: mamba-ssm's SSD scan trains from 2.2.5 (2.2.0's backward
returns 14 gradients for 16 inputs), forward-only rows have no backward, and the matrix states both.
"""

import pytest
import torch

import mixers.ops.ssd.kernel as ssd_kernel
from mixers.ops import dispatch, mamba_chunk_scan_combined
from ssm_pack.__main__ import support_matrix
from ssm_pack.support import installed, requirements
from ssm_pack.support.report import kernel_lines
from tests.support.fake_device import PresentProbe
from tests.support.fakes import fake_ssd_2_2_0, of_kind


def Probe(**versions):
    """Installed versions as given (``mamba_ssm="2.2.0"``), triton 3.4.0, every CUDA extension present, a device."""
    return PresentProbe({"triton": "3.4.0", **{k.replace("_", "-"): v for k, v in versions.items()}})


@pytest.fixture
def probe(monkeypatch):
    def install(**versions):
        monkeypatch.setattr(installed, "probe", Probe(**versions))
        dispatch.cached_support.cache_clear()
    yield install
    dispatch.cached_support.cache_clear()


@pytest.mark.parametrize("mamba,forward,backward", [
    pytest.param("2.1.0", False, False, id="2.1.0-no-cu_seqlens"),
    pytest.param("2.2.0", True, False, id="2.2.0-backward-arity"),
    pytest.param("2.2.4", True, False, id="2.2.4-softplus-gradient"),
    pytest.param("2.2.5", True, True, id="2.2.5"),
    pytest.param("2.3.2.post1", True, True, id="2.3.2.post1"),
])
def test_mamba_ssd_forward_and_backward_minimums(probe, mamba, forward, backward):
    probe(mamba_ssm=mamba)
    assert requirements.kernel_support("mamba_ssd", ("seq_idx",))[0] is forward
    ok, reason = requirements.kernel_support("mamba_ssd", ("seq_idx", requirements.BACKWARD))
    assert ok is backward
    assert requirements.kernel_support("mamba_ssd", ("seq_idx",), training=True)[0] is backward
    if not ok:
        assert f"mamba-ssm {mamba} is too old" in reason and ">= 2.2" in reason


def test_megatron_training_gate_asks_the_backward_minimum(probe):
    probe(mamba_ssm="2.2.4", causal_conv1d="1.7.0")
    ok, reason = requirements.check_mamba_sequence_packing_support()
    assert not ok and "needs >= 2.2.5" in reason
    assert requirements.check_mamba_sequence_packing_support(for_inference_not_training=True)[0] is False
    probe(mamba_ssm="2.2.5", causal_conv1d="1.7.0")
    assert requirements.check_mamba_sequence_packing_support() == (True, None)


@pytest.mark.parametrize("kernel,feature", [
    pytest.param(k, f, id=f"{k}-{f}") for (k, f), row in requirements.FEATURES.items() if row.forward_only])
def test_forward_only_rows_are_refused_for_training(probe, kernel, feature):
    probe(causal_conv1d="1.7.0", mamba_ssm="2.3.2.post1", flash_attn="2.8.0", **{"flash-linear-attention": "0.6.0"})
    assert requirements.kernel_support(kernel, (feature,)) == (True, None)
    ok, reason = requirements.kernel_support(kernel, (feature, requirements.BACKWARD))
    assert not ok and "forward only" in reason and feature in reason


@pytest.mark.parametrize("package,version,kernel,features", [
    pytest.param("flash-linear-attention", "0.4.2", "fla", ("varlen",), id="fla-0.4.2-kda-backward"),
    pytest.param("causal-conv1d", "1.1.3", "causal_conv1d", (), id="conv-1.1-no-initial_states"),
])
def test_other_minimums_from_the_tags(probe, package, version, kernel, features):
    probe(**{package: version})
    ok_forward, _ = requirements.kernel_support(kernel, features)
    ok_backward, reason = requirements.kernel_support(kernel, features, training=True)
    assert not ok_backward and f"{version} is too old" in reason
    assert ok_forward is (kernel == "fla")            # fla 0.4.2 runs the forward; conv 1.1.x lacks the call form


def test_every_row_states_both_minimums_and_why():
    for kernel in requirements.KERNELS.values():
        assert kernel.why, kernel.name
    for row in requirements.FEATURES.values():
        assert row.why, row.name
        assert row.forward_only or row.backward_minimum is not None
    lines = support_matrix().splitlines()
    assert lines[0] == "| kernel | package | forward | backward | needed for | why |"
    ssd = [line for line in lines if line.startswith("| `mamba_ssd` | `mamba_ssm` | 2.2.0 |")]
    assert ssd and "| 2.2.5 |" in ssd[0] and "14 gradients for 16 inputs" in ssd[0]
    assert any("| 1.5.3.post1 | no backward |" in line for line in lines)


def test_report_names_backward_minimums(probe):
    probe(mamba_ssm="2.2.0", causal_conv1d="1.7.0")
    line = next(x for x in kernel_lines() if x.split()[:2] == ["mamba_ssd", "seq_idx"])
    assert "mamba_ssm >= 2.0.0" in line and "backward >= 2.2.5" in line and "forward only" in line


# ----------------------------------------------------------------- the op: 2.2.0's arity never reaches a backward
def ssd_inputs(requires_grad):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 12, 2, 4, generator=g, requires_grad=requires_grad)
    dt = torch.rand(1, 12, 2, generator=g) + 0.1
    A = -torch.rand(2, generator=g) - 0.5
    B, C = (torch.randn(1, 12, 1, 8, generator=g) for _ in range(2))
    return x, dt, A, B, C


CU = torch.tensor([0, 5, 6, 12], dtype=torch.int32)       # uneven lengths: 5, 1, 6


@pytest.fixture
def mamba_2_2_0(probe, monkeypatch):
    probe(mamba_ssm="2.2.0")
    calls = []
    monkeypatch.setattr(dispatch, "is_cuda", lambda t: True)
    monkeypatch.setattr(ssd_kernel, "load_upstream", lambda: fake_ssd_2_2_0(calls))
    return calls


def test_the_2_2_0_fake_fails_at_the_first_backward():
    """Negative control: the fake really has 2.2.0's arity, so a training call that reached it would fail."""
    x, dt, A, B, C = ssd_inputs(True)
    seq_idx = torch.tensor([[0] * 5 + [1] + [2] * 6], dtype=torch.int32)
    out = fake_ssd_2_2_0([])(x, dt, A, B, C, 4, seq_idx=seq_idx)
    with pytest.raises(RuntimeError, match="incorrect number of gradients"):
        out.sum().backward()


def test_training_with_mamba_2_2_0_takes_the_reference(mamba_2_2_0):
    x, dt, A, B, C = ssd_inputs(True)
    out = mamba_chunk_scan_combined(x, dt, A, B, C, 4, cu_seqlens=CU)
    want = mamba_chunk_scan_combined(x, dt, A, B, C, 4, cu_seqlens=CU, backend="reference")
    assert of_kind(mamba_2_2_0, "ssd_2_2_0") == []
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    grad = torch.randn_like(out)
    got, = torch.autograd.grad(out, x, grad)
    expected, = torch.autograd.grad(want, x, grad)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_inference_with_mamba_2_2_0_runs_the_kernel(mamba_2_2_0):
    x, dt, A, B, C = ssd_inputs(False)
    with torch.no_grad():
        out = mamba_chunk_scan_combined(x, dt, A, B, C, 4, cu_seqlens=CU)
    assert len(of_kind(mamba_2_2_0, "ssd_2_2_0")) == 1
    torch.testing.assert_close(out, mamba_chunk_scan_combined(x, dt, A, B, C, 4, cu_seqlens=CU, backend="reference"))


def test_kernel_backend_refuses_training_on_mamba_2_2_0(mamba_2_2_0):
    x, dt, A, B, C = ssd_inputs(True)
    with pytest.raises(RuntimeError, match=r"mamba-ssm 2\.2\.0 is too old .*backward.*>= 2\.2\.5"):
        mamba_chunk_scan_combined(x, dt, A, B, C, 4, cu_seqlens=CU, backend="kernel")
    assert of_kind(mamba_2_2_0, "ssd_2_2_0") == []
