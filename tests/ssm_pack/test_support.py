"""Support checks under faked package metadata: every state they must tell apart."""

import pytest

import ssm_pack as sp
from ssm_pack import kernels, support
from ssm_pack.report import support_report


class FakeProbe:
    def __init__(self, versions=None, modules=(), cuda=True):
        self.versions, self.modules, self.cuda = dict(versions or {}), set(modules), cuda
        self.imported = []

    def version(self, dist):
        return self.versions.get(dist)

    def has_module(self, module):
        return module in self.modules

    def cuda_available(self):
        return self.cuda


ALL_GOOD = FakeProbe({"causal-conv1d": "1.7.0", "mamba-ssm": "2.2.6.post3", "triton": "3.4.0",
                      "flash-linear-attention": "0.4.1", "flash-attn": "2.8.0"},
                     {"causal_conv1d_cuda", "selective_scan_cuda", "flash_attn_2_cuda"})


@pytest.fixture
def fake(monkeypatch):
    def install(probe):
        monkeypatch.setattr(support, "probe", probe)
        return probe
    return install


def test_everything_present(fake):
    fake(ALL_GOOD)
    assert sp.check_causal_conv1d_support(kernels.features_of("causal_conv1d")) == (True, None)
    assert sp.check_mamba_sequence_packing_support() == (True, None)
    assert sp.check_mamba_sequence_packing_support(for_inference_not_training=True) == (True, None)
    assert sp.check_fla_sequence_packing_support() == (True, None)
    assert sp.check_flash_attn_support() == (True, None)
    assert "to get every kernel" not in support_report()


def test_not_installed(fake):
    fake(FakeProbe())
    ok, reason = sp.check_causal_conv1d_support()
    assert not ok and "causal-conv1d is not installed" in reason and "--no-build-isolation" in reason
    ok, reason = sp.check_fla_sequence_packing_support()
    assert not ok and "flash-linear-attention is not installed" in reason


def test_extension_missing(fake):
    fake(FakeProbe({"causal-conv1d": "1.5.0"}))
    ok, reason = sp.check_causal_conv1d_support()
    assert not ok and "CUDA extension 'causal_conv1d_cuda' is missing" in reason and "1.5.0" in reason


@pytest.mark.parametrize("version,features,minimum,feature", [
    pytest.param("1.3.0", ("seq_idx",), "1.4.0", "seq_idx", id="seq_idx"),
    pytest.param("1.3.0", ("varlen_states",), "1.4.0", "varlen_states", id="varlen-states"),
    pytest.param("1.5.3", ("padding_seq_idx",), "1.5.3.post1", "padding_seq_idx", id="padding"),
    pytest.param("1.6.0", ("initial_states_with_seq_idx",), "1.7.0", "initial_states_with_seq_idx", id="init"),
])
def test_too_old_names_feature_and_minimum(fake, version, features, minimum, feature):
    fake(FakeProbe({"causal-conv1d": version}, {"causal_conv1d_cuda"}))
    ok, reason = sp.check_causal_conv1d_support(features)
    assert not ok and f"needs >= {minimum}" in reason and feature in reason and version in reason


def test_version_just_new_enough(fake):
    fake(FakeProbe({"causal-conv1d": "1.5.3.post1"}, {"causal_conv1d_cuda"}))
    assert sp.check_causal_conv1d_support(("padding_seq_idx",)) == (True, None)


@pytest.mark.parametrize("inference,mamba,ok", [
    pytest.param(False, "2.0.0", True, id="training-2.0.0"),
    pytest.param(False, "1.2.2", False, id="training-too-old"),
    pytest.param(True, "2.2.6", False, id="inference-2.2.6"),
    pytest.param(True, "2.2.6.post3", True, id="inference-post3"),
])
def test_mamba_minimums(fake, inference, mamba, ok):
    probe = FakeProbe({**ALL_GOOD.versions, "mamba-ssm": mamba}, ALL_GOOD.modules)
    fake(probe)
    got, reason = sp.check_mamba_sequence_packing_support(for_inference_not_training=inference)
    assert got is ok
    if not ok:
        assert "mamba-ssm" in reason and "needs >=" in reason


def test_mamba_inference_needs_newer_conv(fake):
    fake(FakeProbe({**ALL_GOOD.versions, "causal-conv1d": "1.4.0"}, ALL_GOOD.modules))
    assert sp.check_mamba_sequence_packing_support()[0]
    ok, reason = sp.check_mamba_sequence_packing_support(True)
    assert not ok and "1.5.3.post1" in reason


def test_old_triton_blocks_fla(fake):
    fake(FakeProbe({**ALL_GOOD.versions, "triton": "3.1.0"}, ALL_GOOD.modules))
    ok, reason = sp.check_fla_sequence_packing_support()
    assert not ok and "triton 3.1.0 is too old" in reason and ">= 3.3.0" in reason


def test_fla_core_distribution_counts(fake):
    fake(FakeProbe({"fla-core": "0.5.0", "triton": "3.4.0", "causal-conv1d": "1.4.0"}, {"causal_conv1d_cuda"}))
    assert sp.check_fla_sequence_packing_support() == (True, None)


def test_fla_check_includes_the_short_convolution(fake):
    """Megatron's check_fla_sequence_packing_support: the fla mixers' conv needs causal-conv1d >= 1.4.0."""
    fake(FakeProbe({**ALL_GOOD.versions, "causal-conv1d": "1.3.0"}, ALL_GOOD.modules))
    ok, reason = sp.check_fla_sequence_packing_support()
    assert not ok and "causal-conv1d 1.3.0 is too old" in reason and ">= 1.4.0" in reason


def test_no_cuda_device(fake):
    fake(FakeProbe(ALL_GOOD.versions, ALL_GOOD.modules, cuda=False))
    for check in (sp.check_causal_conv1d_support, sp.check_mamba_sequence_packing_support,
                  sp.check_fla_sequence_packing_support, sp.check_flash_attn_support):
        ok, reason = check()
        assert not ok and "no CUDA device" in reason
    assert sp.check_causal_conv1d_support(require_cuda=False) == (True, None)


def test_unknown_feature():
    with pytest.raises(ValueError, match="unknown causal_conv1d feature"):
        sp.check_causal_conv1d_support(("warp_speed",))


def test_report_lists_every_feature_and_one_fix_per_package(fake):
    fake(FakeProbe())
    text = support_report()
    for kernel, feature in kernels.FEATURES:
        assert f"{kernel:14s} {feature}" in text
    assert "pip install 'mamba-ssm>=2.2.6.post3'" in text and "pip install 'causal-conv1d>=1.7.0'" in text
    assert text.count("pip install 'causal-conv1d") == 1                    # the strictest minimum, once


def test_checks_do_not_import_the_extensions():
    import sys
    for check in (sp.check_causal_conv1d_support, sp.check_mamba_sequence_packing_support,
                  sp.check_fla_sequence_packing_support):
        check()
    assert not {"causal_conv1d_cuda", "selective_scan_cuda", "mamba_ssm", "causal_conv1d"} & set(sys.modules)
