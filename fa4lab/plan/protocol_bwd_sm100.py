"""The sm100 backward's protocol table (`fa4lab.plan.protocol`): its barriers, each role's
ordered program of barrier ops, and the costs and regions of each step for the simulator.

`build_protocol` follows the 1-CTA path of upstream FA4's FlashAttentionBackwardSm100
(flash_attn/cute/flash_bwd_sm100.py: `load`, `mma`, `compute_loop`, `dQacc_reduce`), pipeline
by pipeline (Note [the backward's protocol]); `programs` turns it into the simulator's ops, as
`fa4lab.plan.sm100.programs` does for the forward. `fa4lab.plan.simulate.simulate(plan)` runs
it for a timeline, deadlocks and hazards; `pair_mma_table` is the 2-CTA lesson (Note [the
backward's 2-CTA MMA]).
"""

from __future__ import annotations

from fa4lab.limits import ELEMENT_BYTES
from fa4lab.plan.barriers import PHASE_EMPTY, PHASE_FULL, PHASE_NAMED, Barrier, BarrierGraph
from fa4lab.plan.protocol import Loop, Op, Program, Protocol, Step, Unroll, expand
from fa4lab.plan.roles import Role

__all__ = ["build_barriers", "build_protocol", "programs", "pair_mma_table"]

TMEM_BARRIER_ID = 1     # named barrier of the TMEM hand-off (0 is __syncthreads)
TILE_READ_BARRIER_ID = 2  # named barrier of the compute warps' TMEM reuse (Note [tile_read])

# Note [the backward's protocol]
# One CTA, one key block, N query blocks (steps j = 0 .. N - 1). Every edge, as upstream's
# 1-CTA kernel has it (its pipeline in brackets):
#   load -> mma      kv_full (K and V, once), q_full[j % 2] [pipeline_Q], do_full [pipeline_dO]
#   load -> compute  lse_full[j % 2] [pipeline_LSE], dpsum_full [pipeline_dPsum]
#   mma -> load      q_empty[j % 2] after dK_j, the last MMA to read Q_j; do_empty after dV_j
#   compute -> load  lse_empty, dpsum_empty: the rows were read
#   mma -> compute   s_full: S^T_j in TMEM [pipeline_S_P full]; dp_full: dP^T_j [pipeline_dP
#                    full]; dkv_full[0] dV done, dkv_full[1] dK done [pipeline_dKV]
#   compute -> mma   p_ready: P_j is in TMEM over S [pipeline_S_P empty, "S -> P"]; ds_ready:
#                    dS_j is in TMEM over dP and in SMEM [pipeline_dS full]
#   mma -> compute   ds_empty: the dQ MMA has read dS_j from SMEM [pipeline_dS empty]
#   mma -> reduce    dq_full: dQ_j in TMEM [pipeline_dQ full]
#   reduce -> mma    dq_empty: dQ_j was read out of TMEM [pipeline_dQ empty]; dQ lies over
#                    dP, so the next dP^T MMA waits for it
#   compute -> mma   dkv_empty: the epilogue read dV (dK) [pipeline_dKV empty; one key block
#                    per CTA, so only its released first phase is waited]
# The MMA warp runs a block ahead (upstream's prologue, main loop and tail): S_0, dP_0, dV_0;
# then per j < N - 1: S_j+1, dK_j, dQ_j, dP_j+1, dV_j+1; then dK_N-1, dQ_N-1. Three reuses
# have no barrier and rest on the tensor pipe's issue order, as Note [P aliases S] in
# fa4lab.plan.tmem does in the forward: S_j+1 overwrites P_j after dV_j (which read it) was
# issued; dQ_j overwrites dS_j in TMEM after dK_j (which read it) was issued; dP_j+1
# overwrites dS_j after dK_j too. The simulator's tensor pipe is one in-order agent, so these
# are checked as ordered; the hazard check reports any other.
#
# Note [tile_read]
# The two compute warpgroups split a step's 128 query columns, 64 each, over all 128 key lanes
# (a warp reaches only its own quarter of TMEM's lanes, so warps 4 and 8 share lanes 0-31 and
# must split columns). P (16-bit) is written over S, query q at S's column q / 2, so
# warpgroup 1's P (columns 32-63) lands on S columns warpgroup 0 reads; dS over dP the same. No
# split of the columns avoids it (q -> q / 2 reaches column 0 from every query), so the compute
# warps meet at a named barrier after reading S_j and again after reading dP_j, before any of
# them writes P_j or dS_j there (upstream's `compute_sync_barrier`). The simulator runs a role
# as one agent and cannot show its removal (`fa4lab.plan.simulate.unobservable`).


def build_barriers(tiles, eb: int, roles: tuple[Role, ...]) -> BarrierGraph:
    """The backward's barriers in SharedStorage order (Note [the backward's protocol]); `eb`
    bytes per element of Q, K, V and dO (the TMA transaction counts)."""
    m, n, d, dv = tiles.m_block, tiles.n_block, tiles.head_dim, tiles.head_dim_v
    f32 = ELEMENT_BYTES["fp32"]
    threads = {r.name: r.threads for r in roles}
    comp, red = threads["compute"], threads["dq_reduce"]
    q, do = tiles.q_stage, tiles.do_stage
    once = "; one key block per CTA: only its released first phase is waited"
    tmem_users = ("compute", "dq_reduce")
    return BarrierGraph((
        Barrier("kv_full", "load", "mma", 1, 1, n * (d + dv) * eb, PHASE_FULL,
                "the CTA's K and V blocks landed in SMEM before the first S^T and dP^T MMAs"),
        Barrier("q_full", "load", "mma", 1, q, m * d * eb, PHASE_FULL,
                "Q_j landed before S^T_j = K Q_j^T and dK += dS^T Q_j read it"),
        Barrier("q_empty", "mma", "load", 1, q, 0, PHASE_EMPTY,
                "dK_j, the last MMA reading Q_j, completed before TMA refills its buffer "
                "(tcgen05.commit)", starts_released=True),
        Barrier("lse_full", "load", "compute", 1, q, m * f32, PHASE_FULL,
                "Q_j's LSE rows landed before the compute warps read them for P_j"),
        Barrier("lse_empty", "compute", "load", comp, q, 0, PHASE_EMPTY,
                "the compute warps read LSE_j before TMA overwrites it", starts_released=True),
        Barrier("do_full", "load", "mma", 1, do, m * dv * eb, PHASE_FULL,
                "dO_j landed before dP^T_j = V dO_j^T and dV += P_j^T dO_j read it"),
        Barrier("do_empty", "mma", "load", 1, do, 0, PHASE_EMPTY,
                "dV_j, the last MMA reading dO_j, completed before TMA refills it "
                "(tcgen05.commit)", starts_released=True),
        Barrier("dpsum_full", "load", "compute", 1, do, m * f32, PHASE_FULL,
                "dO_j's D = rowsum(dO * O) rows landed before dS_j = P_j (dP_j - D) reads "
                "them"),
        Barrier("dpsum_empty", "compute", "load", comp, do, 0, PHASE_EMPTY,
                "the compute warps read D_j before TMA overwrites it", starts_released=True),
        Barrier("s_full", "mma", "compute", 1, 1, 0, PHASE_FULL,
                "S^T_j is in TMEM before the compute warps read it (tcgen05.commit)"),
        Barrier("p_ready", "compute", "mma", comp, 1, 0, PHASE_FULL,
                "the compute warps wrote P_j over S_j in TMEM (after tcgen05.wait::st) before "
                "dV += P_j^T dO_j reads it"),
        Barrier("dp_full", "mma", "compute", 1, 1, 0, PHASE_FULL,
                "dP^T_j is in TMEM before the compute warps read it (tcgen05.commit)"),
        Barrier("ds_ready", "compute", "mma", comp, 1, 0, PHASE_FULL,
                "dS_j is in TMEM over dP_j and in SMEM (after fence.proxy.async) before dK_j "
                "and dQ_j read it"),
        Barrier("ds_empty", "mma", "compute", 1, 1, 0, PHASE_EMPTY,
                "dQ_j = dS_j K, the MMA reading dS_j from SMEM, completed before the compute "
                "warps write dS_j+1 there (tcgen05.commit)", starts_released=True),
        Barrier("dq_full", "mma", "dq_reduce", 1, 1, 0, PHASE_FULL,
                "dQ_j is in TMEM before the reduce warps read it (tcgen05.commit)"),
        Barrier("dq_empty", "dq_reduce", "mma", red, 1, 0, PHASE_EMPTY,
                "the reduce warps read dQ_j out of TMEM before dP^T_j+1, which lies over it, "
                "is issued", starts_released=True),
        Barrier("dkv_full", "mma", "compute", 1, 2, 0, PHASE_FULL,
                "stage 0: every dV MMA completed; stage 1: every dK MMA, before the epilogue "
                "reads the accumulator (tcgen05.commit)"),
        Barrier("dkv_empty", "compute", "mma", comp, 2, 0, PHASE_EMPTY,
                f"the epilogue read dV (dK) out of TMEM before the next key block accumulates "
                f"into it{once}", starts_released=True),
        Barrier("tmem", ",".join(tmem_users), "mma",
                sum(threads[r] for r in (*tmem_users, "mma")), 1, 0, PHASE_NAMED,
                "bar.sync: the compute and reduce warps wait for the MMA warp's tcgen05.alloc "
                "(the address is in SMEM); at the end the MMA warp waits for them before "
                "tcgen05.dealloc", kind="named", group="named", named_id=TMEM_BARRIER_ID),
        Barrier("tile_read", "compute", "compute", comp, 1, 0, PHASE_NAMED,
                "bar.sync: every compute warp read S_j (dP_j) out of TMEM before any writes "
                "P_j (dS_j) over it (Note [tile_read])", kind="named", group="named",
                named_id=TILE_READ_BARRIER_ID),
    ))


def build_protocol(barriers: BarrierGraph, tiles) -> Protocol:
    """Each role's barrier ops in upstream's 1-CTA order (Note [the backward's protocol]); Q
    stage of step j: "j % q"; every other pipeline has one stage."""
    E = Op   # noqa: N806
    tmem_use = (E("sync", "tmem"), Step("TMEM address"))
    load = (
        E("expect_tx", "kv_full", "0", one=True), Step("load K"), Step("load V"),
        Loop("N", (
            E("wait", "q_empty", "j % q"), E("expect_tx", "q_full", "j % q", one=True),
            Step("load Q", "j % q"),
            E("wait", "lse_empty", "j % q"), E("expect_tx", "lse_full", "j % q", one=True),
            Step("load LSE", "j % q"),
            E("wait", "do_empty", "0"), E("expect_tx", "do_full", "0", one=True),
            Step("load dO"),
            E("wait", "dpsum_empty", "0"), E("expect_tx", "dpsum_full", "0", one=True),
            Step("load D"))),
    )

    def s_block(stage):   # S^T of step j, or of j + 1 ("S next"), and its hand-off
        what = "S next" if stage.startswith("(j + 1)") else "S"
        return (E("wait", "q_full", stage), Step(what, stage), E("commit", "s_full", "0"))

    def dp_dv(nxt=""):     # dP^T and dV of step j, or of j + 1 (nxt " next")
        return (E("wait", "do_full", "0"), E("wait", "dq_empty", "0"), Step("dP" + nxt),
                E("commit", "dp_full", "0"), E("wait", "p_ready", "0"), Step("dV" + nxt),
                E("commit", "do_empty", "0"))
    dk_dq = (E("wait", "ds_ready", "0"), Step("dK", "j % q"), E("commit", "q_empty", "j % q"),
             Step("dQ"), E("commit", "dq_full", "0"), E("commit", "ds_empty", "0"))
    mma = (Step("alloc TMEM"), *tmem_use,
           E("wait", "kv_full", "0"), *s_block("j % q"), *dp_dv(),
           Loop("N - 1", (*s_block("(j + 1) % q"), *dk_dq, *dp_dv(" next"))),
           E("wait", "dkv_empty", "0"), E("commit", "dkv_full", "0"),
           E("wait", "dkv_empty", "1"), *dk_dq[:3], E("commit", "dkv_full", "1"), *dk_dq[3:],
           E("sync", "tmem"), Step("free TMEM"))
    step = (E("wait", "lse_full", "j % q"), E("wait", "s_full", "0"), Step("ld S", "j % q"),
            E("sync", "tile_read"), Step("exp2"), Step("st P"), E("arrive", "p_ready", "0"),
            E("arrive", "lse_empty", "j % q"),
            E("wait", "dpsum_full", "0"), E("wait", "dp_full", "0"), Step("ld dP"),
            E("sync", "tile_read"), Step("dS"),
            E("wait", "ds_empty", "0"), Step("st dS"), Step("dS to SMEM"),
            E("arrive", "ds_ready", "0"), E("arrive", "dpsum_empty", "0"))
    compute = (*tmem_use, Loop("M", step, "masked"), Loop("N - M", step, "unmasked"),
               E("wait", "dkv_full", "0"), Step("ld dV"), E("arrive", "dkv_empty", "0"),
               Step("dV to SMEM"), Step("store dV"),
               E("wait", "dkv_full", "1"), Step("ld dK"), E("arrive", "dkv_empty", "1"),
               Step("dK to SMEM"), Step("store dK"), Step("drain stores"),
               E("named_arrive", "tmem"))
    chunks, stages = tiles.dq_chunks, tiles.dq_stages
    buf = f"(j * {chunks} + c) % {stages}"     # the staging buffers run on across steps
    reduce = (*tmem_use, Loop("N", (
        E("wait", "dq_full", "0"), Step("ld dQ"), E("arrive", "dq_empty", "0"),
        Unroll("c", str(chunks), (Step("wait dQ buffer", buf), Step("dQ to SMEM", buf),
                                  Step("reduce-add dQ", buf))))),
        Step("drain reduce-adds"), E("named_arrive", "tmem"))
    return Protocol(barriers, (
        Program("load", ("load",), load),
        Program("mma", ("mma",), mma),
        Program("compute", ("compute",), compute),
        Program("dq_reduce", ("dq_reduce",), reduce),
    ))


# ---- the simulator's programs ----
def programs(plan, n_blocks: int, n_tiles: int, costs, masked_blocks: int = 0):
    """Each role's simulator ops over a CTA's key block of `n_blocks` query blocks (one per
    CTA: `n_tiles` is 1), the first `masked_blocks` masked."""
    catalogue = _steps(plan, costs)
    proto, q = plan.protocol, plan.tiles.q_stage
    return {role: expand(proto, role, plan.role(role).threads, n_blocks, masked_blocks, q,
                         catalogue, n_tiles) for role in proto.roles()}


def _steps(plan, costs):
    """Step name -> simulator ops (labels "S^T=K Q3", "dQ3", ...: 3 the query block)."""
    from fa4lab.plan.steps import Issue, Ref, WaitEngine, Work

    hw, t, tm = plan.hardware, plan.tiles, plan.tmem
    m, n, d, dv = t.m_block, t.n_block, t.head_dim, t.head_dim_v
    eb, f32 = plan.spec.element_bytes, ELEMENT_BYTES["fp32"]
    mma = {x.name: costs.mma_op_cycles(hw, x) for x in plan.mmas}
    scores = m * n
    chunk_bytes = m * t.dq_chunk * f32
    aliases = {r.name: r.alias_of for r in plan.smem.regions if r.alias_of}

    def tref(name):
        r = tm.region(name, 0)
        return Ref("tmem", name, 0, r.col_offset, r.col_end)

    def sref(name, stage=0):
        return Ref("smem", aliases.get(name, name), stage)

    def load(label, region, stage, barrier, nbytes):
        return [Issue("tma", label, costs.tma_cycles(nbytes), writes=(sref(region, stage),),
                      complete_tx=(barrier, stage, nbytes))]

    def mma_op(label, name, reads, writes):
        return [Issue("tensor", label, mma[name], reads=reads, writes=writes)]

    def step(s, env, stage):
        w, j = s.what, env["j"]
        stage = stage or 0
        if w == "load K":
            return load("K", "k", 0, "kv_full", n * d * eb)
        if w == "load V":
            return load("V", "v", 0, "kv_full", n * dv * eb)
        if w == "load Q":
            return load(f"Q{j}", "q", stage, "q_full", m * d * eb)
        if w == "load LSE":
            return load(f"LSE{j}", "lse", stage, "lse_full", m * f32)
        if w == "load dO":
            return load(f"dO{j}", "do", 0, "do_full", m * dv * eb)
        if w == "load D":
            return load(f"D{j}", "dpsum", 0, "dpsum_full", m * f32)
        if w in ("S", "S next"):
            blk = j + (w == "S next")
            return mma_op(f"S^T=K Q{blk}", "S", (sref("q", stage), sref("k")), (tref("S"),))
        if w in ("dP", "dP next"):
            return mma_op(f"dP^T=V dO{j + (w == 'dP next')}", "dP", (sref("v"), sref("do")),
                          (tref("dP"),))
        if w in ("dV", "dV next"):   # the first dV initialises the accumulator
            acc = (tref("dV"),) if w == "dV next" else ()
            return mma_op(f"dV+=P^T dO{j + (w == 'dV next')}", "dV",
                          (tref("P"), sref("do")) + acc, (tref("dV"),))
        if w == "dK":
            return mma_op(f"dK+=dS^T Q{j}", "dK",
                          (tref("dS"), sref("q", stage)) + ((tref("dK"),) if j else ()),
                          (tref("dK"),))
        if w == "dQ":
            return mma_op(f"dQ{j}=dS K", "dQ", (sref("ds"), sref("k")), (tref("dQ"),))
        if w == "alloc TMEM":
            return [Work("alloc TMEM", 0, writes=(sref("tmem_ptr"),))]
        if w == "TMEM address":
            return [Work("TMEM address", 0, reads=(sref("tmem_ptr"),))]
        if w == "free TMEM":
            return [Work("free TMEM", 0, writes=(Ref("tmem", "all", 0, 0, tm.total_cols),))]
        if w == "ld S":
            return [Work(f"ld S{j}", costs.tmem_cycles(scores * f32),
                         reads=(tref("S"), sref("lse", stage)))]
        if w == "exp2":
            return [Work(f"P{j}=exp2", costs.softmax_cycles(hw, scores, 0.0,
                                                            env["tag"] == "masked"),
                         unit="mufu")]
        if w == "st P":
            return [Work(f"st P{j}", costs.tmem_cycles(scores * eb), writes=(tref("P"),))]
        if w == "ld dP":
            return [Work(f"ld dP{j}", costs.tmem_cycles(scores * f32),
                         reads=(tref("dP"), sref("dpsum")))]
        if w == "dS":   # subtract D, multiply by P, convert: three FMA-pipe ops per score
            return [Work(f"dS{j}=P(dP-D)", 3 * scores / hw.fma_per_cycle)]
        if w == "st dS":
            return [Work(f"st dS{j}", costs.tmem_cycles(scores * eb), writes=(tref("dS"),))]
        if w == "dS to SMEM":
            return [Work(f"dS{j} to SMEM", costs.smem_cycles(hw, scores * eb),
                         writes=(sref("ds"),))]
        if w in ("ld dV", "ld dK"):
            name = w[3:]
            cols = dv if name == "dV" else d
            return [Work(w, costs.tmem_cycles(n * cols * f32), reads=(tref(name),))]
        if w in ("dV to SMEM", "dK to SMEM"):
            name = w[:2]
            cols = dv if name == "dV" else d
            return [Work(w, costs.smem_cycles(hw, n * cols * eb),
                         writes=(sref(f"{name.lower()}_out"),))]
        if w in ("store dV", "store dK"):
            name = w[6:]
            cols = dv if name == "dV" else d
            return [Issue("tma_store", w, costs.tma_cycles(n * cols * eb),
                          reads=(sref(f"{name.lower()}_out"),))]
        if w == "drain stores":
            return [WaitEngine("tma_store")]
        if w == "ld dQ":
            return [Work(f"ld dQ{j}", costs.tmem_cycles(m * d * f32), reads=(tref("dQ"),))]
        if w == "wait dQ buffer":   # the reduce-add that last read this buffer is done
            return [WaitEngine("tma_reduce", pending=t.dq_stages - 1)]
        if w == "dQ to SMEM":
            return [Work(f"dQ{j} chunk {env['c']} to SMEM", costs.smem_cycles(hw, chunk_bytes),
                         writes=(sref("dq_acc", stage),))]
        if w == "reduce-add dQ":
            return [Issue("tma_reduce", f"dQ{j}.{env['c']} reduce-add",
                          costs.tma_cycles(chunk_bytes), reads=(sref("dq_acc", stage),))]
        if w == "drain reduce-adds":
            return [WaitEngine("tma_reduce")]
        raise KeyError(f"no simulator step {w!r}")

    return step


# Note [the backward's 2-CTA MMA]
# tcgen05.mma.cta_group::2 runs one MMA on the tensor cores of a CTA pair (a cluster of two
# SMs): A is split by rows (M) between the pair, B by columns (N), and each CTA's TMEM holds
# its half of the rows of D. Upstream FA4 uses it in the backward from head_dim 128 on
# (flash_attn/cute/interface.py: `use_2cta_instrs = head_dim >= 128`, cluster (2, 1)): each CTA
# still owns 128 keys, so S^T, dP^T, dV and dK become M = 256 MMAs over the pair's 256 keys
# (`mma_tiler_kq = (2 * tile_n, tile_m, hdim)`), and their B operands (Q, dO) are split: each
# CTA loads and reads half of each Q and dO block. dQ = dS K sums over the pair's 256 keys
# (`mma_tiler_dsk = (tile_m, hdim, 2 * tile_n)`), so each CTA needs the other's dS: the compute
# warps swap half of dS through distributed shared memory (`sdS_xchg`, a relay warp and three
# more mbarriers), and dQ's 128 rows are split 64 per CTA (upstream places dQ inside S's
# columns, `tmem_dQ_offset = tmem_S_offset + tile_hdim // 2`). (192, 128) needs the pair for
# TMEM: S + dV + dP + dK = 128 + 128 + 128 + 192 = 576 > 512, so upstream lays the four out with
# dP over S's upper columns and dQ over dP (`tmem_dP_offset = 512 - tile_m`). What the pair
# buys, in this cost model, is shared-memory bandwidth: at 128 B per SM per cycle, a 1-CTA
# step's S^T, dP^T and dQ read their operands from SMEM in as many cycles as the datasheet's MMA
# rate takes for them (512 each at head_dim 128: `pair_mma_table`), with no slack should the
# tensor cores run at that rate; the pair halves each CTA's B reads of the four key-row MMAs.
# This plan is 1-CTA; the pair's protocol is not planned here.
def pair_mma_table(plan, costs) -> list[dict]:
    """Per MMA of one step, the SMEM bytes each CTA reads and the modelled cycles, with one CTA
    (cta_group::1, this plan) and with a pair (cta_group::2, Note [the backward's 2-CTA MMA]):
    a MODEL from `fa4lab.plan.costs` (MMA FLOPs per CTA unchanged; B split between the pair for
    the key-row MMAs, A and B each halved in one dimension and doubled in the other for dQ)."""
    hw = plan.hardware
    rows = []
    for x in plan.mmas:
        a = x.m * x.k * ELEMENT_BYTES[x.a_dtype] if x.a_source == "smem" else 0
        b = x.n * x.k * ELEMENT_BYTES[x.b_dtype] if x.b_source == "smem" else 0
        # key-row MMAs: B (queries) halves; dQ: 64 query rows x 256 keys of dS and 256 keys x
        # head_dim / 2 of K per CTA, the same bytes as one CTA's 128 x 128 and 128 x head_dim
        pair_b = b if x.name == "dQ" else b // 2
        mma = costs.mma_cycles(hw, x.m, x.n, x.k)
        rows.append({"mma": x.name, "flops_per_cta": x.flops, "mma_cycles": round(mma, 1),
                     "smem_bytes_1cta": a + b, "smem_cycles_1cta":
                         round(costs.smem_cycles(hw, a + b), 1),
                     "smem_bytes_2cta": a + pair_b, "smem_cycles_2cta":
                         round(costs.smem_cycles(hw, a + pair_b), 1)})
    return rows
