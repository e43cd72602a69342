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
    audit]): mbarrier inits (offset, count), every marker claims its op (opcode, address),
    every barrier instruction is claimed, each code path's op sequence and loops, named
    barriers (threads, unaligned, and the id in every thread of each role that runs the
    instruction, an id held in a register evaluated per thread), SMEM region offsets (the
    mailbox `stats` from the ld/st.shared between its barriers).
For sm100a, where flash-attn-4 imports, its sm100 forward compiled the same way is audited side
by side (`--no-peer` skips it); otherwise the audit says "flash-attn-4 not installed".

The binary is read with `fa4lab.kernels.binary` (pip's CUDA tools, PTX / SASS parsers).
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections import Counter

from fa4lab.kernels.binary import (
    Audit,
    AuditRow,
    ThreadValues,
    barrier_ops,
    count_prefix,
    describe,
    mbarrier_inits,
    ptx_count,
    ptxas_report,
    resource_usage,
    sass,
    sass_opcodes,
    setmaxnreg_values,
    smem_accesses,
    smem_operand_offsets,
    spills_in,
    steady_loop,
    tmem_alloc_columns,
)
from fa4lab.kernels.ptx_flow import program_order, ptx_loops
from fa4lab.limits import (
    ALL_HEAD_DIMS,
    EXP2_PAIR_FADD2,
    EXP2_PAIR_FFMA2,
    KERNEL_DTYPES,
    KERNEL_HEAD_DIMS,
    head_dims_text,
)
from fa4lab.online_softmax import emulated_pairs
from fa4lab.plan.protocol import barrier_name

__all__ = ["Audit", "AuditRow", "audit", "audit_compiled", "audit_sm100", "audit_sm90",
           "protocol_rows", "smem_gap_is_alignment"]


def _row(name, expected, found, ok=None, note=""):
    return AuditRow(name, expected, found, expected == found if ok is None else bool(ok), note)


def smem_gap_is_alignment(plan, struct_bytes: int) -> bool:
    """True when the struct is exactly plan.smem.total_bytes rounded up to the largest region
    alignment: a struct's size, like C's sizeof, is a multiple of its alignment."""
    align = max(r.align for r in plan.smem.regions)
    rounded = -(-plan.smem.total_bytes // align) * align
    return struct_bytes != plan.smem.total_bytes and struct_bytes == rounded


# ---------------------------------------------------------------- the barrier protocol
# Note [protocol audit]
# What the PTX proves about the kernel, table row by table row. Every barrier op the kernel
# issues is preceded by a marker naming it (Note [protocol markers] in
# fa4lab.kernels.protocol); the markers are the kernel's claim, the instructions after them the
# evidence. A run of markers claims, in order, the barrier instructions that follow it before
# the next marker: each must have the opcode of its kind (wait: mbarrier.try_wait, arrive:
# mbarrier.arrive, expect_tx: mbarrier.arrive.expect_tx, commit: tcgen05.commit,
# cp_async_arrive: cp.async.mbarrier.arrive (each producer thread's, sm90's cp.async pages), sync /
# named_arrive: the unaligned barrier.sync / barrier.arrive) and an address inside that
# barrier's stages (its exact stage where the marker names one and the address is a
# constant); a named barrier's id must be the table's in every thread of every role that
# runs the instruction: sm90's consumers share one epilogue, whose id the binary computes from
# the warp index (Note [values per thread] in fa4lab.kernels.binary), so `epilogue{c}` is
# checked as epilogue0 in consumer0's threads, epilogue1 in consumer1's. A barrier instruction
# no marker claims fails (bar.sync 0, the CTA-wide setup barrier, is shown apart). The markers
# of each code path, read in an order that follows the control flow (`ptx_flow.program_order`),
# must be the table's sites in order, and a marker is inside a PTX loop exactly when its site
# is inside a table loop, one PTX loop per table loop.
_OPCODES = {"wait": ("mbarrier.try_wait", "mbarrier.test_wait"),
            "arrive": ("mbarrier.arrive",), "expect_tx": ("mbarrier.arrive.expect_tx",),
            "commit": ("tcgen05.commit",), "cp_async_arrive": ("cp.async.mbarrier.arrive",),
            "sync": ("barrier.sync",),
            "named_arrive": ("barrier.arrive",)}


def _family(plan, name: str):
    """The barriers a marker's name covers: one, or a template's family ("epilogue{c}")."""
    if "{" in name:
        head = name.split("{")[0]
        return [b for b in plan.barriers.barriers
                if b.name.startswith(head) and b.name[len(head):].isdigit()]
    return [b for b in plan.barriers.barriers if b.name == name]


def _named_ids(plan, values, marker, op) -> dict:
    """{role: (barrier, the table's id, the ids its threads compute)} for the named barrier
    instruction `op` that `marker` claims: each role running the marker's code path, its
    barrier the marker's name in that role ("epilogue{c}" -> "epilogue1" for consumer1), the
    ids the operand takes in each of the role's threads (Note [values per thread]; None where
    the PTX does not tell)."""
    path, _, name, _ = marker
    prog = plan.protocol.program(path)
    out = {}
    for role in (prog.roles if prog.shared_code else (path,)):
        barrier = barrier_name(name, {prog.var: prog.index(role)} if prog.var else {})
        threads = [32 * w + lane for w in plan.role(role).warps for lane in range(32)]
        got = {values.value(op.named_operand, t) for t in threads}
        out[role] = (barrier, plan.barriers.barrier(barrier).named_id,
                     sorted(got, key=lambda v: (v is None, v or 0)))
    return out


def _ids_text(got: list) -> str:
    return "unresolved" if None in got else " / ".join(map(str, got))


def _claim_problem(plan, offsets, marker, op, ids=None) -> str:
    """Why `op` is not the instruction `marker` announces ("" when it is); `ids`: the named
    barrier ids `_named_ids` found for it."""
    path, kind, name, stage = marker
    who = f"{path}: {kind} {name}[{stage}]"
    fam = _family(plan, name)
    if not fam:
        return f"{who}: no such barrier in the table"
    if op is None:
        return f"{who}: no barrier instruction follows the marker"
    if op.kind != kind or not op.opcode.startswith(_OPCODES[kind]) or (
            kind == "expect_tx") != op.opcode.startswith("mbarrier.arrive.expect_tx"):
        return f"{who}: the next barrier instruction is {op.opcode}"
    b = fam[0]
    if b.kind == "named":
        if op.opcode.startswith("bar.") or ".aligned" in op.opcode:
            return f"{who}: {op.opcode} is the aligned form; role branches need barrier.sync"
        if ids is None:
            return f"{who}: {name} is not a barrier of every role running {path}"
        bad = [f"{role} {_ids_text(got)}" for role, (_, want, got) in ids.items()
               if got != [want]]
        if bad:
            table = ", ".join(f"{b} {want}" for b, want, _ in ids.values())
            return (f"{who}: barrier id {op.named_operand} is {', '.join(bad)}; the table has "
                    f"{table}")
        if op.threads != b.arrive_count:
            return f"{who}: {op.threads} threads, the table has {b.arrive_count}"
        return ""
    lo = offsets[b.name]
    hi = lo + 8 * b.stages
    if op.offset is None or not lo <= op.offset < hi:
        return f"{who}: address {op.offset} is outside {b.name}'s bytes [{lo}, {hi})"
    if stage != "ring" and not op.dynamic and op.offset != lo + 8 * int(stage):
        return f"{who}: address {op.offset} is stage {(op.offset - lo) // 8}, not {stage}"
    return ""


def protocol_rows(plan, ptx: str) -> list[AuditRow]:
    """The binary's barriers against `plan.protocol` (Note [protocol audit])."""
    rows = []
    offsets = plan.barrier_offsets()
    # (a) inits: offset and arrival count of every stage, in the table's order.
    inits = sorted(mbarrier_inits(ptx), key=lambda x: (x[0] is None, x[0] or 0))
    found = dict(inits)
    for b in plan.barriers.barriers:
        if b.kind != "mbarrier":
            continue
        want = [(offsets[b.name] + 8 * s, b.arrive_count) for s in range(b.stages)]
        got = [(off, found.get(off)) for off, _ in want]
        rows.append(_row(f"init {b.name}", want, got,
                         note=f"mbarrier.init (SMEM offset, arrivals); {b.producer} -> "
                              f"{b.consumer}"))
    rows.append(_row("mbarrier.init at table offsets", len(inits),
                     sum(1 for off, _ in inits if off in {o + 8 * s for b in plan.barriers.barriers
                                                          if b.kind == "mbarrier"
                                                          for o in [offsets[b.name]]
                                                          for s in range(b.stages)}),
                     note="every init is one of the table's barrier stages"))
    # (b, c) markers claim the instructions that follow them; every instruction is claimed.
    ops = barrier_ops(ptx)
    claims, unclaimed, setup = [], [], 0
    run: list = []
    for op in ops + [None]:
        if op is not None and op.kind == "marker":
            if run and run[-1][1] is not None:
                run = []
            run.append([op.marker, None])
            continue
        pending = [r for r in run if r[1] is None]
        if op is None:
            claims += [(m, None) for m, _ in pending]
            break
        if pending:
            pending[0][1] = op
            claims.append((pending[0][0], op))
        elif op.kind == "sync" and op.named_id == 0:
            setup += 1
        else:
            unclaimed.append(op)
    values = ThreadValues(ptx)
    ids = {}
    for m, op in claims:
        fam = _family(plan, m[2])
        if op is not None and op.kind in ("sync", "named_arrive") and fam \
                and fam[0].kind == "named":
            try:
                ids[op.line] = _named_ids(plan, values, m, op)
            except KeyError:
                pass
    problems = [p for m, op in claims
                if (p := _claim_problem(plan, offsets, m, op,
                                        None if op is None else ids.get(op.line)))]
    rows.append(_row("markers claim their barrier op", 0, len(problems),
                     note="; ".join(problems[:4]) or f"{len(claims)} markers: opcode, address, "
                                                      f"named id / threads / unaligned"))
    if ids:
        rows.append(_named_row(plan, claims, ids, values))
    rows.append(_row("unclaimed barrier instructions", 0, len(unclaimed),
                     note="; ".join(f"line {o.line + 1}: {o.opcode} @{o.offset}"
                                    for o in unclaimed[:4])
                     or f"besides {setup} bar.sync 0 (CTA-wide setup)"))
    # (d) each code path: its ops in control-flow order and their loops.
    rank = {line: k for k, line in enumerate(program_order(ptx))}
    loops = ptx_loops(ptx)
    q = plan.tiles.q_stage
    markers = sorted((o for o in ops if o.kind == "marker"), key=lambda o: rank.get(o.line, -1))
    for path in plan.protocol.paths():
        want = plan.protocol.sites(path, q, folded=True)
        got = [o for o in markers if o.marker[0] == path]
        rows.append(_sequence_row(path, want, got, loops))
    stray = sorted({o.marker[0] for o in markers} - set(plan.protocol.paths()))
    if stray:
        rows.append(_row("markers of unknown code paths", [], stray))
    # (f) SMEM regions: where the TMA writes each tile, stores O from, tcgen05.alloc writes.
    rows += _smem_rows(plan, ptx, offsets)
    rows += _mailbox_rows(plan, ptx, markers)
    return rows


def _named_row(plan, claims, ids, values) -> AuditRow:
    """Every named barrier's id as the binary computes it, in the threads of each role that
    runs the instruction, against the table's (Note [values per thread]). An id held in a
    register is evaluated per thread, and the note shows how the binary computes it."""
    expected, seen, notes = {}, {}, []
    for m, op in claims:
        if op is None or op.line not in ids:
            continue
        per_role = ids[op.line]
        for barrier, want, got in per_role.values():
            expected[barrier] = want
            seen.setdefault(barrier, set()).update(got)
        if op.named_id is None and (m[0], m[2]) not in {n[:2] for n in notes}:
            prog = plan.protocol.program(m[0])
            wants = [want for _, want, _ in per_role.values()]
            base = (f"; the table: {next(iter(per_role.values()))[0]}'s id {wants[0]} + "
                    f"{prog.var}"
                    if prog.var and wants == [wants[0] + k for k in range(len(wants))] else "")
            notes.append((m[0], m[2], f"{m[0]} {m[2]}: {op.named_operand} = "
                          f"{values.formula(op.named_operand)}, at run time: "
                          + ", ".join(f"{role} {_ids_text(got)}"
                                      for role, (_, _, got) in per_role.items()) + base))
    found = {b: (v[0] if len(v) == 1 else v)
             for b, v in ((b, sorted(v, key=lambda x: (x is None, x or 0)))
                          for b, v in seen.items())}
    note = "; ".join(n[2] for n in notes) or "every id an immediate"
    return _row("named barrier ids", expected, found,
                note=f"the ids in the threads of each role running the instruction: {note}")


def _sequence_row(path, want, got, loops) -> AuditRow:
    def text(site):
        return str(site)

    exp = [text(s) for s in want]
    fnd = [f"{k} {b}[{st if st == 'ring' else int(st)}]" for _, k, b, st in
           (o.marker for o in got)]
    fnd_sites = [f.replace("[ring]", "[ring]") for f in fnd]
    exp_norm = [e for e in exp]
    note = f"{len(exp)} ops in order"
    ok = fnd_sites == exp_norm
    if not ok:
        k = next((i for i, (a, b) in enumerate(zip(exp_norm, fnd_sites)) if a != b),
                 min(len(exp_norm), len(fnd_sites)))
        e = exp_norm[k] if k < len(exp_norm) else "(end)"
        f = fnd_sites[k] if k < len(fnd_sites) else "(end)"
        note = f"{path} op {k}: the binary has {f}, the table has {e}"
    else:
        # Loops: a site in table loop L <-> its marker in one PTX loop, distinct per L.
        pairs = {}
        for site, o in zip(want, got):
            ptx_loop = loops.get(o.line)
            if (site.loop is None) != (ptx_loop is None):
                ok = False
                where = "inside" if ptx_loop else "outside"
                note = (f"{path}: {site} is {where} a loop in the binary, "
                        f"{'outside' if site.loop is None else 'inside'} one in the table")
                break
            if site.loop is not None:
                pairs.setdefault(site.loop, set()).add(ptx_loop)
        if ok:
            mapped = [next(iter(v)) for v in pairs.values() if len(v) == 1]
            if len(mapped) != len(pairs) or len(set(mapped)) != len(mapped):
                ok = False
                note = f"{path}: the table's loops {sorted(pairs)} are not one PTX loop each"
            else:
                note += f", {len(pairs)} loop(s) matched"
    return AuditRow(f"protocol: {path}", f"{len(exp)} ops", f"{len(fnd)} ops", ok, note)


def _smem_rows(plan, ptx, offsets) -> list[AuditRow]:
    regions = plan.smem.offsets()
    by_offset = {offsets[b.name] + 8 * s: b.name for b in plan.barriers.barriers
                 if b.kind == "mbarrier" for s in range(b.stages)}
    lines = re.findall(r"^\s*(?:@!?%\w+\s+)?cp\.async\.bulk\.tensor\S*shared::\w+\.global"
                       r"\S*\s+([^;]*);", ptx, re.M)
    from fa4lab.kernels.binary import SmemAddresses

    addr = SmemAddresses(ptx)
    found: dict[str, int] = {}
    for operands in lines:
        br = re.findall(r"\[[^\]]*\]", operands)
        dst, bar = addr.operand(br[0]), addr.operand(br[-1])
        name = by_offset.get(bar[0]) if bar else None
        if dst and name and name.endswith("_full"):
            region = name[: -len("_full")]
            found[region] = min(found.get(region, dst[0]), dst[0])
    stores = smem_operand_offsets(ptx, r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta", 1)
    if stores:
        found["o"] = min(off for off, _ in stores)
    found["barriers"] = min(offsets.values()) if False else min(
        (off for off, _ in mbarrier_inits(ptx) if off is not None), default=-1)
    alloc = smem_operand_offsets(ptx, r"tcgen05\.alloc", 0)
    if alloc:
        found["tmem_ptr"] = alloc[0][0]
    rows = []
    for r in plan.smem.regions:
        if r.name in found:
            rows.append(_row(f"SMEM offset {r.name}", regions[r.name], found[r.name],
                             note="TMA destination / store source / mbarrier.init / "
                                  "tcgen05.alloc address in the PTX"))
    return rows


def _mailbox_rows(plan, ptx, markers) -> list[AuditRow]:
    """A mailbox region (sm100's `stats`, the softmax -> correction hand-off): no TMA touches
    it, so its offset is read off the ld/st.shared a role issues right after waiting on one of
    the mailbox's barriers, before its next barrier op (softmax: wait stats_empty, write,
    arrive stats_full; correction: wait stats_full, read, arrive stats_empty). The region
    starts at the lowest constant offset there, and every access must lie inside it."""
    regions = plan.smem.offsets()
    boxes = {b.name[: -len("_full")] for b in plan.barriers.barriers
             if b.group == "mailbox" and b.name.endswith("_full")}
    ordered = sorted(markers, key=lambda o: o.line)
    accesses = smem_accesses(ptx)
    rows = []
    for box in sorted(boxes & set(regions)):
        windows = [(o.line, nxt.line if nxt else math.inf) for o, nxt in
                   zip(ordered, ordered[1:] + [None])
                   if o.marker[1] == "wait" and o.marker[2] in (f"{box}_full", f"{box}_empty")]
        hits = [(kind, off) for line, kind, off, _ in accesses
                if any(lo < line < hi for lo, hi in windows)]
        lo, size = regions[box], plan.smem.region(box).bytes
        outside = sorted({off for _, off in hits if not lo <= off < lo + size})
        found = min((off for _, off in hits), default=None)
        kinds = Counter(kind for kind, _ in hits)
        rows.append(_row(f"SMEM offset {box}", lo, found, found == lo and not outside,
                         note=f"{kinds['st']} st.shared / {kinds['ld']} ld.shared after the "
                              f"{box}_empty / {box}_full waits ({len(windows)} sites), constant "
                              f"offsets {sorted({off for _, off in hits})}"
                              + (f"; outside [{lo}, {lo + size}): {outside}" if outside
                                 else f", inside [{lo}, {lo + size})")))
    return rows


# ---------------------------------------------------------------- audits
def _common_rows(cf, ops: Counter, use_ptxas: bool, sass_text: str) -> list[AuditRow]:
    plan = cf.plan
    res = resource_usage(cf.cubin_path)
    budget = plan.hardware.registers_per_sm // plan.threads_per_cta
    spill_instr = count_prefix(ops, "STL") + count_prefix(ops, "LDL")
    loop = steady_loop(sass_text)
    rows = [
        AuditRow("compile seconds", "-", round(cf.seconds, 1), True, "cute.compile, fake tensors"),
        _row("registers per thread (launch)", f"<= {budget}", res["registers"],
             res["registers"] <= budget,
             f"{plan.hardware.registers_per_sm} / {plan.threads_per_cta} threads; roles then "
             f"rebalance with setmaxnreg"),
        _row("spill instructions (STL/LDL)", 0, spill_instr),
        _row("spills in the steady-state loop", 0, spills_in(sass_text, loop),
             spills_in(sass_text, loop) == 0,
             f"SASS {loop[0]:#x}-{loop[1]:#x}: the last loop with MMAs" if loop
             else "no conditional loop around the MMAs (the whole kernel is counted above)"),
        _row("stack frame bytes", 0, res["stack"]),
        _row("dynamic SMEM bytes", plan.smem.total_bytes, cf.smem_bytes,
             note="SharedStorage struct size (not in the cubin)"
             + ("; the plan's total lacks the struct's round-up to its largest alignment"
                if smem_gap_is_alignment(plan, cf.smem_bytes) else "")),
        _row("mbarrier.init", plan.barriers.mbarrier_count,
             ptx_count(cf.ptx, r"\bmbarrier\.init\.")),
    ]
    found_nreg = setmaxnreg_values(cf.ptx)
    if cf.arch == "sm100a":  # the sm100 kernel has one setmaxnreg per role branch
        rows.append(_row("setmaxnreg values", sorted(r.registers for r in plan.roles),
                         found_nreg, note="one per role branch"))
    else:  # the sm90 kernel's consumer warpgroups share one branch
        rows.append(_row("setmaxnreg values (distinct)",
                         sorted({r.registers for r in plan.roles}), sorted(set(found_nreg))))
    rows += protocol_rows(plan, cf.ptx)
    if use_ptxas:
        rep = ptxas_report(cf.ptx_path, cf.arch)
        spilled = rep["spill_stores"] + rep["spill_loads"]
        rows.append(_row("ptxas spill bytes (stores + loads)", 0, spilled, note="ptxas -v"))
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
        _row("exp2 on FMA (polynomial)", steps * 2 * pairs, poly,
             note=f"{per_site} {2 * pairs} of {n} (fraction {plan.exp2_emulation_fraction}); "
                  f"one FADD2.RM per pair"),
        _row("MUFU.EX2", f"{mufu_p}..{mufu_p + steps}", mufu, mufu_p <= mufu <= mufu_p + steps,
             note="P on MUFU (and the sink's in the finalize), plus at most one row-scale exp2 "
                  "per site"),
        _row("FFMA2 (SASS)", steps * ffma2, count_prefix(ops, "FFMA2"),
             note=f"{per_site} ({n // 2} scale-subtract + {EXP2_PAIR_FFMA2} x {pairs} "
                  f"polynomial pairs)"),
        _row("FADD2 (SASS)", steps * fadd2, count_prefix(ops, "FADD2"),
             note=f"{per_site} ({EXP2_PAIR_FADD2} x {pairs} polynomial pairs + "
                  f"{n // 2 - 1} row-sum adds of {n // 2} pairs)"),
        _row("emulated exp2 fraction", plan.exp2_emulation_fraction, round(found_fraction, 4),
             abs(found_fraction - plan.exp2_emulation_fraction) <= 1.5 / n,
             "FMA polynomials / all exp2"),
    ]


def audit_sm100(cf, *, use_ptxas: bool = False) -> Audit:
    plan, kernel = cf.plan, cf.kernel
    text = sass(cf.cubin_path)
    ops = sass_opcodes(text)
    rows = _common_rows(cf, ops, use_ptxas, text)
    allocs = tmem_alloc_columns(cf.ptx)
    rows.append(_row("TMEM columns (tcgen05.alloc)", [plan.tmem.alloc_cols], allocs))
    # MMA instructions: each MMA of the plan is k/16 tcgen05.mma (16-bit inputs: K = 16 per
    # instruction), issued at kernel.mma_sites[name] places in the code.
    k_step = 16
    mma_expected = sum(kernel.mma_sites[m.name] * (m.k // k_step) for m in plan.mmas)
    rows.append(_row("tcgen05.mma (PTX)", mma_expected,
                     ptx_count(cf.ptx, r"\btcgen05\.mma\.cta_group"),
                     note=" + ".join(f"{kernel.mma_sites[m.name]} sites x {m.k // k_step} "
                                     f"({m.name})" for m in plan.mmas)))
    rows.append(_row("UTCHMMA (SASS)", mma_expected, count_prefix(ops, "UTCHMMA")))
    for name, pattern in (("tcgen05.ld", r"\btcgen05\.ld\."), ("tcgen05.st", r"\btcgen05\.st\."),
                          ("tcgen05.commit", r"\btcgen05\.commit\.")):
        n = ptx_count(cf.ptx, pattern)
        rows.append(AuditRow(f"{name} (PTX)", "> 0", n, n > 0, "static count, shown"))
    rows += _exp2_rows(plan, kernel, ops)
    return Audit(f"sm100a audit: {describe(plan.spec)}", tuple(rows))


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
