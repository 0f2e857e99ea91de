"""Property tests over ssm_pack's public entry points (see tests/ssm_pack/contracts.py): any input is
refused clearly, naming the argument, or gives the oracle's result; a refused stream stays refused."""

import pytest
from hypothesis import given

from tests.ssm_pack.contracts import from_lengths_verdict, lengths_case, stream_case, stream_verdict


@given(lengths_case())
def test_from_lengths_refuses_clearly_or_builds_the_offsets(case):
    assert from_lengths_verdict(case) in ("clear", "ok")


@given(stream_case())
def test_pack_stream_packs_every_document_or_stays_refused(case):
    assert stream_verdict(case) in ("clear", "ok")


@pytest.mark.parametrize("case,want", [
    pytest.param(([[1, 2], [3, 4, 5]], "carry", 2), "ok", id="valid"),
    pytest.param(([[1, 2], [1.5, 2], [3]], "carry", 1), "clear", id="float-token"),
    pytest.param(([[1, 2], [1] * 20, [3]], "refuse", 1), "clear", id="refused-long"),
    pytest.param(([[1, 2], [1] * 20], "truncate", 1), "ok", id="truncated"),
])
def test_the_stream_verdict_is_not_vacuous(case, want):
    """Negative controls: each verdict the property accepts is reached."""
    assert stream_verdict(case) == want
