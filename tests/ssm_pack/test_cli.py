import subprocess
import sys

from ssm_pack.cli import main


def test_python_m_prints_the_report():
    out = subprocess.run([sys.executable, "-m", "ssm_pack"], capture_output=True, text=True, check=True)
    assert "ssm-pack support report" in out.stdout and "Mamba2Mixer" in out.stdout


def test_main_report(capsys):
    assert main(["report"]) == 0
    assert "packed backends" in capsys.readouterr().out
