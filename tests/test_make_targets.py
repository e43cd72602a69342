"""The Makefile targets the README shows behave as documented on a CPU machine.

`make test-gpu` and `make fuzz-gpu` must fail, loudly and at once, where no GPU is visible: a
GPU run that passes vacuously would be worse than none. `make test` installs what the browser
test needs.
"""

from __future__ import annotations

import json
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


# Each GPU target, and what its output would hold had it started its work without a GPU.
GPU_TARGETS = {"test-gpu": ("passed", "nbmake"), "fuzz-gpu": ("fa4lab.fuzz: seed",)}


@pytest.mark.parametrize("target", list(GPU_TARGETS))
def test_gpu_targets_fail_without_a_gpu(target):
    if gpu() is not None:
        pytest.skip(f"a GPU is visible here: `make {target}` would run on it")
    result = _make(target, f"PY={sys.executable}")
    output = result.stdout + result.stderr
    assert result.returncode != 0, f"make {target} passed without a GPU:\n{output}"
    assert "GPU: none" in output, output
    assert "needs a CUDA GPU" in output and "none is visible" in output, output
    # It stopped before its work: nothing ran, so nothing can have passed or fuzzed.
    assert not any(word in output for word in GPU_TARGETS[target]), output
    steps = _make("-n", "fuzz-gpu", "FUZZ_SECONDS=7", "FUZZ_SEED=3").stdout
    assert "-m fa4lab.fuzz --seconds 7 --seed 3 --out fuzz-failures" in steps, steps


def test_make_test_lints_installs_the_browser_and_runs_tests_and_notebooks():
    """`make -n test` (print, do not run): ruff first (it fails in seconds), then chromium is
    installed, then the tests and the notebooks nothing else runs."""
    result = _make("-n", "test")
    assert result.returncode == 0, result.stderr
    steps = result.stdout
    assert "ruff check fa4lab tests" in steps, steps
    assert "apt-get install" in steps and "chromium" in steps, steps
    assert steps.index("ruff check") < steps.index("chromium"), steps
    assert steps.index("chromium") < steps.index("tests/shards.py --jobs"), steps
    assert "-- -q tests/" in steps and "--nbmake" in steps, steps
    # the notebooks without graded cells (the graded ones run whole in tests/test_course.py)
    assert "fa4lab.exercises ungraded notebooks" in steps, steps


def test_make_test_fast_is_the_pure_python_tier():
    """`make -n test-fast`: no compiles (and a guard against unmarked ones), no browser, no
    slow or GPU tests, no notebooks."""
    result = _make("-n", "test-fast")
    assert result.returncode == 0, result.stderr
    steps = result.stdout
    run = next(line for line in steps.splitlines() if "tests/shards.py" in line)
    assert "FA4LAB_FORBID_COMPILE=1" in run, run
    for marker in ("compile", "browser", "slow", "gpu", "sm90", "sm100"):
        assert f"not {marker}" in run, run
    assert "--nbmake" not in steps and "apt-get" not in steps and "chromium" not in steps, steps
    assert "-p no:nbmake" in run, run       # Note [rfc3987_syntax] (tests/conftest.py)


def test_every_marker_the_makefile_names_is_registered(pytestconfig):
    import re

    registered = {m.split(":")[0] for m in pytestconfig.getini("markers")}
    fast = re.search(r"^FAST_MARKERS \?= (.+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    named = set(re.findall(r"\bnot (\w+)", fast))
    assert {"compile", "browser", "slow", "gpu"} <= named <= registered, (named, registered)


def test_environment_yml_pins_the_makefiles_torch():
    """environment.yml repeats the Makefile's default TORCH_SPEC (YAML cannot include it)."""
    import re

    spec = re.search(r"^TORCH_SPEC \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    pins = re.findall(r"^\s*- (torch==\S+)", (ROOT / "environment.yml").read_text(), re.M)
    assert pins == [spec], (pins, spec)


def test_the_version_is_said_once():
    """pyproject.toml reads `fa4lab.__version__` (a dynamic field); the metadata agrees."""
    import re
    from importlib.metadata import version

    import fa4lab

    text = (ROOT / "pyproject.toml").read_text()
    project = text.split("\n[project]\n", 1)[1].split("\n[", 1)[0]
    assert 'dynamic = ["version"]' in project and 'attr = "fa4lab.__version__"' in text, text
    assert not re.search(r"^version\s*=", project, re.M), "a second version in [project]"
    assert version("fa4lab") == fa4lab.__version__


@pytest.mark.slow       # three pytest processes collecting: 30 s on a 2-core machine
def test_shards_run_each_test_once():
    """`--shard K/N` (tests/conftest.py) partitions what a selection collects by whole
    modules: the N shards' tests are disjoint and together the whole selection; a bad shard is
    a usage error (`test_a_bad_shard_is_a_usage_error`)."""
    files = ["tests/test_online_softmax.py", "tests/test_spec.py", "tests/test_tiling.py"]

    def collected(*extra):
        result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                                 "-p", "no:logging", *files, *extra],
                                cwd=ROOT, capture_output=True, text=True, timeout=120)
        return result, [line for line in result.stdout.splitlines() if "::" in line]

    _, everything = collected()
    shards = [collected(f"--shard={k}/2")[1] for k in range(2)]
    assert sorted(sum(shards, [])) == sorted(everything) and len(everything) > 3
    assert all(shards) and len(set(sum(shards, []))) == len(everything)
    modules = [{test.split("::")[0] for test in shard} for shard in shards]
    assert not modules[0] & modules[1]          # a module's tests stay in one process


def test_a_bad_shard_is_a_usage_error():
    from conftest import shard_of

    assert shard_of("1/2") == (1, 2)
    for bad in ("2/2", "-1/2", "1", "a/b", "0/0"):
        with pytest.raises(pytest.UsageError, match="0 <= K < N"):
            shard_of(bad)


def test_a_shard_left_without_tests_is_not_a_failure():
    """tests/shards.py: more shards than modules leaves some with no test (pytest exits 5);
    the run fails only on a failing shard, or when no shard got a test at all."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from shards import NO_TESTS, shards_status
    finally:
        sys.path.remove(str(ROOT / "tests"))
    assert shards_status([0, NO_TESTS, NO_TESTS]) == 0
    assert shards_status([NO_TESTS, 1, 0, 2]) == 1
    assert shards_status([NO_TESTS, NO_TESTS]) == NO_TESTS
    assert shards_status([0, 0]) == 0


def test_each_shard_gets_its_share_of_the_cores():
    """tests/shards.py: N shards on C cores run their math libraries on C // N threads each (at
    least one), so two shards on two cores do not wait on each other's spinning threads; a
    thread count the caller set is kept."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from shards import THREAD_VARS, shard_env
    finally:
        sys.path.remove(str(ROOT / "tests"))
    env = shard_env(2, cores=2, environ={"PATH": "/bin"})
    assert env["PATH"] == "/bin" and env["PYTHONUNBUFFERED"] == "1"
    assert [env[v] for v in THREAD_VARS] == ["1"] * len(THREAD_VARS) and len(THREAD_VARS) == 3
    assert shard_env(4, cores=16, environ={})["OMP_NUM_THREADS"] == "4"
    assert shard_env(4, cores=2, environ={})["MKL_NUM_THREADS"] == "1"
    assert shard_env(2, cores=2, environ={"OMP_NUM_THREADS": "3"})["OMP_NUM_THREADS"] == "3"
    assert shard_env(1, cores=2, environ={})["OPENBLAS_NUM_THREADS"] == "2"

def test_shares_weigh_measured_seconds(tmp_path):
    """The shares' weights are the measured seconds where tests/durations.json has them (a
    module of one 60 s test outweighs one of a hundred 0.1 s tests), the markers' estimate
    elsewhere; `save_weights` keeps only the tests of at least RECORDED_FROM seconds."""
    from conftest import RECORDED_FROM, TEST_S, estimate, shares

    heavy = {"a.py": 60.0, "b.py": 100 * 0.1, "c.py": 30.0, "d.py": 20.0}
    first, second = shares(heavy, 2)
    assert first == {"a.py"} and second == {"b.py", "c.py", "d.py"}

    class Item:
        def __init__(self, *marks):
            self.marks = marks

        def get_closest_marker(self, name):
            return name if name in self.marks else None

    assert estimate(Item()) == TEST_S < estimate(Item("slow")) and estimate(Item("compile")) > 1
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from shards import save_weights
    finally:
        sys.path.remove(str(ROOT / "tests"))
    out = tmp_path / "durations.json"
    said = save_weights([{"t.py::a": 3.5, "t.py::b": RECORDED_FROM / 2}, {"u.py::c": 1.25}], out)
    assert json.loads(out.read_text()) == {"t.py::a": 3.5, "u.py::c": 1.25} and "2 tests" in said
    # A slow or compile test that took less (its module fixture charged to another test, or a
    # skip) is written at RECORDED_FROM, so its weight is measured, not its marker's estimate.
    from conftest import recorded_times

    assert recorded_times({"c.py::g": 0.01, "c.py::h": 0.013, "c.py::i": 262.0},
                          {"c.py::g", "c.py::i"}) == {"c.py::g": RECORDED_FROM,
                                                      "c.py::h": 0.01, "c.py::i": 262.0}
