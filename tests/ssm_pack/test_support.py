"""Support checks under faked package metadata: every state they must tell apart."""

import re

import pytest

import ssm_pack as sp
from ssm_pack.support import installed, requirements
from ssm_pack.support.report import support_report


class FakeProbe:
    def __init__(self, versions=None, modules=(), cuda=True, import_errors=None):
        self.versions, self.modules, self.cuda = dict(versions or {}), set(modules), cuda
        self.import_errors = dict(import_errors or {})
        self.imported = []

    def import_error(self, module):
        self.imported.append(module)
        return self.import_errors.get(module)

    def version(self, dist):
        return self.versions.get(dist)

    def has_module(self, module):
        return module in self.modules

    def cuda_available(self):
        return self.cuda


ALL_GOOD = FakeProbe({"causal-conv1d": "1.7.0", "mamba-ssm": "2.2.6.post3", "triton": "3.4.0",
                      "flash-linear-attention": "0.6.0", "flash-attn": "2.8.0"},
                     {"causal_conv1d_cuda", "selective_scan_cuda", "flash_attn_2_cuda"})


@pytest.fixture
def fake(monkeypatch):
    from mixers.ops import dispatch  # its support answers are cached per process

    def install(probe):
        monkeypatch.setattr(installed, "probe", probe)
        dispatch.cached_support.cache_clear()
        return probe
    yield install
    dispatch.cached_support.cache_clear()


def test_everything_present(fake):
    fake(ALL_GOOD)
    assert sp.check_causal_conv1d_support(requirements.features_of("causal_conv1d")) == (True, None)
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
    pytest.param(False, "2.0.0", False, id="training-2.0.0-lacks-cu_seqlens"),
    pytest.param(False, "2.2.0", False, id="training-2.2.0-backward-arity"),
    pytest.param(False, "2.2.5", True, id="training-2.2.5"),
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
    fake(FakeProbe({**ALL_GOOD.versions, "causal-conv1d": "1.3.0", "flash-linear-attention": "0.5.0"},
                   ALL_GOOD.modules))
    ok, reason = sp.check_fla_sequence_packing_support()
    assert not ok and "causal-conv1d 1.3.0 is too old" in reason and ">= 1.4.0" in reason
    assert "flash-linear-attention 0.5.0 is too old" in reason and ">= 0.6.0" in reason    # nor fla's conv
    fake(FakeProbe({**ALL_GOOD.versions, "causal-conv1d": "1.3.0"}, ALL_GOOD.modules))
    assert sp.check_fla_sequence_packing_support() == (True, None)                         # fla's conv runs it


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
    for kernel, feature in requirements.FEATURES:
        assert f"{kernel:14s} {feature}" in text
    assert "pip install 'mamba-ssm>=2.2.6.post3'" in text and "pip install 'causal-conv1d>=1.7.0'" in text
    assert text.count("pip install 'causal-conv1d") == 1                    # the strictest minimum, once


def test_checks_do_not_import_the_extensions():
    import sys
    for check in (sp.check_causal_conv1d_support, sp.check_mamba_sequence_packing_support,
                  sp.check_fla_sequence_packing_support):
        check()
    assert not {"causal_conv1d_cuda", "selective_scan_cuda", "mamba_ssm", "causal_conv1d"} & set(sys.modules)


FLA_ONLY = FakeProbe({"causal-conv1d": "1.7.0", "mamba-ssm": "2.3.2.post1", "triton": "3.4.0",
                      "flash-linear-attention": "0.6.0"}, {"selective_scan_cuda"})


def test_fla_conv_needs_the_checked_release(fake):
    fake(FakeProbe({"flash-linear-attention": "0.5.2", "triton": "3.4.0"}))
    ok, reason = sp.check_fla_conv_support()
    assert not ok and "flash-linear-attention 0.5.2 is too old" in reason and ">= 0.6.0" in reason
    assert requirements.kernel_support("fla", ("varlen",)) == (True, None)   # the scans are fine with 0.5.2
    fake(FLA_ONLY)
    assert sp.check_fla_conv_support() == (True, None)


def test_ssd_check_does_not_ask_for_causal_conv1d(fake):
    fake(FLA_ONLY)
    assert sp.check_mamba_ssd_support() == (True, None)
    ok, reason = sp.check_mamba_sequence_packing_support()               # Megatron's whole-layer gate
    assert not ok and "causal_conv1d_cuda" in reason


def test_mixer_report_names_the_conv_kernel(fake):
    """The per-mixer rows come from the mixers' own plans: the conv row names the kernel that runs."""
    from mixers.report import full_report, mixer_backends
    fake(FLA_ONLY)
    rows = {(mixer, part): (backend, reason) for mixer, part, backend, reason in mixer_backends()}
    assert rows["Mamba2Mixer", "short conv"] == ("fla_conv", None)
    assert rows["GatedDeltaNetMixer", "short convs"] == ("fla_conv", None)
    fake(ALL_GOOD)
    assert {backend for (_, part), (backend, _) in
            {(m, p): (b, r) for m, p, b, r in mixer_backends()}.items() if "conv" in part} == {"causal_conv1d"}
    fake(FakeProbe())
    text = full_report()
    assert "Mamba2Mixer              short conv         reference  (causal-conv1d is not installed" in text


@pytest.mark.parametrize("switch,interpret,on", [
    pytest.param("1", "1", True, id="both"),
    pytest.param("1", None, False, id="switch-without-TRITON_INTERPRET"),
    pytest.param(None, "1", False, id="TRITON_INTERPRET-alone"),
])
def test_interpreter_switch(fake, monkeypatch, switch, interpret, on):
    """The one switch: only with TRITON_INTERPRET=1, and only for the Triton kernels."""
    import torch

    from mixers.ops import dispatch
    for name, value in ((installed.TRITON_INTERPRET_SWITCH, switch), ("TRITON_INTERPRET", interpret)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    fake(FakeProbe({**ALL_GOOD.versions, "flash-linear-attention": "0.6.0"}, ALL_GOOD.modules, cuda=False))
    assert installed.triton_interpreter() is on and dispatch.is_cuda(torch.zeros(1)) is on
    for check in (sp.check_fla_sequence_packing_support, sp.check_fla_conv_support, sp.check_mamba_ssd_support):
        assert check()[0] is on
    for check in (sp.check_causal_conv1d_support, sp.check_flash_attn_support, sp.check_mamba_sequence_packing_support):
        ok, reason = check()                                           # CUDA C++ kernels: never the interpreter
        assert not ok and "no CUDA device" in reason


# ----------------------------------------------------------------- versions with two-digit parts
# compared as strings, "1.10.0" < "1.4.0" and "0.10.0" < "0.6.0": each row fails on a string comparison
@pytest.mark.parametrize("dist,version,kernel,features", [
    pytest.param("causal-conv1d", "1.10.0", "causal_conv1d", ("seq_idx", "varlen_states"), id="conv-1.10.0>=1.4.0"),
    pytest.param("causal-conv1d", "1.10.0", "causal_conv1d", ("padding_seq_idx", "initial_states_with_seq_idx"),
                 id="conv-1.10.0>=1.7.0"),
    pytest.param("causal-conv1d", "1.5.10", "causal_conv1d", ("padding_seq_idx",), id="conv-1.5.10>=1.5.3.post1"),
    pytest.param("flash-linear-attention", "0.10.0", "fla_conv", (), id="fla-0.10.0>=0.6.0"),
    pytest.param("flash-linear-attention", "0.10.0", "fla", ("varlen",), id="fla-0.10.0>=0.4.0"),
    pytest.param("mamba-ssm", "2.2.10", "mamba_ssd", ("packed_inference",), id="mamba-2.2.10>=2.2.6.post3"),
    pytest.param("mamba-ssm", "2.10.0", "mamba_ssd", ("seq_idx",), id="mamba-2.10.0>=2.2.0"),
    pytest.param("triton", "3.10.0", "fla", ("varlen",), id="triton-3.10.0>=3.3.0"),
    pytest.param("flash-attn", "2.10.1", "flash_attn", ("varlen",), id="flash-attn-2.10.1>=2.3.0"),
])
def test_two_digit_version_parts_compare_as_numbers(fake, dist, version, kernel, features):
    fake(FakeProbe({**ALL_GOOD.versions, dist: version}, ALL_GOOD.modules))
    assert requirements.kernel_support(kernel, features) == (True, None)


@pytest.mark.parametrize("dist,version,kernel,features,minimum", [
    pytest.param("causal-conv1d", "1.3.10", "causal_conv1d", ("seq_idx",), "1.4.0", id="conv-1.3.10<1.4.0"),
    pytest.param("flash-linear-attention", "0.5.10", "fla_conv", (), "0.6.0", id="fla-0.5.10<0.6.0"),
    pytest.param("mamba-ssm", "2.2.5.post10", "mamba_ssd", ("packed_inference",), "2.2.6.post3",
                 id="mamba-2.2.5.post10<2.2.6.post3"),
])
def test_two_digit_version_parts_still_refuse_older_releases(fake, dist, version, kernel, features, minimum):
    fake(FakeProbe({**ALL_GOOD.versions, dist: version}, ALL_GOOD.modules))
    ok, reason = requirements.kernel_support(kernel, features)
    assert not ok and f"{dist} {version} is too old" in reason and f">= {minimum}" in reason


def test_megatron_gates_accept_two_digit_releases(fake):
    fake(FakeProbe({**ALL_GOOD.versions, "causal-conv1d": "1.10.0", "mamba-ssm": "2.10.0",
                    "flash-linear-attention": "0.10.0", "triton": "3.10.0"}, ALL_GOOD.modules))
    assert sp.check_mamba_sequence_packing_support() == (True, None)
    assert sp.check_mamba_sequence_packing_support(for_inference_not_training=True) == (True, None)
    assert sp.check_fla_sequence_packing_support() == (True, None)
    assert sp.check_causal_conv1d_support(requirements.features_of("causal_conv1d")) == (True, None)


def test_strictest_minimum_compares_as_numbers(monkeypatch):
    """The report's one install line per package takes the newest minimum: 1.10.0 beats 1.7.0."""
    monkeypatch.setitem(requirements.FEATURES, ("causal_conv1d", "future"),
                        requirements.Feature("causal_conv1d", "future", "causal_conv1d", "1.10.0", "a future feature"))
    assert requirements.strictest_minimums()["causal_conv1d"] == "1.10.0"
    assert requirements.requirements("causal_conv1d", ("seq_idx", "future"))[0][1] == "1.10.0"


# ----------------------------------------------------------------- minimums of the call forms ssm-pack uses
@pytest.mark.parametrize("dist,version,kernel,features,minimum", [
    # mamba_chunk_scan_combined(cu_seqlens=): v2.1.0's signature ends at return_final_states
    pytest.param("mamba-ssm", "2.1.0", "mamba_ssd", ("seq_idx",), "2.2.0", id="ssd-cu_seqlens-2.2.0"),
    # causal_conv1d_update(x, conv_state, weight, bias, activation, cache_seqlens, conv_state_indices): v1.4.0 has 6
    pytest.param("causal-conv1d", "1.4.0", "causal_conv1d", ("update_indices",), "1.5.0", id="conv-update-7-args"),
    # grouped value heads: fla's GDN / KDA document HV > H from v0.5.0
    pytest.param("flash-linear-attention", "0.4.2", "fla", ("varlen", "grouped_values"), "0.5.0",
                 id="fla-grouped-values-0.5.0"),
])
def test_call_forms_need_their_first_release(fake, dist, version, kernel, features, minimum):
    fake(FakeProbe({**ALL_GOOD.versions, dist: version}, ALL_GOOD.modules))
    ok, reason = requirements.kernel_support(kernel, features)
    assert not ok and f"{dist} {version} is too old" in reason and f">= {minimum}" in reason


def test_pyproject_extras_ask_the_tables_minimums():
    import pathlib
    import re

    import tomllib
    extras = tomllib.loads((pathlib.Path(__file__).parents[2] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    names = {"causal-conv1d": "causal_conv1d", "mamba-ssm": "mamba_ssm", "flash-linear-attention": "fla",
             "triton": "triton"}
    seen = {}
    for requirement in extras["fla"] + extras["cuda"]:
        name, minimum = re.fullmatch(r"([\w-]+)>=([\w.]+)", requirement).groups()
        seen[names[name]] = minimum
    wanted = requirements.strictest_minimums()
    assert seen == {package: wanted[package] for package in seen} and set(seen) == set(names.values())


# ----------------------------------------------------------------- a real import, once
def test_a_package_that_fails_to_import_blocks_its_kernel(fake, monkeypatch):
    import torch

    from mixers.ops import dispatch, mamba_chunk_scan_combined
    failure = "ModuleNotFoundError: No module named 'transformers'"
    fake(FakeProbe(ALL_GOOD.versions, ALL_GOOD.modules, import_errors={"mamba_ssm": failure}))
    ok, reason = sp.check_mamba_ssd_support()
    assert not ok and "mamba-ssm 2.2.6.post3 is installed but 'import mamba_ssm' fails" in reason and failure in reason
    monkeypatch.setattr(dispatch, "is_cuda", lambda t: True)
    x, dt = torch.randn(1, 6, 2, 4), torch.rand(1, 6, 2)
    args = (x, dt, -torch.rand(2), torch.randn(1, 6, 1, 8), torch.randn(1, 6, 1, 8), 4)
    mamba_chunk_scan_combined(*args)                                  # auto: the reference, no import crash
    with pytest.raises(RuntimeError, match="No module named 'transformers'"):
        mamba_chunk_scan_combined(*args, backend="kernel")


def test_the_real_probe_imports_once_and_reports_any_failure(monkeypatch):
    import importlib
    tried = []

    def fake_import(name):
        tried.append(name)
        raise OSError("libc10_cuda.so: undefined symbol")           # an extension built against another torch
    monkeypatch.setattr(importlib, "import_module", fake_import)
    installed.import_error.cache_clear()
    try:
        for _ in range(3):
            assert installed.Probe().import_error("causal_conv1d") == "OSError: libc10_cuda.so: undefined symbol"
    finally:
        installed.import_error.cache_clear()
    assert tried == ["causal_conv1d"]


def test_import_ssm_pack_imports_no_kernel_package():
    import subprocess
    import sys
    code = ("import sys, ssm_pack, ssm_pack.support.requirements, ssm_pack.support.report; "
            "print(sorted({'fla', 'triton', 'mamba_ssm', 'causal_conv1d', 'flash_attn'} & set(sys.modules)))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stderr[-2000:]


# ----------------------------------------------------------------- fla 0.6.0's other backends
@pytest.fixture
def fla_switches_unset(monkeypatch):
    for name in installed.FLA_TRITON_PIN:            # recorded, so the test's pins are undone after it
        monkeypatch.setenv(name, "unset")
        monkeypatch.delenv(name)


def test_loading_an_fla_kernel_pins_fla_to_triton(fla_switches_unset):
    import os
    pytest.importorskip("fla")
    # fla imported first, unpinned: its registries (fla/backends.py) switch FlashQLA on by default
    import fla.ops.gated_delta_rule.backends  # noqa: F401
    import fla.ops.kda.backends  # noqa: F401
    from fla.backends import _function_registries, _operation_registries
    registries = [*_operation_registries.values(), *_function_registries.values()]
    switched = [b for r in registries for b in r._backends.values() if b.env_var is not None]
    assert {b.backend_type for b in switched} >= {"flash_qla", "tilelang"}
    assert "flash_qla" in [b.backend_type for b in switched if b.is_enabled()]      # negative control
    import mixers.ops.delta_rule.kernel as delta
    delta.load_upstream("kda")
    assert {name: os.environ[name] for name in installed.FLA_TRITON_PIN} == installed.FLA_TRITON_PIN
    assert [b.backend_type for b in switched if b.is_enabled()] == []       # whatever is installed


def test_report_names_an_fla_backend_the_user_switched_on(fla_switches_unset, monkeypatch):
    assert "fla backends: Triton only" in support_report()
    monkeypatch.setenv("FLA_TILELANG", "1")
    assert installed.pin_fla_triton() == ["FLA_TILELANG=1"]
    assert "NOT pinned to Triton, set here: FLA_TILELANG=1" in support_report()


def _section(text: str, title: str) -> list[str]:
    """The lines of ``text`` after the line ``title``, up to the next blank line."""
    return text.split(f"{title}\n", 1)[1].split("\n\n", 1)[0].splitlines()


@pytest.mark.parametrize("cuda, device", [pytest.param(True, "Fake GPU 0", id="device-0-named"),
                                          pytest.param(False, "none", id="no-device")])
def test_report_header_names_the_device_and_each_package(fake, monkeypatch, cuda, device):
    import torch
    fake(FakeProbe({"causal-conv1d": "1.7.0", "triton": "3.4.0", "flash-attn": "2.8.0"}, {"causal_conv1d_cuda"},
                   cuda=cuda))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: f"Fake GPU {index}")
    text = support_report()
    assert f"\n  CUDA device              {device}\n" in text
    assert _section(text, "optional packages:") == [
        "  causal-conv1d            1.7.0 (CUDA extension present)",
        "  mamba-ssm                not installed",
        "  flash-linear-attention   not installed",
        "  triton                   3.4.0",
        "  flash-attn               2.8.0 (CUDA extension 'flash_attn_2_cuda' MISSING)",
    ]


def _states(text: str) -> dict[tuple[str, str], str]:
    """``(kernel, feature) -> state`` (the last column) of the report's kernel feature lines."""
    lines = _section(text, "kernel features (the requirements table; training needs the backward minimum):")
    return {tuple(line.split()[:2]): re.split(r"\s{2,}", line.strip())[-1] for line in lines}


@pytest.mark.parametrize("versions, changed", [
    pytest.param(ALL_GOOD.versions, {}, id="all-available"),
    pytest.param({**ALL_GOOD.versions, "mamba-ssm": "2.2.0"},
                 {("mamba_ssd", "seq_idx"): "forward only here", ("mamba_ssd", "packed_inference"): "unavailable",
                  ("mamba_decode", "state_batch_indices"): "unavailable"}, id="mamba-2.2.0-forward-only-here"),
])
def test_report_states_which_kernel_features_run_here(fake, versions, changed):
    fake(FakeProbe(versions, ALL_GOOD.modules))
    want = {key: changed.get(key, "available") for key in requirements.FEATURES}
    assert _states(support_report()) == want


def test_report_with_nothing_installed_marks_every_feature_unavailable(fake):
    fake(FakeProbe())
    assert _states(support_report()) == {key: "unavailable" for key in requirements.FEATURES}


def test_report_without_a_device_asks_for_one(fake):
    fake(FakeProbe(ALL_GOOD.versions, ALL_GOOD.modules, cuda=False))
    assert _section(support_report(), "to get every kernel:") == [
        "  - a CUDA device: every kernel above needs one (the reference path runs anywhere)"]


def test_a_single_feature_may_be_named_by_a_string(fake):
    assert requirements.requirements("causal_conv1d", "padding_seq_idx") == \
        requirements.requirements("causal_conv1d", ("padding_seq_idx",)) == [
            ("causal_conv1d", "1.5.3.post1", "negative seq_idx marking padding [padding_seq_idx]"),
            ("causal_conv1d", "1.2.0", "causal-conv1d's CUDA short convolution")]
    fake(FakeProbe({"causal-conv1d": "1.5.3"}, {"causal_conv1d_cuda"}))
    ok, reason = sp.check_causal_conv1d_support("padding_seq_idx")
    assert not ok and "needs >= 1.5.3.post1" in reason and "padding_seq_idx" in reason
