"""The main job runs end to end (tiny settings) and reports failures as one clear line."""

import json

import pytest

from mixers.cli import main as cli_main
from mixers.demo import main
from mixers.demo.corpus import load_documents


def test_corpus_is_real_and_deterministic():
    docs = load_documents(50)
    assert len(docs) == 50 and docs == load_documents(50)
    assert all(24 <= len(d) <= 1024 for d in docs) and len(set(docs)) > 40


def test_demo_runs_and_writes_its_outputs(tmp_path, capsys):
    code = cli_main(["demo", "--steps", "4", "--docs", "24", "--hidden", "32", "--max-tokens", "512",
                     "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert (tmp_path / "demo.png").stat().st_size > 10_000
    summary = json.loads((tmp_path / "demo.json").read_text())
    assert len(summary["losses"]) == 4 and summary["throughput"]["packed"] > 0
    for line in ("packs:", "loss:", "speed:", "leaks:  none"):
        assert line in out


def test_demo_failure_is_one_clear_line(tmp_path, capsys):
    assert main(["--pattern", "MXZ", "--steps", "1", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ssm-pack demo failed: ValueError: pattern must be letters of MGKPA")


@pytest.mark.parametrize("argv,match", [
    (["--steps", "0"], "need --steps >= 1"),
    (["--device", "cuda"], "cuda"),
])
def test_demo_flag_errors(tmp_path, capsys, argv, match):
    assert main(argv + ["--out", str(tmp_path)]) == 1
    assert match in capsys.readouterr().err
