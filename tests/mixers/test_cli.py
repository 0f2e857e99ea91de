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

