"""Neighbouring plans of one shape, timed beside each other, and how well the model ranks them.

    fa4lab bench --neighbours --head-dim 128 --seqlen 8192 --causal false     # on an H200

The plan fa4lab ships for the shape and its neighbours (`neighbour_overrides`: n_block,
kv_stage and q_stage changed one or two at a time, every one that plans), each compiled with
its own tiles (`fa4lab.kernels.launch.compile_plan`), checked against the float64 reference
and timed in one process; the record (kind "neighbours", `fa4lab.bench.records`) has one row
per plan. `rank_correlation(record)` reads such a record beside the cost model's predictions
(`fa4lab.plan.throughput.predict`, the chip's calibrated model): Spearman's rho of the two
orders, the test of whether the planner's choice among neighbours can be trusted.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass

from fa4lab.bench.records import (
    NEIGHBOURS,
    OK,
    NeighbourResult,
    neighbour_results_of,
    record_header,
    validate_record,
)
from fa4lab.bench.sweep import BenchShape

MIN_NEIGHBOURS = 8
# The nearest plans measured (the shipped one included): each is a compile of its own, about
# 10 s on the GPU host, so all ~30 that plan would take most of a benchmark session.
MAX_NEIGHBOURS = 12
# The knobs' values tried around the shipped plan (each must still plan: SMEM, registers).
N_BLOCKS = (64, 80, 96, 112, 128, 144, 160, 176)
KV_STAGES = (2, 3, 4)
Q_STAGES = (1, 2, 3)


def neighbour_overrides(spec, arch: str = "sm90",
                        limit: int = MAX_NEIGHBOURS) -> list[dict[str, int]]:
    """The shipped plan's (n_block, kv_stage, q_stage) first, then the combinations of
    N_BLOCKS x KV_STAGES x Q_STAGES that plan for `spec`, nearest first (fewest knobs
    changed, then smallest change in n_block): `limit` plans in all."""
    from fa4lab.errors import PlanError
    from fa4lab.plan import plan_forward

    t = plan_forward(spec, arch).tiles
    own = {"n_block": t.n_block, "kv_stage": t.kv_stage, "q_stage": t.q_stage}
    out = []
    for n in N_BLOCKS:
        for kv in KV_STAGES:
            for q in Q_STAGES:
                ov = {"n_block": n, "kv_stage": kv, "q_stage": q}
                if ov == own:
                    continue
                try:
                    plan_forward(spec, arch, **ov)
                except PlanError:
                    continue
                out.append(ov)

    def distance(ov):
        return (sum(ov[k] != own[k] for k in own), abs(ov["n_block"] - own["n_block"]),
                ov["kv_stage"], ov["q_stage"])
    return ([own] + sorted(out, key=distance))[:limit]


def predicted_tflops(spec, overrides: list[dict], arch: str = "sm90",
                     persistent: bool | None = None) -> list[float]:
    """The calibrated model's TFLOP/s of each plan (`fa4lab.plan.throughput.predict`);
    `persistent` as `plan_forward` takes it (None: the plan's default)."""
    from fa4lab.plan import plan_forward
    from fa4lab.plan.throughput import predict

    return [predict(plan_forward(spec, arch, persistent=persistent, **ov)).tflops
            for ov in overrides]


def measured_persistent(record: dict) -> bool | None:
    """Whether a neighbours record's plans ran persistent CTAs (its config says; records made
    before it did are sm90 records of one CTA per tile, the only sm90 kernel then)."""
    return record.get("config", {}).get("persistent", False)


# ---- the rank correlation ----
def _ranks(values: list[float]) -> list[float]:
    """Ranks 1..n, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation: Pearson's r of the ranks (ties get mean ranks)."""
    if len(xs) != len(ys) or len(xs) < 3:
        raise ValueError(f"spearman needs two lists of one length >= 3, got {len(xs)} and "
                         f"{len(ys)}")
    rx, ry = _ranks(list(xs)), _ranks(list(ys))
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    vx = sum((a - mx) ** 2 for a in rx)
    vy = sum((b - my) ** 2 for b in ry)
    if vx == 0 or vy == 0:
        raise ValueError("spearman: one list is constant; its order says nothing")
    return cov / (vx * vy) ** 0.5


@dataclass(frozen=True)
class RankCorrelation:
    rho: float
    plans: list[dict]          # overrides, in the record's order
    measured: list[float]
    predicted: list[float]
    best_measured: dict
    best_predicted: dict

    def summary(self) -> str:
        return (f"Spearman rho {self.rho:+.2f} over {len(self.plans)} plans; fastest measured "
                f"{_text(self.best_measured)}, fastest predicted {_text(self.best_predicted)}")


def _text(ov: dict) -> str:
    return f"n_block {ov['n_block']}, kv_stage {ov['kv_stage']}, q_stage {ov['q_stage']}"


def rank_correlation(record: dict, predicted: list[float] | None = None) -> RankCorrelation:
    """Spearman's rho between a neighbours record's measured TFLOP/s and the model's
    predictions for the same plans (`predicted`, default: `predicted_tflops` on the record's
    shape and arch). Rows that were not measured ('ok') are left out of both."""
    rows = [r for r in neighbour_results_of(record) if r.status == OK]
    if len(rows) < 3:
        raise ValueError(f"the record has {len(rows)} measured plans; a rank correlation needs "
                         f">= 3 (run `fa4lab bench --neighbours` on a GPU)")
    plans = [r.overrides for r in rows]
    if predicted is None:
        shape = BenchShape(rows[0].head_dim, rows[0].seqlen, rows[0].causal, rows[0].batch,
                           rows[0].heads, rows[0].dtype)
        predicted = predicted_tflops(shape.spec, plans, record.get("arch") or "sm90",
                                     measured_persistent(record))
    measured = [r.tflops for r in rows]
    best_m = plans[max(range(len(rows)), key=measured.__getitem__)]
    best_p = plans[max(range(len(rows)), key=list(predicted).__getitem__)]
    return RankCorrelation(spearman(measured, list(predicted)), plans, measured,
                           list(predicted), best_m, best_p)


def format_neighbours_table(record: dict) -> str:
    """A neighbours record as a markdown table (measured beside predicted) and its Spearman rho."""
    rows = neighbour_results_of(record)
    shape = BenchShape(rows[0].head_dim, rows[0].seqlen, rows[0].causal, rows[0].batch,
                       rows[0].heads, rows[0].dtype)
    plans = [r.overrides for r in rows]
    predicted = predicted_tflops(shape.spec, plans, record.get("arch") or "sm90",
                                 measured_persistent(record))
    lines = [f"{shape.label()}:", "", "| plan | shipped | measured TFLOP/s | predicted TFLOP/s |",
             "|---|---|---|---|"]
    lines += [f"| {_text(r.overrides)} | {'yes' if r.default else ''} | "
              f"{f'{r.tflops:.0f}' if r.status == OK else r.status} | {p:.0f} |"
              for r, p in zip(rows, predicted, strict=True)]
    try:
        ok = [p for p, r in zip(predicted, rows, strict=True) if r.status == OK]
        lines += ["", rank_correlation(record, ok).summary()]
    except ValueError as err:
        lines += ["", f"no rank correlation: {err}"]
    return "\n".join(lines)


# ---- measuring (GPU) ----
def measure_neighbours(shape: BenchShape, arch: str, overrides: list[dict], *,
                       warmup_ms: float, rep_ms: float, log=print) -> list[NeighbourResult]:
    """Compile, check and time each plan of `overrides` on `shape` (one process, in turn).
    A plan that fails to compile or its check is a row with that status, not an exception."""
    from fa4lab.bench.measure import check_then_time
    from fa4lab.bench.providers import Provider, short_error
    from fa4lab.bench.records import ERROR
    from fa4lab.kernels.launch import compile_plan
    from fa4lab.plan import plan_forward

    own = overrides[0]
    rows = []
    for ov in overrides:
        base = dict(ov, default=ov == own, head_dim=shape.head_dim, seqlen=shape.seqlen,
                    causal=shape.causal, batch=shape.batch, heads=shape.heads,
                    dtype=shape.dtype)
        t0 = time.perf_counter()
        try:
            from fa4lab.bench.measure import make_inputs

            runner, _ = compile_plan(plan_forward(shape.spec, arch, **ov),
                                     make_inputs(shape, "cuda"))
        except Exception as err:
            rows.append(NeighbourResult(**base, status=ERROR,
                                        note=f"compile: {type(err).__name__}: "
                                             f"{short_error(err)}"))
            log(f"  {_text(ov)}: compile failed")
            continue
        m = next(iter(check_then_time(shape, [Provider("fa4lab", runner)],
                                      warmup_ms=warmup_ms, rep_ms=rep_ms)))
        ok = m.status == OK
        rows.append(NeighbourResult(
            **base, status=m.status, ms=m.ms,
            tflops=shape.flops / (m.ms * 1e-3) / 1e12 if ok else None, max_err=m.max_err,
            tol=m.tol, first_call_s=time.perf_counter() - t0, note=m.note))
        log(f"  {_text(ov)}: " + (f"{rows[-1].tflops:.0f} TFLOP/s" if ok else m.status))
    return rows


def make_neighbours_record(rows: list[NeighbourResult], *, gpu_name: str, arch: str,
                           command: str, config: dict, label: str | None = None) -> dict:
    record = record_header(NEIGHBOURS, gpu_name=gpu_name, arch=arch, command=command,
                           config=config, label=label or f"fa4lab neighbouring plans on "
                                                         f"{gpu_name}")
    record["results"] = [asdict(r) for r in rows]
    return validate_record(record)


def neighbours_args(args, *, command: str, save) -> int:
    """`fa4lab bench --neighbours`: one --head-dim, one --seqlen, --causal true or false."""
    from fa4lab.bench.sweep import HIDDEN, TOTAL_TOKENS

    if len(args.head_dim) != 1 or len(args.seqlen) != 1 or args.causal not in ("true", "false"):
        print("fa4lab bench --neighbours: give one --head-dim, one --seqlen and --causal true "
              "or false", file=sys.stderr)
        return 2
    d, s, causal = args.head_dim[0], args.seqlen[0], args.causal == "true"
    shape = BenchShape(d, s, causal, max(1, TOTAL_TOKENS // s), HIDDEN // d, args.dtype)
    arch = "sm90" if args.arch == "auto" else args.arch
    overrides = neighbour_overrides(shape.spec, arch)
    predicted = predicted_tflops(shape.spec, overrides, arch)
    print(f"fa4lab bench --neighbours: {shape.label()}, {len(overrides)} {arch} plans "
          f"(the first is the one fa4lab ships); predicted TFLOP/s:")
    for ov, p in zip(overrides, predicted, strict=True):
        print(f"  {_text(ov)}: {p:.0f}")
    from fa4lab.environment import gpu

    g = gpu()
    if g is None or g.arch != arch:
        print(f"no {arch} GPU visible: nothing measured (run this on an "
              f"{'H200' if arch == 'sm90' else 'B200'})")
        return 0
    started = time.perf_counter()
    rows = measure_neighbours(shape, arch, overrides, warmup_ms=args.warmup_ms,
                              rep_ms=args.rep_ms)
    from fa4lab.plan import plan_forward

    config = {"shape": asdict(shape), "plans": overrides,
              "persistent": plan_forward(shape.spec, arch).protocol.persistent,
              "warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms,
              "wall_s": round(time.perf_counter() - started, 1)}
    record = make_neighbours_record(rows, gpu_name=g.name, arch=arch, command=command,
                                    config=config, label=args.label)
    save(record, args)
    try:
        print(rank_correlation(record, [p for p, r in zip(predicted, rows, strict=True)
                                        if r.status == OK]).summary())
    except ValueError as err:
        print(f"no rank correlation: {err}")
    return 0
