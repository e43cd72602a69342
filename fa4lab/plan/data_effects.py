"""What each op of the role programs does to the data, for the data-carrying simulator
(`fa4lab.plan.datasim`): `classify` names an op's effect from the regions it touches (Note
[data effects]), `stage_of` / `buffer_of` the Q tile and S / P buffer it works for, `cells_of`
the memory cells a region reference covers.
"""

from __future__ import annotations

import re

from fa4lab.plan.steps import Issue, Work

# Note [data effects]
# An op reads its sources when it starts and writes its destination when it ends: a Work op
# at its start and start + cycles, an async op (TMA copy, MMA, TMA store) at the start and the
# end of its execution on the engine (a TMA copy lands after the engine's latency, just before
# its bytes complete the barrier). So an op that overlaps another's read-modify-write sees
# the old value or loses its update, as the hardware would. Which op does what is read from
# the regions it touches (its Refs), not from its position in the program:
#     load      TMA "Q{i}" -> smem q[i]; "K{j}" / "V{j}" -> smem kv[stage]  (the tile's step-th
#               K or V; steps walk the K/V blocks from the last to the first, as the kernel)
#     mma       writes S[i]: S_i = Q_i K^T (fp32);  writes O[i]: O_i (+)= P_i V (the first value
#               MMA of a work tile overwrites, as the kernel's accumulate flag); a value MMA
#               that reads only some of P's columns (Note [split P hand-off] in
#               fa4lab.plan.sm100) multiplies those keys by V's matching rows, and the second
#               part always accumulates
#     softmax   reads S[i]: mask, row max, conditional rescale, exp2 (MUFU or polynomial per
#               pair of columns), row sum (update_state); writes P[i]: P in 16 bits over S's
#               upper half, only the columns of its Ref (one part of a split hand-off); writes
#               stats[i]: the row scale, or (labels with "sum") row sum and row max
#     correction reads stats[i]: the scale, or row sum and row max; reads and writes O[i]:
#               O *= scale; reads O[i]: O / row_sum and LSE (finalize); writes smem o[i]: O in
#               16 bits, and LSE to global
#     epilogue  TMA store reading smem o[i] -> global out (rows past seqlen_q clipped); its
#               drains wait for the older stores only (Note [store drains] in
#               fa4lab.plan.steps), so o_empty[0] may be released with store 1 in flight
#     TMEM      "alloc TMEM" (writes smem tmem_ptr) publishes the address; a role's "TMEM
#               address" (reads tmem_ptr) takes it: before that its TMEM loads return garbage
#               and its stores land elsewhere; "free TMEM" leaves garbage in the columns
# The k-th op of a kind (per Q stage) belongs to work tile k // n_blocks, step k % n_blocks.


class DataSimError(RuntimeError):
    """The programs hold an op whose data effect this simulator does not know."""


# The effects that happen once per K/V block of a work tile.
PER_BLOCK = {"load_k", "load_v", "mma_s", "mma_pv", "ld_s"}


def stage_of(op) -> int | None:
    """The Q tile an op works for: its Q, O, mailbox or S/P region's index (the S buffer is the
    Q tile's with two Q tiles; with one, the simulator's `_effects` takes 0)."""
    for names in (("q", "O", "o", "stats"), ("S", "P")):
        for r in op.reads + op.writes:
            if r.name in names:
                return r.stage
    return None


def buffer_of(op) -> int | None:
    """The S / P buffer an op touches: the Q tile's, or with one Q tile block step j's, j % 2
    (Note [S ping-pong] in fa4lab.plan.sm100)."""
    return next((r.stage for r in op.reads + op.writes if r.name in ("S", "P")), None)


def cells_of(ref) -> tuple:
    if ref.space == "tmem":
        return tuple(("tmem", c) for c in range(ref.lo, ref.hi))
    return ((ref.space, ref.name, ref.stage),)


def classify(role: str, op) -> str | None:
    """Which data effect an op has (Note [data effects]), from the regions it touches; None for
    an op that moves no data (exp2 in registers). Raises DataSimError for an op it cannot place.
    """
    if not isinstance(op, (Work, Issue)):
        return None
    reads = {(r.space, r.name) for r in op.reads}
    writes = {(r.space, r.name) for r in op.writes}
    # O staged in Q's bytes (plan.smem "o" alias_of "q"): the store reads q, the staging of O,
    # the one Work op that writes Q's SMEM, writes it.
    if isinstance(op, Issue) and op.engine == "tma_store" and ("smem", "q") in reads:
        reads.add(("smem", "o"))
    if isinstance(op, Work) and ("smem", "q") in writes:
        writes.add(("smem", "o"))
    if isinstance(op, Issue):
        if op.engine == "tma" and ("smem", "q") in writes:
            return "load_q"
        if op.engine == "tma" and ("smem", "kv") in writes:
            if re.match(r"\s*K", op.label):
                return "load_k"
            if re.match(r"\s*V", op.label):
                return "load_v"
        if op.engine == "tma_store" and ("smem", "o") in reads:
            return "store_o"
        if op.engine == "tensor" and ("tmem", "S") in writes:
            return "mma_s"
        if op.engine == "tensor" and ("tmem", "O") in writes and ("tmem", "P") in reads:
            return "mma_pv"
    else:
        sums = "sum" in op.label
        if ("smem", "tmem_ptr") in writes:
            return "alloc_tmem"
        if ("smem", "tmem_ptr") in reads:
            return "tmem_address"
        if ("tmem", "all") in writes:
            return "free_tmem"
        if ("tmem", "S") in reads:
            return "ld_s"
        if ("tmem", "P") in writes:
            return "st_p"
        if ("smem", "stats") in writes:
            return "post_sum" if sums else "post_scale"
        if ("smem", "stats") in reads:
            return "read_sum" if sums else "read_scale"
        if ("tmem", "O") in reads and ("tmem", "O") in writes:
            return "rescale_o"
        if ("tmem", "O") in reads:
            return "ld_o"
        if ("smem", "o") in writes:
            return "stage_o"
        if not reads and not writes:
            return None
    raise DataSimError(f"{role}: no data effect known for {op} (Note [data effects] in "
                       f"fa4lab.plan.data_effects)")
