"""The machine line every benchmark report starts with: the figures of two machines differ by
more than their CPU model says (one 2-core VM's L3 holds a block's working set, another's 2 MB L2
does not), so the line names the vector ISA and the caches too."""

from __future__ import annotations

import pytest
import torch

from benchmarks.common import caches, machine


def _fake_cache(root, entries):
    for i, (level, kind, size) in enumerate(entries):
        d = root / f"index{i}"
        d.mkdir()
        for name, value in (("level", level), ("type", kind), ("size", size)):
            (d / name).write_text(f"{value}\n")


@pytest.mark.parametrize("entries, expected", [
    pytest.param([(1, "Data", "48K"), (1, "Instruction", "64K"), (2, "Unified", "2048K"), (3, "Unified", "491520K")],
                 "L1d 48K, L2 2048K, L3 491520K", id="intel-vm"),
    pytest.param([(1, "Data", "32K"), (2, "Unified", "512K")], "L1d 32K, L2 512K", id="no-l3"),
    pytest.param([], "", id="none-listed"),
])
def test_caches_lists_the_data_caches(tmp_path, entries, expected):
    _fake_cache(tmp_path, entries)
    assert caches(str(tmp_path)) == expected


def test_caches_skips_an_unreadable_entry(tmp_path):
    _fake_cache(tmp_path, [(1, "Data", "48K"), (2, "Unified", "2048K")])
    (tmp_path / "index1" / "size").unlink()
    assert caches(str(tmp_path)) == "L1d 48K"
    assert caches(str(tmp_path / "missing")) == ""


def test_machine_names_isa_threads_and_versions():
    line = machine()
    assert f"({torch.backends.cpu.get_cpu_capability()}" in line
    assert f"{torch.get_num_threads()} threads" in line
    assert f"torch {torch.__version__}" in line
