"""Fake-device mode: the cuda-marked tests run on a CPU machine up to their first kernel call.

With ``SSM_PACK_FAKE_CUDA=1`` (``tests/conftest.py`` reads it) the cuda-marked tests are not skipped:
their tensors live on the CPU (:data:`DEVICE`), every optional package of the requirements table is
reported installed at its newest minimum with a device, ``dispatch.is_cuda`` answers yes (and
PyTorch's ``varlen_attn`` sees a CUDA tensor), and every upstream kernel is replaced by its strict
fake (``tests/support/fakes.py``, ``tests/support/decode_fakes.py``), which checks upstream's contract and
then stops the test with :class:`KernelReached`. A test that stops there passes; one that errors
before (a support check naming no kernel, a bad argument, a contract the fake refuses) or ends
without reaching a kernel fails. So a cuda test that could not start on a GPU fails on CPU, at the
cost of everything up to one kernel call.
"""

from __future__ import annotations

import os

from ssm_pack.support import installed

SWITCH = "SSM_PACK_FAKE_CUDA"


class PresentProbe(installed.Probe):
    """Every module and CUDA extension present, a device; ``versions`` maps a distribution name to
    its installed version (a distribution not in it is not installed)."""

    def __init__(self, versions: dict):
        self.versions = dict(versions)

    def version(self, dist):
        return self.versions.get(dist)

    def has_module(self, module):
        return True

    def cuda_available(self):
        return True

    def import_error(self, module):
        return None


def on() -> bool:
    return os.environ.get(SWITCH) == "1"


DEVICE = "cpu" if on() else "cuda"


class KernelReached(Exception):
    """Raised by a strict fake once it accepted a call: the test got as far as a kernel."""


class StopAtFirstCall(list):
    """The fakes' call record: the first recorded call (made after the fake's checks) stops the test."""

    def append(self, call):
        super().append(call)
        raise KernelReached(call[0])


def install(monkeypatch) -> None:
    """Every package present and new enough, a device, ``is_cuda`` true, the strict fakes stopping."""
    from mixers.ops import dispatch
    from mixers.ops.attention import kernel_torch
    from ssm_pack.support import requirements
    from tests.support import decode_fakes as fakes
    from tests.support import fakes as training_fakes

    minimums = requirements.strictest_minimums()

    newest = {dists[0]: minimums[package] for package, (dists, _) in installed._DISTS.items() if package in minimums}
    monkeypatch.setattr(installed, "probe", PresentProbe(newest))
    dispatch.cached_support.cache_clear()
    monkeypatch.setattr(dispatch, "is_cuda", lambda t: True)
    calls = fakes.install(monkeypatch, calls=StopAtFirstCall())
    monkeypatch.setattr(kernel_torch, "on_cuda", lambda t: True)        # attention's first kernel on a GPU
    monkeypatch.setattr(kernel_torch, "load_upstream", lambda: training_fakes.fake_torch_varlen(calls))


def settle(outcome) -> None:
    """A test's result in fake-device mode: stopped at a kernel = passed; finished = no kernel reached."""
    excinfo = outcome.excinfo
    if excinfo is None:
        outcome.force_exception(AssertionError("fake-device mode: the test ended without reaching a kernel"))
    elif issubclass(excinfo[0], KernelReached):
        outcome.force_result(True)
