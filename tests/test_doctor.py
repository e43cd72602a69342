import subprocess
import sys

import pytest

from fa4lab.cli import main


def test_doctor_prints_versions_and_tiers(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    for word in ("python", "torch", "cutlass-dsl", "jupyterlab", "CUDA GPU", "tiers"):
        assert word in out
    import fa4lab

    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert lines["fa4lab"].split()[1] == fa4lab.__version__
    for tool in ("ptxas", "cuobjdump", "nvdisasm"):   # a path, or how to install it
        assert tool in lines and (tool in lines[tool].split()[1] or "missing" in lines[tool])


def test_version_flag(capsys):
    import pytest

    import fa4lab

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == \
        f"fa4lab {fa4lab.__version__}"


def test_the_package_says_it_is_typed():
    from importlib.resources import files

    assert files("fa4lab").joinpath("py.typed").is_file()


# A fresh process importing torch (3 s on a 2-core machine) for what two fast tests show:
# test_doctor_prints_versions_and_tiers runs `fa4lab.cli.main(["doctor"])`, the function
# `python -m fa4lab` calls, and test_plan_cli's test_python_m_fa4lab_plan_takes_the_mask_flags
# runs `python -m fa4lab`. `make test` runs it.
@pytest.mark.slow
def test_console_script_runs():
    res = subprocess.run([sys.executable, "-m", "fa4lab", "doctor"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert "tiers:" in res.stdout
