import subprocess
import sys

from mixers.cli import main


def test_python_m_ssm_pack_prints_the_package_report():
    out = subprocess.run([sys.executable, "-m", "ssm_pack"], capture_output=True, text=True, check=True)
    assert "ssm-pack support report" in out.stdout and "kernel features" in out.stdout
    assert "Mamba2Mixer" not in out.stdout                 # the ground floor knows no mixer


def test_main_report_adds_every_mixer(capsys):
    assert main(["report"]) == 0
    out = capsys.readouterr().out
    assert "packed training backends per mixer" in out
    for mixer in ("Mamba2Mixer", "GatedDeltaNetMixer", "KDAMixer", "GatedDeltaProductMixer", "AttentionMixer"):
        assert mixer in out


def test_python_m_mixers_is_the_command():
    out = subprocess.run([sys.executable, "-m", "mixers", "report"], capture_output=True, text=True, check=True)
    assert "packed training backends per mixer" in out.stdout
