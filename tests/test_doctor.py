import subprocess
import sys

from fa4lab.cli import main


def test_doctor_prints_versions_and_tiers(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    for word in ("python", "torch", "cutlass-dsl", "jupyterlab", "CUDA GPU", "tiers"):
        assert word in out


def test_console_script_runs():
    res = subprocess.run([sys.executable, "-m", "fa4lab", "doctor"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert "tiers:" in res.stdout
