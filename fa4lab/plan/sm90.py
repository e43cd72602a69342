"""The Hopper (sm90) plan: the same design with S, P and O in registers (FA3-style).

One producer warpgroup (warp 0 issues the TMA loads; the group gives its registers away with
setmaxnreg) and two or three consumer warpgroups, each owning one Q tile of 64 rows (wgmma
M = 64). The consumers take turns at the tensor core through one named barrier each (the
ping-pong, a ring with three): while one issues its wgmmas the others run their softmax. No
TMEM: `plan.tmem` is None.

The tuning numbers live in the single table `SM90_TUNING` below, keyed by (head_dim,
head_dim_v); the sm90 kernel reads them only through the plan. Supported: the pairs of
`fa4lab.limits.KERNEL_HEAD_DIMS["sm90"]`, one table row each.

`pack_gqa=True` (see Note [sm90 pack-GQA]) makes a CTA's rows the packed rows of one KV head.
"""

from __future__ import annotations

from dataclasses import dataclass

from fa4lab.errors import PlanError
from fa4lab.hardware import H200
from fa4lab.limits import (
    Q_TILE_ROWS,
    RESCALE_THRESHOLDS,
    cp_async_row_threads,
    cp_async_rows_per_pass,
    kernel_builds,
    key_block_for_pages,
    page_loader,
    small_pages_by_cp_async,
    unsupported_head_dims,
)
from fa4lab.plan.barriers import PHASE_EMPTY, PHASE_FULL, PHASE_NAMED, Barrier, BarrierGraph
from fa4lab.plan.plan import Plan
from fa4lab.plan.protocol import If, Loop, Op, Program, Protocol, Step, TileLoop, Unroll, expand
from fa4lab.plan.roles import Role, check_roles
from fa4lab.plan.smem import MBARRIER_BYTES, SmemPlan, SmemRegion
from fa4lab.plan.tiles import MmaPlan, Tiles, check_pack_gqa, pack_gqa_notes
from fa4lab.scheduling import kernel_tile_order


@dataclass(frozen=True)
class Sm90Tuning:
    n_block: int
    kv_stage: int
    q_stage: int               # consumer warpgroups (64 query rows each)
    o_in_q: bool               # stage O for the TMA store in Q's SMEM (Q is dead by then)


# Note [sm90 tuning table]
# The only numbers of the Hopper plan that are choices rather than consequences. head_dim 64
# runs three consumers (a 192-row CTA, as upstream FA4's Hopper path does): its per-block
# GEMMs are short, so a third warpgroup's softmax is needed to keep the tensor core fed, and
# its small accumulators fit the 160 registers three consumers leave each thread. head_dim 96
# keeps two: upstream FA4 runs it with three (192 rows) only by passing P through SMEM, since P
# and O in registers do not fit three consumers' 160 (consumer_registers_needed: 176). (192, 128)
# takes 128-key blocks with O staged in Q's bytes, as upstream does (Q, two K and two V buffers:
# 214,016 bytes): 112-key blocks fit O beside Q, but each block's fixed work (barriers, waits,
# row statistics) is then spread over 12.5% fewer keys, and ptxas gave the steady loop 518
# instructions per 112 keys against 514 per 128. Measured on the H200
# (benchmarks/2026-12-04_nvidia-h200_sm90-tuning.txt, 16 heads, bf16, FA4 in the same process):
# 112 -> 128 keys took causal s4096 b4 from 0.79x to 0.89x FA4, s8192 b2 from 0.87x to 0.96x,
# non-causal s4096 b4 from 0.91x to 0.97x (no longer persistent: below). See Note [head dims 96
# and 192/128].
SM90_TUNING = {
    (64, 64): Sm90Tuning(n_block=128, kv_stage=2, q_stage=3, o_in_q=False),
    (96, 96): Sm90Tuning(n_block=128, kv_stage=2, q_stage=2, o_in_q=False),
    (128, 128): Sm90Tuning(n_block=128, kv_stage=2, q_stage=2, o_in_q=False),
    (192, 128): Sm90Tuning(n_block=128, kv_stage=2, q_stage=2, o_in_q=True),
    (256, 256): Sm90Tuning(n_block=80, kv_stage=2, q_stage=2, o_in_q=True),
}
# setmaxnreg (producer, each consumer) by consumer count. Each pair keeps
# 128 * producer + 128 * consumers * consumer <= 65536 (the SM's register file, one CTA per SM)
# and is a multiple of 8, as setmaxnreg needs.
SM90_REGISTERS = {1: (24, 240), 2: (24, 240), 3: (32, 160)}
# With a cp.async producer (Note [cp.async pages] in fa4lab.limits) every producer thread holds
# a row's page, its addresses and the copy loop: upstream FA4 moves two consumers' split to
# (40, 224) for it; three consumers keep (32, 160), as upstream's do.
SM90_CP_ASYNC_REGISTERS = {1: (56, 240), 2: (40, 224), 3: (32, 160)}


def role_registers(q_stage: int, kv_load: str = "tma") -> tuple[int, int]:
    """setmaxnreg (producer, each consumer) of a plan with `q_stage` consumers whose producer
    loads K/V by `kv_load` ("tma" or "cp.async")."""
    table = SM90_CP_ASYNC_REGISTERS if kv_load == "cp.async" else SM90_REGISTERS
    return table[q_stage]


def kernel_registers(plan) -> tuple[int, int]:
    """setmaxnreg values the sm90 kernel reads from a built plan's roles: (producer "load",
    consumers).

    Both consumer warpgroups run the same code after one `setmaxnreg.inc`: ptxas allocates the
    consumer code for that single budget (one increase per consumer in separate branches would
    leave the shared code under the launch budget and spill), so the plan must give every
    consumer role the same count.
    """
    producer = plan.role("load").registers
    consumers = {plan.role(f"consumer{i}").registers for i in range(plan.tiles.q_stage)}
    if len(consumers) != 1:
        raise ValueError(f"the sm90 kernel needs one register budget for all consumer roles, "
                         f"the plan has {sorted(consumers)}")
    return producer, consumers.pop()


M_BLOCK = Q_TILE_ROWS["sm90"]  # wgmma M: one consumer warpgroup's Q tile
# Besides O (head_dim_v / 2 fp32 per thread), S (n_block / 2) and P (n_block / 4 packed
# pairs), a consumer thread needs about this many registers for addresses, row statistics and
# loop state (ptxas's count for the head_dim 64 three-consumer kernel: 160 with no spills).
CONSUMER_REG_OVERHEAD = 32
# Named barriers (0 is __syncthreads): each consumer's epilogue, then the ping-pong turns,
# with room for three consumers each.
MAX_CONSUMERS = 3
EPILOGUE_BARRIER_ID = 1
TURN_BARRIER_ID = EPILOGUE_BARRIER_ID + MAX_CONSUMERS


# Note [sm90 pack-GQA]
# With pack_gqa the qhead_per_kvhead (g) query heads of a KV head share one CTA: its M rows are
# packed rows (position * g + head within the group, Note [pack-GQA rows] in fa4lab.gqa), so
# the grid has heads_kv columns and ceil(seqlen_q * g / cta_m) row tiles, and K/V are loaded once
# per group instead of g times (what decode and short seqlen_q need). The kernel keeps TMA for
# Q and O: a 64-row tile is a (g, 64 / g) box over (head, position), which needs g to divide
# m_block; the SMEM, barriers and MMAs are the same as without packing. With g == 1 there is
# nothing to pack, and the plan records pack_gqa=False.


# Note [sm90 persistent CTAs]
# A persistent sm90 plan launches min(work tiles, SMs) CTAs; CTA c runs linear tiles c,
# c + gridDim.x, ... in the plan's order (`fa4lab.scheduling.persistent_tiles` and `tile_at`, as on
# sm100: Note [persistent CTAs] in fa4lab.plan.sm100). What changes against one CTA per tile:
#   * Q is loaded once per tile into the same bytes, so it needs q_empty: each consumer thread
#     arrives once its last score wgmma of the tile has completed (after the block loop; the
#     last value wgmma still runs), and the producer waits for it before the next tile's Q.
#     The producer's K and V of the next tile only wait for their ring slots, so they load
#     while the consumers finish the tile (last value wgmma, normalisation, epilogue).
#   * O staging is reused: before a consumer's warps write the next tile's O to SMEM, its
#     first warp waits until the last TMA store has read them (`cp.async.bulk.wait_group.read`,
#     deferred from the store to here so the store runs under the next tile) and syncs
#     epilogue{c} once more. O in Q's bytes (head_dim 256) would need the store to finish
#     before the next Q lands; that plan stays one CTA per tile.
#   * The ping-pong ring runs on across tiles: the last consumer's opening pass and consumer0's
#     closing sync happen once per CTA, not per tile (a pass per tile would let the last
#     consumer arrive twice on mma_turn0 before consumer0 syncs once, completing the named
#     barrier with one warpgroup's threads).
# Barriers are initialised once and the pipeline phases run on from tile to tile; each tile's
# consumer state (row max and sum, O, the row limits) starts afresh.
# The default (`persistent_default`) is what the H200 measured, both kernels and upstream FA4
# in one run (benchmarks/2026-12-01_nvidia-h200_5db14f9_042927.json and the _decode record of
# the LLM shapes beside it, bf16): persistent where the attention is not causal, where every
# tile costs the same and the static order loses nothing (persistent / one CTA per tile over
# the 20 non-causal sweep points: geometric mean 1.014, 0.996 to 1.057, the gain at seqlen
# 1024, where a CTA's start weighs most); one CTA per tile for causal attention (0.968, 0.902
# to 1.037: hd128 s4096-16384 lose 10%, the 3000-token LLM shape 5%). Causal tiles differ in
# length, and CTA c taking tiles c, c + 132, ... of the LPT order in turn balances them worse
# than the hardware handing each next tile to the first SM that frees, which a grid of one
# CTA per tile gets for free; a persistent causal kernel would need a dynamic scheduler (an
# atomic tile counter), as FA3's Hopper kernel has. A ragged batch (varlen, or a paged cache
# whose sequences use different key counts) has unequal tiles for the same reason, so it too
# runs one CTA per tile (`persistent_default(..., ragged=True)`). hd256 stages O in Q's bytes:
# one CTA per tile (above).
def persistent_able(tuning: Sm90Tuning) -> bool:
    """Whether a plan with this tuning can run persistent CTAs (Note [sm90 persistent CTAs])."""
    return not tuning.o_in_q


def persistent_default(head_dim: int, head_dim_v: int, causal: bool, seqlen_q: int,
                       seqlen_k: int, ragged: bool = False) -> bool:
    """Whether an sm90 plan of this shape is persistent when not told: where it can be and
    every tile costs the same, that is the attention is not causal and the batch's sequences
    are not ragged (varlen, or a paged cache with per-sequence key counts) (measured: Note
    [sm90 persistent CTAs]: a static tile order balances unequal tiles worse than the hardware
    handing each next CTA to the first free SM); also what `fa4lab.attention` compiles for a
    call of this shape. The sizes are not used (yet): the measurement found no seqlen where the
    choice turns."""
    tuning = SM90_TUNING.get((head_dim, head_dim_v))
    return tuning is not None and persistent_able(tuning) and not causal and not ragged


def consumer_registers_needed(n_block: int, head_dim_v: int) -> int:
    return head_dim_v // 2 + n_block // 2 + n_block // 4 + CONSUMER_REG_OVERHEAD


def build_barriers(tiles: Tiles, eb: int, persistent: bool = False) -> BarrierGraph:
    """The mbarriers and named barriers; `eb` is the bytes per element of Q, K and V. With a
    cp.async producer (`tiles.kv_load`) k_full / v_full take one arrival per producer thread
    once its copies landed, and no transaction bytes."""
    q, kv = tiles.q_stage, tiles.kv_stage
    consumers = ",".join(f"consumer{i}" for i in range(q))
    threads = 128 * q
    cp_async = tiles.kv_load == "cp.async"
    # (arrivals, bytes, what lands) of a K / V slot's full side
    k_in = (128, 0, "every producer thread's cp.async rows of K_j") if cp_async else (
        1, tiles.n_block * tiles.head_dim * eb, "K_j")
    v_in = (128, 0, "every producer thread's cp.async rows of V_j") if cp_async else (
        1, tiles.n_block * tiles.head_dim_v * eb, "V_j")
    b = [
        Barrier("q_full", "load", consumers, 1, 1, tiles.cta_m * tiles.head_dim * eb, PHASE_FULL,
                "the CTA's Q rows (both consumers' tiles, one TMA) landed before any wgmma "
                "reads them"),
    ]
    if persistent:   # Note [sm90 persistent CTAs]
        b.append(Barrier("q_empty", consumers, "load", threads, 1, 0, PHASE_EMPTY,
                         "every consumer's last score wgmma of the work tile completed before "
                         "TMA loads the next tile's Q over it", starts_released=True))
    b += [
        Barrier("k_full", "load", consumers, k_in[0], kv, k_in[1], PHASE_FULL,
                f"{k_in[2]} landed in its buffer before the score wgmma reads it", ring="k"),
        Barrier("k_empty", consumers, "load", threads, kv, 0, PHASE_EMPTY,
                "every consumer finished the score wgmma on K_j before TMA refills the buffer",
                starts_released=True, ring="k"),
        Barrier("v_full", "load", consumers, v_in[0], kv, v_in[1], PHASE_FULL,
                f"{v_in[2]} landed before the value wgmma reads it", ring="v"),
        Barrier("v_empty", consumers, "load", threads, kv, 0, PHASE_EMPTY,
                "every consumer finished the value wgmma on V_j before TMA refills the buffer",
                starts_released=True, ring="v"),
    ]
    for i in range(q):
        b.append(Barrier(
            f"epilogue{i}", f"consumer{i}", f"consumer{i}", 128, 1, 0, PHASE_NAMED,
            f"consumer{i}'s four warps wrote their O rows to SMEM (and fenced) before its "
            f"first warp issues the TMA store" + (
                "; and, before they write the next tile's, that warp saw the last store read "
                "them" if persistent else ""), kind="named", group="named",
            named_id=EPILOGUE_BARRIER_ID + i))
    if q >= 2:
        for i in range(q):
            prev = (i - 1) % q
            b.append(Barrier(
                f"mma_turn{i}", f"consumer{prev}", f"consumer{i}", 256, 1, 0, PHASE_NAMED,
                f"consumer{i} issues its wgmmas only after consumer{prev} finished issuing "
                f"its own (warp-scheduler ping-pong: softmax overlaps the others' GEMMs)",
                kind="named", group="named", named_id=TURN_BARRIER_ID + i))
    return BarrierGraph(tuple(b))


def build_roles(tiles: Tiles) -> tuple[Role, ...]:
    producer_regs, consumer_regs = role_registers(tiles.q_stage, tiles.kv_load)
    what = ("producer warpgroup: warp 0 issues the TMA load of Q; all four warps copy K and V "
            "row by row with cp.async (Note [cp.async pages])" if tiles.kv_load == "cp.async"
            else "producer warpgroup: warp 0 issues the TMA loads of Q, K, V; warps 1-3 idle")
    roles = [Role("load", (0, 1, 2, 3), producer_regs, what)]
    for i in range(tiles.q_stage):
        roles.append(Role(f"consumer{i}", tuple(range(4 + 4 * i, 8 + 4 * i)),
                          consumer_regs,
                          f"Q rows {64 * i}-{64 * i + 63}: wgmma S = Q K^T, softmax in registers "
                          f"(rescale O when needed), wgmma O += P V, epilogue and TMA store"))
    return tuple(roles)


def build_sm90(spec, m_block=M_BLOCK, n_block=None, q_stage=None, kv_stage=None,
               pack_gqa: bool = False, persistent: bool | None = None) -> Plan:
    hw = H200
    d, dv = spec.head_dim, spec.head_dim_v
    if not kernel_builds("sm90", d, dv):
        raise PlanError(unsupported_head_dims("sm90", d, dv))
    tuning = SM90_TUNING[(d, dv)]
    if n_block is None:   # pages a TMA read fits take it (Note [cp.async pages])
        n_block = tuning.n_block
        if not small_pages_by_cp_async("sm90", spec.page_size):
            n_block = key_block_for_pages(n_block, spec.page_size)
    kv_stage = tuning.kv_stage if kv_stage is None else kv_stage
    # Packed or not, a plan keeps its tuning's consumers (Note [sm90 packs head_dim 64] in
    # fa4lab.limits).
    q_stage = tuning.q_stage if q_stage is None else q_stage
    if m_block != M_BLOCK:
        raise PlanError(f"m_block={m_block}: sm90 consumers own 64 rows each (wgmma M = 64)")
    if q_stage not in SM90_REGISTERS:
        raise PlanError(f"q_stage={q_stage}: 1, 2 or 3 consumer warpgroups (4 warpgroups, 512 "
                        f"threads, is the most one CTA can run with registers to spare)")
    if n_block % 16 or not 16 <= n_block <= 256:
        raise PlanError(f"n_block={n_block} must be a multiple of 16 in [16, 256] (wgmma N, "
                        f"and K of the value wgmma)")
    if kv_stage < 1:
        raise PlanError(f"kv_stage={kv_stage} must be >= 1")
    if persistent and not persistent_able(tuning):
        raise PlanError(f"persistent=True: head_dim {d} stages O in Q's bytes, so the next "
                        f"tile's Q would have to wait for the store (Note [sm90 persistent "
                        f"CTAs] in fa4lab.plan.sm90)")
    if persistent is None:
        persistent = persistent_default(d, dv, spec.causal, spec.seqlen_q, spec.seqlen_k)
    kv_load = page_loader("sm90", spec.page_size, n_block)
    rows, passes = cp_async_rows_per_pass(d, dv), cp_async_row_threads(d, dv)
    if kv_load == "cp.async" and (n_block % rows or n_block > rows * passes):
        raise PlanError(f"n_block={n_block}: a cp.async producer copies {rows} rows per pass "
                        f"at head dims ({d}, {dv}), at most {passes} passes a block (one page "
                        f"index per thread: Note [cp.async gather] in "
                        f"fa4lab.kernels.device.page_rows); take a multiple of {rows} up to "
                        f"{rows * passes}")
    tiles = Tiles(m_block, n_block, q_stage, kv_stage, d, dv,
                  pack_gqa=check_pack_gqa(spec, m_block, pack_gqa, "sm90"),
                  order=kernel_tile_order(spec.causal, "sm90"), kv_load=kv_load)
    need = consumer_registers_needed(n_block, dv)
    consumer_regs = role_registers(q_stage, kv_load)[1]
    if need > consumer_regs:
        raise PlanError(
            f"registers: a consumer thread holds O ({dv // 2}), S ({n_block // 2}), P "
            f"({n_block // 4}) + ~{CONSUMER_REG_OVERHEAD} = {need} > setmaxnreg "
            f"{consumer_regs} with {q_stage} consumers; lower n_block or q_stage")
    eb = spec.element_bytes
    barriers = build_barriers(tiles, eb, persistent)
    q_region = SmemRegion("q", m_block * d * eb, q_stage, what="Q tile per consumer")
    regions = [
        q_region,
        SmemRegion("k", n_block * d * eb, kv_stage, what="K ring"),
        SmemRegion("v", n_block * dv * eb, kv_stage, what="V ring"),
        SmemRegion("o", m_block * dv * eb, q_stage, alias_of="q" if tuning.o_in_q else None,
                   what="O staging for the TMA store" + (" (in Q's bytes)" if tuning.o_in_q
                                                         else "")),
        SmemRegion("barriers", MBARRIER_BYTES, barriers.mbarrier_count, align=8,
                   what="mbarriers"),
    ]
    smem = SmemPlan.build(tuple(regions), hw.smem_per_cta)
    roles = build_roles(tiles)
    check_roles(roles, hw.registers_per_sm)
    mmas = (
        MmaPlan("score", m_block, n_block, d, spec.dtype, spec.dtype, "fp32", "smem", "smem",
                "rmem", f"wgmma.mma_async m64n{n_block}k16 (SS)"),
        MmaPlan("value", m_block, dv, n_block, spec.dtype, spec.dtype, "fp32", "rmem", "smem",
                "rmem", f"wgmma.mma_async m64n{dv}k16 (RS: P from registers)"),
    )
    notes = (
        (f"Persistent CTAs (min(work tiles, {hw.num_sms}) CTAs looping over tiles): q_empty "
         f"orders a CTA's tiles, and the next tile's K/V load under this one's epilogue (Note "
         f"[sm90 persistent CTAs])." if persistent else
         "One work tile per CTA (not persistent): Q is loaded once, so it needs no empty "
         "barrier."),
        "The ping-pong named barriers order the consumers' wgmma issue; the simulator "
        "treats the tensor-core turn as a region both write, so a missing turn is a hazard.",
        "exp2 runs on MUFU only (no polynomial emulation on Hopper).",
    ) + pack_gqa_notes(spec, tiles)
    if kv_load == "cp.async":
        notes += (f"Pages of {spec.page_size} keys: the producer warpgroup's 128 threads copy "
                  f"K and V rows with cp.async, {cp_async_rows_per_pass(d, dv)} rows per pass, "
                  f"each row from its own page; k_full / v_full count one arrival per thread "
                  f"(cp.async.mbarrier.arrive.noinc) and no bytes (Note [cp.async pages]).",)
    return Plan(spec, "sm90", hw, tiles, mmas, None, smem, roles,
                build_protocol(barriers, q_stage, persistent, kv_load),
                RESCALE_THRESHOLDS["sm90"], 0.0, notes)


# ---- the protocol table (fa4lab.plan.protocol): FlashForwardSm90, op by op ----
def build_protocol(barriers: BarrierGraph, q_stage: int, persistent: bool = False,
                   kv_load: str = "tma") -> Protocol:
    """The producer warp and the consumers' shared code in the order fwd_sm90.py runs them: per
    work tile, in a loop over the CTA's tiles when `persistent` (Note [sm90 persistent CTAs]).

    Loads run K_last, then (K_j+1, V_j) pairs, then V_first. A consumer's block step waits
    for K, takes its turn, issues S = Q K^T, waits for V, issues O += P V, passes the turn;
    the ring's last consumer also passes once at the start so consumer0 goes first. It
    passes N + 1 times and consumer0 takes N turns in the loop, so consumer0 takes the last pass
    once more after its last value wgmma: no arrival is left on a barrier at exit. The last
    block's value wgmma is issued without a turn. The turn and epilogue barrier ids are picked
    per consumer in unrolled branches (`Unroll` over t). A persistent CTA passes first and
    takes the last pass once, around its tile loop.

    With `kv_load` "cp.async" (Note [cp.async pages]) a K or V slot is waited for, copied by
    every producer thread, then each thread's cp.async arrival is armed on its full side (no
    expect_tx: the barrier counts threads, not bytes).
    """
    E = Op   # noqa: N806

    def tiles(*body) -> tuple:   # the CTA's work tiles: Note [sm90 persistent CTAs]
        return (TileLoop(body),) if persistent else body

    def fill(x: str, slot: str) -> tuple:   # one K or V slot: wait, arm, copy (or copy, arrive)
        empty, full = f"{x.lower()}_empty", f"{x.lower()}_full"
        if kv_load == "cp.async":
            return (E("wait", empty, slot), Step(f"load {x}", slot),
                    E("cp_async_arrive", full, slot))
        return (E("wait", empty, slot), E("expect_tx", full, slot, one=True),
                Step(f"load {x}", slot))
    load = tiles(*((E("wait", "q_empty", "0"),) if persistent else ()),
                 E("expect_tx", "q_full", "0", one=True), Step("load Q"),
                 *fill("K", "K"),
                 Loop("N - 1", (*fill("K", "K+1"), *fill("V", "V"))),
                 *fill("V", "V"))
    pingpong = q_stage >= 2
    take = (Unroll("t", "q", (If("c == t", (E("sync", "mma_turn{t}"),)),)),) if pingpong else ()
    give = ((Unroll("t", "q", (If("c == t", (E("named_arrive", "mma_turn{(t + 1) % q}"),)),)),)
            if pingpong else ())
    step = ((E("wait", "k_full", "K+1"),) + take + (Step("QK", "K+1"), E("wait", "v_full", "V"),
            Step("PV", "V")) + give + (E("arrive", "k_empty", "K+1"), Step("softmax"),
                                       E("arrive", "v_empty", "V")))
    opening = (If("c == q - 1", give),) if pingpong else ()
    closing = (If("c == 0", (E("sync", "mma_turn0"),)),) if pingpong else ()
    tile = (
        E("wait", "q_full", "0"),
        E("wait", "k_full", "K")) + take + (Step("QK", "K"),) + give + (
        E("arrive", "k_empty", "K"), Step("softmax"),
        Loop("max(M, 1) - 1", step, "masked"),
        Loop("N - max(M, 1)", step, "unmasked")) + (
        (E("arrive", "q_empty", "0"),) if persistent else ()) + (
        E("wait", "v_full", "V"), Step("last PV", "V"), E("arrive", "v_empty", "V")) + (
        () if persistent else closing)
    if persistent:   # the last store must have read O's SMEM before the next tile writes it
        tile += (Step("drain store"), E("sync", "epilogue{c}"))
    tile += (Step("O to SMEM"), E("sync", "epilogue{c}"), Step("store O"))
    consumer = opening + tiles(*tile) + (closing + (Step("drain store"),) if persistent else ())
    return Protocol(barriers, (
        Program("load", ("load",), load),
        Program("consumer", tuple(f"consumer{i}" for i in range(q_stage)), consumer, var="c",
                shared_code=True),
    ))


# ---- role programs for the protocol simulator (fa4lab.plan.simulate) ----
def programs(plan: Plan, n_blocks: int, n_tiles: int, costs, masked_blocks: int = 0):
    """The producer and the consumers over a CTA's `n_tiles` work tiles (1 unless the plan is
    persistent: Note [sm90 persistent CTAs]): the protocol table, expanded, with each step's
    costs from `_steps`. The tensor core is a region every wgmma writes ("turn"), so two
    consumers' wgmmas unordered by the ping-pong are a hazard."""
    catalogue = _steps(plan, costs, n_blocks)
    proto, q = plan.protocol, plan.tiles.q_stage
    threads = {role: plan.role(role).threads for role in proto.roles()}
    if plan.tiles.kv_load != "cp.async":
        threads["load"] = 1   # one elected thread issues every TMA
    return {role: expand(proto, role, threads[role], n_blocks, masked_blocks, q, catalogue,
                         n_tiles)
            for role in proto.roles()}


def _steps(plan: Plan, costs, n_blocks: int):
    """Step name -> simulator ops (labels "S{c}=Q{c}K{j}", "O{c}+=P{c}V{j}": j the block)."""
    from fa4lab.plan.steps import Issue, Ref, WaitEngine, Work

    hw, t_ = plan.hardware, plan.tiles
    q, S, m, n = t_.q_stage, t_.kv_stage, t_.m_block, t_.n_block
    d, dv = t_.head_dim, t_.head_dim_v
    eb = plan.spec.element_bytes
    o_region = plan.smem.region("o")
    turn = Ref("turn", "tensor-core turn", 0)
    rescale_at = costs.rescale_blocks(n_blocks)
    capped = bool(plan.spec.softcap)   # the softmax also pays the cap (CostModel)
    qk = costs.mma_op_cycles(hw, plan.mma("score"))
    pv = costs.mma_op_cycles(hw, plan.mma("value"))
    q_bytes = t_.cta_m * d * eb
    k_bytes, v_bytes = n * d * eb, n * dv * eb
    cp_async = t_.kv_load == "cp.async"

    def sref(name, i):
        if name == "o" and o_region.alias_of:
            name = o_region.alias_of
        return Ref("smem", name, i)

    def slot(stage, env):   # (buffer, block) of a ring slot: Note [ring slots]
        step = env["j"] + int(stage[1:] or 0)
        return (step + env["t"] * env["N"]) % S, env["N"] - 1 - step

    def step(s, env, stage):
        c, w = env.get("c", 0), s.what
        if w == "load Q":
            return [Issue("tma", "Q", costs.tma_cycles(q_bytes),
                          writes=tuple(sref("q", i) for i in range(q)),
                          complete_tx=("q_full", 0, q_bytes))]
        if w in ("load K", "load V"):
            buf, blk = slot(stage, env)
            name, nbytes = w[-1].lower(), (k_bytes if w[-1] == "K" else v_bytes)
            if cp_async:   # lands on the thread's cp_async_arrive (a Commit), not by bytes
                return [Issue("cpasync", f"{w[-1]}{blk}", costs.tma_cycles(nbytes),
                              writes=(sref(name, buf),))]
            return [Issue("tma", f"{w[-1]}{blk}", costs.tma_cycles(nbytes),
                          writes=(sref(name, buf),), complete_tx=(f"{name}_full", buf, nbytes))]
        if w == "QK":
            buf, blk = slot(stage, env)
            return [Work(f"S{c}=Q{c}K{blk}", qk, unit="tensor",
                         reads=(sref("q", c), sref("k", buf)), writes=(turn,))]
        if w in ("PV", "last PV"):   # the last one without the turn (see build_protocol)
            buf, blk = slot(stage, env)
            return [Work(f"O{c}+=P{c}V{blk}", pv, unit="tensor", reads=(sref("v", buf),),
                         writes=(turn,) if w == "PV" else ())]
        if w == "softmax":
            cyc = costs.softmax_cycles(hw, m * n, 0.0, env["tag"] != "unmasked", capped)
            if env["j"] in rescale_at:
                cyc += m * dv / hw.fma_per_cycle
            stall = cyc * costs.sm90_softmax_stall   # see CostModel.sm90_softmax_stall
            return [Work(f"softmax{c}", cyc - stall, unit="mufu")] + (
                [Work(f"softmax{c} stalls the tensor pipe", stall, unit="tensor")] if stall else [])
        if w == "O to SMEM":
            return [Work(f"O{c} to SMEM", costs.smem_cycles(hw, m * dv * eb),
                         writes=(sref("o", c),))]
        if w == "store O":   # a persistent consumer drains it at its next epilogue
            store = Issue("tma_store", f"store O{c}", costs.tma_cycles(m * dv * eb),
                          reads=(sref("o", c),))
            return [store] if plan.protocol.persistent else [store, WaitEngine("tma_store")]
        if w == "drain store":
            return [WaitEngine("tma_store")]
        raise KeyError(f"no simulator step {w!r}")

    return step
