"""The interpreter lane (``TRITON_INTERPRET=1 python -m pytest -m interpret``): real upstream Triton
kernels on CPU through ssm-pack's wrappers and dispatch. Shims (``shims.py``) are installed for
each lane module and removed after it (so tests outside the lane never see them, even in one
process); every test runs with ssm-pack's switch on and the lane's support probe, and can count
the upstream calls through ``upstream_calls``."""

from __future__ import annotations

import pytest

from tests.interpret import shims


@pytest.fixture(scope="module")
def _shims():
    remove = shims.install()
    yield
    remove()


@pytest.fixture(autouse=True)
def _lane(_shims, monkeypatch):
    import ssm_pack.support.installed as support
    from mixers.ops import dispatch
    monkeypatch.setenv(support.TRITON_INTERPRET_SWITCH, "1")
    monkeypatch.setattr(support, "probe", shims.LaneProbe(support.probe))
    dispatch.cached_support.cache_clear()
    yield
    dispatch.cached_support.cache_clear()


@pytest.fixture
def upstream_calls(monkeypatch):
    """``{kind: calls}`` of the real upstream functions (counted, then run unchanged), so a test
    whose dispatch silently took the reference would fail instead of comparing it with itself."""
    import mixers.ops.causal_conv1d.kernel as cuda_conv
    import mixers.ops.causal_conv1d.kernel_fla as fla_conv
    import mixers.ops.delta_rule.kernel as delta
    import mixers.ops.lightning.kernel as simple_gla
    import mixers.ops.ssd.kernel as ssd
    from mixers.ops.rg_lru import kernel as hgrn
    counts = {"fla_conv": 0, "causal_conv1d": 0, "ssd": 0, "gdn": 0, "kda": 0, "gdp": 0, "simple_gla": 0,
              "hgrn": 0}

    def counted(kind, function):
        def run(*args, **kwargs):
            counts[kind] += 1
            return function(*args, **kwargs)
        return run

    load_fla_conv, load_ssd, load_delta = fla_conv.load_upstream, ssd.load_upstream, delta.load_upstream
    load_simple_gla = simple_gla.load_upstream
    monkeypatch.setattr(simple_gla, "load_upstream", lambda: counted("simple_gla", load_simple_gla()))
    monkeypatch.setattr(fla_conv, "load_upstream", lambda: counted("fla_conv", load_fla_conv()))
    monkeypatch.setattr(ssd, "load_upstream", lambda: counted("ssd", load_ssd()))
    monkeypatch.setattr(delta, "load_upstream", lambda kind: counted(kind, load_delta(kind)))
    load_hgrn = hgrn.load_upstream
    monkeypatch.setattr(hgrn, "load_upstream", lambda: counted("hgrn", load_hgrn()))
    monkeypatch.setattr(cuda_conv, "load_upstream", lambda: pytest.fail("causal-conv1d's CUDA kernel was chosen"))
    return counts
