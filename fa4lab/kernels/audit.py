"""Read a compiled kernel back and check it against its plan: `fa4lab audit`.

    fa4lab audit --arch sm100a --head-dim 128 --causal          # markdown table
    fa4lab audit --arch sm90a --format json

What is checked (each an `AuditRow(name, expected, found, ok)`; any `ok=False` is a failure):
  * registers per thread and spills (cuobjdump -res-usage on the cubin; STL/LDL in the SASS;
    `--ptxas` also runs pip's `ptxas -arch=... -v` on the PTX for its spill report): spills 0;
  * dynamic shared memory = the kernel's shared-storage struct (not in the cubin) vs
    plan.smem.total_bytes;
  * sm100a: TMEM columns in `tcgen05.alloc` vs plan.tmem.alloc_cols; tcgen05.mma count vs the
    plan's MMA shapes; mbarrier.init count vs plan.barriers.mbarrier_count; setmaxnreg values vs
    the plan's role registers; MUFU.EX2 vs polynomial exp2 (SASS) vs
    plan.exp2_emulation_fraction; FFMA2 / FADD2 (the scale-subtract, the packed polynomial and
    row sum) vs the plan's emulated pairs; tcgen05.ld / st / commit counts (shown);
  * sm90a: wgmma count, setmaxnreg, mbarrier inits, registers, spills, SMEM;
  * both: the barrier protocol against `plan.protocol` (`protocol_rows`, see Note [protocol
    audit] in fa4lab.kernels.protocol_audit): mbarrier inits (offset, count), every marker
    claims its op (opcode, address), every barrier instruction is claimed, each code path's op
    sequence and loops, named barriers (threads, unaligned, and the id in every thread of each
    role that runs the instruction, an id held in a register evaluated per thread), SMEM region
    offsets (the mailbox `stats` from the ld/st.shared between its barriers).
For sm100a, where flash-attn-4 imports, its sm100 forward compiled the same way is audited side
by side (`--no-peer` skips it); otherwise the audit says "flash-attn-4 not installed".

The binary is read with `fa4lab.kernels.binary` (pip's CUDA tools, PTX / SASS parsers); the
protocol rows come from `fa4lab.kernels.protocol_audit`.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

from fa4lab.kernels.binary import (
    Audit,
    AuditRow,
    audit_row,
    count_prefix,
    describe,
    ptx_count,
    ptxas_report,
    resource_usage,
    sass,
    sass_opcodes,
    setmaxnreg_values,
    spills_in,
    steady_loop,
    tmem_alloc_columns,
)
from fa4lab.kernels.protocol_audit import protocol_rows
from fa4lab.limits import (
    ALL_HEAD_DIMS,
    EXP2_PAIR_FADD2,
    EXP2_PAIR_FFMA2,
    KERNEL_DTYPES,
    KERNEL_HEAD_DIMS,
    head_dims_text,
)
from fa4lab.online_softmax import emulated_pairs

__all__ = ["Audit", "AuditRow", "audit", "audit_backward", "audit_compiled", "audit_sm100",
           "audit_sm90",
           "protocol_rows", "smem_gap_is_alignment"]


def smem_gap_is_alignment(plan, struct_bytes: int) -> bool:
    """True when the struct is exactly plan.smem.total_bytes rounded up to the largest region
    alignment: a struct's size, like C's sizeof, is a multiple of its alignment."""
    align = max(r.align for r in plan.smem.regions)
    rounded = -(-plan.smem.total_bytes // align) * align
    return struct_bytes != plan.smem.total_bytes and struct_bytes == rounded


# ---------------------------------------------------------------- audits
def _common_rows(cf, ops: Counter, use_ptxas: bool, sass_text: str) -> list[AuditRow]:
    plan = cf.plan
    res = resource_usage(cf.cubin_path)
    budget = plan.hardware.registers_per_sm // plan.threads_per_cta
    spill_instr = count_prefix(ops, "STL") + count_prefix(ops, "LDL")
    loop = steady_loop(sass_text)
    rows = [
        AuditRow("compile seconds", "-", round(cf.seconds, 1), True, "cute.compile, fake tensors"),
        audit_row("registers per thread (launch)", f"<= {budget}", res["registers"],
             res["registers"] <= budget,
             f"{plan.hardware.registers_per_sm} / {plan.threads_per_cta} threads; roles then "
             f"rebalance with setmaxnreg"),
        audit_row("spill instructions (STL/LDL)", 0, spill_instr),
        audit_row("spills in the steady-state loop", 0, spills_in(sass_text, loop),
             spills_in(sass_text, loop) == 0,
             f"SASS {loop[0]:#x}-{loop[1]:#x}: the last loop with MMAs" if loop
             else "no conditional loop around the MMAs (the whole kernel is counted above)"),
        audit_row("stack frame bytes", 0, res["stack"]),
        audit_row("dynamic SMEM bytes", plan.smem.total_bytes, cf.smem_bytes,
             note="SharedStorage struct size (not in the cubin)"
             + ("; the plan's total lacks the struct's round-up to its largest alignment"
                if smem_gap_is_alignment(plan, cf.smem_bytes) else "")),
        audit_row("mbarrier.init", plan.barriers.mbarrier_count,
             ptx_count(cf.ptx, r"\bmbarrier\.init\.")),
    ]
    found_nreg = setmaxnreg_values(cf.ptx)
    if cf.arch == "sm100a":  # the sm100 kernel has one setmaxnreg per role branch
        rows.append(audit_row("setmaxnreg values", sorted(r.registers for r in plan.roles),
                         found_nreg, note="one per role branch"))
    else:  # the sm90 kernel's consumer warpgroups share one branch
        rows.append(audit_row("setmaxnreg values (distinct)",
                         sorted({r.registers for r in plan.roles}), sorted(set(found_nreg))))
    rows += protocol_rows(plan, cf.ptx)
    if use_ptxas:
        rep = ptxas_report(cf.ptx_path, cf.arch)
        spilled = rep["spill_stores"] + rep["spill_loads"]
        rows.append(audit_row("ptxas spill bytes (stores + loads)", 0, spilled, note="ptxas -v"))
    return rows


def _exp2_rows(plan, kernel, ops: Counter) -> list[AuditRow]:
    """The softmax's exp2 split and its f32x2 arithmetic (Note [packed exp2] in
    fa4lab.kernels.device.exp2), per softmax-step site, from the plan's emulated pairs."""
    n = plan.tiles.n_block
    pairs = sum(emulated_pairs(n, plan.exp2_emulation_fraction))
    steps = kernel.softmax_step_sites
    # Each emulated pair rounds down once (FADD2.RM): the polynomials, two elements each.
    poly = 2 * count_prefix(ops, "FADD2", "RM")
    mufu_p = steps * (n - 2 * pairs) + kernel.finalize_exp2_sites
    mufu = count_prefix(ops, "MUFU.EX2")
    per_site = f"{steps} softmax-step sites x"
    ffma2 = n // 2 + EXP2_PAIR_FFMA2 * pairs
    fadd2 = EXP2_PAIR_FADD2 * pairs + n // 2 - 1
    found_fraction = poly / max(poly + mufu, 1)
    return [
        audit_row("exp2 on FMA (polynomial)", steps * 2 * pairs, poly,
             note=f"{per_site} {2 * pairs} of {n} (fraction {plan.exp2_emulation_fraction}); "
                  f"one FADD2.RM per pair"),
        audit_row("MUFU.EX2", f"{mufu_p}..{mufu_p + steps}", mufu, mufu_p <= mufu <= mufu_p + steps,
             note="P on MUFU (and the sink's in the finalize), plus at most one row-scale exp2 "
                  "per site"),
        audit_row("FFMA2 (SASS)", steps * ffma2, count_prefix(ops, "FFMA2"),
             note=f"{per_site} ({n // 2} scale-subtract + {EXP2_PAIR_FFMA2} x {pairs} "
                  f"polynomial pairs)"),
        audit_row("FADD2 (SASS)", steps * fadd2, count_prefix(ops, "FADD2"),
             note=f"{per_site} ({EXP2_PAIR_FADD2} x {pairs} polynomial pairs + "
                  f"{n // 2 - 1} row-sum adds of {n // 2} pairs)"),
        audit_row("emulated exp2 fraction", plan.exp2_emulation_fraction, round(found_fraction, 4),
             abs(found_fraction - plan.exp2_emulation_fraction) <= 1.5 / n,
             "FMA polynomials / all exp2"),
    ]


def audit_sm100(cf, *, use_ptxas: bool = False) -> Audit:
    plan, kernel = cf.plan, cf.kernel
    text = sass(cf.cubin_path)
    ops = sass_opcodes(text)
    rows = _common_rows(cf, ops, use_ptxas, text)
    rows += _tcgen05_rows(cf, ops)
    rows += _exp2_rows(plan, kernel, ops)
    return Audit(f"sm100a audit: {describe(plan.spec)}", tuple(rows))


def _tcgen05_rows(cf, ops: Counter) -> list[AuditRow]:
    """TMEM columns allocated, and each MMA of the plan as k / 16 tcgen05.mma (16-bit inputs:
    K = 16 per instruction) at kernel.mma_sites[name] places in the code."""
    plan, kernel = cf.plan, cf.kernel
    rows = [audit_row("TMEM columns (tcgen05.alloc)", [plan.tmem.alloc_cols],
                      tmem_alloc_columns(cf.ptx))]
    k_step = 16
    mma_expected = sum(kernel.mma_sites[m.name] * (m.k // k_step) for m in plan.mmas)
    rows.append(audit_row("tcgen05.mma (PTX)", mma_expected,
                          ptx_count(cf.ptx, r"\btcgen05\.mma\.cta_group"),
                          note=" + ".join(f"{kernel.mma_sites[m.name]} sites x {m.k // k_step} "
                                          f"({m.name})" for m in plan.mmas)))
    rows.append(audit_row("UTCHMMA (SASS)", mma_expected, count_prefix(ops, "UTCHMMA")))
    for name, pattern in (("tcgen05.ld", r"\btcgen05\.ld\."), ("tcgen05.st", r"\btcgen05\.st\."),
                          ("tcgen05.commit", r"\btcgen05\.commit\.")):
        n = ptx_count(cf.ptx, pattern)
        rows.append(AuditRow(f"{name} (PTX)", "> 0", n, n > 0, "static count, shown"))
    return rows


def audit_backward(cb, *, use_ptxas: bool = False) -> Audit:
    """The sm100 backward (`fa4lab.kernels.launch_backward.compile_backward` of an sm100 key)
    against its `BackwardPlan`: the forward's resource, SMEM, setmaxnreg and protocol rows
    (the table of fa4lab.plan.protocol_bwd_sm100), TMEM columns and the five MMAs' counts."""
    text = sass(cb.cubin_path)
    ops = sass_opcodes(text)
    rows = _common_rows(cb, ops, use_ptxas, text) + _tcgen05_rows(cb, ops)
    return Audit(f"sm100a backward audit: {cb.key.name}", tuple(rows))


def audit_sm90(cf, *, use_ptxas: bool = False) -> Audit:
    plan = cf.plan
    text = sass(cf.cubin_path)
    ops = sass_opcodes(text)
    rows = _common_rows(cf, ops, use_ptxas, text)
    n = ptx_count(cf.ptx, r"\bwgmma\.mma_async\.")
    rows.append(AuditRow("wgmma.mma_async (PTX)", "> 0", n, n > 0, "static count, shown"))
    rows.append(AuditRow("HGMMA (SASS)", "> 0", count_prefix(ops, "HGMMA"),
                         count_prefix(ops, "HGMMA") > 0, "static count, shown"))
    return Audit(f"sm90a audit: {describe(plan.spec)}", tuple(rows))


def audit_compiled(cf, *, use_ptxas: bool = False) -> Audit:
    return (audit_sm100 if cf.arch == "sm100a" else audit_sm90)(cf, use_ptxas=use_ptxas)


def audit(spec_or_plan, arch: str = "sm100a", *, keep_dir=None, use_ptxas: bool = False
          ) -> Audit:
    """Compile (fake tensors, any machine) and audit against the plan."""
    from fa4lab.kernels.compile import compile_forward

    return audit_compiled(compile_forward(spec_or_plan, arch=arch, keep_dir=keep_dir),
                          use_ptxas=use_ptxas)


# ---------------------------------------------------------------- CLI
def _spec_from_args(args):
    from fa4lab.spec import AttentionSpec

    heads_q = 8
    return AttentionSpec(batch=1, seqlen_q=4096, seqlen_k=4096, heads_q=heads_q,
                         heads_kv=heads_q // args.gqa, head_dim=args.head_dim,
                         head_dim_v=args.head_dim_v, dtype=args.dtype, causal=args.causal,
                         return_lse=args.lse)


def cached_audit(spec, arch: str, *, use_ptxas: bool = False) -> tuple[Audit, bool]:
    """(`audit` of the spec's default plan, whether it came from the disk cache): kept beside
    the kernels (`fa4lab.kernels.cache`, the same fingerprint of fa4lab's sources and
    toolchain, so a change of either audits afresh); FA4LAB_CACHE=0 always compiles."""
    import json
    import os

    from fa4lab.kernels import cache
    from fa4lab.kernels.binary import AuditRow
    from fa4lab.plan import plan_forward

    plan = plan_forward(spec, arch.removesuffix("a"))
    path = (cache.cache_root() / cache.fingerprint()
            / f"audit-{cache.digest(cache.plan_key(plan) + arch + str(use_ptxas))}.json")
    if cache.enabled() and path.is_file():
        data = json.loads(path.read_text())
        return Audit(data["title"], tuple(AuditRow(**r) for r in data["rows"])), True
    result = audit(plan, arch, use_ptxas=use_ptxas)
    if cache.enabled():
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_suffix(f".{os.getpid()}.part")
        part.write_text(json.dumps(result.to_dict(), default=str))
        part.replace(path)
    return result, False


def _main(args) -> int:
    import sys

    from fa4lab.errors import Fa4labError

    try:
        spec = _spec_from_args(args)
        if args.keep_dir is None:
            print(f"fa4lab audit: the {args.arch} kernel for {describe(spec)}: compiling on the "
                  f"CPU and reading its binary back (about a minute the first time; the result "
                  f"is kept in the kernel cache)...", file=sys.stderr, flush=True)
            result, cached = cached_audit(spec, args.arch, use_ptxas=args.ptxas)
            if cached:
                print("fa4lab audit: from the cache (FA4LAB_CACHE=0 compiles afresh)",
                      file=sys.stderr)
        else:   # the PTX and cubin asked for: compile
            result = audit(spec, args.arch, keep_dir=args.keep_dir, use_ptxas=args.ptxas)
    except (Fa4labError, ValueError, FileNotFoundError) as exc:
        print(f"fa4lab audit: {exc}")
        return 2
    audits = [result]
    peer_note = None
    if args.peer and args.arch == "sm100a":
        from fa4lab.kernels import peer_sm100

        try:
            audits.append(peer_sm100.audit_flash_attn4(spec, keep_dir=args.keep_dir))
        except peer_sm100.PeerUnavailable as exc:
            peer_note = str(exc)
    if args.format == "json":
        print(json.dumps({"audits": [a.to_dict() for a in audits], "peer": peer_note},
                         indent=2, default=str))
    else:
        print("\n\n".join(a.to_markdown() for a in audits))
        if peer_note:
            print(f"\npeer: {peer_note}")
    return 0 if result.ok else 1


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("audit", help="compile a kernel on CPU and check it against the plan",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", choices=[f"{a}a" for a in KERNEL_HEAD_DIMS], default="sm100a")
    p.add_argument("--head-dim", type=int, default=128,
                   choices=sorted({d for d, _ in ALL_HEAD_DIMS}),
                   help="; ".join(f"{head_dims_text(a)} ({a}a)" for a in KERNEL_HEAD_DIMS))
    p.add_argument("--head-dim-v", type=int, default=None,
                   help="V's head dim (default: --head-dim), e.g. 128 with --head-dim 192")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--gqa", type=int, default=1, help="query heads per KV head (1, 2, 4, 8)")
    p.add_argument("--lse", action="store_true", help="also write the log-sum-exp")
    p.add_argument("--dtype", choices=KERNEL_DTYPES, default=KERNEL_DTYPES[0])
    p.add_argument("--format", choices=("md", "json"), default="md")
    p.add_argument("--ptxas", action="store_true", help="also run ptxas -v on the PTX (slow)")
    p.add_argument("--no-peer", dest="peer", action="store_false",
                   help="skip the side-by-side with flash-attn-4's sm100 forward (compiled "
                        "the same way when it is installed)")
    p.add_argument("--keep-dir", default=None, help="where PTX and cubin are kept")
    p.set_defaults(func=_main)


def _parse(argv=None):
    parser = argparse.ArgumentParser(prog="fa4lab audit")
    sub = parser.add_subparsers(dest="command", required=True)
    add_cli(sub)
    return parser.parse_args(["audit", *(argv or [])])
