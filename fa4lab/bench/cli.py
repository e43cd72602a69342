"""`fa4lab bench ...`: the command line of the bench (its only entry is `fa4lab.cli:main`).

Eight modes: the throughput sweep (default), `--host-overhead`, `--decode`, `--features`,
`--neighbours` (`fa4lab.bench.neighbours`), `--serving` (`fa4lab.bench.serving`),
`--backward` (`fa4lab.bench.backward`) and `--training` (`fa4lab.bench.training`: a small
transformer trained with fa4lab and with SDPA). On a GPU each checks, times and records; on a
CPU it says so, prints what it would run and the latest recorded results, and exits 0
(`--training --device cpu` trains the CPU config). Bad arguments exit 2; `--strict` makes a
provider that raised or failed its check exit 1 (with `--training`: a curve not within the
noise); a `--features`, `--serving` or `--backward` run that outlives its step limit exits 3
(TIMEOUT_EXIT, Note [run time limits]).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from fa4lab.bench.check import ATOL, CHECK_HEADS
from fa4lab.bench.decode import (
    DECODE_BATCH,
    DECODE_PROVIDERS,
    DECODE_SEQLEN_K,
    DECODE_SEQLEN_Q,
    HEAD_DIM,
    HEADS_KV,
    HEADS_Q,
    PREFILL_SEQLEN,
    announce_copy_bandwidth,
    decode_config,
    describe_decode_run,
    format_decode_table,
    gqa_shapes,
    llm_shapes,
    make_decode_record,
    run_decode,
)
from fa4lab.bench.features import (
    BUDGET_S,
    FEATURE_GROUPS,
    FEATURE_HEAD_DIM,
    FEATURE_NAMES,
    FEATURE_PEERS,
    FEATURE_SEQLEN,
    STEP_TIMEOUT_S,
)
from fa4lab.bench.host_overhead import (
    CALLS,
    HOST_LABELS,
    HOST_PROVIDERS,
    HOST_SHAPE,
    REPEATS,
    VARLEN_HOST_LABELS,
    VARLEN_HOST_PROVIDERS,
    WARMUP_CALLS,
    first_calls_in_new_processes,
    format_first_calls,
    format_host_table,
    host_calls,
    host_cases,
    host_config,
    make_host_record,
    measure_host_cases,
)
from fa4lab.bench.measure import run_sweep
from fa4lab.bench.providers import Provider, provider_lines, resolve_providers, short_error
from fa4lab.bench.records import (
    DECODE,
    ERROR,
    FAILED,
    HOST_OVERHEAD,
    OK,
    decode_results_of,
    host_results_of,
    latest_record,
    latest_summary,
    load_records,
    make_record,
    results_of,
)
from fa4lab.bench.runs import (
    changed,
    command_line,
    exit_status,
    first_calls_line,
    no_gpu_here,
    planned,
    refused,
    run_arch,
    save_run,
    with_defaults,
)
from fa4lab.bench.sweep import (
    HEAD_DIMS,
    HIDDEN,
    OURS,
    PEERS,
    PROVIDER_LABELS,
    QUICK_HEAD_DIMS,
    QUICK_SEQLENS,
    SEQLENS,
    TOTAL_TOKENS,
    UNPACKED,
    VARIANTS,
    BenchShape,
    parse_causal,
    sweep,
)
from fa4lab.bench.table import format_table, providers_in
from fa4lab.bench.timing import (
    GEMM_SIZE,
    REP_MS,
    WARMUP_MS,
    gemm_tflops,
    timer_name,
    timing_config,
)
from fa4lab.limits import KERNEL_DTYPES


def add_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "bench", help="throughput of fa4lab beside PyTorch SDPA and upstream FA4 (GPU)",
        description="Check every provider against the float64 reference, then time it with "
                    "triton.testing.do_bench; print a table with fa4lab/peer ratios, save a "
                    "JSON record and optionally a plot. --host-overhead times the host work "
                    "of one tiny call instead; --decode times a GQA decode and a GQA prefill "
                    "against the HBM floor; --features times each attention option beside "
                    "upstream FA4 and PyTorch; --backward times the attention backward. On a "
                    "CPU: say so, print the plan of the run and the latest recorded results, "
                    "exit 0.")
    p.add_argument("--arch", default="auto", choices=("auto", "sm90", "sm100"),
                   help="the fa4lab kernel to run; auto = the GPU's (default)")
    p.add_argument("--head-dim", type=int, nargs="+", default=list(HEAD_DIMS), metavar="D")
    p.add_argument("--seqlen", type=int, nargs="+", default=list(SEQLENS), metavar="S")
    p.add_argument("--causal", default="both", help="both (default), true or false")
    p.add_argument("--peers", default=",".join(PEERS),
                   help=f"comma-separated, from {','.join(PEERS)} (default: all)")
    p.add_argument("--dtype", default=KERNEL_DTYPES[0], choices=KERNEL_DTYPES)
    p.add_argument("--total-tokens", type=int, default=TOTAL_TOKENS,
                   help="batch * seqlen for every point (default 16384)")
    p.add_argument("--hidden", type=int, default=HIDDEN,
                   help="heads * head_dim for every point (default 2048)")
    p.add_argument("--quick", action="store_true",
                   help="hd128, seqlen 4096 and 8192 only (overrides --head-dim/--seqlen)")
    p.add_argument("--json", "--out", dest="json", default=None, metavar="OUT.json",
                   help="where to save the record (default: benchmarks/<date>_<gpu>_<commit>.json)")
    p.add_argument("--no-save", action="store_true", help="do not write a JSON record")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="save the throughput plot")
    p.add_argument("--label", default=None, help="a label stored in the record")
    p.add_argument("--warmup-ms", type=float, default=WARMUP_MS)
    p.add_argument("--rep-ms", type=float, default=REP_MS)
    p.add_argument("--no-gemm", action="store_true", help="skip the GEMM ceiling")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 when an installed provider errors or fails its check")
    p.add_argument("--records", default=None, metavar="DIR",
                   help="where recorded results are read from on a CPU (default: benchmarks/)")
    host = p.add_argument_group(
        "host overhead", "host time per call on a (1, 128, 1, 128) bf16 problem, for fa4lab, "
                         "upstream FA4 and torch SDPA; the sweep's shape options do not apply")
    host.add_argument("--host-overhead", action="store_true",
                      help="measure the host time per call instead of the throughput sweep")
    host.add_argument("--calls", type=int, default=CALLS,
                      help=f"back-to-back calls per repeat (default {CALLS})")
    host.add_argument("--repeats", type=int, default=REPEATS,
                      help=f"repeats per provider, the median is reported too (default "
                           f"{REPEATS})")
    dec = p.add_argument_group(
        "decode (GQA)", "a GQA decode and a GQA prefill, each provider's time against the HBM "
                        "floor (the bytes K, V, q and out must move at the copy bandwidth of "
                        "the same run); fa4lab runs with its default (pack_gqa=None) and as "
                        f"{UNPACKED} (pack_gqa=False). --head-dim (one value, default "
                        f"{HEAD_DIM}), --dtype, --peers and the timing options apply")
    dec.add_argument("--decode", action="store_true",
                     help="measure the decode and prefill shapes instead of the sweep")
    dec.add_argument("--batch", type=int, default=DECODE_BATCH,
                     help=f"decode batch (default {DECODE_BATCH})")
    dec.add_argument("--seqlen-q", type=int, default=DECODE_SEQLEN_Q,
                     help=f"decode query tokens per sequence (default {DECODE_SEQLEN_Q})")
    dec.add_argument("--seqlen-k", type=int, default=DECODE_SEQLEN_K,
                     help=f"decode K/V length (default {DECODE_SEQLEN_K})")
    dec.add_argument("--heads-q", type=int, default=HEADS_Q,
                     help=f"query heads of both shapes (default {HEADS_Q})")
    dec.add_argument("--heads-kv", type=int, default=HEADS_KV,
                     help=f"K/V heads of both shapes (default {HEADS_KV})")
    dec.add_argument("--llm-shapes", action="store_true",
                     help="with --decode: the four causal LLM prefill shapes instead (Note [LLM "
                          "prefill shapes] in fa4lab.bench.decode)")
    dec.add_argument("--prefill-seqlen", type=int, default=PREFILL_SEQLEN,
                     help=f"seqlen of the causal batch-1 GQA prefill (default "
                          f"{PREFILL_SEQLEN}; 0 leaves it out)")
    feat = p.add_argument_group(
        "features", f"each attention option (window, softcap, sink, score_mod / mask_mod) at "
                    f"one shape (default hd{FEATURE_HEAD_DIM} s{FEATURE_SEQLEN}, batch and "
                    f"heads as the sweep's), then the model features at their own shapes "
                    f"(GPT-OSS, MLA, Mistral, GQA 16:1, Gemma-2: --feature models), for "
                    f"fa4lab's default call, upstream FA4, PyTorch SDPA and "
                    f"FlexAttention ({','.join(FEATURE_PEERS)} for --peers); --head-dim and "
                    f"--seqlen (one value each), --total-tokens, --hidden, --dtype, --plot and "
                    f"the timing options apply")
    feat.add_argument("--features", action="store_true",
                      help="measure the attention features instead of the sweep")
    feat.add_argument("--feature", nargs="+", default=None, metavar="NAME",
                      help=f"only these features (default: all): {', '.join(FEATURE_NAMES)}; "
                           f"or a group: {', '.join(FEATURE_GROUPS)}")
    feat.add_argument("--time-budget", type=float, default=BUDGET_S, metavar="S",
                      help=f"start no provider after S seconds; the rows left are recorded as "
                           f"skipped (default {BUDGET_S:g})")
    feat.add_argument("--step-timeout", type=float, default=STEP_TIMEOUT_S, metavar="S",
                      help=f"end the run, saving what was measured, when one provider on one "
                           f"feature takes more than S seconds (default {STEP_TIMEOUT_S:g})")
    nb = p.add_argument_group(
        "neighbouring plans", "the plan fa4lab ships for one sweep shape and >= 8 neighbours "
                              "(n_block, kv_stage, q_stage), each timed, then Spearman's rho "
                              "against the cost model (fa4lab.bench.neighbours); one "
                              "--head-dim, one --seqlen, --causal true or false")
    nb.add_argument("--neighbours", action="store_true",
                    help="time the neighbouring plans of one shape instead of the sweep")
    serve = p.add_argument_group(
        "serving", "a varlen prefill (32 sequences of 128..8192 tokens), a paged decode (batch "
                   "64, K/V lengths 4096..32768, page sizes 16 and 128), a split-KV decode "
                   "(batch 1/2/4, seqlen_k 131072) and a chunked prefill over pages (16 "
                   "chunks of 128..2048 over contexts of 1024..16384) for fa4lab, upstream FA4 "
                   "and PyTorch, against FA4 and the HBM floor (fa4lab.bench.serving); --quick "
                   "(smaller sizes), --scenario, --dtype, --json/--out, the timing options, "
                   "--time-budget (none by default) and --step-timeout apply")
    serve.add_argument("--serving", action="store_true",
                       help="measure the serving calls instead of the sweep")
    from fa4lab.bench.serving import SCENARIOS

    serve.add_argument("--scenario", nargs="+", choices=SCENARIOS, default=None,
                       help="with --serving: only these scenarios (default: all)")
    from fa4lab.bench import backward as b

    bwd = p.add_argument_group(
        "backward", f"the attention backward alone (the forward run once before timing) of "
                    f"fa4lab (its autograd, and its kernel from the saved out and lse), "
                    f"upstream FA4 and PyTorch SDPA (cuDNN, flash), bf16, 16k tokens, hidden "
                    f"2048, hd {b.BACKWARD_HEAD_DIMS}, seqlen {b.BACKWARD_SEQLENS}, causal and "
                    f"not; TFLOP/s count {b.FLOPS_RULE} (fa4lab.bench.backward); --head-dim, "
                    f"--seqlen, --causal, --quick (hd {b.QUICK_HEAD_DIMS}, seqlen "
                    f"{b.QUICK_SEQLENS}), --peers, --dtype, --total-tokens, --hidden, the timing "
                    f"options, --time-budget (none by default) and --step-timeout apply")
    bwd.add_argument("--backward", action="store_true",
                     help="time the attention backward instead of the forward sweep")
    train = p.add_argument_group(
        "training", "a small decoder-only transformer (4 layers, hidden 512, seqlen 512, bf16 "
                    "autocast) trained 200 steps with fa4lab.attention, with SDPA and with SDPA "
                    "one precision up (the noise yardstick), from one seed; the verdict says "
                    "whether the fa4lab curve follows SDPA's within bf16 noise "
                    "(fa4lab.bench.training); --json/--out, --plot (default: beside the record), "
                    "--label, --no-save and --strict (exit 1 when it does not) apply")
    train.add_argument("--training", action="store_true",
                       help="compare training loss curves instead of the sweep")
    train.add_argument("--steps", type=int, default=None,
                       help="training steps (default 200 on a GPU, 20 on the CPU)")
    train.add_argument("--layers", type=int, default=None,
                       help="transformer blocks (default 4 on a GPU, 2 on the CPU)")
    train.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"),
                       help="auto (default): the GPU, else print the latest record; cpu: train "
                            "the tiny CPU config on fa4lab's float64 reference")
    p.set_defaults(func=main_args)


def _peers_from(arg: str) -> list[str]:
    names = [x.strip() for x in str(arg).split(",") if x.strip()]
    unknown = [n for n in names if n not in PEERS + VARIANTS and n != OURS]
    if unknown:
        raise ValueError(f"--peers: unknown {unknown}; choose from {','.join(PEERS + VARIANTS)}")
    return names


def plan_of_run(args) -> tuple[list[BenchShape], list[str]]:
    """The shapes and provider names a command line asks for (errors are ValueError)."""
    head_dims, seqlens = args.head_dim, args.seqlen
    if args.quick:
        head_dims, seqlens = list(QUICK_HEAD_DIMS), list(QUICK_SEQLENS)
    shapes = sweep(head_dims, seqlens, parse_causal(args.causal),
                   total_tokens=args.total_tokens, hidden=args.hidden, dtype=args.dtype)
    return shapes, [OURS] + [p for p in _peers_from(args.peers) if p != OURS]


def describe_run(shapes: Sequence[BenchShape], providers: Sequence[Provider]) -> str:
    lines = [f"{len(shapes)} shapes x {len(providers)} providers "
             f"({shapes[0].dtype}; batch * seqlen = {shapes[0].batch * shapes[0].seqlen}, "
             f"heads * head_dim = {shapes[0].heads * shapes[0].head_dim}):"]
    lines += [f"  {s.label()}  {s.flops / 1e12:.2f} TFLOP" for s in shapes]
    lines += provider_lines(providers, PROVIDER_LABELS, 11)
    lines.append(f"plus the dense bf16 GEMM ceiling ({GEMM_SIZE}^3 torch.matmul); "
                 f"timer: {timer_name()}")
    return "\n".join(lines)


def recorded_summary(directory=None, *, gpu: str = "H200") -> str:
    """The latest recorded results for `gpu` as text (what the CPU path prints)."""
    try:
        records = load_records(directory)
    except ValueError as err:
        return f"could not read the recorded results: {err}"
    rec = latest_record(records, gpu=gpu)
    if rec is None:
        return f"no recorded {gpu} results in {directory or 'benchmarks/'}"
    text = [f"latest recorded {gpu} results: {Path(rec['path']).name}",
            f"  {rec['label']} ({rec['kind']}, {rec['date']}, {rec['gpu']})"]
    if rec.get("notes"):
        text.append("  " + rec["notes"])
    if not any(r.provider == OURS and r.status == OK for r in results_of(rec)):
        text.append("  (no fa4lab numbers in this record)")
    text += ["", format_table(results_of(rec), gemm_tflops=rec.get("gemm_tflops"))]
    return "\n".join(text)


# Options that belong to one mode: given to another, they are an error rather than ignored.
_DECODE_ONLY = ("batch", "seqlen_q", "seqlen_k", "heads_q", "heads_kv", "prefill_seqlen",
                "llm_shapes")
_SWEEP_ONLY = ("seqlen", "causal", "total_tokens", "hidden", "quick", "plot", "no_gemm")
_FEATURES_ONLY = ("feature", "time_budget", "step_timeout")
_TRAINING_ONLY = ("steps", "layers", "device")


def _modes(args) -> list[str]:
    return [f"--{m.replace('_', '-')}" for m in ("host_overhead", "decode", "features",
                                                  "neighbours", "serving", "backward",
                                                  "training")
            if getattr(args, m, False)]


def _parser_defaults() -> dict:
    """Every `fa4lab bench` option's default (what `runs.command_line` and `runs.changed`
    compare with)."""
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers(dest="command"))
    return vars(parser.parse_args(["bench"]))


def main_args(args) -> int:
    with_defaults(args, _parser_defaults())
    modes = _modes(args)
    if len(modes) > 1:
        print(f"fa4lab bench: {' and '.join(modes)} are separate modes: choose one",
              file=sys.stderr)
        return 2
    if getattr(args, "scenario", None) and not getattr(args, "serving", False):
        print("fa4lab bench: --scenario applies to --serving only", file=sys.stderr)
        return 2
    if getattr(args, "training", False):
        from fa4lab.bench.training_cli import training_args

        return training_args(args)
    wrong = changed(args, _TRAINING_ONLY)
    if wrong:
        print(f"fa4lab bench: {', '.join(wrong)} apply to --training only", file=sys.stderr)
        return 2
    if args.features:
        if refused(args, ("causal", "quick", "no_gemm") + _DECODE_ONLY, "--features"):
            return 2
        from fa4lab.bench.features_cli import features_args

        return features_args(args)
    if getattr(args, "serving", False):
        from fa4lab.bench.serving_cli import serving_args

        return serving_args(args)
    if getattr(args, "backward", False):
        from fa4lab.bench.backward_cli import backward_args

        return backward_args(args)
    wrong = changed(args, _FEATURES_ONLY)
    if wrong:
        print(f"fa4lab bench: {', '.join(wrong)} apply to --features only", file=sys.stderr)
        return 2
    if args.decode:
        if refused(args, _SWEEP_ONLY, "--decode",
                   "its shapes: --batch, --seqlen-q, --seqlen-k, --heads-q, --heads-kv, "
                   "--head-dim, --prefill-seqlen"):
            return 2
        return decode_args(args)
    wrong = changed(args, _DECODE_ONLY)
    if wrong:
        print(f"fa4lab bench: {', '.join(wrong)} apply to --decode only", file=sys.stderr)
        return 2
    if args.host_overhead:
        return host_overhead_args(args)
    if getattr(args, "neighbours", False):
        from fa4lab.bench.neighbours import neighbours_args

        return neighbours_args(args, command=command_line(args), save=save_run)
    plan = planned(plan_of_run, args, "fa4lab bench")
    if plan is None:
        return 2
    shapes, names = plan
    from fa4lab.environment import gpu

    g = gpu()
    if g is None:
        providers = resolve_providers(names[1:], include_ours=True, arch=None)
        return no_gpu_here("fa4lab bench", describe_run(shapes, providers),
                           recorded_summary(args.records))

    arch, no_kernel = run_arch(args, g, "fa4lab bench")
    providers = resolve_providers(names[1:], include_ours=True, arch=arch)
    if no_kernel:
        providers[0] = Provider(OURS, None, no_kernel)
    print(f"fa4lab bench on {g.name}")
    print(describe_run(shapes, providers))
    started = time.perf_counter()
    gemm = None
    if not args.no_gemm:
        try:
            gemm = gemm_tflops(warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
        except Exception as err:
            print(f"GEMM ceiling not measured: {type(err).__name__}: {short_error(err)}",
                  file=sys.stderr)
    results = run_sweep(shapes, providers, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
    wall_s = time.perf_counter() - started
    print()
    firsts = {p: sum(r.first_call_s or 0 for r in results if r.provider == p)
              for p in providers_in(results)}
    print(f"measured in {wall_s:.0f} s; first calls (compiles included): "
          + ", ".join(f"{p} {t:.0f} s" for p, t in firsts.items()))
    print(format_table(results, gemm_tflops=gemm))
    config = {"total_tokens": args.total_tokens, "hidden": args.hidden, "dtype": args.dtype,
              **timing_config(args.warmup_ms, args.rep_ms),
              "check": f"batch 0, heads 0..{CHECK_HEADS - 1}, float64 reference, tol = 2 x "
                       f"same-dtype PyTorch error + {ATOL[args.dtype]:.1e}",
              "providers": {p.name: PROVIDER_LABELS.get(p.name, p.name) for p in providers},
              "wall_s": round(wall_s, 1)}
    record = make_record(results, gemm=gemm, gpu_name=g.name, arch=arch,
                         command=command_line(args), config=config, label=args.label)
    save_run(record, args)
    if args.plot:
        try:
            from fa4lab.viz.bench import plot_throughput

            fig = plot_throughput(record)
            fig.savefig(args.plot, dpi=110, bbox_inches="tight")
            print(f"plot saved: {args.plot}")
        except Exception as err:   # the record is saved; a plot can be drawn from it later
            print(f"plot not saved: {type(err).__name__}: {short_error(err)}", file=sys.stderr)
    return exit_status(results, args)


# ---- --host-overhead ---------------------------------------------------------------------------
def describe_host_run(calls: int, repeats: int) -> str:
    s = HOST_SHAPE
    lines = [f"host time per call on q, k, v of (batch, seqlen, heads, head_dim) = "
             f"({s.batch}, {s.seqlen}, {s.heads}, {s.head_dim}) {s.dtype}: {WARMUP_CALLS} "
             f"warm-up calls, then {repeats} x {calls} back-to-back calls timed with "
             f"time.perf_counter (no synchronize inside a repeat), for:"]
    lines += [f"  {name:<7} {HOST_LABELS[name]}" for name in HOST_PROVIDERS]
    lines.append("then the varlen and paged calls, each at its batches, tiny sequences so the "
                 "GPU is not the bottleneck:")
    lines += [f"  {c.name:<11} {c.label()}" for c in host_cases() if c.serving is not None]
    lines.append("for (fa4lab's default call first):")
    lines += [f"  {name:<16} {VARLEN_HOST_LABELS[name]}" for name in VARLEN_HOST_PROVIDERS]
    return "\n".join(lines)


def recorded_host_summary(directory=None) -> str:
    """The latest host-overhead record as text (what the CPU path prints)."""
    return latest_summary(HOST_OVERHEAD, "host overhead", lambda rec: [
        f"  {rec['label']} ({rec['date']}, {rec['gpu']}, {rec['config'].get('repeats')} x "
        f"{rec['config'].get('calls')} calls)", "", format_host_table(host_results_of(rec))],
        directory)


def host_overhead_args(args) -> int:
    if args.calls < 1 or args.repeats < 1:
        print(f"fa4lab bench: --calls ({args.calls}) and --repeats ({args.repeats}) must be "
              f">= 1", file=sys.stderr)
        return 2
    from fa4lab.environment import gpu

    g = gpu()
    if g is None:
        return no_gpu_here("fa4lab bench --host-overhead",
                           describe_host_run(args.calls, args.repeats),
                           recorded_host_summary(args.records), would="measure",
                           why=" (the host time of a call includes its GPU launch, so it needs "
                               "a GPU)")
    print(f"fa4lab bench --host-overhead on {g.name}")
    print(describe_host_run(args.calls, args.repeats))
    cases = host_cases()
    results = measure_host_cases(cases, "cuda", calls=args.calls, repeats=args.repeats,
                                 calls_of=host_calls)
    print()
    print(format_host_table(results))
    first_calls = []
    if any(r.provider == OURS and r.status == OK and r.case == cases[0].name
           for r in results):   # only where a fa4lab kernel runs
        print("\nthe first call of a new process (Note [first call]):")
        first_calls = first_calls_in_new_processes()
        print(format_first_calls(first_calls))
    record = make_host_record(results, gpu_name=g.name, arch=g.arch, command=command_line(args),
                              config=host_config(args.calls, args.repeats, cases=cases),
                              label=args.label)
    record["first_calls"] = first_calls
    save_run(record, args)
    bad = [r for r in results if r.status in (FAILED, ERROR)]
    return 1 if (args.strict and bad) else 0


# ---- --decode ----------------------------------------------------------------------------------
def plan_of_decode(args):
    """The GQA shapes and provider names `--decode` asks for (errors are ValueError). The
    sweep's default --head-dim (three values) means the decode's 128; otherwise one value."""
    head_dims = list(args.head_dim)
    if head_dims == list(HEAD_DIMS):
        head_dims = [HEAD_DIM]
    if len(head_dims) != 1:
        raise ValueError(f"--decode takes one --head-dim, got {head_dims}")
    if args.llm_shapes:
        shapes = llm_shapes(args.dtype)
    else:
        shapes = gqa_shapes(batch=args.batch, seqlen_q=args.seqlen_q, seqlen_k=args.seqlen_k,
                            heads_q=args.heads_q, heads_kv=args.heads_kv,
                            head_dim=head_dims[0], prefill_seqlen=args.prefill_seqlen,
                            dtype=args.dtype)
    peers = [p for p in _peers_from(args.peers) if p not in (OURS, UNPACKED)]
    order = DECODE_PROVIDERS[:2] + VARIANTS + DECODE_PROVIDERS[2:]
    return shapes, [n for n in order if n in (OURS, UNPACKED) or n in peers]


def recorded_decode_summary(directory=None) -> str:
    """The latest decode record as text (what the CPU path prints)."""
    return latest_summary(DECODE, "GQA decode", lambda rec: [
        f"  {rec['label']} ({rec['date']}, {rec['gpu']})", "",
        format_decode_table(decode_results_of(rec), hbm_gbps=rec["hbm_gbps"])], directory)


def decode_args(args) -> int:
    plan = planned(plan_of_decode, args, "fa4lab bench --decode")
    if plan is None:
        return 2
    shapes, names = plan
    from fa4lab.environment import gpu
    from fa4lab.hardware import H200

    g = gpu()
    if g is None:
        providers = resolve_providers(names[1:], include_ours=True, arch=None)
        return no_gpu_here("fa4lab bench --decode",
                           describe_decode_run(shapes, providers,
                                               hbm_gbps_hint=H200.hbm_bytes_per_s / 1e9),
                           recorded_decode_summary(args.records), floors=True)

    arch, no_kernel = run_arch(args, g, "fa4lab bench --decode")
    providers = resolve_providers(names[1:], include_ours=True, arch=arch)
    if no_kernel:
        providers = [Provider(p.name, None, no_kernel) if p.name in (OURS, UNPACKED) else p
                     for p in providers]
    print(f"fa4lab bench --decode on {g.name}")
    print(describe_decode_run(shapes, providers))
    started = time.perf_counter()
    copy = announce_copy_bandwidth(warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
    hbm_gbps = copy.gbps if copy else None
    results = run_decode(shapes, providers, hbm_gbps=hbm_gbps, warmup_ms=args.warmup_ms,
                         rep_ms=args.rep_ms)
    wall_s = time.perf_counter() - started
    print()
    print(first_calls_line(wall_s, results, lambda r: r.shape))
    print(format_decode_table(results, hbm_gbps=hbm_gbps))
    config = decode_config(shapes, [p.name for p in providers], copy=copy,
                           warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, wall_s=wall_s)
    record = make_decode_record(results, hbm_gbps=hbm_gbps, gpu_name=g.name, arch=arch,
                                command=command_line(args), config=config, label=args.label)
    save_run(record, args)
    return exit_status(results, args)
