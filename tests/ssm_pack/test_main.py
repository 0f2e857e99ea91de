"""``python -m ssm_pack``: the support report; ``--matrix`` prints the requirements table instead."""

import subprocess
import sys

from ssm_pack.__main__ import main, support_matrix
from ssm_pack.support.report import support_report


def test_matrix_prints_the_table_and_nothing_else(capsys):
    assert main(["--matrix"]) == 0
    assert capsys.readouterr().out == support_matrix()


def test_no_option_prints_the_report_and_not_the_table(capsys):
    assert main([]) == 0
    assert capsys.readouterr().out == support_report() + "\n"


def test_python_m_ssm_pack_prints_the_package_report():
    out = subprocess.run([sys.executable, "-m", "ssm_pack"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("ssm-pack support report\n") and "kernel features" in out.stdout
    assert "Mamba2Mixer" not in out.stdout                 # the ground floor knows no mixer


def test_python_m_ssm_pack_matrix_prints_the_kernel_table():
    out = subprocess.run([sys.executable, "-m", "ssm_pack", "--matrix"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("| kernel |") and "ssm-pack support report" not in out.stdout
    assert "| causal_conv1d | 1.7.0 |" in out.stdout.replace("`", "")
