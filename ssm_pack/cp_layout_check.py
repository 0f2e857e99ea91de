"""The context-parallel layout check at its documented path (defined in :mod:`ssm_pack.parallel.layout_check`)."""

from .parallel.layout_check import (
    check_layout_agreement,
    checks_run,
    fingerprint,
    layout_check_mode,
    set_layout_check,
)

__all__ = ["check_layout_agreement", "checks_run", "fingerprint", "layout_check_mode", "set_layout_check"]
