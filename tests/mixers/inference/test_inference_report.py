"""The inference rows of the support report and of ``backend="kernel"``: read from the mixers'
``INFERENCE_PLAN`` and the requirements table, with the upstream minimums of the decode kernels."""

import pytest

from mixers.ops import dispatch
from ssm_pack.support import installed, requirements
from tests.mixers.inference.common import make_mixer
from tests.ssm_pack.test_support import ALL_GOOD, FakeProbe


@pytest.fixture
def probe(monkeypatch):
    def install(fake):
        monkeypatch.setattr(installed, "probe", fake)
        dispatch.cached_support.cache_clear()
    yield install
    dispatch.cached_support.cache_clear()


def test_decode_kernels_carry_their_first_releases():
    minimums = {key: f.minimum for key, f in requirements.FEATURES.items()}
    assert minimums["causal_conv1d", "update_indices"] == "1.5.0"
    assert minimums["mamba_decode", "state_batch_indices"] == "2.2.3"
    assert minimums["fla", "fused_recurrent"] == "0.4.0"
    assert minimums["flash_attn", "kvcache"] == "2.3.1"


def test_report_lists_the_inference_backends(probe):
    from mixers.report import full_report, inference_backends
    probe(FakeProbe({**ALL_GOOD.versions, "mamba-ssm": "2.2.2", "flash-attn": "2.3.0"}, ALL_GOOD.modules))
    rows = {(m, p): (b, r) for m, p, b, r in inference_backends()}
    assert rows["Mamba2Mixer", "conv decode"] == ("causal_conv1d", None)
    assert rows["GatedDeltaNetMixer", "scan decode"] == ("fla", None)
    backend, reason = rows["Mamba2Mixer", "SSD decode"]
    assert backend == "reference" and "mamba-ssm 2.2.2 is too old" in reason and ">= 2.2.3" in reason
    backend, reason = rows["AttentionMixer", "KV-cache attention"]
    assert backend == "reference" and "flash-attn 2.3.0 is too old" in reason
    assert "inference backends per mixer" in full_report()
    probe(ALL_GOOD)
    assert {b for _, _, b, _ in inference_backends()} == {"causal_conv1d", "mamba_decode", "fla", "flash_attn"}


def test_report_rows_whose_kernel_runs_end_at_the_backend(probe):
    from mixers.report import full_report
    probe(ALL_GOOD)
    lines = full_report().splitlines()
    inference = lines[lines.index(next(line for line in lines if line.startswith("inference backends per mixer"))):]
    assert ["Mamba2Mixer", "conv", "decode", "causal_conv1d"] in [line.split() for line in inference]
    assert not any("(None)" in line for line in lines), [line for line in lines if "(None)" in line]


def test_kernel_backend_checks_the_decode_kernels_when_a_cache_is_allocated(probe):
    probe(FakeProbe({**ALL_GOOD.versions, "mamba-ssm": "2.2.2"}, ALL_GOOD.modules))
    layer = make_mixer("M", backend="kernel")              # training kernels are there: construction passes
    with pytest.raises(RuntimeError, match="SSD decode cannot run on mamba_decode: .*mamba-ssm 2.2.2 is too old"):
        layer.allocate_inference_cache(2, 8)
    probe(ALL_GOOD)
    assert layer.allocate_inference_cache(2, 8)["ssm"].shape == (2, 4, 16, 4)          # slots, heads, head_dim, state
