"""Hardware markers, reproducible randomness, and the guard of `make test-fast`.

`gpu`, `sm90`, `sm100` skip with a reason where that hardware is absent; FA4LAB_REQUIRE_GPU=1
(set by `make test-gpu`) turns a missing GPU into a failure, so a GPU run can never pass
vacuously.

Every test gets its own seed, the CRC-32 of its node id: the same in every process and on every
machine (Python's `hash` of a string is salted per process), so a failure reproduces. The `rng`
fixture is a numpy generator with that seed, and numpy's, torch's and `random`'s global
generators are seeded with it before each test. Under CI=true Hypothesis runs derandomized.

FA4LAB_FORBID_COMPILE=1 (set by `make test-fast`) makes `cutlass.cute.compile` raise: a test that
compiles a kernel without the `compile` marker fails there, naming the marker, instead of
making the fast tier slow.

`--shard K/N` keeps the K-th of N shares of the selected tests (0 <= K < N) and deselects the
rest: N processes with K = 0..N-1 run each test once (tests/shards.py runs them side by side,
as `make test-gpu` does, sharing compiled kernels through the disk cache). A share is whole
test modules, so a module's tests keep their order and their process; the modules go to the
share with the least weight so far, heaviest module first. A test weighs the seconds it took
when tests/durations.json was last measured (`--durations-out`, merged by `tests/shards.py
--save-weights`), or, where it has none (a new test, a GPU test), what its markers say a test of
its kind takes (`estimate`), so the CPU tiers' compiles and notebook runs spread evenly over the
processes.
"""

from __future__ import annotations

import importlib.abc
import json
import os
import random
import sys
import zlib
from pathlib import Path

import pytest
from hypothesis import settings

from fa4lab.environment import gpu

# The figures are built without pyplot, but tests may use it; never open a window.
os.environ.setdefault("MPLBACKEND", "Agg")

# Note [rfc3987_syntax]: nbformat validates a notebook with jsonschema, whose format checkers
# import rfc3987_syntax where it is installed (jupyter-events asks for it), and that module
# builds 38 Earley parsers as it is imported: 2-3 s of every pytest process that reads a
# notebook, for the "iri" string formats that no schema here names (nbformat's schemas name no
# format). Without it jsonschema leaves those two formats unchecked. A process that loads the
# nbmake plugin has imported it before this file (make test); `make test-fast` leaves the
# plugin out (-p no:nbmake) and so never builds the parsers.
sys.modules.setdefault("rfc3987_syntax", None)

settings.register_profile("ci", derandomize=True)
if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
    settings.load_profile("ci")


def _hardware_skip_reason(item) -> str | None:
    g = gpu()
    if item.get_closest_marker("sm100"):
        if g is None or g.arch != "sm100":
            here = g.name if g else "no GPU"
            return f"needs a B200-class GPU (compute capability 10.x); here: {here}"
    if item.get_closest_marker("sm90"):
        if g is None or g.arch != "sm90":
            return f"needs a Hopper GPU (compute capability 9.0); here: {g.name if g else 'no GPU'}"
    if item.get_closest_marker("gpu") and g is None:
        return "needs a CUDA GPU; none is visible (run `make test-gpu` on a GPU host)"
    return None


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="K/N",
                     help="run every N-th collected test from the K-th (0 <= K < N)")
    parser.addoption("--durations-out", default=None, metavar="FILE",
                     help="write each test's seconds (setup, call and teardown) to FILE as JSON")


def shard_of(value: str) -> tuple[int, int]:
    """(K, N) of a `--shard K/N` value, or a UsageError saying what a shard is."""
    try:
        k, n = (int(part) for part in value.split("/"))
    except ValueError:
        k, n = -1, 0
    if not 0 <= k < n:
        raise pytest.UsageError(f"--shard {value!r}: expected K/N with 0 <= K < N, e.g. 0/4")
    return k, n


# What a test weighs in a share, in seconds: its measured time (tests/durations.json: every test
# that took at least RECORDED_FROM seconds on a 2-core machine, one process of two) where known,
# else an estimate by kind (a pure-Python test ~0.03 s: the fast tier's tests under RECORDED_FROM
# average 0.023 s; a compile and audit 5-15 s, a `slow` test that is not a compile runs notebooks
# or processes, 20-60 s).
DURATIONS = Path(__file__).with_name("durations.json")
RECORDED_FROM = 0.2
TEST_S, COMPILE_S, SLOW_S = 0.03, 8.0, 40.0


def estimate(item) -> float:
    """The seconds a test without a measured time is taken to need, by its markers."""
    return (COMPILE_S if item.get_closest_marker("compile")
            else SLOW_S if item.get_closest_marker("slow") else TEST_S)


def measured() -> dict[str, float]:
    """tests/durations.json ({node id: seconds}), or {} where there is none."""
    try:
        return json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return {}


def shares(modules: dict[str, float], n: int) -> list[set[str]]:
    """n sets of module names: each module (name: weight) to the share with the least weight so
    far, the heaviest module first (ties by name, so every process computes the same shares)."""
    out, weights = [set() for _ in range(n)], [0] * n
    for name, weight in sorted(modules.items(), key=lambda m: (-m[1], m[0])):
        k = weights.index(min(weights))
        out[k].add(name)
        weights[k] += weight
    return out


def _keep_shard(config, items) -> None:
    value = config.getoption("--shard")
    if value is None:
        return
    k, n = shard_of(value)
    seconds = measured()
    modules: dict[str, float] = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        modules[module] = modules.get(module, 0.0) + seconds.get(item.nodeid, estimate(item))
    mine = shares(modules, n)[k]
    kept = [item for item in items if item.nodeid.split("::")[0] in mine]
    config.hook.pytest_deselected(items=[item for item in items
                                         if item.nodeid.split("::")[0] not in mine])
    items[:] = kept


@pytest.hookimpl(trylast=True)      # after -m / -k deselect: shards of what will run
def pytest_collection_modifyitems(config, items):
    _keep_shard(config, items)
    require_gpu = os.environ.get("FA4LAB_REQUIRE_GPU") == "1"
    for item in items:
        reason = _hardware_skip_reason(item)
        if reason is None:
            continue
        if require_gpu and gpu() is None:
            item.add_marker(pytest.mark.xfail(reason=reason, run=False, strict=True))
        else:
            item.add_marker(pytest.mark.skip(reason=reason))


# ---- reproducible randomness ------------------------------------------------------------------
def seed_of(nodeid: str) -> int:
    """A test's seed: stable across processes, runs and machines."""
    return zlib.crc32(nodeid.encode())


@pytest.fixture(autouse=True)
def _seed_global_generators(request):
    seed = seed_of(request.node.nodeid)
    random.seed(seed)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed)
    if "torch" in sys.modules:            # only where the test module uses torch already
        sys.modules["torch"].manual_seed(seed)


@pytest.fixture
def rng(request):
    """A fresh generator seeded per test: inputs are random but a failure reproduces."""
    import numpy as np

    return np.random.default_rng(seed_of(request.node.nodeid))


@pytest.fixture
def gen(rng):
    """A torch CPU generator seeded from `rng` (torch inputs, reproducible like numpy's)."""
    import torch

    return torch.Generator().manual_seed(int(rng.integers(2**31)))


@pytest.fixture
def quiet_reference():
    """Silence fa4lab's SlowReferenceWarning: tests that run the API on CPU tensors on purpose
    (`pytestmark = pytest.mark.usefixtures("quiet_reference")`)."""
    import warnings

    from fa4lab.api import SlowReferenceWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowReferenceWarning)
        yield


# ---- the guard of `make test-fast` --------------------------------------------------------------
def _compile_forbidden(*args, **kwargs):
    raise RuntimeError(
        "this test compiles a kernel with the CuTe DSL (cute.compile) but is not marked "
        "@pytest.mark.compile; `make test-fast` (FA4LAB_FORBID_COMPILE=1) runs only tests that "
        "do not compile. Mark it `compile`.")


class _ForbidCompile(importlib.abc.MetaPathFinder):
    """Loads `cutlass.cute` as usual, then replaces its `compile` with `_compile_forbidden`."""

    def find_spec(self, name, path=None, target=None):
        if name != "cutlass.cute":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                spec.loader = _ForbidCompileLoader(spec.loader)
                return spec
        return None


class _ForbidCompileLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        module.compile = _compile_forbidden


def pytest_configure(config):
    if os.environ.get("FA4LAB_FORBID_COMPILE") == "1":
        if "cutlass.cute" in sys.modules:
            sys.modules["cutlass.cute"].compile = _compile_forbidden
        else:
            sys.meta_path.insert(0, _ForbidCompile())


# ---- measured times (tests/durations.json) ----------------------------------------------------
_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report):
    _seconds[report.nodeid] = _seconds.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session):
    """Write the tests' times to --durations-out; a compile or slow test that ran in less than
    RECORDED_FROM (a skip, or a test whose module fixture another test's time holds) at
    RECORDED_FROM, so that its recorded weight replaces its kind's estimate (the 15 graded
    course tests, 40 s each by their marker, had weighed 600 s against the 0.1 s they take)."""
    out = session.config.getoption("--durations-out")
    if out:
        marked = {item.nodeid for item in session.items if estimate(item) > RECORDED_FROM}
        Path(out).write_text(json.dumps(recorded_times(_seconds, marked), indent=0) + "\n")


def recorded_times(seconds: dict[str, float], marked: set[str]) -> dict[str, float]:
    """The times a run writes: each test's, rounded; a `marked` test's (one whose kind's
    estimate exceeds RECORDED_FROM) at least RECORDED_FROM (`pytest_sessionfinish`)."""
    return {k: round(max(v, RECORDED_FROM) if k in marked else v, 2)
            for k, v in sorted(seconds.items())}
