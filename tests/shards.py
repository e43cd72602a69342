"""Run one pytest selection as N processes side by side (`--shard K/N`, tests/conftest.py).

    python tests/shards.py --jobs 4 -- -q -m "gpu or sm90 or sm100" tests/

What a GPU run spends most of its time on is compiling kernels, on the CPU, one at a time per
process; N processes compile N at a time while the GPU runs the others' tests, and a kernel
one shard compiled reaches the others through the disk cache (`fa4lab.kernels.cache`: a second
process that needs it waits on its lock, then loads it). Each shard's output goes to
`<out>/shard-K.log`; every `--every` seconds one line gives each shard's progress (pytest's
`[ NN%]`), and at the end each shard's slowest tests (where the run asked for
`--durations`), its summary line and the failures of any that failed. The exit status is the
first non-zero shard's, 0 when every shard passed. `make test` and `make test-fast` run their
CPU tiers this way too, one process per core, their shares weighted by each test's measured
seconds (tests/conftest.py). Each shard writes its tests' times (`<out>/durations-K.json`), and
the run prints each shard's busy seconds; `--save-weights tests/durations.json` keeps them as
the weights of the next runs (`make durations`).

Each shard's math libraries (torch's OpenMP, OpenBLAS, MKL) get the machine's cores divided
among the shards (`shard_env`; a variable already set is kept): N processes of N threads each
on N cores wait on one another's spinning threads, which cost `make test-fast` (2 shards on 2
cores) a quarter of its tests' seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

PROGRESS = re.compile(r"\[\s*(\d+)%\]")
SUMMARY = re.compile(r"^=*\s*(\d+ (passed|failed|error|skipped|xfailed|deselected).*?)\s*=*$")


def _progress(log: Path) -> str:
    text = log.read_text(errors="replace") if log.exists() else ""
    found = PROGRESS.findall(text)
    return f"{found[-1]}%" if found else "collecting"


def _summary(text: str) -> str:
    lines = [m.group(1) for m in map(SUMMARY.match, text.splitlines()) if m]
    return lines[-1] if lines else "(no summary: see the log)"


def _durations(text: str) -> str:
    """The lines of pytest's `--durations` section in a log (after its header, up to the
    summary), or '' where it has none."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if " slowest " in line and "durations" in line
                  and line.startswith("=")), None)
    if start is None:
        return ""
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].strip()
                or lines[i].startswith("=") or SUMMARY.match(lines[i])), len(lines))
    return "\n".join(lines[start + 1:end]).strip("\n")


def _failures(text: str) -> str:
    """The log from pytest's FAILURES / ERRORS section on, or its last 60 lines."""
    for header in ("= FAILURES =", "= ERRORS ="):
        at = text.find(header)
        if at >= 0:
            return text[text.rfind("\n", 0, at) + 1:]
    return "\n".join(text.splitlines()[-60:])


# The variables the math libraries read their thread count from (torch's OpenMP, numpy's
# OpenBLAS, MKL).
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def shard_env(jobs: int, cores: int | None = None, environ=None) -> dict[str, str]:
    """The environment of one of `jobs` shards: `environ` (default os.environ), unbuffered,
    and each of THREAD_VARS that is not set there set to this shard's share of the cores (at
    least one)."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
    env = {**(os.environ if environ is None else environ), "PYTHONUNBUFFERED": "1"}
    for var in THREAD_VARS:
        env.setdefault(var, str(max(1, cores // jobs)))
    return env


# pytest's exit status when a run selected no test: a shard of fewer modules than shards.
NO_TESTS = 5


def shards_status(codes: list[int]) -> int:
    """The run's exit status: the first failing shard's; a shard that got no test is not a
    failure unless none got any (then the selection was empty: NO_TESTS)."""
    failed = [c for c in codes if c not in (0, NO_TESTS)]
    if failed:
        return failed[0]
    return NO_TESTS if codes and all(c == NO_TESTS for c in codes) else 0


def _read_times(path: Path) -> dict[str, float]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def save_weights(seconds: list[dict[str, float]], path: Path) -> str:
    """Write the tests of these shards' times that took at least RECORDED_FROM seconds to `path`
    (sorted JSON, one test a line); say how many."""
    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import RECORDED_FROM

    kept = {k: v for t in seconds for k, v in t.items() if v >= RECORDED_FROM}
    path.write_text("{\n" + ",\n".join(f"{json.dumps(k)}: {v}" for k, v in sorted(kept.items()))
                    + "\n}\n")
    return f"{path} ({len(kept)} tests, {sum(kept.values()):.0f} s)"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=4, help="processes (default 4)")
    parser.add_argument("--out", default="test-output/shards", help="where the logs go")
    parser.add_argument("--every", type=float, default=30.0, help="seconds between progress")
    parser.add_argument("--save-weights", default=None, metavar="FILE",
                        help="after a passing run, write the times of its tests that took at "
                             "least conftest.RECORDED_FROM seconds to FILE (the shares' weights)")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER,
                        help="after --: the arguments of one pytest run")
    args = parser.parse_args(argv)
    pytest_args = [a for a in args.pytest_args if a != "--"]
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: need at least 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logs = [out / f"shard-{k}.log" for k in range(args.jobs)]
    times = [out / f"durations-{k}.json" for k in range(args.jobs)]
    for path in times:
        path.unlink(missing_ok=True)
    procs = []
    for k, log in enumerate(logs):
        cmd = [sys.executable, "-m", "pytest", *pytest_args, f"--shard={k}/{args.jobs}",
               f"--durations-out={times[k]}"]
        procs.append(subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                      env=shard_env(args.jobs)))
    start = time.monotonic()
    report = start + min(args.every, 2.0)
    while any(p.poll() is None for p in procs):
        time.sleep(0.2)         # the run ends when its last shard does, not at the next report
        if time.monotonic() < report:
            continue
        report += min(args.every, 2.0) if time.monotonic() - start < 5 else args.every
        states = ", ".join(f"{k}: {'done' if p.poll() is not None else _progress(log)}"
                           for k, (p, log) in enumerate(zip(procs, logs)))
        print(f"[{time.monotonic() - start:6.0f} s] shards {states}", flush=True)
    texts = [log.read_text(errors="replace") for log in logs]
    for k, text in enumerate(texts):
        if _durations(text):
            print(f"---- shard {k}/{args.jobs}: slowest tests\n{_durations(text)}")
    for k, (p, log) in enumerate(zip(procs, logs)):
        print(f"shard {k}/{args.jobs} (exit {p.returncode}): {_summary(texts[k])}  [{log}]")
    seconds = [_read_times(path) for path in times]
    print("busy seconds per shard (its tests' setup, call and teardown): "
          + ", ".join(f"{k}: {sum(t.values()):.0f}" for k, t in enumerate(seconds)))
    codes = [p.returncode for p in procs]
    status = shards_status(codes)
    if args.save_weights and status == 0:
        print(f"weights saved: {save_weights(seconds, Path(args.save_weights))}")
    for k, (p, log) in enumerate(zip(procs, logs)):
        if p.returncode not in (0, NO_TESTS):
            print(f"\n---- shard {k} ----\n{_failures(log.read_text(errors='replace'))}")
    return status


if __name__ == "__main__":
    sys.exit(main())
