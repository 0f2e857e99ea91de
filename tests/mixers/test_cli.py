import subprocess
import sys

import pytest

from mixers.cli import main


def test_main_report_adds_every_mixer(capsys):
    assert main(["report"]) == 0
    out = capsys.readouterr().out
    assert "packed training backends per mixer" in out
    for mixer in ("Mamba2Mixer", "GatedDeltaNetMixer", "KDAMixer", "GatedDeltaProductMixer", "AttentionMixer"):
        assert mixer in out


def test_python_m_mixers_is_the_command():
    out = subprocess.run([sys.executable, "-m", "mixers", "report"], capture_output=True, text=True, check=True)
    assert "packed training backends per mixer" in out.stdout


def test_version_prints_the_installed_version(capsys):
    import ssm_pack
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"ssm-pack {ssm_pack.__version__}"



@pytest.mark.parametrize("flags,code,stream,start", [
    pytest.param(["--help"], 0, "out", "usage: ssm-pack train [--config FILE]", id="help"),
    pytest.param(["--config"], 2, "err", "ssm-pack train: error: config file '{missing}' does not exist",
                 id="config-file"),
])
def test_train_hands_every_flag_to_the_training_command(tmp_path, monkeypatch, capsys, flags, code, stream, start):
    def trainer(*args, **kwargs):
        raise AssertionError("a training run started: a flag was lost")
    monkeypatch.setattr("mixers.training.train.Trainer", trainer)
    missing = tmp_path / "missing.toml"
    argv = ["train", *flags] + ([str(missing)] if flags == ["--config"] else [])
    assert main(argv) == code
    captured = capsys.readouterr()
    assert getattr(captured, stream).startswith(start.format(missing=missing)), captured


def test_an_interrupted_report_says_so_and_exits_130(monkeypatch, capsys):
    def interrupted():
        raise KeyboardInterrupt
    monkeypatch.setattr("mixers.report.full_report", interrupted)
    assert main(["report"]) == 130
    captured = capsys.readouterr()
    assert captured.err == "interrupted\n" and captured.out == ""


def test_python_m_mixers_exits_with_the_command_status(tmp_path):
    missing = tmp_path / "missing.toml"
    done = subprocess.run([sys.executable, "-m", "mixers", "train", "--config", str(missing)],
                          capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"ssm-pack train: error: config file '{missing}' does not exist"), done.stderr
