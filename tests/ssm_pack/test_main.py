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


def test_the_matrix_has_one_row_per_package_and_per_feature_under_its_kernel():
    """Each kernel's rows are its packages, then its own features, and nothing else: torch 2.10 is the
    package only of the kernel that names none (PyTorch's varlen_attn); every feature sits under the
    kernel it belongs to."""
    from ssm_pack.support.requirements import FEATURES, KERNELS

    rows = [[cell.strip().strip("`") for cell in line.strip("|").split("|")]
            for line in support_matrix().splitlines()[2:]]
    want = []
    for kernel in KERNELS.values():
        want += [(kernel.name, package, minimum) for package, minimum in kernel.packages] or \
            [(kernel.name, "torch", "2.10")]
        want += [(kernel.name, f.package, f.minimum) for f in FEATURES.values() if f.kernel == kernel.name]
    assert [tuple(row[:3]) for row in rows] == want
    torch_rows = [row[0] for row in rows if row[1] == "torch"]
    assert torch_rows == ["torch_varlen"], torch_rows
    assert ("causal_conv1d", "causal_conv1d", "1.7.0") in want and ("fla", "fla", "0.5.0") in want
