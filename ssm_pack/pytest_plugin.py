"""A pytest fixture for checking your own mixer; enable it with
``pytest_plugins = ["ssm_pack.pytest_plugin"]`` in a ``conftest.py``.

    def test_my_mixer(packing_check):
        x, params = packing_check.layout([0, 15, 100, 300], hidden=64, dtype=torch.float64)
        packing_check.packed_equals_unpacked(my_mixer.double(), x, params)   # outputs, input and param grads
        packing_check.no_cross_document_leakage(my_mixer.double(), x, params)  # bitwise, forward and backward

Both helpers are :mod:`ssm_pack.testing`'s (see there for the probes and the negative control).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from . import testing
from .formats.params import PackedSeqParams


def layout(lengths, *, hidden: int, dtype=torch.float32, pad_to_multiple_of: int = 1, tail: int = 0, seed: int = 0):
    """Random packed ``hidden_states [1, T, D]`` and its :class:`PackedSeqParams` for documents of
    ``lengths``, each padded to a multiple of ``pad_to_multiple_of``, then ``tail`` padding tokens
    (``T = sum of the padded lengths + tail``)."""
    params = PackedSeqParams.from_lengths(lengths, pad_to_multiple_of=pad_to_multiple_of)
    total = params.total_tokens + tail
    if tail:
        params = params.replace(total_tokens=total)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, total, hidden, generator=g, dtype=torch.float64).to(dtype), params


@pytest.fixture
def packing_check():
    """``layout``, ``packed_equals_unpacked`` and ``no_cross_document_leakage`` in one namespace."""
    return SimpleNamespace(layout=layout, packed_equals_unpacked=testing.assert_packed_equals_unpacked,
                           no_cross_document_leakage=testing.assert_no_cross_document_leakage)
