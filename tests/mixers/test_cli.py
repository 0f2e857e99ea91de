import subprocess
import sys

import pytest

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


def test_version_prints_the_installed_version(capsys):
    import ssm_pack
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"ssm-pack {ssm_pack.__version__}"


def test_python_m_ssm_pack_matrix_prints_the_kernel_table():
    out = subprocess.run([sys.executable, "-m", "ssm_pack", "--matrix"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("| kernel |") and "ssm-pack support report" not in out.stdout
    assert "| causal_conv1d | 1.7.0 |" in out.stdout.replace("`", "")
