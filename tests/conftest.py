"""Shared test settings: deterministic seeds, the `cuda` marker skipped without a GPU (or run up to the
first kernel call with ``SSM_PACK_FAKE_CUDA=1``, see ``tests/support/fake_device.py``)."""

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=30, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")


FAKE_DEVICE = os.environ.get("SSM_PACK_FAKE_CUDA") == "1"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available() or FAKE_DEVICE:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _fake_device(request, monkeypatch):
    if FAKE_DEVICE and "cuda" in request.keywords:
        from tests.support import fake_device
        fake_device.install(monkeypatch)


@pytest.hookimpl(hookwrapper=True)
def pytest_pyfunc_call(pyfuncitem):
    outcome = yield
    if FAKE_DEVICE and "cuda" in pyfuncitem.keywords:
        from tests.support import fake_device
        fake_device.settle(outcome)
