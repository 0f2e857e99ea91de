"""``backend="kernel"`` without a CUDA device names the device as the blocker, before any package
version, whatever is installed (the requirements table checks the device first)."""

import re

import pytest

from mixers import AttentionMixer, GatedDeltaNetMixer, Mamba2Mixer
from mixers.ops import dispatch
from ssm_pack.support import installed as packages


class NoCuda(packages.Probe):
    """This machine's packages as given, and no CUDA device."""

    def __init__(self, versions, modules=()):
        self.versions, self.modules = versions, set(modules)

    def version(self, dist):
        return self.versions.get(dist)

    def has_module(self, module):
        return module in self.modules

    def import_error(self, module):
        return None                   # the faked packages import (the real ones need not be installed)

    def cuda_available(self):
        return False


INSTALLS = {
    "nothing": NoCuda({}),
    "old-causal-conv1d": NoCuda({"causal-conv1d": "1.1.0", "flash-linear-attention": "0.3.0", "triton": "3.0.0"},
                                {"causal_conv1d_cuda"}),
    "everything": NoCuda({"causal-conv1d": "1.7.0", "mamba-ssm": "2.2.6.post3", "triton": "3.4.0",
                          "flash-linear-attention": "0.6.0", "flash-attn": "2.8.0"},
                         {"causal_conv1d_cuda", "selective_scan_cuda", "flash_attn_2_cuda"}),
}


@pytest.fixture
def installed(monkeypatch):
    def use(probe):
        monkeypatch.setattr(packages, "probe", probe)
        dispatch.cached_support.cache_clear()
    yield use
    dispatch.cached_support.cache_clear()


@pytest.mark.parametrize("install", [pytest.param(name, id=name) for name in INSTALLS])
@pytest.mark.parametrize("layer", [pytest.param(GatedDeltaNetMixer, id="gdn"), pytest.param(Mamba2Mixer, id="mamba2"),
                                   pytest.param(AttentionMixer, id="attention")])
def test_kernel_backend_without_cuda_names_the_device_first(installed, layer, install):
    installed(INSTALLS[install])
    with pytest.raises(RuntimeError) as err:
        layer(512, backend="kernel")
    message = str(err.value)
    assert message.startswith(f"{layer.__name__}(backend='kernel'): ")
    first_reason = message.index("no CUDA device")
    assert "torch.cuda.is_available() is False" in message
    # no version, and no "too old" / "not installed", is offered as the problem
    assert not re.search(r"\d+\.\d+\.\d+ |too old|not installed|>=", message[:first_reason])
    assert "too old" not in message and "not installed" not in message
