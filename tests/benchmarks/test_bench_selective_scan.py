"""Smoke test of ``benchmarks/bench_selective_scan.py`` at a tiny size: every figure is produced and
the bytes kept for the backward stay below one state per token."""

import pytest

from benchmarks import bench_selective_scan as bench


def test_tiny_run_prints_every_figure():
    text = bench.main(["--tokens", "128", "--docs", "8", "--repeat", "1", "--channels", "16", "--state", "32"])
    for measure in ("fwd, 8 documents vs one", "per-document loop", "token-at-a-time specification",
                    "fwd+bwd vs fwd", "ours (chunked, recomputed in the backward)"):
        assert measure in text
    ours = bench.memory_rows(128, 8, 16, 32)[0]
    assert ours[-1] == "below 1", ours


def test_bad_document_count_is_refused():
    with pytest.raises(ValueError, match=r"--docs must be between 1 and --tokens \(64\), got 65"):
        bench.main(["--tokens", "64", "--docs", "65"])
