"""Where ``python -m benchmarks --out DIR`` writes its report: one dated markdown file per machine
class, named from the machine line, so reports of two machines sit side by side and a rerun on the
same machine on the same day replaces its own."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest

from benchmarks.__main__ import report_path
from benchmarks.common import machine_slug

XEON = ("Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz (avx512, L1d 48K, L2 2048K, L3 107520K), 2 threads, "
        "Python 3.12.3, torch 2.13.0")


@pytest.mark.parametrize("line, slug", [
    pytest.param(XEON, "intel-xeon-platinum-8481c-cpu-2-70ghz-avx512-l1d-48k-l2-2048k-l3-107520k-2-threads",
                 id="intel-vm"),
    pytest.param(XEON.replace("torch 2.13.0", "torch 2.14.0"),
                 "intel-xeon-platinum-8481c-cpu-2-70ghz-avx512-l1d-48k-l2-2048k-l3-107520k-2-threads",
                 id="versions-are-not-the-machine"),
    pytest.param("AMD EPYC 9654 (avx2), 16 threads, Python 3.11.9, torch 2.13.0, GPU NVIDIA H200",
                 "amd-epyc-9654-avx2-16-threads-gpu-nvidia-h200", id="with-gpu"),
])
def test_machine_slug_names_the_machine_class(line, slug):
    assert machine_slug(line) == slug


def test_report_path_is_dated_and_marks_quick_runs(tmp_path):
    day = datetime.date(2026, 12, 1)
    full = report_path(tmp_path, XEON, day, full=True)
    quick = report_path(tmp_path, XEON, day, full=False)
    assert full.parent == tmp_path and full.name.startswith("2026-12-01-intel-xeon-platinum-8481c")
    assert full.suffix == ".md" and quick.name == full.stem + "-quick.md"


def test_machine_slug_of_this_machine_is_a_file_name():
    slug = machine_slug()
    assert slug and Path(slug).name == slug and slug == slug.lower()


def test_index_names_the_latest_report_of_each_machine_class(tmp_path):
    from benchmarks.__main__ import write_index
    for name in ("2026-11-02-amd-epyc-2-threads.md", "2026-12-01-amd-epyc-2-threads.md",
                 "2026-11-20-intel-xeon-2-threads-quick.md", "notes.md"):
        (tmp_path / name).write_text("x")
    text = write_index(tmp_path).read_text()
    latest = text.split("## All reports")[0]
    assert "[amd-epyc-2-threads](2026-12-01-amd-epyc-2-threads.md)" in latest
    assert "2026-11-02" not in latest
    assert "[intel-xeon-2-threads-quick](2026-11-20-intel-xeon-2-threads-quick.md)" in latest
    assert "notes.md" not in text and text.index("2026-12-01") < text.index("2026-11-02")


def test_main_writes_the_dated_report_its_plots_and_the_index(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import benchmarks.__main__ as bench
    from benchmarks.common import Result

    fake = [Result("layers", "Mamba2: packed vs padded", 2.0, 1.0, 2.0, unit="tok/s"),
            Result("layers", "Mamba2: packed vs padded loop", 2.0, 1.5, 1.3, unit="tok/s"),
            Result("metadata", "seq_idx vs cumsum", 1e-3, 1e-3, 1.0, target=3.0, higher_is_better=False)]
    monkeypatch.setattr(bench, "collect", lambda sizes, log: fake)         # no timing: the file layout only
    monkeypatch.setattr(bench.bench_syncs, "report", lambda *args, **kwargs: "| the sync census |")
    assert bench.main(["--out", str(tmp_path)]) == 0
    report = report_path(tmp_path, bench.machine(), datetime.date.today(), full=False)
    text = report.read_text()
    assert "Machine: " in text and "seq_idx vs cumsum" in text and f"]({report.stem}-ops.png)" in text
    assert "## host syncs of a training step" in text and "| the sync census |" in text
    assert (tmp_path / f"{report.stem}-ops.png").exists() and (tmp_path / "index.md").exists()
    assert report.name in (tmp_path / "index.md").read_text()
