"""`python -m fa4lab.fuzz`: the fuzzer's command line, its run loop, progress and summary.

    python -m fa4lab.fuzz --seconds 200 --seed 0 --out fuzz-failures    # on a Hopper / B200
    python -m fa4lab.fuzz --replay '{"seed": 0, "index": 17, ...}'      # one case again
    python -m fa4lab.fuzz --replay fuzz-failures/seed0-case17.json
    python -m fa4lab.fuzz --device cpu --seconds 10                     # a CPU smoke run

Cases 0, 1, 2, ... of the seed run until --seconds have passed (a case started in time is
finished) or --cases have run. Every failure is printed with its replay line and, with --out,
saved as DIR/seed{seed}-case{index}.json; before each case DIR/in-flight-seed{seed}.json holds
it, so a process that dies (a segfault) leaves the case that killed it. A CUDA fault stops
the run. The exit status is 0 when every case passed or was refused, 1 on a failure or a
fault, 2 for bad arguments or no GPU with a kernel (CUDA runs only), 130 when interrupted
before any failure.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from fa4lab.fuzz.cases import POOL_SIZE, draw_case, parse_replay, to_json

__all__ = ["main", "refusal_key", "replay_line"]

PROGRESS_S = 10.0     # seconds between progress lines
SHOWN_PROBLEMS = 3    # problems printed per failure (the saved record has them all)


def refusal_key(message: str) -> str:
    """A refusal's message with its numbers as N, so refusals of one kind group together."""
    text = re.sub(r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?(?!\w)", "N", message)
    return text if len(text) <= 200 else text[:197] + "..."


def replay_line(case, device: str = "cuda") -> str:
    """The command that runs `case` again."""
    where = "" if device == "cuda" else f" --device {device}"
    return f"python -m fa4lab.fuzz --replay {shlex.quote(to_json(case))}{where}"


def _no_kernel_gpu() -> str | None:
    """Why a CUDA run cannot fuzz here, or None."""
    from fa4lab.environment import gpu

    g = gpu()
    if g is None:
        return ("python -m fa4lab.fuzz needs a CUDA GPU and none is visible; `--device cpu` "
                "runs tiny cases on the float64 reference path instead (a smoke run of the "
                "fuzzer itself)")
    if g.arch is None:
        return (f"python -m fa4lab.fuzz needs a Hopper (H100/H200) or B200 GPU, where "
                f"fa4lab's kernels run; {g.name} has compute capability "
                f"{g.capability[0]}.{g.capability[1]}, where fa4lab computes the float64 "
                f"reference")
    return None


def _kernels_line(device: str) -> str:
    """"; kernels N compiled, M loaded from the disk cache" on a GPU ("" on the CPU)."""
    if device == "cpu":
        return ""
    from fa4lab.kernels import launch

    stats = launch.stats()
    return f"; kernels {stats['compiled']} compiled, {stats['loaded']} loaded from the disk cache"


def _record(case, verdict, device: str) -> dict:
    return {"case": asdict(case), "verdict": verdict.kind, "problems": list(verdict.problems),
            "message": verdict.message, "traceback": verdict.traceback,
            "seconds": round(verdict.seconds, 3), "replay": replay_line(case, device)}


def _print_failure(case, verdict, device: str, saved: Path | None) -> None:
    print(f"{verdict.kind.upper()} case {case.index}: {case.describe()}", flush=True)
    for problem in verdict.problems[:SHOWN_PROBLEMS]:
        print(f"    {problem}")
    if len(verdict.problems) > SHOWN_PROBLEMS:
        print(f"    ... and {len(verdict.problems) - SHOWN_PROBLEMS} more")
    if saved is not None:
        print(f"    saved: {saved}")
    print(f"    {replay_line(case, device)}", flush=True)


def fuzz(seed: int, seconds: float, *, device: str = "cuda", out: Path | None = None,
         configs: int = POOL_SIZE, max_cases: int | None = None) -> int:
    """Run cases of `seed` for `seconds` (or `max_cases`); print progress, failures and the
    summary; the exit status (module docstring)."""
    from fa4lab.fuzz.judge import run_case

    size = "tiny" if device == "cpu" else "full"
    where = "the CPU (float64 reference path)"
    if device != "cpu":
        from fa4lab.environment import gpu

        where = f"{gpu().name} ({gpu().arch})"
    print(f"fa4lab.fuzz: seed {seed}, {seconds:g} s on {where}, {configs or 'unbounded'} "
          f"kernel configurations", flush=True)
    in_flight = None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        in_flight = out / f"in-flight-seed{seed}.json"
        print(f"(if this process dies, {in_flight} holds the case it was running)")
    kinds, refusals, failures = Counter(), Counter(), []
    start = last = time.monotonic()
    index, stopped = 0, ""
    try:
        while time.monotonic() - start < seconds and (max_cases is None or index < max_cases):
            case = draw_case(seed, index, configs=configs, size=size)
            if in_flight is not None:
                in_flight.write_text(to_json(case) + "\n")
            verdict = run_case(case, device)
            kinds[verdict.kind] += 1
            if verdict.kind == "refusal":
                refusals[refusal_key(verdict.message)] += 1
            elif verdict.kind in ("failure", "fault"):
                saved = None
                if out is not None:
                    saved = out / f"seed{seed}-case{index}.json"
                    saved.write_text(json.dumps(_record(case, verdict, device), indent=1))
                _print_failure(case, verdict, device, saved)
                failures.append((case, verdict))
                if verdict.kind == "fault":
                    stopped = "stopped at a CUDA fault (the context is dead): case above"
                    break
            index += 1
            if time.monotonic() - last >= PROGRESS_S:
                last = time.monotonic()
                print(f"fuzz: {sum(kinds.values())} cases, {kinds['refusal']} refusals, "
                      f"{len(failures)} failures, {last - start:.0f} s{_kernels_line(device)}",
                      flush=True)
    except KeyboardInterrupt:
        stopped = f"interrupted at case {index}"
    if in_flight is not None:
        in_flight.unlink(missing_ok=True)
    _summary(seed, device, time.monotonic() - start, kinds, refusals, failures, stopped)
    return 1 if failures else (130 if stopped else 0)


def _summary(seed, device, elapsed, kinds, refusals, failures, stopped) -> None:
    ran = sum(kinds.values())
    print()
    print(f"fa4lab.fuzz seed {seed}: {ran} cases in {elapsed:.0f} s: {kinds['pass']} passed, "
          f"{kinds['refusal']} refused, {len(failures)} failed"
          + (f" ({stopped})" if stopped else "") + _kernels_line(device))
    if refusals:
        print("refusals by message (numbers as N):")
        for message, count in refusals.most_common():
            print(f"  {count:6d}  {message}")
    if failures:
        print("failures:")
        for case, verdict in failures:
            first = verdict.problems[0] if verdict.problems else verdict.kind
            print(f"  case {case.index} ({case.describe()}): {first}")
            print(f"    {replay_line(case, device)}")


def replay(value: str, device: str = "cuda") -> int:
    """Run one case again (`--replay`), print its verdict in full; 0 for a pass or a refusal,
    1 for a failure or a fault, 2 for an argument that is not a case."""
    from fa4lab.fuzz.judge import run_case

    try:
        case = parse_replay(value)
    except ValueError as err:
        print(f"python -m fa4lab.fuzz: {err}", file=sys.stderr)
        return 2
    print(f"case {case.index} of seed {case.seed}: {case.describe()}", flush=True)
    verdict = run_case(case, device)
    print(f"{verdict.kind} in {verdict.seconds:.2f} s" + (f": {verdict.message}"
                                                          if verdict.message else ""))
    for problem in verdict.problems:
        print(f"    {problem}")
    if verdict.traceback:
        print(verdict.traceback, end="")
    return 1 if verdict.kind in ("failure", "fault") else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fa4lab.fuzz",
        description="Random configurations of fa4lab.attention / attention_varlen crossed "
                    "over every option, held to the float64 reference (fa4lab.acceptance).")
    parser.add_argument("--seconds", type=float, default=200.0,
                        help="how long to draw new cases (default 200)")
    parser.add_argument("--seed", type=int, default=0, help="case i of a seed is always the "
                        "same case (default 0)")
    parser.add_argument("--out", type=Path, default=None,
                        help="save each failure there as JSON")
    parser.add_argument("--replay", default=None, metavar="JSON_OR_PATH",
                        help="run one case again: its JSON, or a file holding it")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: tiny cases on the float64 reference path (a smoke run)")
    parser.add_argument("--configs", type=int, default=POOL_SIZE,
                        help=f"kernel configurations to draw from (default {POOL_SIZE}; 0: "
                             f"a new one per case); see Note [a bounded pool of kernels]")
    parser.add_argument("--cases", type=int, default=None, help="stop after this many cases")
    args = parser.parse_args(argv)
    if args.configs < 0 or (args.cases is not None and args.cases < 0):
        parser.error("--configs and --cases must be >= 0")
    if args.device == "cuda":
        why = _no_kernel_gpu()
        if why is not None:
            print(why, file=sys.stderr)
            return 2
    if args.replay is not None:
        return replay(args.replay, args.device)
    return fuzz(args.seed, args.seconds, device=args.device, out=args.out,
                configs=args.configs, max_cases=args.cases)
