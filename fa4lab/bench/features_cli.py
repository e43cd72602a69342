"""`fa4lab bench --features`: the command-line side of the features mode.

`plan_of_features` reads the command line, `features_args` runs the mode (on a CPU: the plan of
the run and the latest recorded features; on a GPU: check, time, table, record, plot, within the
run's time limits), `recorded_features_summary` prints the latest record. The mode itself is
`fa4lab.bench.features`.
"""

from __future__ import annotations

import sys
import time

from fa4lab.bench.features import (
    FEATURE_HEAD_DIM,
    FEATURE_PEERS,
    FEATURE_SEQLEN,
    available,
    describe_features_run,
    feature_cases,
    feature_flops,
    features_config,
    features_named,
    make_features_record,
    run_features,
)
from fa4lab.bench.measure import RunGuard
from fa4lab.bench.providers import short_error
from fa4lab.bench.records import FEATURES, feature_results_of, latest_summary
from fa4lab.bench.runs import (
    check_time_limits,
    command_line,
    exit_status,
    mode_peers,
    no_gpu_here,
    planned,
    run_arch,
    save_run,
)
from fa4lab.bench.sweep import HEAD_DIMS, OURS, SEQLENS
from fa4lab.bench.table import format_features_table


def plan_of_features(args):
    """The cases and provider names `--features` asks for (errors are ValueError). The sweep's
    default --head-dim and --seqlen mean the mode's hd128 s8192; otherwise one value each."""
    def one(values, default, sweep_default, flag):
        values = list(values)
        if values == list(sweep_default):
            return default
        if len(values) != 1:
            raise ValueError(f"--features takes one {flag}, got {values}")
        return values[0]

    head_dim = one(args.head_dim, FEATURE_HEAD_DIM, HEAD_DIMS, "--head-dim")
    seqlen = one(args.seqlen, FEATURE_SEQLEN, SEQLENS, "--seqlen")
    peers = mode_peers(args, FEATURE_PEERS, "--features")
    check_time_limits(args)
    cases = feature_cases(features_named(args.feature), head_dim=head_dim, seqlen=seqlen,
                          dtype=args.dtype, total_tokens=args.total_tokens, hidden=args.hidden)
    return cases, [OURS] + peers


def recorded_features_summary(directory=None) -> str:
    """The latest features record as text (what the CPU path prints)."""
    def body(rec):
        shape = rec["config"].get("shape", {})
        return [f"  {rec['label']} ({rec['date']}, {rec['gpu']}, hd{shape.get('head_dim')} "
                f"s{shape.get('seqlen')} b{shape.get('batch')} h{shape.get('heads')})", "",
                format_features_table(feature_results_of(rec))]

    return latest_summary(FEATURES, "features", body, directory)


def features_args(args) -> int:
    plan = planned(plan_of_features, args, "fa4lab bench --features")
    if plan is None:
        return 2
    cases, names = plan
    from fa4lab.environment import gpu

    g = gpu()
    if g is None:
        flops = {c.feature.name: feature_flops(c) for c in cases}
        return no_gpu_here("fa4lab bench --features",
                           describe_features_run(cases, names,
                                                 missing=available(names, has_gpu=False),
                                                 flops=flops),
                           recorded_features_summary(args.records))
    arch, no_kernel = run_arch(args, g, "fa4lab bench --features")
    missing = available(names, has_gpu=True)
    if no_kernel:
        missing[OURS] = no_kernel
    print(f"fa4lab bench --features on {g.name}")
    print(describe_features_run(cases, names, missing=missing))
    results: list = []
    started = time.perf_counter()

    def record(wall_s: float, notes: str = "") -> dict:
        config = features_config(cases, names, guard=guard, warmup_ms=args.warmup_ms,
                                 rep_ms=args.rep_ms, wall_s=wall_s,
                                 flops={r.feature: r.flops for r in results if r.flops})
        return make_features_record(results, gpu_name=g.name, arch=arch,
                                    command=command_line(args), config=config,
                                    label=args.label, notes=notes)

    def on_timeout(label: str, seconds: float) -> None:
        print(format_features_table(results))
        save_run(record(time.perf_counter() - started,
                     f"ended by the watchdog: {label} ran {seconds:.0f} s (limit "
                     f"{args.step_timeout:g} s); the features after it were not run"), args)

    guard = RunGuard(budget_s=args.time_budget, step_s=args.step_timeout,
                     on_timeout=on_timeout)
    run_features(cases, names, missing=missing, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms,
                 guard=guard, on_result=results.append)
    wall_s = time.perf_counter() - started
    print()
    print(f"measured in {wall_s:.0f} s; first calls (compiles, masks, block masks included): "
          + ", ".join(f"{p} {sum(r.first_call_s or 0 for r in results if r.provider == p):.0f} s"
                      for p in names))
    print(format_features_table(results))
    rec = record(wall_s)
    save_run(rec, args)
    if args.plot:
        try:
            from fa4lab.viz.bench import plot_features

            plot_features(rec).savefig(args.plot, dpi=110, bbox_inches="tight")
            print(f"plot saved: {args.plot}")
        except Exception as err:   # the record is saved; a plot can be drawn from it later
            print(f"plot not saved: {type(err).__name__}: {short_error(err)}", file=sys.stderr)
    return exit_status(results, args)
