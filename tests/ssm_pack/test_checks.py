"""The shared argument checks: every boundary tensor a public function takes goes through
:func:`ssm_pack.checks.check_boundaries`, so its messages are the ones users read."""

import pytest
import torch

from ssm_pack.checks import check_boundaries


@pytest.mark.parametrize("cu", [
    pytest.param([0], id="no-document"),
    pytest.param([0, 0, 3, 3], id="empty-documents"),
    pytest.param([0, 2, 7], id="two-documents"),
])
def test_boundaries_from_0_that_never_decrease_pass(cu):
    check_boundaries("cu", torch.tensor(cu, dtype=torch.int32))


@pytest.mark.parametrize("cu,match", [
    pytest.param([3], r"^cu must start at 0, got 3$", id="one-offset-not-0"),
    pytest.param([2, 4, 8], r"^cu must start at 0, got 2$", id="not-at-0"),
    pytest.param([-1, 4], r"^cu must start at 0, got -1$", id="negative-start"),
    pytest.param([0, 4, 3], r"^cu must be non-decreasing, got 4 then 3 at positions 1 and 2$", id="decrease"),
    pytest.param([0, -3], r"^cu must be non-decreasing, got 0 then -3 at positions 0 and 1$",
                 id="one-document-of-negative-length"),
])
def test_boundaries_not_from_0_or_decreasing_are_refused(cu, match):
    with pytest.raises(ValueError, match=match):
        check_boundaries("cu", torch.tensor(cu, dtype=torch.int32))


def test_values_false_reads_no_value():
    check_boundaries("cu", torch.tensor([2, 1], dtype=torch.int32), values=False)
    with pytest.raises(ValueError, match="must hold at least one offset"):
        check_boundaries("cu", torch.tensor([], dtype=torch.int32), values=False)
