"""What every `fa4lab bench` mode does around its measurement: the command line its record
stores, the options the user changed (and those its mode refuses), its plan or why the command
line is wrong, the peers and time limits it was given, what it prints where no GPU is visible,
the arch fa4lab runs as, saving the record, the exit status. The dispatcher
(`fa4lab.bench.cli.main_args`) puts the parser's defaults on the arguments (`with_defaults`), so
the modes (`features_cli`, `serving_cli`, `backward_cli`, `training_cli`, the sweep's) read them
here without importing the dispatcher.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from fa4lab.bench.records import ERROR, FAILED, default_record_path, save_record
from fa4lab.bench.sweep import OURS, PEERS

T = TypeVar("T")

DEFAULTS = "bench_defaults"


def with_defaults(args, defaults: dict):
    """`args` carrying every option's default (`DEFAULTS`), for `command_line` and `changed`."""
    setattr(args, DEFAULTS, defaults)
    return args


def _defaults(args) -> dict:
    found = getattr(args, DEFAULTS, None)
    if found is None:
        raise ValueError("the bench arguments carry no defaults: parse them with fa4lab bench "
                         "(fa4lab.bench.cli.main_args puts them there)")
    return found


def command_line(args) -> str:
    """`fa4lab bench` with every option of `args` that differs from its default: the command
    that reproduces this run, stored in its record."""
    parts = ["fa4lab", "bench"]
    for dest, default in _defaults(args).items():
        value = getattr(args, dest, default)
        if dest in ("command", "func") or value == default:
            continue
        flag = "--" + dest.replace("_", "-")
        if value is True:
            parts.append(flag)
        elif isinstance(value, (list, tuple)):
            parts += [flag] + [str(x) for x in value]
        else:
            parts += [flag, str(value)]
    return " ".join(shlex.quote(x) for x in parts)


def changed(args, names) -> list[str]:
    """The flags among `names` (option dests) that `args` sets to other than their defaults."""
    defaults = _defaults(args)
    return ["--" + n.replace("_", "-") for n in names
            if getattr(args, n, defaults[n]) != defaults[n]]


def refused(args, names, mode: str, its: str = "") -> bool:
    """Whether `args` sets any of `names` (option dests) that `mode` (`--backward`) does not read;
    said on stderr, with `its` (what the mode reads instead) in parentheses."""
    wrong = changed(args, names)
    if wrong:
        print(f"fa4lab bench {mode}: {', '.join(wrong)} do not apply to {mode}"
              + (f" ({its})" if its else ""), file=sys.stderr)
    return bool(wrong)


def planned(plan_of: Callable[..., T], args, command: str) -> T | None:
    """`plan_of(args)`, or None once the error in the command line (a ValueError or TypeError)
    is said on stderr."""
    try:
        return plan_of(args)
    except (ValueError, TypeError) as err:
        print(f"{command}: {err}", file=sys.stderr)
        return None


def mode_peers(args, peers: Sequence[str], mode: str) -> list[str]:
    """The mode's `peers` that `--peers` names, in the mode's order; all of them where --peers
    keeps the sweep's default. A name not among them is a ValueError."""
    if args.peers == ",".join(PEERS):
        return list(peers)
    named = [x.strip() for x in str(args.peers).split(",") if x.strip() and x != OURS]
    unknown = [x for x in named if x not in peers]
    if unknown:
        raise ValueError(f"--peers: unknown {unknown} for {mode}; choose from "
                         f"{','.join(peers)}")
    return [p for p in peers if p in named]


def check_time_limits(args) -> None:
    """--time-budget and --step-timeout are positive seconds (else ValueError)."""
    for name, value in (("--time-budget", args.time_budget),
                        ("--step-timeout", args.step_timeout)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0 seconds, got {value}")


def no_gpu_here(command: str, description: str, summary: str, *, why: str = "",
                would: str = "run", floors: bool = False) -> int:
    """What a mode prints where no CUDA GPU is visible: that nothing is measured (and `why`),
    what it would do on a GPU, and the summary of its latest record; the exit status, 0.
    `floors`: the description's HBM floors use the H200 datasheet's bandwidth."""
    print(f"{command}: no CUDA GPU visible, so nothing is measured here{why}.")
    print(f"On a GPU this command would {would}:")
    print(description)
    if floors:
        print("(the floors above use the H200 datasheet's bandwidth; the run measures its own)")
    print()
    print(summary)
    return 0


def first_calls_line(wall_s: float, results, label) -> str:
    """The line after a run: its wall time and each result's first call, `label(result)`
    naming its case."""
    return (f"measured in {wall_s:.0f} s; first calls (compiles included): "
            + ", ".join(f"{r.provider} {label(r)} {r.first_call_s:.1f} s" for r in results
                        if r.first_call_s is not None))


def run_arch(args, g, command: str) -> tuple[str | None, str]:
    """(the arch fa4lab runs as, '' or why no fa4lab kernel runs on this GPU); says so on
    stderr when none does (the peers are still measured)."""
    arch = g.arch if args.arch == "auto" else args.arch
    if g.arch is not None and arch == g.arch:
        return arch, ""
    print(f"{command}: the GPU is {g.name} (compute capability "
          f"{g.capability[0]}.{g.capability[1]}); fa4lab's kernels run on sm90 (Hopper) "
          f"and sm100 (B200){'' if args.arch == 'auto' else f', not --arch {args.arch}'}; "
          f"the peers are still measured.", file=sys.stderr)
    return arch, f"no fa4lab kernel for {g.name} with --arch {arch}"


def save_run(record: dict, args) -> None:
    """Save the run's record where `--json` says (or the default path), unless `--no-save`."""
    if not args.no_save:
        path = Path(args.json) if args.json else default_record_path(record)
        save_record(record, path)
        print(f"record saved: {path}")


def exit_status(results, args, *, see: str = "'not measured' above") -> int:
    """The run's exit status: 1 under --strict where a provider failed its check or raised,
    else 0; how many did is said (`see`: where their reasons are)."""
    bad = [r for r in results if r.status in (FAILED, ERROR)]
    if bad:
        print(f"{len(bad)} runs failed their check or raised (see {see}).")
    return 1 if (args.strict and bad) else 0
