"""The barrier protocol in a compiled kernel's PTX against the plan's protocol table: the
`fa4lab audit` rows of `protocol_rows` (Note [protocol audit]).

    from fa4lab.kernels.protocol_audit import protocol_rows
    rows = protocol_rows(plan, ptx)      # one AuditRow per check; any ok=False is a failure

The PTX is read with `fa4lab.kernels.binary` (markers, barrier instructions, the values of a
register per thread, SMEM addresses) and `fa4lab.kernels.ptx_flow` (loops, control-flow order).
"""

from __future__ import annotations

import math
import re
from collections import Counter

from fa4lab.kernels.binary import (
    AuditRow,
    ThreadValues,
    audit_row,
    barrier_ops,
    mbarrier_inits,
    smem_accesses,
    smem_operand_offsets,
)
from fa4lab.kernels.ptx_flow import program_order, ptx_loops
from fa4lab.plan.protocol import barrier_name

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
        rows.append(audit_row(f"init {b.name}", want, got,
                         note=f"mbarrier.init (SMEM offset, arrivals); {b.producer} -> "
                              f"{b.consumer}"))
    rows.append(audit_row("mbarrier.init at table offsets", len(inits),
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
    rows.append(audit_row("markers claim their barrier op", 0, len(problems),
                     note="; ".join(problems[:4]) or f"{len(claims)} markers: opcode, address, "
                                                      f"named id / threads / unaligned"))
    if ids:
        rows.append(_named_row(plan, claims, ids, values))
    rows.append(audit_row("unclaimed barrier instructions", 0, len(unclaimed),
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
        rows.append(audit_row("markers of unknown code paths", [], stray))
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
    return audit_row("named barrier ids", expected, found,
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
            rows.append(audit_row(f"SMEM offset {r.name}", regions[r.name], found[r.name],
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
        rows.append(audit_row(f"SMEM offset {box}", lo, found, found == lo and not outside,
                         note=f"{kinds['st']} st.shared / {kinds['ld']} ld.shared after the "
                              f"{box}_empty / {box}_full waits ({len(windows)} sites), constant "
                              f"offsets {sorted({off for _, off in hits})}"
                              + (f"; outside [{lo}, {lo + size}): {outside}" if outside
                                 else f", inside [{lo}, {lo + size})")))
    return rows
