"""`fa4lab plan`: the chosen plan, the evidence behind it, its contract tables, a simulated
timeline, the minimal validation and the risks, as Markdown or JSON.

    fa4lab plan --head-dim 128 --causal --gqa 4 --arch sm100
    fa4lab plan --head-dim 128 --window 1024 0 --softcap 30 --sink   # sliding window, cap, sink
    fa4lab plan --head-dim 128 --format json > plan.json    # Plan.from_dict(json.load(...))
    fa4lab plan --backward --head-dim 128 --causal   # the B200 backward (fa4lab.plan.backward)

Shapes default to the benchmark sweep's convention (16384 tokens, hidden 2048: batch =
16384 / seqlen, heads = 2048 / head_dim). A spec the arch cannot plan (head_dim 256 on sm100:
S + O need 768 of 512 TMEM columns) prints why and the fallbacks, and exits with status 2.
JSON output is the plan's `to_dict()` (keys sorted) plus a "report" key, so it round-trips
through `Plan.from_dict`. A bad window or softcap gets the spec's own message
(`fa4lab.spec.check_window_size`, `check_softcap`) and status 2. `--backward` prints the five
outputs for the backward instead (`fa4lab.plan.report_backward`): same shape flags; the tile
overrides and --page-size are the forward's and are refused with it.
"""

from __future__ import annotations

import json
import sys

from fa4lab.errors import PlanError
from fa4lab.limits import KERNEL_DTYPES
from fa4lab.plan.plan import ARCHS
from fa4lab.plan.report import build_report, paged_section, render_markdown, render_paged, side_text

EXIT_NO_PLAN = 2


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("plan", help="the tile/TMEM/role/barrier plan and its simulation",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="sm100", choices=ARCHS)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=8192, help="seqlen_q (and seqlen_k by default)")
    p.add_argument("--seqlen-k", type=int, default=None)
    p.add_argument("--batch", type=int, default=None, help="default: 16384 // seqlen")
    p.add_argument("--heads", type=int, default=None, help="query heads; default 2048 // head_dim")
    p.add_argument("--gqa", type=int, default=1, help="query heads per KV head")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--window", nargs=2, metavar=("LEFT", "RIGHT"), default=None,
                   help="sliding window: keys seen left and right of the diagonal, each an int "
                        ">= 0 or 'none' (unbounded); causal is RIGHT = 0")
    p.add_argument("--softcap", default="0", metavar="C",
                   help="scores become C * tanh(score / C) (Gemma 2); 0 = off")
    p.add_argument("--sink", action="store_true",
                   help="a learnable sink logit per query head (GPT-OSS)")
    p.add_argument("--lse", action="store_true", help="also return the log-sum-exp")
    p.add_argument("--dtype", default=KERNEL_DTYPES[0], choices=KERNEL_DTYPES)
    p.add_argument("--n-block", type=int, default=None)
    p.add_argument("--kv-stage", type=int, default=None)
    p.add_argument("--q-stage", type=int, default=None)
    p.add_argument("--page-size", type=int, default=None, metavar="P",
                   help="also show how a paged K/V cache of P-token pages maps to the plan's "
                        "K/V blocks (`fa4lab.varlen_tiles.key_block_pages`)")
    p.add_argument("--backward", action="store_true",
                   help="plan the backward instead (sm100: fa4lab.plan.backward)")
    p.add_argument("--format", default="md", choices=["md", "json"])
    p.set_defaults(func=run)



def _number(text: str, kind=float):
    """`kind(text)`, or the text itself when it is not one: the spec's checks
    (`fa4lab.spec.check_window_size`, `check_softcap`) then say what is wrong with it."""
    try:
        return kind(text)
    except ValueError:
        return text


def spec_from_args(args):
    from fa4lab.spec import AttentionSpec

    heads = args.heads or max(1, 2048 // args.head_dim)
    if heads % args.gqa:
        raise ValueError(f"--heads {heads} is not a multiple of --gqa {args.gqa}")
    batch = args.batch or max(1, 16384 // args.seqlen)
    window = (None, None) if args.window is None else tuple(
        None if x.lower() == "none" else _number(x, int) for x in args.window)
    return AttentionSpec(batch, args.seqlen, args.seqlen_k or args.seqlen, heads,
                         heads // args.gqa, args.head_dim, dtype=args.dtype, causal=args.causal,
                         return_lse=args.lse, window_size=window,
                         softcap=_number(args.softcap), learnable_sink=args.sink)


def _mask_flags(spec) -> str:
    """The `fa4lab plan` flags of the spec's mask, softcap and sink ("" when none is set)."""
    flags = ["--causal"] if spec.causal else []
    if spec.window_size != (None, None):
        flags.append("--window " + " ".join(map(side_text, spec.window_size)))
    if spec.softcap:
        flags.append(f"--softcap {spec.softcap:g}")
    if spec.learnable_sink:
        flags.append("--sink")
    return "".join(" " + f for f in flags)


def _fallbacks(spec, arch: str, overrides: dict) -> list[str]:
    """Commands that do plan this spec: other overrides on this arch, the other arch."""
    from fa4lab.limits import kernel_builds
    from fa4lab.plan.forward import fitting_overrides
    from fa4lab.plan.sm90 import build_sm90
    from fa4lab.plan.sm100 import build_sm100

    base = f"fa4lab plan --head-dim {spec.head_dim}{_mask_flags(spec)}"
    build = build_sm100 if arch == "sm100" else build_sm90
    out = []
    for fit in fitting_overrides(build, spec, overrides, limit=1):
        flags = " ".join(f"--{kv.split('=')[0].strip().replace('_', '-')} {kv.split('=')[1]}"
                         for kv in fit.split(", "))
        out.append(f"{base} --arch {arch} {flags}")
    if arch == "sm100" and kernel_builds("sm90", spec.head_dim, spec.head_dim_v):
        out.append(f"{base} --arch sm90")
    return out


def run(args) -> int:
    from fa4lab.bench.records import sweep_figures
    from fa4lab.plan import plan_forward

    try:
        spec = spec_from_args(args)
    except (ValueError, TypeError) as err:
        print(f"fa4lab plan: {err}", file=sys.stderr)
        return EXIT_NO_PLAN
    overrides = {k: v for k, v in (("n_block", args.n_block), ("kv_stage", args.kv_stage),
                                   ("q_stage", args.q_stage)) if v is not None}
    if getattr(args, "backward", False):
        return run_backward(args, spec, overrides)
    try:
        plan = plan_forward(spec, args.arch, **overrides)
    except PlanError as err:
        fallbacks = _fallbacks(spec, args.arch, overrides)
        if args.format == "json":
            print(json.dumps({"error": str(err), "arch": args.arch, "fallbacks": fallbacks},
                             sort_keys=True, indent=2))
        else:
            print(f"# fa4lab plan: no {args.arch} plan for head_dim {spec.head_dim}\n\n"
                  f"PlanError: {err}\n")
            if fallbacks:
                print("Try: " + "; ".join(f"`{f}`" for f in fallbacks))
        return EXIT_NO_PLAN
    rep = build_report(plan, recorded=sweep_figures(plan))
    page_size = getattr(args, "page_size", None)
    if page_size is not None:
        try:
            rep["paged"] = paged_section(plan, page_size)
        except ValueError as err:
            print(f"fa4lab plan: --page-size: {err}", file=sys.stderr)
            return EXIT_NO_PLAN
    if args.format == "json":
        out = plan.to_dict()
        out["report"] = rep
        print(json.dumps(out, sort_keys=True, indent=2))
    else:
        print(render_markdown(plan, rep) + (render_paged(rep["paged"]) if "paged" in rep
                                            else ""))
    return 0


def run_backward(args, spec, overrides: dict) -> int:
    """`fa4lab plan --backward`: the backward plan's five outputs, or why there is none."""
    from fa4lab.plan.backward import plan_backward
    from fa4lab.plan.report_backward import build_backward_report, render_backward_markdown

    refused = [f"--{k.replace('_', '-')}" for k in overrides]
    if getattr(args, "page_size", None) is not None:
        refused.append("--page-size")
    if refused:
        print(f"fa4lab plan --backward: {', '.join(refused)} are the forward's; the backward "
              f"plan has its own tiles (fa4lab.plan.backward)", file=sys.stderr)
        return EXIT_NO_PLAN
    try:
        plan = plan_backward(spec, args.arch)
    except PlanError as err:
        if args.format == "json":
            print(json.dumps({"error": str(err), "arch": args.arch, "direction": "backward"},
                             sort_keys=True, indent=2))
        else:
            print(f"# fa4lab plan --backward: no {args.arch} plan for head_dim "
                  f"{spec.head_dim}\n\nPlanError: {err}")
        return EXIT_NO_PLAN
    rep = build_backward_report(plan)
    if args.format == "json":
        out = plan.to_dict()
        out["report"] = rep
        print(json.dumps(out, sort_keys=True, indent=2))
    else:
        print(render_backward_markdown(plan, rep))
    return 0
