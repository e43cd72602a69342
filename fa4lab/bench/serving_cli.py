"""`fa4lab bench --serving`: the table, the bars and the command line of the serving mode.

`format_serving_table` prints a record's rows with fa4lab's bars (`bar_lines`, the mode's
BARS), `describe_serving_run` what a run would measure, `plan_of_serving` reads the command
line, `serving_args` runs the mode (on a CPU: the plan of the run and the latest recorded
serving results; on a GPU: bandwidth, check, time, table, record, within the run's time
limits), `recorded_serving_summary` prints the latest record. The mode itself is
`fa4lab.bench.serving`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from fa4lab.bench.decode import COPY_BYTES, _num, announce_copy_bandwidth, floor_us
from fa4lab.bench.records import (
    OK,
    SERVING,
    ServingResult,
    latest_summary,
    serving_results_of,
)
from fa4lab.bench.runs import (
    changed,
    check_time_limits,
    command_line,
    exit_status,
    first_calls_line,
    no_gpu_here,
    planned,
    refused,
    run_arch,
    save_run,
)
from fa4lab.bench.serving import (
    BARS,
    CALLS,
    CHECKED,
    SCENARIO_PROVIDERS,
    ServingCase,
    VarlenArgs,
    make_serving_record,
    run_serving,
    serving_cases,
    serving_config,
    serving_labels,
    serving_providers,
)
from fa4lab.bench.sweep import OURS
from fa4lab.bench.timing import timer_name


# ---- the table ---------------------------------------------------------------------------------
def _ok(rows: Sequence[ServingResult], provider: str) -> ServingResult | None:
    return next((r for r in rows if r.provider == provider and r.status == OK), None)


def bar_lines(results: Sequence[ServingResult]) -> list[str]:
    """Per case, fa4lab's default call (the headline row, Note [the headline row]) against its
    bars (BARS): its speed over the peer's (the peer's time / fa4lab's) and its multiple of the
    HBM floor, each "met" or "MISSED", or why not judged; beside the floor bar, the peer's own
    multiple of the floor."""
    cases: dict[str, list[ServingResult]] = {}
    for r in results:
        cases.setdefault(r.case, []).append(r)
    lines = []
    for case, rows in cases.items():
        bar, mine = BARS.get(rows[0].scenario, {}), _ok(rows, OURS)
        said = []
        if "peer" in bar:
            peer = _ok(rows, bar["peer"])
            if mine and peer:
                speed, least = peer.us / mine.us, bar.get("min_speed")
                judged = ("no bar" if least is None else
                          f"bar >= {least:.2f}x: {'met' if speed >= least else 'MISSED'}")
                said.append(f"at {speed:.2f}x the speed of {bar['peer']} ({judged})")
            else:
                said.append(f"x {bar['peer']}: not judged ({OURS} or {bar['peer']} not ok)")
        if "max_x_floor" in bar:
            if mine and mine.x_floor:
                said.append(f"{mine.x_floor:.2f}x the HBM floor (bar <= "
                            f"{bar['max_x_floor']:.2f}x: "
                            f"{'met' if mine.x_floor <= bar['max_x_floor'] else 'MISSED'})")
            else:
                said.append("x floor: not judged (no fa4lab time or no bandwidth)")
            peer = _ok(rows, bar.get("peer", ""))
            if peer and peer.x_floor:
                said.append(f"{bar['peer']} {peer.x_floor:.2f}x the HBM floor")
        if said:
            lines.append(f"- {case}: {OURS} (default call) " + "; ".join(said))
    return lines


def _shape_of(r: ServingResult) -> str:
    """A row's shape from its own fields, where the case's lengths are not at hand."""
    return (f"b{r.batch} q{r.total_q} k{r.total_k} h{r.heads_q}/{r.heads_kv} hd{r.head_dim} "
            f"{'causal' if r.causal else 'full'}")


def call_of(provider: str, scenario: str = "", calls: dict[str, str] | None = None) -> str:
    """The table's "call" column: what the row's call changes from fa4lab's default call
    (`calls` first, then CALLS; "scenario/provider" keys before a provider's)."""
    for table in (calls or {}, CALLS):
        for key in (f"{scenario}/{provider}", provider):
            if key in table:
                return table[key]
    return ""


def recorded_calls(record: dict) -> dict[str, str]:
    """The call column of a record written before fa4lab's row was its default call (no
    "headline" in its config): what its labels say that row passed."""
    config = record.get("config", {})
    if "headline" in config:
        return {}
    out = {}
    for key, label in config.get("providers", {}).items():
        if key.endswith(f"/{OURS}"):
            out[key] = next((f"{arg} (recorded)" for arg in ("check_indices=False",
                                                             "num_splits=None")
                             if arg in label), "as recorded")
        elif key.endswith(f"/{CHECKED}") and "check_indices=True" in label:
            out[key] = "check_indices=True"
    return out


def format_serving_table(results: Sequence[ServingResult], *,
                         hbm_gbps: float | None = None,
                         shapes: dict[str, str] | None = None,
                         calls: dict[str, str] | None = None) -> str:
    """A markdown table: per case and provider (fa4lab's default call first: Note [the
    headline row]), the shape and dtype, the call, us per call, the multiple of the HBM floor,
    GB/s, TFLOP/s and the default call's speed over the provider (its time / fa4lab's; > 1:
    fa4lab is faster); then the bars, the floors and the providers not measured. `shapes`:
    {case name: shape} (`ServingCase.shape_label`); else each row's shape from its fields.
    `calls`: the call column where it is not CALLS' (`recorded_calls`)."""
    cases: dict[str, list[ServingResult]] = {}
    for r in results:
        cases.setdefault(r.case, []).append(r)
    lines = ["| case | shape | dtype | provider | call | us | x HBM floor | GB/s | TFLOP/s | "
             "fa4lab/this |", "|---|---|---|---|---|---|---|---|---|---|"]
    floors, notes = [], []
    for case, rows in cases.items():
        mine = _ok(rows, OURS)
        order = {p: i for i, p in enumerate(SCENARIO_PROVIDERS.get(rows[0].scenario, ()))}
        for r in sorted(rows, key=lambda r: order.get(r.provider, len(order))):
            head = (f"| {case} | {(shapes or {}).get(case) or _shape_of(r)} | {r.dtype} | "
                    f"{r.provider} | {call_of(r.provider, r.scenario, calls)} |")
            if r.status != OK:
                lines.append(f"{head} {r.status} | - | - | - | - |")
                if r.note:
                    notes.append(f"- {r.provider} {case}: {r.status}: {r.note}")
                continue
            ratio = f"{r.us / mine.us:.2f}" if mine else "-"
            lines.append(f"{head} {r.us:.1f} | {_num(r.x_floor)} | {_num(r.gbps, '.0f')} | "
                         f"{_num(r.tflops, '.1f')} | {ratio} |")
            if r.note:
                notes.append(f"- {r.provider} {case}: {r.note}")
        first = rows[0]
        floor = floor_us(first.hbm_bytes, hbm_gbps) if hbm_gbps else first.floor_us
        floors.append(f"{case} {(first.hbm_bytes or 0) / 1e9:.3f} GB"
                      + (f" = {floor:.1f} us" if floor else ""))
    lines += ["", f"{OURS} (call: default) is fa4lab's call with its default arguments: no "
                  f"check_indices (varlen, paged), no num_splits (split-KV); the other "
                  f"{OURS}-* rows change only what their call column says."]
    bars = bar_lines(results)
    if bars:
        lines += ["", "bars:"] + bars
    lines += ["", (f"HBM floor (the K/V each sequence attends to once, q and out once) at "
                   f"{hbm_gbps:.0f} GB/s, the device-to-device copy of this run: " if hbm_gbps
                   else "HBM floor not measured (no bandwidth): ") + "; ".join(floors)]
    if notes:
        lines += ["", "notes:"] + notes
    return "\n".join(lines)


def describe_serving_run(cases: Sequence[ServingCase], missing: dict[str, str] | None = None,
                         hbm_gbps_hint: float | None = None) -> str:
    """What the mode runs: each case with its bytes, FLOPs and floor, the providers per
    scenario (missing ones with why: missing["scenario/name"]), how the floor is measured.
    `hbm_gbps_hint` (a datasheet figure) shows what the floors would be."""
    missing = missing or {}
    lines = [f"{len(cases)} serving cases ({cases[0].dtype}, lengths seeded, seed "
             f"{cases[0].seed}):"]
    for c in cases:
        hint = floor_us(c.hbm_bytes, hbm_gbps_hint)
        lines.append(f"  {c.label()}  {c.hbm_bytes / 1e9:.3f} GB to move, "
                     f"{c.flops / 1e9:.1f} GFLOP"
                     + (f", floor {hint:.0f} us at {hbm_gbps_hint:.0f} GB/s" if hint else ""))
    lines.append("providers:")
    for key, text in serving_labels().items():
        if key.split("/")[0] in {c.scenario for c in cases}:
            why = missing.get(key)
            lines.append(f"  {key:<30} {text}" + (f": missing ({why})" if why else ""))
    lines.append(f"HBM floor: bytes / the bandwidth of a {COPY_BYTES / 2**30:g} GiB "
                 f"device-to-device copy_ in the same run (read + write); timer: {timer_name()}")
    return "\n".join(lines)


def recorded_serving_summary(directory=None) -> str:
    """The latest serving record as text (what the CPU path prints)."""
    return latest_summary(SERVING, "serving calls", lambda rec: [
        f"  {rec['label']} ({rec['date']}, {rec['gpu']})", "",
        format_serving_table(serving_results_of(rec), hbm_gbps=rec["hbm_gbps"],
                             shapes=recorded_shapes(rec), calls=recorded_calls(rec))],
        directory)


def recorded_shapes(record: dict) -> dict[str, str]:
    """{case name: shape} of a serving record's config (empty where it cannot be read)."""
    try:
        return {c["name"]: ServingCase.from_config(c).shape_label()
                for c in record["config"]["cases"]}
    except (KeyError, TypeError, ValueError):
        return {}


# ---- the command -------------------------------------------------------------------------------
# Options of other modes: given with --serving, they are an error rather than ignored.
_NOT_SERVING = ("head_dim", "seqlen", "causal", "peers", "total_tokens", "hidden", "plot",
                "no_gemm", "batch", "seqlen_q", "seqlen_k", "heads_q", "heads_kv",
                "prefill_seqlen", "llm_shapes", "feature", "calls", "repeats")


def _missing(cases: Sequence[ServingCase]) -> dict[str, str]:
    """{"scenario/provider": why} for the providers that cannot run (not installed, no GPU)."""
    out = {}
    for c in {c.scenario: c for c in cases}.values():
        for p in serving_providers(c, VarlenArgs(), {}):
            if p.missing:
                out[f"{c.scenario}/{p.name}"] = p.why_missing
    return out


def plan_of_serving(args) -> list[ServingCase]:
    """The cases `--serving` asks for (errors are ValueError)."""
    check_time_limits(args)
    return [c for c in serving_cases(quick=args.quick, dtype=args.dtype)
            if not args.scenario or c.scenario in args.scenario]


def serving_args(args) -> int:
    from fa4lab.bench.measure import RunGuard

    if refused(args, _NOT_SERVING, "--serving",
               "its options: --quick, --scenario, --dtype, --json/--out, --label, --no-save, "
               "--warmup-ms, --rep-ms, --time-budget, --step-timeout, --strict, --arch, "
               "--records"):
        return 2
    cases = planned(plan_of_serving, args, "fa4lab bench --serving")
    if cases is None:
        return 2
    from fa4lab.environment import gpu
    from fa4lab.hardware import H200

    g = gpu()
    if g is None:
        return no_gpu_here("fa4lab bench --serving",
                           describe_serving_run(cases, _missing(cases),
                                                hbm_gbps_hint=H200.hbm_bytes_per_s / 1e9),
                           recorded_serving_summary(args.records), floors=True)

    arch, no_kernel = run_arch(args, g, "fa4lab bench --serving")

    def providers(case, varlen_args, how):
        made = serving_providers(case, varlen_args, how)
        if no_kernel:
            from fa4lab.bench.providers import Provider

            made = [Provider(p.name, None, no_kernel) if p.name.startswith(OURS) else p
                    for p in made]
        return made

    print(f"fa4lab bench --serving on {g.name}")
    print(describe_serving_run(cases, _missing(cases)))
    started = time.perf_counter()
    copy = announce_copy_bandwidth(warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
    hbm_gbps = copy.gbps if copy else None
    results: list[ServingResult] = []
    # No budget unless asked for (a full run compiles many kernels); the step watchdog always.
    budget = args.time_budget if "--time-budget" in changed(args, ("time_budget",)) else None

    def record(wall_s: float, notes: str = "") -> dict:
        config = serving_config(cases, copy=copy, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms,
                                wall_s=wall_s, guard=guard)
        return make_serving_record(results, hbm_gbps=hbm_gbps, gpu_name=g.name, arch=arch,
                                   command=command_line(args), config=config,
                                   label=args.label, notes=notes)

    shapes = {c.name: c.shape_label() for c in cases}

    def on_timeout(label: str, seconds: float) -> None:
        print(format_serving_table(results, hbm_gbps=hbm_gbps, shapes=shapes))
        save_run(record(time.perf_counter() - started,
                     f"ended by the watchdog: {label} ran {seconds:.0f} s (limit "
                     f"{args.step_timeout:g} s); the cases after it were not run"), args)

    guard = RunGuard(budget_s=budget, step_s=args.step_timeout, on_timeout=on_timeout)
    run_serving(cases, providers, hbm_gbps=hbm_gbps, warmup_ms=args.warmup_ms,
                rep_ms=args.rep_ms, guard=guard, on_result=results.append)
    wall_s = time.perf_counter() - started
    print()
    print(first_calls_line(wall_s, results, lambda r: r.case))
    print(format_serving_table(results, hbm_gbps=hbm_gbps, shapes=shapes))
    save_run(record(wall_s), args)
    return exit_status(results, args, see="the notes above")
