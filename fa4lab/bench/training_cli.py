"""`fa4lab bench --training`: the command-line side of the training comparison.

`training_args` runs the mode: on a GPU (or with `--device cpu`, the CPU config on the float64
reference) it trains the model once per attention, prints the curves at a few steps and the
verdict, saves the record and a plot of the curves; with no GPU and no `--device cpu` it prints
what it would run and the latest recorded comparison. The mode itself is
`fa4lab.bench.training`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from pathlib import Path

from fa4lab.bench.providers import short_error
from fa4lab.bench.records import (
    OK,
    TRAINING,
    TrainingResult,
    default_record_path,
    latest_summary,
    save_record,
    training_results_of,
)
from fa4lab.bench.runs import command_line, no_gpu_here, refused

OURS, PEER, WIDE = "fa4lab", "sdpa", "sdpa-wide"   # fa4lab.bench.training's names


def table_steps(steps: int, rows: int = 8) -> list[int]:
    """About `rows` steps to show, the first and the last among them."""
    return sorted({0, steps - 1} | {round(i * (steps - 1) / (rows - 1)) for i in range(rows)})


def format_training_table(losses: Mapping[str, list[float]], verdict: Mapping | None = None
                          ) -> str:
    """A markdown table at a few steps: the fa4lab and SDPA losses, |diff|, the noise
    (|sdpa-wide - sdpa|), and with a verdict (a record's) the windowed |diff| it judged and the
    tolerance ("-" before the first full window: Note [bf16 noise] in fa4lab.bench.training)."""
    ours, sdpa, wide = losses[OURS], losses[PEER], losses[WIDE]
    judged = bool(verdict and verdict.get("tolerance"))
    lines = ["| step | loss fa4lab | loss sdpa | abs diff | noise (sdpa-wide) |"
             + (" windowed diff | tolerance |" if judged else ""),
             "|---:" * (7 if judged else 5) + "|"]
    for i in table_steps(len(sdpa)):
        row = (f"| {i} | {ours[i]:.4f} | {sdpa[i]:.4f} | {abs(ours[i] - sdpa[i]):.2e} | "
               f"{abs(wide[i] - sdpa[i]):.2e} |")
        if judged:
            tol = verdict["tolerance"][i]
            row += (f" {verdict['windowed_diff'][i]:.2e} | "
                    f"{'-' if tol is None else f'{tol:.2e}'} |")
        lines.append(row)
    return "\n".join(lines)


def run_line(r: TrainingResult) -> str:
    if r.status != OK:
        return f"  {r.provider:<9} {r.status}: {r.note}"
    return (f"  {r.provider:<9} loss {r.losses[0]:.3f} -> {r.losses[-1]:.3f}, "
            f"{r.ms_per_step:.1f} ms/step, first step {r.first_step_s:.1f} s")


def describe_training_run(cfg) -> str:
    return (f"a {cfg.layers}-layer decoder (hidden {cfg.hidden}, {cfg.heads}/{cfg.kv_heads} "
            f"heads of {cfg.head_dim}, vocab {cfg.vocab}) on {cfg.batch} x {cfg.seqlen} tokens "
            f"a step, {cfg.steps} steps of AdamW, {cfg.dtype}, seed {cfg.seed}, trained three "
            f"times from the same init on the same data: with fa4lab.attention, with SDPA, and "
            f"with SDPA one precision up (the noise yardstick: Note [bf16 noise] in "
            f"fa4lab.bench.training); then the fa4lab curve is judged against SDPA's")


def training_record_lines(rec: dict) -> list[str]:
    """A training record's verdict and, with the three loss curves, its table."""
    from fa4lab.bench.training import verdict_line

    losses = {r.provider: r.losses for r in training_results_of(rec)}
    lines = [verdict_line(rec["verdict"])]
    if all(losses.get(n) for n in (OURS, PEER, WIDE)):
        lines += ["", format_training_table(losses, rec["verdict"])]
    return lines


def recorded_training_summary(directory=None) -> str:
    """The latest training record as text (what the CPU path prints)."""
    def body(rec):
        verdict, *table = training_record_lines(rec)
        return [f"  {rec['label']} ({rec['date']}, {rec['gpu']})", "  " + verdict, *table]

    return latest_summary(TRAINING, "training comparison", body, directory)


# Options of other modes: given with --training, they are an error rather than ignored.
_NOT_TRAINING = ("head_dim", "seqlen", "causal", "peers", "dtype", "total_tokens", "hidden",
                 "quick", "no_gemm", "warmup_ms", "rep_ms", "batch", "seqlen_q", "seqlen_k",
                 "heads_q", "heads_kv", "prefill_seqlen", "llm_shapes", "feature",
                 "time_budget", "step_timeout", "calls", "repeats", "arch")


def training_args(args) -> int:
    if refused(args, _NOT_TRAINING, "--training",
               "its options: --steps, --layers, --device, --json/--out, --plot, --label, "
               "--no-save, --strict, --records"):
        return 2
    from fa4lab.bench.training import TrainConfig
    from fa4lab.environment import gpu

    g = gpu()
    device = args.device
    try:
        cfg = TrainConfig.for_device("cpu" if device == "cpu" else "cuda", steps=args.steps,
                                     layers=args.layers)
    except ValueError as err:
        print(f"fa4lab bench --training: {err}", file=sys.stderr)
        return 2
    if g is None and device != "cpu":
        if device == "cuda":
            print("fa4lab bench --training: --device cuda, but no CUDA GPU is visible",
                  file=sys.stderr)
            return 2
        return no_gpu_here("fa4lab bench --training", describe_training_run(cfg),
                           recorded_training_summary(args.records),
                           why=" (--device cpu trains the CPU config on the float64 reference)")
    return _train_and_record(args, cfg, None if device == "cpu" else g)


def _train_and_record(args, cfg, g) -> int:
    """Train, print, record, plot; `g` the GPU (None: the CPU run)."""
    from fa4lab.bench.training import compare, make_training_record, verdict_line

    on_gpu = g is not None
    where = g.name if on_gpu else "the CPU (fa4lab.attention: the float64 reference)"
    print(f"fa4lab bench --training on {where}")
    print(describe_training_run(cfg))
    started = time.perf_counter()
    cmp = compare(cfg, on_run=lambda r: print(run_line(r), flush=True))
    wall_s = time.perf_counter() - started
    record = make_training_record(cmp, gpu_name=g.name if on_gpu else "cpu",
                                  arch=g.arch if on_gpu else None, command=command_line(args),
                                  label=args.label, wall_s=wall_s)
    print()
    if cmp.verdict is not None:
        print(format_training_table(cmp.losses, record["verdict"]))
    print(f"trained in {wall_s:.0f} s; {verdict_line(record['verdict'])}")
    path = None
    if not args.no_save and (on_gpu or args.json):
        path = save_record(record, Path(args.json) if args.json else
                           default_record_path(record))
        print(f"record saved: {path}")
    elif not args.no_save:
        print("record not saved: a CPU run (--json PATH keeps it)")
    plot = Path(args.plot) if args.plot else (path.with_suffix(".png") if path else None)
    if plot and cmp.verdict is not None:
        try:
            from fa4lab.viz.training import plot_training

            plot_training(record).savefig(plot, dpi=110, bbox_inches="tight")
            print(f"plot saved: {plot}")
        except Exception as err:   # the record is saved; a plot can be drawn from it later
            print(f"plot not saved: {type(err).__name__}: {short_error(err)}", file=sys.stderr)
    return 1 if args.strict and not record["verdict"]["within_noise"] else 0
