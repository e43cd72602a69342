"""The B200 (sm100) plan: FA4's design with S, P and O in tensor memory.

One CTA owns two Q tiles of 128 rows (q_stage 2). The MMA warp issues tcgen05 MMAs for both;
two softmax warpgroups ping-pong (while one computes exp2 on its S the tensor core works on the
other's), a correction warpgroup rescales O in TMEM when a row max grows by more than the
threshold and runs the epilogue, and single warps issue the TMA loads and stores. With q_stage 1
(head_dim 256, whose O is 256 columns) one Q tile's consecutive key blocks ping-pong between two
S buffers instead (Note [S ping-pong]).

Constraints: head_dim a multiple of 16 up to 256, head_dim_v == head_dim or a pair the kernel
builds (`fa4lab.limits.KERNEL_HEAD_DIMS["sm100"]`); two S buffers + O of every Q stage within
the 512 TMEM columns (head_dim 256 needs q_stage 1); SMEM within the per-CTA limit. The
tuning choices sit in `SM100_TUNING`, keyed by (head_dim, head_dim_v). The role programs for
the protocol simulator live here too (`programs`); the protocol table is
`fa4lab.plan.protocol_sm100`.

`pack_gqa=True` (see Note [sm100 pack-GQA]) makes a CTA's rows the packed rows of one KV head.
With two Q tiles and O staged in its own SMEM the CTAs are persistent (Note [persistent CTAs]).
"""

from __future__ import annotations

from dataclasses import dataclass

from fa4lab.errors import PlanError
from fa4lab.hardware import B200
from fa4lab.limits import (
    ELEMENT_BYTES,
    KERNEL_HEAD_DIMS,
    Q_TILE_ROWS,
    RESCALE_THRESHOLDS,
    SM100_EXP2_FRACTION_MAX,
    head_dims_text,
    key_block_for_pages,
    min_gather_page,
    unsupported_head_dims,
)
from fa4lab.plan.barriers import PHASE_EMPTY, PHASE_FULL, PHASE_NAMED, Barrier, BarrierGraph
from fa4lab.plan.costs import balanced_exp2_fraction
from fa4lab.plan.plan import Plan
from fa4lab.plan.protocol import expand, ring_slot
from fa4lab.plan.protocol_sm100 import build_protocol
from fa4lab.plan.roles import Role, check_roles
from fa4lab.plan.smem import MBARRIER_BYTES, SmemPlan, SmemRegion
from fa4lab.plan.tiles import MmaPlan, Tiles, check_pack_gqa, pack_gqa_notes
from fa4lab.plan.tmem import TmemPlan, TmemRegion, alloc_columns
from fa4lab.scheduling import kernel_tile_order

# Defaults (FA4 on B200). Tuning knobs sit together.
M_BLOCK = Q_TILE_ROWS["sm100"]  # one TMEM lane per query row: the MMA's M and a softmax warpgroup


@dataclass(frozen=True)
class Sm100Tuning:
    n_block: int = 128
    q_stage: int = 2
    kv_stage: int = 3          # K and V share one ring of buffers (K_j, V_j, K_j+1, ...)
    o_in_q: bool = False       # stage O for the TMA store in Q's SMEM (Q is dead by then)


# Note [sm100 tuning table]
# The choices of the B200 plan per (head_dim, head_dim_v); a head dim the kernel does not build
# is planned with the default row. (192, 128) cannot hold Q (2 x 48 KiB), three 48 KiB K/V
# buffers and O staging (2 x 32 KiB) in 227 KiB. It stages O in Q's bytes (as upstream FA4
# does) and takes 96-key blocks, so three 36 KiB K/V buffers fit (207 KiB in all). The other
# ways out were measured on the compiled binary, not on a B200: two 128-key buffers spill (with
# kv_stage 2 ptxas spills the softmax's loop state, at every head dim, and the MMA warp's
# descriptors for 12 K steps do not fit 48 registers); upstream keeps three 128-key buffers by
# packing the ring unevenly ([K 48, V 32, K 48] KiB, a phase-dependent offset for the middle
# one), a larger kernel change.
# (256, 256): O is 256 TMEM columns, so one Q tile (q_stage 1, Note [S ping-pong]); Q (64 KiB),
# two 64 KiB K/V buffers and O staged in Q's bytes make 192 KiB.
DEFAULT_TUNING = Sm100Tuning()
SM100_TUNING = {
    (64, 64): DEFAULT_TUNING,
    (96, 96): DEFAULT_TUNING,
    (128, 128): DEFAULT_TUNING,
    (192, 128): Sm100Tuning(n_block=96, o_in_q=True),
    (256, 256): Sm100Tuning(q_stage=1, kv_stage=2, o_in_q=True),
}
# setmaxnreg per role. With q_stage 1 the second softmax warpgroup idles at the minimum, 24, and
# the MMA warp's warpgroup takes what it leaves: 512 - 192 - 80 - 24 = 216 -> 208 (at head_dim
# 256 the MMA warp's 16 K steps of descriptors spill at 120; Note [S ping-pong]).
REGISTERS = {"softmax": 192, "correction": 80, "other": 48}
REGISTERS_ONE_Q_TILE = {**REGISTERS, "other": 208, "idle": 24}
S_BUFFERS = 2               # S (and P over it) buffers in TMEM, whatever q_stage
SOFTMAX_REG_OVERHEAD = 48   # registers a softmax thread needs besides its row of S
TMEM_BARRIER_ID = 1         # named barrier of the TMEM hand-off (0 is __syncthreads)
S_CHUNK = 32                # S columns per tcgen05.ld (32x32b.x32) and per softmax exp2 chunk


# Note [split P hand-off]
# With two Q tiles the softmax hands P_i to the value MMA in two parts, as upstream FA4 does: it
# writes P's columns (keys) [0, p_split) chunk by chunk, fences its tcgen05.st, arrives on
# p_part, then writes [p_split, n_block) and arrives on p_ready. The MMA warp issues
# O_i += P_i[:, :p_split] V_j[:p_split] once p_part (and o_rescaled) completed, then waits for
# p_ready and issues O_i += P_i[:, p_split:] V_j[p_split:] (accumulating). What it buys: the
# tensor core starts O's update while the softmax still computes the last quarter of its
# exp2 and stores it; with one hand-off the value MMA waited for the whole of P.
# Why it is safe, edge by edge:
#   * p_part orders the first part's stores (and the fence) before the MMA that reads those
#     columns; the second part's stores write the other columns only (P is 16-bit, two per
#     TMEM column: keys [0, p_split) are P's first p_split / 2 columns), so the first MMA never
#     reads what the second stores write, and the second MMA waits for p_ready;
#   * p_ready keeps both of its meanings: P_i is complete, and S_i (read into registers before
#     any P store) may be overwritten: the next score MMA into S_i is issued after the second
#     value MMA, which waited for p_ready (Note [P aliases S] in fa4lab.plan.tmem);
#   * both MMAs read V_j, released once by the kv_empty commit after the last of them;
#   * p_part needs no empty side: softmax_i arrives on it for the next block only after that
#     block's s_full, whose score MMA the MMA warp issues after it waited on p_part for this
#     block, so a phase never completes before the wait on the one before (the simulator
#     reports a "phase overrun" otherwise).
# In the timing model (`_steps`) the softmax's exp2 is two steps around the p_part arrive, the
# first holding the MUFU for the second (Work.hold in fa4lab.plan.steps): the kernel's exp2
# chunks run back to back, so the other warpgroup's exp2 does not slip in between (that would
# undo the two warpgroups' ping-pong, a loss the kernel does not have). Calibrated, the hd64
# and hd128 B200 plans are bound by the K/V ring's loads (the MMA warp waits on kv_full), so a
# block costs the same cycles as with one hand-off and only a tile's start and end get shorter;
# where the softmax -> MMA chain is the bound (TMA latency 100 cycles: hd64, hd128) a block
# takes 3-5% fewer cycles.
# p_split is upstream's rule: 3/4 of n_block, rounded down to the softmax's chunk (S_CHUNK, 32
# columns of S: a chunk's P goes to TMEM in one tcgen05.st, and the MMA's K step of 16 divides
# it); 0 (one hand-off) when that leaves nothing (n_block 32). The one-Q-tile plans (Note [S
# ping-pong]) keep one hand-off: their value MMA of step j is issued after the score MMA of
# step j + 1, so the tensor core already has that score MMA to run while the softmax finishes
# P(j); splitting there too (p_part per S buffer, at the block step's run-time phase) is not
# done.
def p_split(tiles: Tiles) -> int:
    """Keys (columns of S) of P_i the softmax hands to the value MMA first, 0 for one hand-off:
    Note [split P hand-off]."""
    if tiles.q_stage != 2:
        return 0
    return tiles.n_block * 3 // 4 // S_CHUNK * S_CHUNK


# Note [sm100 pack-GQA]
# As on sm90 (Note [sm90 pack-GQA] in fa4lab.plan.sm90): with pack_gqa the qhead_per_kvhead (g)
# query heads of a KV head share one CTA, whose 2 x 128 M rows are packed rows (position * g +
# head within the group, Note [pack-GQA rows] in fa4lab.gqa). The grid has heads_kv columns
# and ceil(seqlen_q * g / cta_m) row tiles; K/V are loaded once per group. Q and O keep their
# TMA: a 128-row tile is a (g, 128 / g) box over (head, position), so g must divide m_block.
# TMEM, SMEM, barriers, roles and MMAs are those of the unpacked plan. With g == 1 there is
# nothing to pack, and the plan records pack_gqa=False.


# Note [S ping-pong]
# TMEM holds two S buffers (fp32, n_block columns each, P over the upper half of each: Note
# [P aliases S] in fa4lab.plan.tmem) and one O per Q stage. With two Q tiles (q_stage 2) S_i is
# Q tile i's and the two softmax warpgroups take turns with the tensor core. With one Q tile
# (q_stage 1: head_dim 256, whose O takes 256 of the 512 columns) key block step j uses S
# buffer j % 2, and the MMA warp issues S(j+1) = Q K_j+1^T before O += P(j) V_j: the tensor
# core computes the next scores while the one softmax warpgroup exponentiates these (upstream
# FA4's "S ping-pong"). Three consequences, each in the protocol table:
#   * the loads run one K ahead (Note [ring slots] in fa4lab.plan.protocol, ring "kv_ahead");
#   * S(j+1) overwrites buffer (j+1) % 2 = (j-1) % 2 after O += P(j-1) V_j-1 was issued, so the
#     in-order tensor pipe keeps P(j-1) until it is read, as with two Q tiles;
#   * when softmax posts block j's row scale, S(j) is complete but O += P(j-1) V_j-1 (issued
#     after it) may not be: the value MMA commits o_final after EVERY block, and the correction
#     waits for it before it rescales O (with two Q tiles o_final fires once, after the last).


# Note [persistent CTAs]
# A persistent plan launches min(work tiles, SMs) CTAs (`plan.hardware.num_sms`, a build-time
# figure); CTA c runs linear tiles c, c + gridDim.x, ... (`fa4lab.scheduling.persistent_tiles`),
# mapped to (m_block, head, batch) by `fa4lab.scheduling.tile_at` in `plan.tiles.order` (the grid
# order, or LPT for causal), as upstream FA4's static persistent scheduler does. Every role
# loops over the CTA's tiles (the table's TileLoop) with its pipeline states carried across
# them: barriers are initialised once, phases run on, TMEM is allocated once. q_empty and
# o_empty then order work tiles: the load warp's Q of tile t + 1 waits only for q_empty, which
# the MMA warp commits once it has issued tile t's last score MMAs (it fires when they are
# done, before the last value MMAs, which wait for the softmax's last P), so the next tile's
# loads and first score MMAs overlap tile t's last softmax step and its epilogue (the
# correction's normalisation, the TMA store); the correction stages O_i of tile t + 1 once the
# store of tile t has read its SMEM (o_empty). The simulator runs several tiles per CTA, so
# both edges are checked like the others.
# It is the default (`plan_forward(..., persistent=False)` opts out) for plans with two Q tiles
# and O staged in its own SMEM: head_dim 64, 96, 128. With O in Q's bytes ((192, 128),
# (256, 256)) tile t's O sits where tile t + 1's Q lands, so the next Q would have to wait for
# the store (an edge q_empty does not model), and the one-Q-tile ping-pong counts its phases
# per tile: those run one CTA per tile, their causal order "grid_reversed" (Note [tile order]
# in fa4lab.kernels.device.scheduler). The MMA warp rebuilds its operand descriptors in each
# tile (Note [operand descriptors per tile] in fa4lab.kernels.fwd_sm100); the softmax has no
# register to spare (a softcap's tanh spilled 10 instructions with the tile loop before the
# packed row sum became one chain, measured), so keep its per-tile state small.
def persistent_plan(q_stage: int, o_in_q: bool, requested: bool | None = None) -> bool:
    """Whether the plan's CTAs are persistent: `requested`, or (None) wherever the plan allows
    it. Note [persistent CTAs]."""
    able = q_stage == 2 and not o_in_q
    if requested and not able:
        raise PlanError(f"persistent=True needs two Q tiles and O staged in its own SMEM; this "
                        f"plan has q_stage={q_stage}" + (", O in Q's bytes" if o_in_q else "") +
                        ": see Note [persistent CTAs] in fa4lab.plan.sm100")
    return able if requested is None else requested


def tmem_columns(q_stage: int, n_block: int, head_dim_v: int) -> int:
    """Two S buffers (fp32, n_block cols each; P lives inside S) and O (fp32, head_dim_v cols)
    per Q stage: Note [S ping-pong]."""
    return S_BUFFERS * n_block + q_stage * head_dim_v


def _tmem_error(spec, tiles: Tiles, limit: int) -> PlanError:
    q, n, dv = tiles.q_stage, tiles.n_block, tiles.head_dim_v
    need = tmem_columns(q, n, dv)
    why = ""
    if q > 1 and tmem_columns(1, n, dv) <= limit:
        why = (f" q_stage=1 fits ({tmem_columns(1, n, dv)} columns): one Q tile whose key "
               f"blocks ping-pong between the two S buffers (Note [S ping-pong]).")
    elif q * dv >= limit:
        why = f" O alone needs {q}x{dv}={q * dv} columns, so no n_block helps."
    fallback = ""
    pair = (spec.head_dim, spec.head_dim_v)
    if pair not in KERNEL_HEAD_DIMS["sm100"]:   # the planner plans any that fit
        fallback = (f" Fallback for {pair}: the Hopper-style design (S, P, O in registers: "
                    f"arch='sm90') or q_stage=1; this lab's sm100 kernel builds "
                    f"{head_dims_text('sm100')}.")
    return PlanError(
        f"TMEM over budget: S {S_BUFFERS}x{n} cols + O {q}x{dv} cols (fp32) = {need} columns > "
        f"{limit} per SM ({need - limit} over) for head_dim {spec.head_dim}.{why}{fallback}")


def build_tmem(spec, tiles: Tiles, limit: int) -> TmemPlan:
    q, n, dv = tiles.q_stage, tiles.n_block, tiles.head_dim_v
    if tmem_columns(q, n, dv) > limit:
        raise _tmem_error(spec, tiles, limit)
    regions = []
    for i in range(S_BUFFERS):   # Q tile i's S, or with one Q tile block step j's: j % 2
        s = i * n
        regions.append(TmemRegion("S", i, s, n, "fp32", None, "p_ready"))
        # See Note [P aliases S]
        regions.append(TmemRegion("P", i, s + n // 2, n // 2, spec.dtype, "S", "s_full"))
    for i in range(q):
        regions.append(TmemRegion("O", i, S_BUFFERS * n + i * dv, dv, "fp32", None,
                                  "o_rescaled"))
    total = tmem_columns(q, n, dv)
    return TmemPlan(tuple(regions), total, alloc_columns(total), B200.tmem_lanes, limit)


def build_barriers(tiles: Tiles, eb: int, roles: tuple[Role, ...],
                   persistent: bool = False) -> BarrierGraph:
    """The barriers in the kernel's SharedStorage order: per DSL pipeline its full side then its
    empty side (q, kv, s, o, stats, epi), then the TMEM named barrier. `eb` is the bytes per
    element of Q, K and V (the TMA transaction counts)."""
    once = "" if persistent else "; one tile per CTA: only its first, released, phase is waited"
    q, kv = tiles.q_stage, tiles.kv_stage
    softmax = ",".join(f"softmax{i}" for i in range(q))
    sm_threads = 32 * 4   # one softmax warpgroup per Q stage; stage i belongs to softmax{i}
    corr_threads = 32 * 4
    q_bytes = tiles.m_block * tiles.head_dim * eb
    kv_bytes = tiles.n_block * tiles.head_dim * eb
    v_bytes = tiles.n_block * tiles.head_dim_v * eb
    tmem_users = [r for r in roles if r.name.startswith("softmax")
                  or r.name in ("correction", "mma")]
    # Note [S ping-pong]: with one Q tile the S buffers take turns by block step, and the K/V
    # loads run one K ahead.
    pp = q == 1
    ring = "kv_ahead" if pp else "kv"
    s_of = "block step j's S (buffer j % 2)" if pp else "S_i = Q_i K^T"
    b = [
        Barrier("q_full", "load", "mma", 1, q, q_bytes, PHASE_FULL,
                "Q tile i landed in SMEM before the score MMA reads it"),
        Barrier("q_empty", "mma", "load", 1, q, 0, PHASE_EMPTY,
                f"the last score MMA of a work tile has read Q tile i before the next work "
                f"tile's Q overwrites it (tcgen05.commit{once})",
                starts_released=True),
        Barrier("kv_full", "load", "mma", 1, kv, kv_bytes, PHASE_FULL,
                "a K or V block landed in its ring buffer before an MMA reads it", ring=ring,
                tx_bytes_v=v_bytes if v_bytes != kv_bytes else 0),
        Barrier("kv_empty", "mma", "load", 1, kv, 0, PHASE_EMPTY,
                "the MMAs reading a K/V buffer completed before TMA refills it "
                "(tcgen05.commit)", starts_released=True, ring=ring),
        Barrier("s_full", "mma", softmax, 1, S_BUFFERS, 0, PHASE_FULL,
                f"{s_of} is in TMEM (and, the tensor pipe being in order, the value MMA "
                f"before it finished) before the softmax reads it (tcgen05.commit)",
                per_role_stage=not pp),
        Barrier("p_ready", softmax, "mma", sm_threads, S_BUFFERS, 0, PHASE_FULL,
                "the softmax read S and wrote P over it in TMEM before the value MMA reads P "
                "and a next score MMA overwrites that S buffer", per_role_stage=not pp),
        Barrier("o_final", "mma", "correction", 1, q, 0, PHASE_FULL,
                "O += P V_j of every block completed before the correction rescales O for the "
                "next one, and the last before the epilogue reads O (tcgen05.commit; Note [S "
                "ping-pong])" if pp else
                "the last value MMA of a work tile completed before the epilogue reads O_i "
                "(tcgen05.commit)"),
        Barrier("o_rescaled", "correction", "mma", corr_threads, q, 0, PHASE_EMPTY,
                "correction finished with O_i (rescale, or the epilogue's read) before the "
                "next value MMA accumulates into it", starts_released=True),
        Barrier("stats_full", softmax, "correction", sm_threads, q, 0, PHASE_FULL,
                "softmax_i posted a block's rescale factor (or the final row sum and max) in "
                "the mailbox before correction reads it", group="mailbox",
                per_role_stage=True),
        Barrier("stats_empty", "correction", softmax, corr_threads, q, 0, PHASE_EMPTY,
                "correction read the mailbox before softmax_i posts again", group="mailbox",
                starts_released=True, per_role_stage=True),
        Barrier("o_staged", "correction", "epilogue", corr_threads, q, 0, PHASE_FULL,
                "normalized O_i is in SMEM (after fence.proxy.async) before the TMA store "
                "reads it"),
        Barrier("o_empty", "epilogue", "correction", 1, q, 0, PHASE_EMPTY,
                f"the TMA store finished reading O_i's SMEM staging before the next work "
                f"tile's epilogue writes it{once}", starts_released=True),
    ]
    if p_split(tiles):
        b.append(Barrier("p_part", softmax, "mma", sm_threads, q, 0, PHASE_FULL,
                         f"the softmax wrote P_i's first {p_split(tiles)} keys to TMEM (after "
                         f"its tcgen05.st fence) before the value MMA reads them; the rest "
                         f"follows under p_ready (Note [split P hand-off])",
                         per_role_stage=True))
    b += [
        Barrier("tmem", ",".join(r.name for r in tmem_users if r.name != "mma"), "mma",
                sum(r.threads for r in tmem_users), 1, 0, PHASE_NAMED,
                "bar.sync: every TMEM user waits for the MMA warp's tcgen05.alloc (the address "
                "is in SMEM); at the end the MMA warp waits for every user before tcgen05.dealloc",
                kind="named", group="named", named_id=TMEM_BARRIER_ID),
    ]
    return BarrierGraph(tuple(b))


def build_roles(q_stage: int) -> tuple[Role, ...]:
    r = REGISTERS if q_stage == 2 else REGISTERS_ONE_Q_TILE
    roles = [Role("softmax0", (0, 1, 2, 3), r["softmax"],
                  ("Q stage 0: S0" if q_stage == 2 else "the Q tile: S of block step j from "
                   "buffer j % 2") + " from TMEM, row max, exp2 (MUFU + polynomial), row sum, "
                  "P to TMEM over S; posts rescale factors to the mailbox")]
    if q_stage == 2:
        roles.append(Role("softmax1", (4, 5, 6, 7), r["softmax"],
                          "Q stage 1: the same on S1/P1, ping-ponging with softmax0"))
    roles += [
        Role("correction", (8, 9, 10, 11), r["correction"],
             "rescales O_i in TMEM when a row max grew past the threshold; epilogue: O_i / "
             "row_sum to SMEM, LSE to global"),
        Role("mma", (12,), r["other"], "one thread issues every tcgen05.mma and tcgen05.commit"),
        Role("load", (13,), r["other"], "TMA loads of Q tiles and the K/V ring"),
        Role("epilogue", (14,), r["other"], "TMA store of O from SMEM, waits until drained"),
        Role("empty", (15,), r["other"], "no work; holds the warpgroup's register count"),
    ]
    if q_stage == 1:
        roles.append(Role("empty_idle", (4, 5, 6, 7), r["idle"],
                          "the second softmax warpgroup, idle with one Q tile: its registers go "
                          "to the MMA warp's warpgroup"))
    return tuple(roles)


def build_sm100(spec, m_block=M_BLOCK, n_block=None, q_stage=None, kv_stage=None,
                pack_gqa: bool = False, persistent: bool | None = None) -> Plan:
    hw = B200
    d, dv = spec.head_dim, spec.head_dim_v
    if d != dv and (d, dv) not in SM100_TUNING:
        raise PlanError(unsupported_head_dims("sm100", d, dv) + "; the planner plans "
                        "head_dim_v == head_dim, a multiple of 16 up to 256, besides these")
    if d % 16 or not 16 <= d <= 256:
        raise PlanError(f"head_dim {d} must be a multiple of 16 in [16, 256] (MMA K step 16)")
    tuning = SM100_TUNING.get((d, dv), DEFAULT_TUNING)
    if n_block is None:
        n_block = key_block_for_pages(tuning.n_block, spec.page_size, S_CHUNK,
                                      min_gather_page(spec.head_dim, spec.head_dim_v))
    q_stage = tuning.q_stage if q_stage is None else q_stage
    kv_stage = tuning.kv_stage if kv_stage is None else kv_stage
    if m_block != M_BLOCK:
        raise PlanError(f"m_block={m_block}: sm100 plans use m_block 128 (one TMEM lane per "
                        f"query row; each softmax warp owns 32 lanes)")
    if q_stage not in (1, 2):
        raise PlanError(f"q_stage={q_stage}: use 1 or 2 (two softmax warpgroups at most)")
    if n_block % S_CHUNK or not S_CHUNK <= n_block <= 256:
        raise PlanError(f"n_block={n_block} must be a multiple of {S_CHUNK} in [{S_CHUNK}, 256]: "
                        f"tcgen05 N is a multiple of 16 up to 256, and the softmax moves S and P "
                        f"between TMEM and registers {S_CHUNK} columns at a time")
    if kv_stage < 2:
        raise PlanError(f"kv_stage={kv_stage}: the K/V ring needs >= 2 buffers (K and V of "
                        f"one block)")
    persistent = persistent_plan(q_stage, tuning.o_in_q, persistent)
    tiles = Tiles(m_block, n_block, q_stage, kv_stage, d, dv,
                  pack_gqa=check_pack_gqa(spec, m_block, pack_gqa, "sm100"),
                  order=kernel_tile_order(spec.causal, "sm100", persistent))
    need = n_block + SOFTMAX_REG_OVERHEAD
    if need > REGISTERS["softmax"]:
        raise PlanError(f"n_block={n_block}: a softmax thread holds its row of S ({n_block} "
                        f"registers) + ~{SOFTMAX_REG_OVERHEAD} = {need} > setmaxnreg "
                        f"{REGISTERS['softmax']}; use n_block <= "
                        f"{REGISTERS['softmax'] - SOFTMAX_REG_OVERHEAD}")
    tmem = build_tmem(spec, tiles, hw.tmem_columns)
    eb = spec.element_bytes
    roles = build_roles(q_stage)
    check_roles(roles, hw.registers_per_sm)
    barriers = build_barriers(tiles, eb, roles, persistent)
    regions = (   # the kernel's shared-storage struct declares them in this order
        SmemRegion("q", m_block * d * eb, q_stage, what="Q tiles, one per Q stage"),
        SmemRegion("kv", n_block * max(d, dv) * eb, kv_stage,
                   what="K/V ring: K_j and V_j take turns in the same buffers"),
        SmemRegion("o", m_block * dv * eb, q_stage, alias_of="q" if tuning.o_in_q else None,
                   what="O staging for the TMA store" + (" (in Q's bytes)" if tuning.o_in_q
                                                         else "")),
        SmemRegion("stats", m_block * 2 * ELEMENT_BYTES["fp32"], q_stage, align=16,
                   what="softmax -> correction mailbox: rescale factor and row sum per row"),
        SmemRegion("barriers", MBARRIER_BYTES, barriers.mbarrier_count, align=8,
                   what="mbarriers"),
        SmemRegion("tmem_ptr", 4, 1, align=4, what="TMEM base address from tcgen05.alloc"),
    )
    smem = SmemPlan.build(regions, hw.smem_per_cta)
    mmas = (
        MmaPlan("score", m_block, n_block, d, spec.dtype, spec.dtype, "fp32", "smem", "smem",
                "tmem", f"tcgen05.mma.cta_group::1.kind::f16 M{m_block} N{n_block} K16"),
        MmaPlan("value", m_block, dv, n_block, spec.dtype, spec.dtype, "fp32", "tmem", "smem",
                "tmem", f"tcgen05.mma.cta_group::1.kind::f16 M{m_block} N{dv} K16 (A=P in TMEM)"),
    )
    notes = (
        "K and V share one ring of kv_stage buffers, loaded from the last block down: "
        "K_N-1, V_N-1, K_N-2, V_N-2, ... (the masked blocks first).",
        "The MMA warp issues, per Q stage i and block step j: O_i += P_i V_j-1, then "
        "S_i = Q_i K_j; tcgen05 MMAs complete in order, so S_i never overwrites P_i before it "
        "is read.",
        (f"Persistent: min(work tiles, {hw.num_sms} SMs) CTAs, each looping over linear "
         f"tiles c, c + gridDim.x, ... in {tiles.order!r} order; pipeline phases run on across "
         f"tiles, and the next tile's loads overlap this one's epilogue (Note [persistent "
         f"CTAs])." if persistent else
         "One work tile per CTA (not persistent: Note [persistent CTAs] says which plans "
         "are): q_empty and o_empty are waited once, on their released first phase."),
        *((f"The softmax hands P_i to the value MMA in two parts: p_part once its first "
           f"{p_split(tiles)} keys are in TMEM, p_ready once all {n_block} are; the MMA "
           f"starts O_i += P_i V_j on the first part while the softmax computes the rest "
           f"(Note [split P hand-off]).",) if p_split(tiles) else ()),
        f"exp2_emulation_fraction balances MUFU ({hw.exp2_per_cycle}/cycle) against FMA "
        f"({hw.fma_per_cycle}/cycle) under fa4lab.plan.costs' instruction counts "
        f"({balanced_exp2_fraction(hw):g}), at most {SM100_EXP2_FRACTION_MAX:g} "
        f"(limits.SM100_EXP2_FRACTION_MAX: the softmax's registers).",
    ) + pack_gqa_notes(spec, tiles)
    return Plan(spec, "sm100", hw, tiles, mmas, tmem, smem, roles,
                build_protocol(barriers, q_stage, persistent), RESCALE_THRESHOLDS["sm100"],
                min(balanced_exp2_fraction(hw), SM100_EXP2_FRACTION_MAX), notes)


# ---- role programs for the protocol simulator (fa4lab.plan.simulate) ----
def programs(plan: Plan, n_blocks: int, n_tiles: int, costs, masked_blocks: int = 0):
    """Each role's simulator ops over a CTA's `n_tiles` work tiles (1 unless the plan is
    persistent: Note [persistent CTAs]): the protocol table, expanded
    (`fa4lab.plan.protocol.expand`), with the costs and regions of each step from `_steps`."""
    catalogue = _steps(plan, costs, n_blocks)
    proto, q = plan.protocol, plan.tiles.q_stage
    return {role: expand(proto, role, plan.role(role).threads, n_blocks, masked_blocks, q,
                         catalogue, n_tiles) for role in proto.roles()}


def _steps(plan: Plan, costs, n_blocks: int):
    """Step name -> simulator ops (labels "S{i}=Q{i}K{j}", "O{i}+=P{i}V{j}", "K{j}", ...: j is
    the K/V block index, block N - 1 - step)."""
    from fa4lab.plan.steps import Issue, Ref, WaitEngine, Work

    hw, t_, tm = plan.hardware, plan.tiles, plan.tmem
    m, n, d, dv = t_.m_block, t_.n_block, t_.head_dim, t_.head_dim_v
    eb, acc_b = plan.spec.element_bytes, ELEMENT_BYTES["fp32"]   # inputs, P; S and O (fp32)
    f = plan.exp2_emulation_fraction
    kv = plan.barriers.barrier("kv_full")
    q_bytes, o_bytes = m * d * eb, m * dv * acc_b
    kv_bytes = {"K": n * d * eb, "V": n * dv * eb}
    qk = costs.mma_op_cycles(hw, plan.mma("score"))
    pv = costs.mma_op_cycles(hw, plan.mma("value"))
    rescale_at = costs.rescale_blocks(n_blocks)
    capped = bool(plan.spec.softcap)   # the softmax also pays the cap (CostModel)
    pp = t_.q_stage == 1               # Note [S ping-pong]: S buffer j % 2, not the Q tile's

    def tref(name, i):
        r = tm.region(name, i)
        return Ref("tmem", name, i, r.col_offset, r.col_end)

    split = p_split(t_)     # Note [split P hand-off]

    def keys(w):
        """(step, first key, end key): "exp2 part" covers keys [0, split), "... rest" the
        others, a step without a part all n."""
        if w.endswith(" part"):
            return w[:-5], 0, split
        if w.endswith(" rest"):
            return w[:-5], split, n
        return w, 0, n

    def pref(i, lo, hi):
        """P_i's TMEM columns holding keys [lo, hi): 16-bit, so two keys per column."""
        c = tm.region("P", i).col_offset
        return Ref("tmem", "P", i, c + lo * eb // acc_b, c + hi * eb // acc_b)

    o_region = plan.smem.region("o")

    def sref(name, i):
        if name == "o" and o_region.alias_of:   # O_i staged in Q_i's bytes (SmemPlan)
            name = o_region.alias_of
        return Ref("smem", name, i)

    def ring(stage, env):
        """(buffer, block index) of ring slot `stage` at the env's block step."""
        delta = int(stage[1:] or 0)
        return (ring_slot(kv, stage, env["j"], env["N"], env["t"])[0],
                env["N"] - 1 - (env["j"] + delta))

    def load(what, nbytes, stage, env):
        buf, blk = ring(stage, env)
        return [Issue("tma", f"{what}{blk}", costs.tma_cycles(nbytes), writes=(sref("kv", buf),),
                      complete_tx=("kv_full", buf, nbytes))]

    def step(s, env, stage):
        i = env.get("i", 0)
        w, lo, hi = keys(s.what)
        part = f" keys {lo}-{hi - 1}" if hi - lo < n else ""
        if w == "load Q":
            return [Issue("tma", f"Q{i}", costs.tma_cycles(q_bytes), writes=(sref("q", i),),
                          complete_tx=("q_full", i, q_bytes))]
        if w in ("load K", "load V"):
            return load(w[-1], kv_bytes[w[-1]], stage, env)
        if w == "QK":
            buf, blk = ring(stage, env)
            sb = (env["j"] + int(stage[1:] or 0)) % 2 if pp else i
            return [Issue("tensor", f"S{sb}=Q{i}K{blk}", qk,
                          reads=(sref("q", i), sref("kv", buf)), writes=(tref("S", sb),))]
        if w == "PV":
            buf, blk = ring(stage, env)
            pb = env["j"] % 2 if pp else i
            o_reads = (tref("O", i),) if env["j"] > 0 or lo > 0 else ()
            return [Issue("tensor", f"O{i}+=P{pb}V{blk}{part}", pv * (hi - lo) / n,
                          reads=(pref(pb, lo, hi), sref("kv", buf)) + o_reads,
                          writes=(tref("O", i),))]
        if w == "alloc TMEM":
            return [Work("alloc TMEM", 0, writes=(sref("tmem_ptr", 0),))]
        if w == "TMEM address":
            return [Work("TMEM address", 0, reads=(sref("tmem_ptr", 0),))]
        if w == "free TMEM":
            return [Work("free TMEM", 0, writes=(Ref("tmem", "all", 0, 0, tm.total_cols),))]
        if w == "ld S":
            return [Work(f"ld S{stage}", costs.tmem_cycles(m * n * acc_b),
                         reads=(tref("S", stage),))]
        if w in ("post scale", "post row sum"):
            return [Work(w, 8, writes=(sref("stats", i),))]
        if w == "exp2":
            def exp2(a, b):
                return costs.softmax_cycles(hw, m * (b - a), f, env["tag"] == "masked", capped)
            # The first part keeps the MUFU for the rest, as one pass (its stores between).
            hold = exp2(split, n) + costs.tmem_cycles(m * split * eb) if hi < n else 0.0
            return [Work(f"exp2 S{i}{part}", exp2(lo, hi), unit="mufu", hold=hold)]
        if w == "st P":
            return [Work(f"st P{stage}{part}", costs.tmem_cycles(m * (hi - lo) * eb),
                         writes=(pref(stage, lo, hi),))]
        if w in ("read scale", "read row sum"):
            return [Work(w, 8, reads=(sref("stats", i),))]
        if w == "rescale O":   # the kernel rescales when a row max moved: costs' rate
            if env["j"] not in rescale_at:
                return []
            cycles = costs.tmem_cycles(2 * o_bytes) + m * dv / hw.fma_per_cycle
            return [Work(f"rescale O{i}", cycles, reads=(tref("O", i),), writes=(tref("O", i),))]
        if w == "ld O":
            return [Work(f"ld O{i}, / row sum",
                         costs.tmem_cycles(o_bytes) + m * dv / hw.fma_per_cycle,
                         reads=(tref("O", i),))]
        if w == "O to SMEM":
            return [Work(f"O{i} to SMEM", costs.smem_cycles(hw, m * dv * eb),
                         writes=(sref("o", i),))]
        if w == "store O":
            return [Issue("tma_store", f"store O{i}", costs.tma_cycles(m * dv * eb),
                          reads=(sref("o", i),))]
        if w == "drain store":   # wait_group.read q - 1 - i: Note [store drains]
            return [WaitEngine("tma_store", pending=t_.q_stage - 1 - stage)]
        raise KeyError(f"no simulator step {w!r}")

    return step
