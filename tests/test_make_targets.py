"""The Makefile targets the README shows behave as documented on a CPU machine.

`make test-gpu` must fail, loudly and at once, where no GPU is visible: a GPU run that passes
vacuously would be worse than none. `make test` installs what the browser test needs.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from labserver import ROOT

from fa4lab.environment import gpu


def _make(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS")}
    return subprocess.run(["make", "--no-print-directory", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_make_test_gpu_fails_without_a_gpu():
    if gpu() is not None:
        pytest.skip("a GPU is visible here: `make test-gpu` would run the whole GPU suite")
    result = _make("test-gpu", f"PY={sys.executable}")
    output = result.stdout + result.stderr
    assert result.returncode != 0, f"make test-gpu passed without a GPU:\n{output}"
    assert "GPU: none" in output, output
    assert "needs a CUDA GPU" in output and "none is visible" in output, output
    # It stopped before pytest: nothing ran, so nothing can have "passed".
    assert "passed" not in output and "nbmake" not in output, output


def test_make_test_installs_the_browser_and_runs_tests_and_notebooks():
    """`make -n test` (print, do not run): chromium is installed first, then both suites."""
    result = _make("-n", "test")
    assert result.returncode == 0, result.stderr
    steps = result.stdout
    assert "apt-get install" in steps and "chromium" in steps, steps
    assert steps.index("chromium") < steps.index("-m pytest -q tests/"), steps
    assert "--nbmake" in steps and "notebooks/" in steps, steps
