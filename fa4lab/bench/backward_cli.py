"""`fa4lab bench --backward`: the command-line side of the backward mode.

`plan_of_backward` reads the command line, `backward_args` runs the mode (on a CPU: the plan of
the run and the latest recorded backward results; on a GPU: check, time, table, record, within
the run's time limits), `recorded_backward_summary` prints the latest record. The mode itself
is `fa4lab.bench.backward`.
"""

from __future__ import annotations

import time

from fa4lab.bench.backward import (
    BACKWARD_HEAD_DIMS,
    BACKWARD_PEERS,
    BACKWARD_SEQLENS,
    QUICK_HEAD_DIMS,
    QUICK_SEQLENS,
    BackwardProvider,
    backward_cases,
    backward_config,
    backward_providers,
    describe_backward_run,
    format_backward_table,
    make_backward_record,
    run_backward,
)
from fa4lab.bench.records import BACKWARD, backward_results_of, latest_summary
from fa4lab.bench.runs import (
    changed,
    check_time_limits,
    command_line,
    exit_status,
    first_calls_line,
    mode_peers,
    no_gpu_here,
    planned,
    refused,
    run_arch,
    save_run,
)
from fa4lab.bench.sweep import HEAD_DIMS, OURS, SEQLENS, BenchShape, parse_causal

# Options of other modes: given with --backward, they are an error rather than ignored.
_NOT_BACKWARD = ("plot", "no_gemm", "batch", "seqlen_q", "seqlen_k", "heads_q", "heads_kv",
                 "prefill_seqlen", "llm_shapes", "feature", "calls", "repeats")


def plan_of_backward(args) -> tuple[list[BenchShape], list[str]]:
    """The cases and provider names `--backward` asks for (errors are ValueError). The sweep's
    default --head-dim, --seqlen and --peers mean the mode's own (hd 64 and 128; seqlen 2048,
    8192 and 16384; every peer); --quick: hd128, seqlen 2048 and 8192."""
    head_dims = list(args.head_dim)
    seqlens = list(args.seqlen)
    if head_dims == list(HEAD_DIMS):
        head_dims = list(BACKWARD_HEAD_DIMS)
    if seqlens == list(SEQLENS):
        seqlens = list(BACKWARD_SEQLENS)
    if args.quick:
        head_dims, seqlens = list(QUICK_HEAD_DIMS), list(QUICK_SEQLENS)
    peers = mode_peers(args, BACKWARD_PEERS, "--backward")
    check_time_limits(args)
    cases = backward_cases(head_dims, seqlens, parse_causal(args.causal),
                           total_tokens=args.total_tokens, hidden=args.hidden, dtype=args.dtype)
    return cases, [OURS] + peers


def recorded_backward_summary(directory=None) -> str:
    """The latest backward record as text (what the CPU path prints)."""
    return latest_summary(BACKWARD, "backward", lambda rec: [
        f"  {rec['label']} ({rec['date']}, {rec['gpu']})", "",
        format_backward_table(backward_results_of(rec))], directory)


def backward_args(args) -> int:
    from fa4lab.bench.measure import RunGuard

    if refused(args, _NOT_BACKWARD, "--backward",
               "its options: --head-dim, --seqlen, --causal, --quick, --peers, --dtype, "
               "--total-tokens, --hidden, --json/--out, --label, --no-save, --warmup-ms, "
               "--rep-ms, --time-budget, --step-timeout, --strict, --arch, --records"):
        return 2
    plan = planned(plan_of_backward, args, "fa4lab bench --backward")
    if plan is None:
        return 2
    cases, names = plan
    from fa4lab.environment import gpu

    g = gpu()
    if g is None:
        return no_gpu_here("fa4lab bench --backward",
                           describe_backward_run(cases, backward_providers(names, arch=None)),
                           recorded_backward_summary(args.records))
    arch, no_kernel = run_arch(args, g, "fa4lab bench --backward")
    providers = backward_providers(names, arch=arch)
    if no_kernel:
        providers = [BackwardProvider(p.name, None, no_kernel) if p.name.startswith(OURS) else p
                     for p in providers]
    print(f"fa4lab bench --backward on {g.name}")
    print(describe_backward_run(cases, providers))
    results: list = []
    started = time.perf_counter()

    def record(wall_s: float, notes: str = "") -> dict:
        config = backward_config(cases, names, guard=guard, warmup_ms=args.warmup_ms,
                                 rep_ms=args.rep_ms, wall_s=wall_s)
        return make_backward_record(results, gpu_name=g.name, arch=arch,
                                    command=command_line(args), config=config,
                                    label=args.label, notes=notes)

    def on_timeout(label: str, seconds: float) -> None:
        print(format_backward_table(results))
        save_run(record(time.perf_counter() - started,
                     f"Ended by the watchdog: {label} ran {seconds:.0f} s (limit "
                     f"{args.step_timeout:g} s); the cases after it were not run."), args)

    # No budget unless asked for (the first case compiles); the step watchdog always.
    budget = args.time_budget if changed(args, ("time_budget",)) else None
    guard = RunGuard(budget_s=budget, step_s=args.step_timeout, on_timeout=on_timeout)
    run_backward(cases, providers, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, guard=guard,
                 on_result=results.append)
    wall_s = time.perf_counter() - started
    print()
    print(first_calls_line(wall_s, results, lambda r: f"hd{r.head_dim} s{r.seqlen}"
                           f"{' causal' if r.causal else ''}"))
    print(format_backward_table(results))
    save_run(record(wall_s), args)
    return exit_status(results, args)
