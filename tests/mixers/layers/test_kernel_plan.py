"""The report and the layers read one kernel table: for any installed versions, the backend the
report prints for each part of each mixer is the one the layer's packed forward really runs."""

import pytest
import torch

import mixers.ops.attention.kernel as attn_kernel
import mixers.ops.attention.kernel_torch as torch_varlen_kernel
import mixers.ops.causal_conv1d.kernel as conv_kernel
import mixers.ops.causal_conv1d.kernel_fla as fla_conv_kernel
import mixers.ops.delta_rule.kernel as fla_kernel
import mixers.ops.lightning.kernel as simple_gla_kernel
import mixers.ops.ssd.kernel as ssd_kernel
from mixers.ops import dispatch, varlen_attention
from mixers.ops.rg_lru import kernel as hgrn_kernel
from mixers.report import mixer_backends
from ssm_pack.pytest_plugin import layout
from ssm_pack.support import installed
from tests.mixers.layers.test_layers import HIDDEN, LAYERS
from tests.support import fakes

EXTENSIONS = {"causal_conv1d_cuda", "selective_scan_cuda", "flash_attn_2_cuda"}
NEWEST = {"causal-conv1d": "1.7.0", "mamba-ssm": "2.2.6.post3", "triton": "3.4.0", "flash-linear-attention": "0.6.0",
          "flash-attn": "2.8.0"}
ENVIRONMENTS = {
    "everything": (NEWEST, EXTENSIONS),
    "no-causal-conv1d-extension": (NEWEST, EXTENSIONS - {"causal_conv1d_cuda"}),
    "old-causal-conv1d": ({**NEWEST, "causal-conv1d": "1.2.0"}, EXTENSIONS),
    "old-causal-conv1d-old-fla": ({**NEWEST, "causal-conv1d": "1.2.0", "flash-linear-attention": "0.5.0"}, EXTENSIONS),
    "old-mamba": ({**NEWEST, "mamba-ssm": "1.2.2"}, EXTENSIONS),
    "old-triton": ({**NEWEST, "triton": "3.1.0"}, EXTENSIONS),
    "fla-only": ({"triton": "3.4.0", "flash-linear-attention": "0.6.0"}, set()),
    "nothing": ({}, set()),
}
# which fake call each kernel of the table makes
CALL_OF = {"causal_conv1d": "conv", "fla_conv": "fla_conv", "fla_hgrn": "hgrn", "mamba_ssd": "ssd",
           "flash_attn": "flash", "torch_varlen": "torch_varlen", "fla_simple_gla": "simple_gla"}
CLASS_OF = {"mamba2": "Mamba2Mixer", "gdn": "GatedDeltaNetMixer", "kda": "KDAMixer", "gdp": "GatedDeltaProductMixer",
            "attention": "AttentionMixer", "gated_short_conv": "GatedShortConvMixer", "mamba1": "Mamba1Mixer",
            "rg_lru": "RGLRUMixer", "lightning": "LightningMixer"}


class Probe(installed.Probe):
    def __init__(self, versions, modules):
        self.versions, self.modules = versions, modules

    def version(self, dist):
        return self.versions.get(dist)

    def has_module(self, module):
        return module in self.modules

    def import_error(self, module):
        return None                   # the faked packages import (the real ones need not be installed)

    def cuda_available(self):
        return True


@pytest.fixture
def environment(monkeypatch):
    def install(versions, modules):
        monkeypatch.setattr(installed, "probe", Probe(versions, modules))
        monkeypatch.setattr(dispatch, "is_cuda", lambda t: True)
        dispatch.cached_support.cache_clear()
        calls = []
        monkeypatch.setattr(conv_kernel, "load_upstream", lambda: (fakes.fake_conv(calls), None))
        monkeypatch.setattr(fla_conv_kernel, "load_upstream", lambda: fakes.fake_fla_conv(calls))
        monkeypatch.setattr(ssd_kernel, "load_upstream", lambda: fakes.fake_ssd(calls))
        monkeypatch.setattr(fla_kernel, "load_upstream", fakes.fake_fla(calls))
        monkeypatch.setattr(simple_gla_kernel, "load_upstream", lambda: fakes.fake_simple_gla(calls))
        monkeypatch.setattr(hgrn_kernel, "load_upstream", lambda: fakes.fake_fla_hgrn(calls))
        monkeypatch.setattr(attn_kernel, "load_upstream", lambda: fakes.fake_flash(calls))
        monkeypatch.setattr(torch_varlen_kernel, "on_cuda", lambda t: True)    # torch's own kernel needs no package
        monkeypatch.setattr(torch_varlen_kernel, "load_upstream", lambda: _fake_torch_varlen(calls))
        return calls
    yield install
    dispatch.cached_support.cache_clear()


def _fake_torch_varlen(calls):
    def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1),
                    enable_gqa=False):
        calls.append(("torch_varlen", cu_q))
        return varlen_attention(q, k, v, cu_q, max_q, causal=window_size[1] == 0, window_size=window_size,
                                softmax_scale=scale, backend="reference")
    return varlen_attn


def _call_of(kernel, name):
    return name if kernel == "fla" else CALL_OF[kernel]        # fla's fakes record the op (gdn / kda / gdp)


@pytest.mark.parametrize("env", list(ENVIRONMENTS))
@pytest.mark.parametrize("name", list(LAYERS))
def test_report_equals_what_the_layer_runs(environment, env, name):
    calls = environment(*ENVIRONMENTS[env])
    rows = [row for row in mixer_backends() if row[0] == CLASS_OF[name]]
    torch.manual_seed(0)
    module = LAYERS[name]().to(torch.float16)
    x, params = layout([0, 15, 37, 9], hidden=HIDDEN, dtype=torch.float16, tail=3)
    module(x, packed_seq_params=params)
    ran = {kind for kind, _ in calls}
    expected = set()
    for _, _, backend, _ in rows:
        if backend != "reference":
            expected.add(_call_of(backend, name))
    assert ran == expected, (rows, ran)
    if env == "everything":
        assert all(backend != "reference" for _, _, backend, _ in rows)
    if env == "nothing":                  # no optional package: only torch's own varlen_attn runs
        assert all(backend in ("reference", "torch_varlen") for _, _, backend, _ in rows)
        assert ran <= {"torch_varlen"}
