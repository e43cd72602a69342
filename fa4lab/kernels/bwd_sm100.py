"""FlashAttention backward on B200 (sm_100a) in the CuTe DSL, built from a `BackwardPlan`.

What it computes: dK and dV of attention, and dQ's float32 partial sums added into dQ_accum,
for q (batch, seqlen_q, heads_q, d), k and v (batch, seqlen_k, heads_kv, d), the forward's LSE
and the gradient dO of its output: MHA or GQA (query head h reads KV head h // (heads_q //
heads_kv), the group size baked in from the plan's spec), bottom-right causal or not, any
seqlen_q, seqlen_k >= 1. The host contract is the sm90 backward's (`fa4lab.kernels
.launch_backward`): LSE in log2 units and D = rowsum(dO * O) - dLSE, both float32 (batch,
heads_q, seqlen_q rounded up to m_block), LSE +inf on rows that see no key and on the padding;
dQ_accum (batch, heads_q, padded seqlen_q, d) float32, zeroed; dQ = softmax_scale * dQ_accum.

Constraints: head_dim == head_dim_v in {64, 128} (the plan's 1-CTA TMEM map also holds 96,
whose 48-column halves this kernel does not split), bf16 or fp16, last dim contiguous.

How it is built (the numbers and the barriers come from `fa4lab.plan.backward.plan_backward`):
  * one CTA per (key block of n_block = 128 keys, KV head, batch) walks the query blocks that
    see its keys (`fa4lab.tiling.query_block_range`), for each query head of the KV head's
    group in turn (Note [sm100 backward, GQA]); per step five tcgen05 MMAs, cta_group::1:
    S^T = K Q^T, dP^T = V dO^T, dV += P^T dO (P from TMEM), dK += dS^T Q (dS from TMEM),
    dQ = dS K (dS from SMEM): keys in TMEM's lanes for the first four, queries for dQ;
  * TMEM at the plan's columns (`plan.tmem`: S, P over S, dV, dP, dS over dP, dK, dQ over dP);
    SMEM in the plan's order (`plan.smem`, fa4lab.kernels.device.storage.storage_struct);
  * roles (`plan.roles`, each warp branch one method): dq_reduce (warps 0-3) reads dQ out of
    TMEM and adds it into dQ_accum with TMA reduce-adds, each warp its 32 rows, chunk by chunk
    through the plan's staging buffers; compute (warps 4-11, two warpgroups of 64 query
    columns each) P = exp2(S scale_log2 - LSE) and dS = P (dP - D), then dV and dK;
    mma (warp 12) issues every MMA and tcgen05.commit; load (warp 13) the TMA loads; relay and
    empty only set their registers;
  * barriers: the protocol table `plan.protocol` (fa4lab.plan.protocol_bwd_sm100, Note [the
    backward's protocol]); the kernel initialises every mbarrier of the table at its stages
    and arrival counts, and issues each wait / arrive / expect_tx / commit through
    `self.sites` (fa4lab.kernels.protocol) by name, so `fa4lab.kernels.audit` checks the
    binary against the table (Note [sm100 backward, first version]).

Compile on any machine: `fa4lab.kernels.launch_backward.compile_backward(key)` with an sm100
key. Not yet run on a B200.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils as utils
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.pipeline import NamedBarrier
from cutlass.tensor_utils import LayoutEnum

from fa4lab import tiling
from fa4lab.kernels.device import storage
from fa4lab.kernels.protocol import Sites

_DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}

# Note [sm100 backward, first version]
# Correct by construction first, on the plan's table; speed is for a B200 to judge. What it
# chose beside upstream FA4's 1-CTA kernel (flash_attn/cute/flash_bwd_sm100.py):
# - Barriers: raw mbarrier ops on the table's barriers (no DSL pipeline objects), so each op
#   is the table's, with its phase: the k-th wait on a stage waits parity k % 2, on a barrier
#   that starts released (k + 1) % 2 (Note [phases from the table] in fa4lab.plan.protocol).
#   K and V have their own kv_full (upstream folds them into the first Q and dO phases).
# - dQ: each reduce warp adds its own 32 rows per chunk (a TMA tensor reduce-add of a 32 x 32
#   float32 box into the row-major dQ_accum the host zeroed), so no barrier joins the four
#   reduce warps; the chunk buffers are the plan's `dq_acc` staging, a quarter per warp, and a
#   warp reuses a buffer once its reduce-add two chunks back has read it (bulk wait_group).
# - dK and dV go from registers to global memory (16-byte stores of each thread's key row,
#   rows past seqlen_k dropped), as upstream's non-TMA epilogue (`epilogue_dKV`) does: a TMA
#   store would need a barrier joining a warpgroup's warps that the table does not have. The
#   plan's `dk_out` / `dv_out` staging (aliases in Q's and dO's bytes, adding none) stay unused.
# - Masking: a step masks (seqlen_k's tail, the causal diagonal) in the compute warps' masked
#   loop, the others run unmasked; query rows past seqlen_q need no mask: their LSE is +inf,
#   so P = 0 there, and dS = 0.
# - Not built: sliding windows, softcap, a learnable sink's kernel side, mods, varlen,
#   deterministic dQ, 2-CTA MMA: `fa4lab.plan.key.backward_unbuilt` names what a key lacks,
#   `fa4lab.kernels.launch_backward.unbuilt` what a call does.

# Note [sm100 backward, GQA]
# As the sm90 kernel (Note [sm90 backward, first version] in fa4lab.kernels.bwd_sm90): one CTA
# per (key block, KV head, batch), whose steps run over the query blocks that see the key block
# for each query head of the group in turn, step j being head j // H of the group at query
# block m_min + j % H (H: the query blocks per head). The protocol table is unchanged: its
# loops run G * H steps instead of H, every role counting phases by the same j, and the MMA
# warp's dV and dK accumulate in TMEM from step 0 to the last, so they are summed over the
# group and stored once (no float32 dK / dV buffer, no atomics for them). Q, dO, LSE, D and
# dQ_accum are indexed by the step's query head; K, V, dK and dV by the CTA's KV head. The
# compute warps' masked steps (the key tail's, the causal diagonal's) are the first of each
# head's H, so their two loops sit in a loop over the group. With G = 1 every role's code is
# the MHA kernel's (the group's index is a compile-time 0).


class FlashBackwardSm100:
    """The sm100 backward kernel, configured once from a `BackwardPlan`; no DSL code here."""

    arch = "sm100a"

    def __init__(self, plan, mutation=None):
        spec = plan.spec
        if plan.arch != "sm100" or getattr(plan, "direction", "") != "backward":
            raise ValueError("FlashBackwardSm100 needs an sm100 backward plan (plan_backward)")
        t = plan.tiles
        if t.head_dim != t.head_dim_v or t.head_dim not in (64, 128):
            raise ValueError(f"FlashBackwardSm100 builds head_dim 64 and 128 (head_dim == "
                             f"head_dim_v); the plan has ({t.head_dim}, {t.head_dim_v})")
        if spec.window_size not in ((None, 0 if spec.causal else None), (None, None)):
            raise ValueError("FlashBackwardSm100 builds no sliding window (Note [sm100 "
                             "backward, first version])")
        self.plan = plan
        self.dtype = _DTYPES[spec.dtype]
        self.causal = spec.causal
        self.qhead_per_kvhead = spec.qhead_per_kvhead    # Note [sm100 backward, GQA]
        self.m_block, self.n_block = t.m_block, t.n_block
        self.q_stage, self.do_stage = t.q_stage, t.do_stage
        self.head_dim, self.head_dim_v = t.head_dim, t.head_dim_v
        self.dq_chunk, self.dq_stages, self.dq_chunks = t.dq_chunk, t.dq_stages, t.dq_chunks
        if t.cta_group != 1 or self.do_stage != 1:
            raise ValueError("FlashBackwardSm100 is the 1-CTA kernel with one dO buffer")
        self.tiler_S = (self.n_block, self.m_block, self.head_dim)        # S^T = K Q^T
        self.tiler_dP = (self.n_block, self.m_block, self.head_dim_v)     # dP^T = V dO^T
        self.tiler_dV = (self.n_block, self.head_dim_v, self.m_block)     # dV += P^T dO
        self.tiler_dK = (self.n_block, self.head_dim, self.m_block)       # dK += dS^T Q
        self.tiler_dQ = (self.m_block, self.head_dim, self.n_block)       # dQ = dS K
        tm = plan.tmem
        self.tmem = {r.name: r.col_offset for r in tm.regions}
        self.tmem_alloc_cols = tm.alloc_cols
        roles = {r.name: r for r in plan.roles}
        self.registers = {name: r.registers for name, r in roles.items()}
        self.warps = {name: r.warps for name, r in roles.items()}
        self.threads_per_cta = plan.threads_per_cta
        self.compute_threads = roles["compute"].threads
        self.reduce_threads = roles["dq_reduce"].threads
        self.warpgroups = len(roles["compute"].warps) // 4   # query columns split between them
        self.sites = Sites(plan, mutation)
        bars = plan.barriers
        self.mbarriers = [b for b in bars.barriers if b.kind == "mbarrier"]
        self.arrivals = {b.name: b.arrive_count for b in bars.barriers}
        self.tx_bytes = {b.name: b.tx_bytes for b in bars.barriers}
        self.stages = {b.name: b.stages for b in bars.barriers}
        # Code sites of each MMA (the audit's count): S^T, dP^T and dV in the prologue and the
        # loop, dK and dQ in the loop and the tail.
        self.mma_sites = {"S": 2, "dP": 2, "dV": 2, "dK": 2, "dQ": 2}

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,        # (batch, seqlen_q, heads_q, head_dim)
        mK: cute.Tensor,        # (batch, seqlen_k, heads_kv, head_dim)
        mV: cute.Tensor,        # (batch, seqlen_k, heads_kv, head_dim_v)
        mdO: cute.Tensor,       # (batch, seqlen_q, heads_q, head_dim_v)
        mLSE: cute.Tensor,      # (batch, heads_q, seqlen_q padded) fp32, log2 units, +inf empty
        mD: cute.Tensor,        # (batch, heads_q, seqlen_q padded) fp32, rowsum(dO * O) - dLSE
        mdQaccum: cute.Tensor,  # (batch, heads_q, seqlen_q padded, head_dim) fp32, zeroed
        mdK: cute.Tensor,       # (batch, seqlen_k, heads_kv, head_dim)
        mdV: cute.Tensor,       # (batch, seqlen_k, heads_kv, head_dim_v)
        scale_log2: Float32,    # softmax_scale * log2(e)
        pre_scale: Float32,     # unused: no softcap (BackwardArgs)
        softmax_scale: Float32,  # dK's factor
        window_left: Int32,     # unused: no window
        window_right: Int32,
        mSemaphore: cute.Tensor | None,  # None: no deterministic mode
        stream: cuda.CUstream,
    ):
        if const_expr(mSemaphore is not None):
            raise ValueError("the sm100 backward has no deterministic mode: its semaphore is "
                             "None (BackwardArgs)")
        # TMA views: (rows, cols, heads, batch); dO as (dv, seqlen_q, ...): dV's B is MN-major.
        mQv, mKv, mVv = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))
                         for t in (mQ, mK, mV)]
        mdOv = cute.make_tensor(mdO.iterator, cute.select(mdO.layout, mode=[3, 1, 2, 0]))
        mdQv = cute.make_tensor(mdQaccum.iterator,
                                cute.select(mdQaccum.layout, mode=[2, 3, 1, 0]))
        mma_S, mma_dP, mma_dV, mma_dK, mma_dQ = self.tiled_mmas()
        layouts = self.smem_layouts(mma_S, mma_dP, mma_dV, mma_dK, mma_dQ)
        cluster = cute.tiled_divide(cute.make_layout((1, 1, 1)), (mma_S.thr_id.shape,)).shape
        load = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
        sel = [0, 1, 2]
        atom_K, tK = cute.nvgpu.make_tiled_tma_atom_A(
            load, mKv, cute.select(layouts["k"], mode=sel), self.tiler_S, mma_S, cluster)
        atom_Q, tQ = cute.nvgpu.make_tiled_tma_atom_B(
            load, mQv, cute.select(layouts["q"], mode=sel), self.tiler_S, mma_S, cluster)
        atom_V, tV = cute.nvgpu.make_tiled_tma_atom_A(
            load, mVv, cute.select(layouts["v"], mode=sel), self.tiler_dP, mma_dP, cluster)
        atom_dO, tdO = cute.nvgpu.make_tiled_tma_atom_B(
            load, mdOv, cute.select(layouts["do"], mode=sel), self.tiler_dV, mma_dV, cluster)
        box = (32, self.dq_chunk)      # one reduce warp's rows of one chunk
        atom_dQ, tdQ = cpasync.make_tiled_tma_atom(
            cpasync.CopyReduceBulkTensorTileS2GOp(), mdQv,
            cute.select(layouts["dq_acc"], mode=[0, 1]), box)
        self.check_tx_bytes(layouts)
        self.shared_storage = storage.storage_struct(self.plan, {
            "q": (self.dtype, cute.cosize(layouts["q"])),
            "k": (self.dtype, cute.cosize(layouts["k"])),
            "v": (self.dtype, cute.cosize(layouts["v"])),
            "do": (self.dtype, cute.cosize(layouts["do"])),
            "ds": (self.dtype, cute.cosize(layouts["ds"])),
            "lse": (Float32, self.m_block * self.q_stage),
            "dpsum": (Float32, self.m_block * self.do_stage),
            "dq_acc": (Float32, cute.cosize(layouts["dq_acc"]))})
        grid = (cute.ceil_div(cute.size(mK.shape[1]), self.n_block), cute.size(mK.shape[2]),
                cute.size(mQ.shape[0]))
        self.kernel(mma_S, mma_dP, mma_dV, mma_dK, mma_dQ, atom_Q, tQ, atom_K, tK, atom_V, tV,
                    atom_dO, tdO, atom_dQ, tdQ, mLSE, mD, mdK, mdV, scale_log2, softmax_scale,
                    layouts["q"], layouts["qt"], layouts["k"], layouts["kt"], layouts["v"],
                    layouts["do"], layouts["dot"], layouts["ds"], layouts["ds_epi"],
                    layouts["p"], layouts["ds_tmem"], layouts["dq_acc"],
                    ).launch(grid=grid, block=[self.threads_per_cta, 1, 1], stream=stream,
                             min_blocks_per_mp=1)

    def tiled_mmas(self):
        """The five MMAs of a step (`plan.mmas`' shapes): operand majors as upstream's."""
        K, MN = tcgen05.OperandMajorMode.K, tcgen05.OperandMajorMode.MN
        one, dt = tcgen05.CtaGroup.ONE, self.dtype
        tmem = tcgen05.OperandSource.TMEM
        mk = sm100_utils.make_trivial_tiled_mma
        return (mk(dt, dt, K, K, Float32, one, self.tiler_S[:2]),
                mk(dt, dt, K, K, Float32, one, self.tiler_dP[:2]),
                mk(dt, dt, K, MN, Float32, one, self.tiler_dV[:2], tmem),
                mk(dt, dt, K, MN, Float32, one, self.tiler_dK[:2], tmem),
                mk(dt, dt, MN, MN, Float32, one, self.tiler_dQ[:2]))

    def smem_layouts(self, mma_S, mma_dP, mma_dV, mma_dK, mma_dQ):
        """Each SMEM operand's layout; "qt", "kt", "dot" are the same bytes as "q", "k", "do"
        read as another MMA's operand, "ds_epi" dS as the compute warps write it, "p" and
        "ds_tmem" the TMEM A operands of dV and dK."""
        a, b, dt = sm100_utils.make_smem_layout_a, sm100_utils.make_smem_layout_b, self.dtype
        ds_epi = sm100_utils.make_smem_layout_epi(dt, LayoutEnum.ROW_MAJOR,
                                                  (self.n_block, self.m_block), 1)
        return {
            "q": b(mma_S, self.tiler_S, dt, self.q_stage),
            "qt": b(mma_dK, self.tiler_dK, dt, self.q_stage),
            "k": a(mma_S, self.tiler_S, dt, 1),
            "kt": b(mma_dQ, self.tiler_dQ, dt, 1),
            "v": a(mma_dP, self.tiler_dP, dt, 1),
            "do": b(mma_dV, self.tiler_dV, dt, self.do_stage),
            "dot": b(mma_dP, self.tiler_dP, dt, self.do_stage),
            "ds": a(mma_dQ, self.tiler_dQ, dt, 1),
            "ds_epi": ds_epi,
            "p": a(mma_dV, self.tiler_dV, dt, 1),
            "ds_tmem": a(mma_dK, self.tiler_dK, dt, 1),
            # a (32, dq_chunk) float32 box per (buffer, reduce warp)
            "dq_acc": sm100_utils.make_smem_layout_epi(
                Float32, LayoutEnum.ROW_MAJOR, (32, self.dq_chunk),
                self.dq_stages * (self.reduce_threads // 32)),
        }

    def check_tx_bytes(self, layouts):
        """The TMA boxes bring the bytes the table's full barriers expect."""
        def nbytes(name):
            return cute.size_in_bytes(self.dtype, cute.select(layouts[name], mode=[0, 1, 2]))
        for barrier, got in (("q_full", nbytes("q")), ("do_full", nbytes("do")),
                             ("kv_full", nbytes("k") + nbytes("v"))):
            if got != self.tx_bytes[barrier]:
                raise ValueError(f"{barrier}: the TMA brings {got} bytes, the table expects "
                                 f"{self.tx_bytes[barrier]}")

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, mma_S: cute.TiledMma, mma_dP: cute.TiledMma, mma_dV: cute.TiledMma,
               mma_dK: cute.TiledMma, mma_dQ: cute.TiledMma, atom_Q: cute.CopyAtom,
               mQ: cute.Tensor, atom_K: cute.CopyAtom, mK: cute.Tensor, atom_V: cute.CopyAtom,
               mV: cute.Tensor, atom_dO: cute.CopyAtom, mdO: cute.Tensor,
               atom_dQ: cute.CopyAtom, mdQ: cute.Tensor, mLSE: cute.Tensor, mD: cute.Tensor,
               mdK: cute.Tensor, mdV: cute.Tensor, scale_log2: Float32, softmax_scale: Float32,
               sQ_layout: cute.ComposedLayout, sQt_layout: cute.ComposedLayout,
               sK_layout: cute.ComposedLayout, sKt_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout, sdO_layout: cute.ComposedLayout,
               sdOt_layout: cute.ComposedLayout, sdS_layout: cute.ComposedLayout,
               sdS_epi_layout: cute.ComposedLayout, tP_layout: cute.ComposedLayout,
               tdS_layout: cute.ComposedLayout, sdQ_layout: cute.ComposedLayout):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == self.warps["load"][0]:
            for atom in (atom_Q, atom_K, atom_V, atom_dO, atom_dQ):
                cpasync.prefetch_descriptor(atom)
        self.sites.start()
        smem = utils.SmemAllocator().allocate(self.shared_storage)
        if warp_idx == self.warps["load"][0]:
            with cute.arch.elect_one():
                for b in self.mbarriers:
                    for s in cutlass.range_constexpr(b.stages):
                        cute.arch.mbarrier_init(self.bar(smem, b.name) + s, b.arrive_count)
            cute.arch.mbarrier_init_fence()
        cute.arch.barrier()     # the barriers are initialised before any role uses them
        tmem = utils.TmemAllocator(smem.tmem_ptr.ptr, allocator_warp_id=self.warps["mma"][0],
                                   barrier_for_retrieve=NamedBarrier(
                                       barrier_id=self.sites.named_id("tmem"),
                                       num_threads=self.arrivals["tmem"]))
        sQ = smem.q.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = smem.k.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = smem.v.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sdO = smem.do.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)
        sdS = smem.ds.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
        views = dict(
            sQ=sQ, sK=sK, sV=sV, sdO=sdO, sdS=sdS,
            sQt=self.view(sQ, sQt_layout), sKt=self.view(sK, sKt_layout),
            sdOt=self.view(sdO, sdOt_layout), sdS_epi=self.view(sdS, sdS_epi_layout),
            sLSE=smem.lse.get_tensor(cute.make_layout((self.m_block, self.q_stage))),
            sD=smem.dpsum.get_tensor(cute.make_layout((self.m_block, self.do_stage))),
            sdQ=smem.dq_acc.get_tensor(sdQ_layout.outer, swizzle=sdQ_layout.inner))
        e = dict(views, smem=smem, tmem=tmem, mQ=mQ, mK=mK,
                 mmas=(mma_S, mma_dP, mma_dV, mma_dK, mma_dQ), tP_layout=tP_layout,
                 tdS_layout=tdS_layout)
        w = self.warps
        if warp_idx >= w["compute"][0] and warp_idx <= w["compute"][-1]:
            self.compute_role(e, mLSE, mD, mdK, mdV, scale_log2, softmax_scale)
        elif warp_idx >= w["dq_reduce"][0] and warp_idx <= w["dq_reduce"][-1]:
            self.reduce_role(e, atom_dQ, mdQ)
        elif warp_idx == w["load"][0]:
            self.load_role(e, atom_Q, mQ, atom_K, mK, atom_V, mV, atom_dO, mdO, mLSE, mD)
        elif warp_idx == w["relay"][0]:
            self.set_registers("relay")
        elif warp_idx == w["mma"][0]:
            # Traced after every role that reads the tiled MMAs: it updates their ACCUMULATE
            # state (as fwd_sm100's MMA role, last in program order).
            self.mma_role(e)
        else:
            self.set_registers("empty")
        self.sites.finish()

    def work(self, e):
        """`e` with this CTA's key block, KV head, batch, sequence lengths, its query blocks
        [m_min, m_min + head_steps) (`fa4lab.tiling.query_block_range`) and its steps, those
        blocks for each query head of the group (Note [sm100 backward, GQA]), computed in each
        role's own branch after its setmaxnreg: a value computed before the role branches lives
        across all of them (Note [role branches] in fa4lab.kernels.fwd_sm100; ptxas spilled such
        values here, 106 spill instructions at head_dim 128, measured on the binary)."""
        n_block, head, batch = cute.arch.block_idx()
        seqlen_q, seqlen_k = e["mQ"].shape[0], e["mK"].shape[0]
        m_min, m_max = tiling.query_block_range(
            n_block, self.n_block, self.m_block, seqlen_q, seqlen_k, None,
            0 if const_expr(self.causal) else None, imin=cutlass.min, imax=cutlass.max)
        head_steps = m_max - m_min
        steps = head_steps if const_expr(self.qhead_per_kvhead == 1) else \
            head_steps * self.qhead_per_kvhead
        return dict(e, n_block=n_block, head=head, batch=batch, seqlen_q=seqlen_q,
                    seqlen_k=seqlen_k, m_min=m_min, head_steps=head_steps, steps=steps)

    def query_step(self, e, j):
        """(query head, query block) of step j (Note [sm100 backward, GQA])."""
        if const_expr(self.qhead_per_kvhead == 1):
            return e["head"], e["m_min"] + j
        g = j // e["head_steps"]
        return (e["head"] * self.qhead_per_kvhead + g,
                e["m_min"] + j - g * e["head_steps"])

    @staticmethod
    def view(t: cute.Tensor, layout) -> cute.Tensor:
        """`t`'s bytes read through another swizzled layout (another MMA's operand view)."""
        return cute.make_tensor(cute.recast_ptr(t.iterator, layout.inner), layout.outer)

    @staticmethod
    def bar(smem, name: str):
        return getattr(smem, name).data_ptr()

    def set_registers(self, role: str) -> None:
        """setmaxnreg to the role's count (plan.roles): .inc above the launch budget, else .dec."""
        if self.registers[role] > self.plan.hardware.registers_per_sm // self.threads_per_cta:
            cute.arch.setmaxregister_increase(self.registers[role])
        else:
            cute.arch.setmaxregister_decrease(self.registers[role])

    # ---- barrier ops, each through the table's sites (fa4lab.kernels.protocol) ----
    def wait(self, role, smem, name, index, phase, stage=0):
        self.sites(role, f"wait {name}", cute.arch.mbarrier_wait, self.bar(smem, name) + index,
                   phase, stage=stage)

    def arrive(self, role, smem, name, index, stage=0):
        self.sites(role, f"arrive {name}", cute.arch.mbarrier_arrive,
                   self.bar(smem, name) + index, stage=stage)

    def expect_tx(self, role, smem, name, index, stage=0):
        with cute.arch.elect_one():
            self.sites(role, f"expect_tx {name}", cute.arch.mbarrier_arrive_and_expect_tx,
                       self.bar(smem, name) + index, self.tx_bytes[name], stage=stage)

    def commit(self, smem, name, index, stage=0):
        with cute.arch.elect_one():
            self.sites("mma", f"commit {name}", tcgen05.commit, self.bar(smem, name) + index,
                       stage=stage)

    # ------------------------------------------------------------------ role: load
    @cute.jit
    def load_role(self, e, atom_Q, mQ, atom_K, mK, atom_V, mV, atom_dO, mdO, mLSE, mD):
        """K and V once (kv_full), then per step Q and its LSE rows, dO and its D rows (of the
        step's query head: Note [sm100 backward, GQA])."""
        self.set_registers("load")
        e = self.work(e)
        smem, head, batch = e["smem"], e["head"], e["batch"]
        mma_S, mma_dP = e["mmas"][0], e["mmas"][1]
        gK = cute.local_tile(mK[None, None, head, batch], cute.select(self.tiler_S, [0, 2]),
                             (None, 0))
        gV = cute.local_tile(mV[None, None, head, batch], cute.select(self.tiler_dP, [0, 2]),
                             (None, 0))
        tKsK, tKgK = self.tma(atom_K, mma_S.get_slice(0).partition_A(gK), e["sK"])
        tVsV, tVgV = self.tma(atom_V, mma_dP.get_slice(0).partition_A(gV), e["sV"])
        rows = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), Float32)
        loads = (atom_Q, mQ, atom_dO, mdO, mLSE, mD)
        mha = self.step_loads(e, None, head, loads, once=True)
        kv = self.bar(smem, "kv_full")
        self.expect_tx("load", smem, "kv_full", 0)
        cute.copy(atom_K, tKgK[None, e["n_block"]], tKsK[None, 0], tma_bar_ptr=kv)
        cute.copy(atom_V, tVgV[None, e["n_block"]], tVsV[None, 0], tma_bar_ptr=kv)
        for i in cutlass.range(e["steps"], unroll=1):
            head_q, m = self.query_step(e, i)
            tQsQ, tQgQ, tdOsdO, tdOgdO, gLSE, gD = self.step_loads(e, mha, head_q, loads)
            st, use = i % self.q_stage, i // self.q_stage
            self.wait("load", smem, "q_empty", st, (use + 1) % 2, stage=None)
            self.expect_tx("load", smem, "q_full", st, stage=None)
            cute.copy(atom_Q, tQgQ[None, m], tQsQ[None, st],
                      tma_bar_ptr=self.bar(smem, "q_full") + st)
            self.wait("load", smem, "lse_empty", st, (use + 1) % 2, stage=None)
            self.expect_tx("load", smem, "lse_full", st, stage=None)
            with cute.arch.elect_one():
                cute.copy(rows, gLSE[None, m], e["sLSE"][None, st],
                          mbar_ptr=self.bar(smem, "lse_full") + st)
            self.wait("load", smem, "do_empty", 0, (i + 1) % 2)
            self.expect_tx("load", smem, "do_full", 0)
            cute.copy(atom_dO, tdOgdO[None, m], tdOsdO[None, 0],
                      tma_bar_ptr=self.bar(smem, "do_full"))
            self.wait("load", smem, "dpsum_empty", 0, (i + 1) % 2)
            self.expect_tx("load", smem, "dpsum_full", 0)
            with cute.arch.elect_one():
                cute.copy(rows, gD[None, m], e["sD"][None, 0],
                          mbar_ptr=self.bar(smem, "dpsum_full"))

    @staticmethod
    def tma(atom, gX, sX):
        """(SMEM, global) TMA partitions of one CTA's tile."""
        return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(sX, 0, 3),
                                     cute.group_modes(gX, 0, 3))

    def query_loads(self, e, head_q, atom_Q, mQ, atom_dO, mdO, mLSE, mD):
        """Query head `head_q`'s Q, dO (TMA partitions), LSE and D rows, by query block."""
        batch, mma_S, mma_dV = e["batch"], e["mmas"][0], e["mmas"][2]
        gQ = cute.local_tile(mQ[None, None, head_q, batch], cute.select(self.tiler_S, [1, 2]),
                             (None, 0))
        gdO = cute.local_tile(mdO[None, None, head_q, batch],
                              cute.select(self.tiler_dV, [1, 2]), (0, None))
        tQsQ, tQgQ = self.tma(atom_Q, mma_S.get_slice(0).partition_B(gQ), e["sQ"])
        tdOsdO, tdOgdO = self.tma(atom_dO, mma_dV.get_slice(0).partition_B(gdO), e["sdO"])
        return (tQsQ, tQgQ, tdOsdO, tdOgdO,
                cute.local_tile(mLSE[batch, head_q, None], (self.m_block,), (None,)),
                cute.local_tile(mD[batch, head_q, None], (self.m_block,), (None,)))

    def step_loads(self, e, mha, head_q, loads, once=False):
        """`query_loads` of a step's query head: under MHA made once before the loop (`once`)
        and then `mha`, under GQA per step (None before the loop)."""
        if self.qhead_per_kvhead == 1:
            return self.query_loads(e, head_q, *loads) if once else mha
        return None if once else self.query_loads(e, head_q, *loads)

    # ------------------------------------------------------------------ role: mma
    def tmem_views(self, e, tmem_ptr):
        """Every TMEM region of `plan.tmem` as its MMA's accumulator or operand view."""
        mma_S, mma_dP, mma_dV, mma_dK, mma_dQ = e["mmas"]

        def acc(mma, tiler, name):
            thr = mma.get_slice(0)
            frag = thr.make_fragment_C(thr.partition_shape_C(tiler[:2]))
            return cute.make_tensor(tmem_ptr + self.tmem[name], frag.layout)

        def operand(mma, layout, name, over):
            frag = mma.get_slice(0).make_fragment_A(
                cute.make_tensor(acc(mma_S, self.tiler_S, over).iterator, layout.outer))
            frag = frag[None, None, None, 0]
            return cute.make_tensor(cute.recast_ptr(tmem_ptr + self.tmem[name],
                                                    dtype=self.dtype), frag.layout)
        return dict(S=acc(mma_S, self.tiler_S, "S"), dP=acc(mma_dP, self.tiler_dP, "dP"),
                    dV=acc(mma_dV, self.tiler_dV, "dV"), dK=acc(mma_dK, self.tiler_dK, "dK"),
                    dQ=acc(mma_dQ, self.tiler_dQ, "dQ"),
                    P=operand(mma_dV, e["tP_layout"], "P", "S"),
                    dS=operand(mma_dK, e["tdS_layout"], "dS", "dP"))

    def mma_role(self, e):
        self.set_registers("mma")
        e = self.work(e)
        tmem = e["tmem"]
        tmem.allocate(self.tmem_alloc_cols)
        self.sites.bar_sync("mma", "tmem")
        tmem_ptr = tmem.retrieve_ptr(Float32)
        self.mma(e, self.tmem_views(e, tmem_ptr))
        tmem.relinquish_alloc_permit()
        self.sites.bar_sync("mma", "tmem")
        tmem.free(tmem_ptr)

    @cute.jit
    def gemm(self, tiled_mma, acc, tA, tB, accumulate):
        """acc (+)= A B over the K blocks of one tile; `accumulate` a runtime flag."""
        for k in cutlass.range_constexpr(cute.size(tA, mode=[2])):
            tiled_mma.set(tcgen05.Field.ACCUMULATE, accumulate or k != 0)
            cute.gemm(tiled_mma, acc, tA[None, None, k], tB[None, None, k], acc)
        return tiled_mma

    @cute.jit
    def mma(self, e, t):
        """The table's MMA program (Note [the backward's protocol]): S_0, dP_0, dV_0; per next
        step S_j+1, dK_j, dQ_j, dP_j+1, dV_j+1; then dK and dQ of the last step."""
        smem, steps = e["smem"], e["steps"]
        mma_S, mma_dP, mma_dV, mma_dK, mma_dQ = e["mmas"]
        for m in (mma_S, mma_dP, mma_dV, mma_dK, mma_dQ):
            m.set(tcgen05.Field.NEGATE_A, False)
            m.set(tcgen05.Field.NEGATE_B, False)
        tSrK, tSrQ, tdPrV, tdPrdO, tdVrdO, tdKrQ, tdQrdS, tdQrK = self.operands(e, 0)
        self.wait("mma", smem, "kv_full", 0, 0)
        # step 0: S_0, dP_0, dV_0 (the accumulator's first write)
        self.wait("mma", smem, "q_full", 0, 0, stage=None)
        mma_S = self.gemm(mma_S, t["S"], tSrK[None, None, None, 0], tSrQ[None, None, None, 0],
                          False)
        self.commit(smem, "s_full", 0)
        mma_dP, mma_dV = self.dp_dv(smem, t, mma_dP, mma_dV, tdPrV, tdPrdO, tdVrdO, Int32(0),
                                    False)
        for i in cutlass.range(steps - 1, unroll=1):
            nxt = i + 1
            self.wait("mma", smem, "q_full", nxt % self.q_stage, (nxt // self.q_stage) % 2,
                      stage=None)
            mma_S = self.gemm(mma_S, t["S"], tSrK[None, None, None, 0],
                              tSrQ[None, None, None, nxt % self.q_stage], False)
            self.commit(smem, "s_full", 0)
            mma_dK, mma_dQ = self.dk_dq(smem, t, mma_dK, mma_dQ, tdKrQ, tdQrdS, tdQrK, i,
                                        False)
            mma_dP, mma_dV = self.dp_dv(smem, t, mma_dP, mma_dV, tdPrV, tdPrdO, tdVrdO, nxt,
                                        True)
        last = steps - 1
        self.wait("mma", smem, "dkv_empty", 0, 1)
        self.commit(smem, "dkv_full", 0)
        self.wait("mma", smem, "dkv_empty", 1, 1, stage=1)
        mma_dK, mma_dQ = self.dk_dq(smem, t, mma_dK, mma_dQ, tdKrQ, tdQrdS, tdQrK, last, True)

    def operands(self, e, zero):
        """The MMAs' SMEM operand fragments, their tensors offset by `zero` elements."""
        mma_S, mma_dP, mma_dV, mma_dK, mma_dQ = e["mmas"]

        def at(name):
            return cute.make_tensor(e[name].iterator + zero, e[name].layout)
        return (mma_S.make_fragment_A(at("sK")), mma_S.make_fragment_B(at("sQ")),
                mma_dP.make_fragment_A(at("sV")), mma_dP.make_fragment_B(at("sdOt")),
                mma_dV.make_fragment_B(at("sdO")), mma_dK.make_fragment_B(at("sQt")),
                mma_dQ.make_fragment_A(at("sdS")), mma_dQ.make_fragment_B(at("sKt")))

    @cute.jit
    def dp_dv(self, smem, t, mma_dP, mma_dV, tdPrV, tdPrdO, tdVrdO, j, accumulate):
        """dP^T_j = V dO_j^T once dO_j landed and dQ_j-1 (over dP) was read; dV += P_j^T dO_j
        once P_j is in TMEM."""
        self.wait("mma", smem, "do_full", 0, j % 2)
        self.wait("mma", smem, "dq_empty", 0, (j + 1) % 2)
        mma_dP = self.gemm(mma_dP, t["dP"], tdPrV[None, None, None, 0],
                           tdPrdO[None, None, None, 0], False)
        self.commit(smem, "dp_full", 0)
        self.wait("mma", smem, "p_ready", 0, j % 2)
        mma_dV = self.gemm(mma_dV, t["dV"], t["P"], tdVrdO[None, None, None, 0], accumulate)
        self.commit(smem, "do_empty", 0)
        return mma_dP, mma_dV

    @cute.jit
    def dk_dq(self, smem, t, mma_dK, mma_dQ, tdKrQ, tdQrdS, tdQrK, j,
              tail: cutlass.Constexpr[bool]):
        """dK += dS_j^T Q_j and dQ_j = dS_j K once dS_j is in TMEM and SMEM; with `tail` the
        last step's, dkv_full[1] committed between them (every dK MMA issued)."""
        st = j % self.q_stage
        self.wait("mma", smem, "ds_ready", 0, j % 2)
        mma_dK = self.gemm(mma_dK, t["dK"], t["dS"], tdKrQ[None, None, None, st], j > 0)
        self.commit(smem, "q_empty", st, stage=None)
        if const_expr(tail):
            self.commit(smem, "dkv_full", 1, stage=1)
        mma_dQ = self.gemm(mma_dQ, t["dQ"], tdQrdS[None, None, None, 0],
                           tdQrK[None, None, None, 0], False)
        self.commit(smem, "dq_full", 0)
        self.commit(smem, "ds_empty", 0)
        return mma_dK, mma_dQ

    # ------------------------------------------------------------------ role: compute
    def tmem_copy(self, t: cute.Tensor, col: int, cols: int, store: bool, tidx):
        """This thread's slice (lane tidx % 128) of fp32 columns [col, col + cols) of the
        (128, *) TMEM tile `t`: (thread copy, its TMEM partition, its coordinates)."""
        tile = t[(None, None), 0, 0]
        sub = cute.make_tensor(tile.iterator + col, cute.composition(
            tile.layout, cute.make_layout((128, cols))))
        op = (tcgen05.copy.St32x32bOp if store else tcgen05.copy.Ld32x32bOp)(
            tcgen05.copy.Repetition(cols))
        thr = tcgen05.make_tmem_copy(cute.make_copy_atom(op, Float32), sub).get_slice(tidx % 128)
        coords = cute.make_identity_tensor((128, cols))
        if store:
            return thr, thr.partition_D(sub), thr.partition_S(coords)
        return thr, thr.partition_S(sub), thr.partition_D(coords)

    def compute_role(self, e, mLSE, mD, mdK, mdV, scale_log2, softmax_scale):
        self.set_registers("compute")
        e = self.work(e)
        tmem = e["tmem"]
        self.sites.bar_sync("compute", "tmem")
        t = self.tmem_views(e, tmem.retrieve_ptr(Float32))
        self.compute(e, t, scale_log2)
        self.epilogue(e, t, mdK, mdV, softmax_scale)
        self.sites.bar_arrive("compute", "tmem")

    @cute.jit
    def compute(self, e, t, scale_log2: Float32):
        """Every step: P = exp2(S^T scale_log2 - LSE) over S, dS = P (dP^T - D) over dP and into
        SMEM; the masked steps (the key tail's, the causal diagonal's) first."""
        tidx = cute.arch.thread_idx()[0] % self.compute_threads
        head_steps = e["head_steps"]
        n_masked = head_steps
        key_end = e["seqlen_k"] - e["n_block"] * self.n_block   # keys of this block that exist
        offset = e["seqlen_k"] - e["seqlen_q"]                  # bottom-right alignment
        if key_end >= self.n_block:
            n_masked = 0
            if const_expr(self.causal):   # steps whose last visible key is inside the block
                last = e["n_block"] * self.n_block + self.n_block - 1 - offset
                full = (cutlass.max(last, 0) + self.m_block - 1) // self.m_block
                n_masked = cutlass.min(cutlass.max(full - e["m_min"], 0), head_steps)
        if const_expr(self.qhead_per_kvhead == 1):
            for i in cutlass.range(n_masked, unroll=1):
                self.compute_step(e, t, i, e["m_min"] + i, True, tidx, key_end, offset,
                                  scale_log2)
            for i in cutlass.range(n_masked, head_steps, unroll=1):
                self.compute_step(e, t, i, e["m_min"] + i, False, tidx, key_end, offset,
                                  scale_log2)
        else:   # each query head's masked steps first (Note [sm100 backward, GQA])
            for g in cutlass.range(self.qhead_per_kvhead, unroll=1):
                first = g * head_steps
                for i in cutlass.range(n_masked, unroll=1):
                    self.compute_step(e, t, first + i, e["m_min"] + i, True, tidx, key_end,
                                      offset, scale_log2)
                for i in cutlass.range(n_masked, head_steps, unroll=1):
                    self.compute_step(e, t, first + i, e["m_min"] + i, False, tidx, key_end,
                                      offset, scale_log2)

    @cute.jit
    def compute_step(self, e, t, i, m, masked: cutlass.Constexpr[bool], tidx, key_end, offset,
                     scale_log2: Float32):
        """Step i, of query block m."""
        smem = e["smem"]
        cols = self.m_block // self.warpgroups          # query columns of this warpgroup
        col0 = (tidx // 128) * cols
        st, use = i % self.q_stage, i // self.q_stage
        key = tidx % 128
        self.wait("compute", smem, "lse_full", st, use % 2, stage=None)
        self.wait("compute", smem, "s_full", 0, i % 2)
        thr_s, tS, cS = self.tmem_copy(t["S"], col0, cols, False, tidx)
        rS = cute.make_rmem_tensor(cS.shape, Float32)
        cute.copy(thr_s, tS, rS)
        cute.arch.fence_view_async_tmem_load()
        self.sites.bar_sync("compute", "tile_read")
        if const_expr(masked):   # this key row sees queries from q_first on (none past the tail)
            q_first = Int32(0)
            if const_expr(self.causal):
                q_first = e["n_block"] * self.n_block + key - offset - m * self.m_block - col0
            q_first = q_first if key < key_end else Int32(self.m_block)
            for c in cutlass.range_constexpr(cute.size(rS)):
                rS[c] = rS[c] if cS[c][1] >= q_first else -Float32.inf
        for c in cutlass.range_constexpr(cute.size(rS)):
            lse = e["sLSE"][col0 + cS[c][1], st]
            rS[c] = cute.math.exp2(rS[c] * scale_log2 - lse, fastmath=True)
        # P (16-bit pairs in fp32 columns) at the plan's P columns, this warpgroup's half
        thr_p, tP, cP = self.tmem_copy(t["S"], self.tmem["P"] - self.tmem["S"] + col0 // 2,
                                       cols // 2, True, tidx)
        rP32 = cute.make_rmem_tensor(cP.shape, Float32)
        rP = cute.make_tensor(cute.recast_ptr(rP32.iterator, dtype=self.dtype), rS.layout)
        rP.store(rS.load().to(self.dtype))
        cute.copy(thr_p, rP32, tP)
        cute.arch.fence_view_async_tmem_store()
        self.arrive("compute", smem, "p_ready", 0)
        self.arrive("compute", smem, "lse_empty", st, stage=None)
        self.wait("compute", smem, "dpsum_full", 0, i % 2)
        self.wait("compute", smem, "dp_full", 0, i % 2)
        thr_ds, tdS, cdS = self.tmem_copy(t["dP"], self.tmem["dS"] - self.tmem["dP"] + col0 // 2,
                                          cols // 2, True, tidx)
        rdS32 = cute.make_rmem_tensor(cdS.shape, Float32)
        rdS = cute.make_tensor(cute.recast_ptr(rdS32.iterator, dtype=self.dtype), rS.layout)
        # dP in halves, each turned into 16-bit dS at once: the fp32 P and dP of a whole row
        # half did not fit the compute warps' registers (60 spill instructions, measured)
        half = cols // 2
        rS_h = cute.logical_divide(rS, cute.make_layout(half))
        rdS_h = cute.logical_divide(rdS, cute.make_layout(half))
        for h in cutlass.range_constexpr(2):
            thr_dp, tdP, cdP = self.tmem_copy(t["dP"], col0 + h * half, half, False, tidx)
            rdP = cute.make_rmem_tensor(cdP.shape, Float32)
            cute.copy(thr_dp, tdP, rdP)
            cute.arch.fence_view_async_tmem_load()
            for c in cutlass.range_constexpr(half):
                rdP[c] = rS_h[c, h] * (rdP[c] - e["sD"][col0 + h * half + cdP[c][1], 0])
            rdS_h[None, h].store(rdP.load().to(self.dtype))
        self.sites.bar_sync("compute", "tile_read")
        self.wait("compute", smem, "ds_empty", 0, (i + 1) % 2)
        cute.copy(thr_ds, rdS32, tdS)
        # dS^T's row `key` into SMEM (queries contiguous): the dQ MMA's A operand
        row = e["sdS_epi"][key, None, 0]
        cute.autovec_copy(rdS, cute.local_tile(row, (cols,), (tidx // 128,)))
        cute.arch.fence_view_async_tmem_store()
        cute.arch.fence_view_async_shared()
        self.arrive("compute", smem, "ds_ready", 0)
        self.arrive("compute", smem, "dpsum_empty", 0)

    @cute.jit
    def epilogue(self, e, t, mdK, mdV, softmax_scale: Float32):
        """dV, then dK (times softmax_scale): each thread its key row's half of the columns,
        from TMEM into registers, then into global memory (Note [sm100 backward, first
        version]); rows past seqlen_k are not stored."""
        smem = e["smem"]
        tidx = cute.arch.thread_idx()[0] % self.compute_threads
        key = tidx % 128
        row = e["n_block"] * self.n_block + key
        for stage, name, out, width, factor in ((0, "dV", mdV, self.head_dim_v, None),
                                                (1, "dK", mdK, self.head_dim, softmax_scale)):
            cols = width // self.warpgroups
            self.wait("compute", smem, "dkv_full", stage, 0, stage=stage)
            thr, tX, cX = self.tmem_copy(t[name], (tidx // 128) * cols, cols, False, tidx)
            rX = cute.make_rmem_tensor(cX.shape, Float32)
            cute.copy(thr, tX, rX)
            cute.arch.fence_view_async_tmem_load()
            self.arrive("compute", smem, "dkv_empty", stage, stage=stage)
            if const_expr(factor is not None):
                rX.store(rX.load() * factor)
            rO = cute.make_rmem_tensor(cX.shape, self.dtype)
            rO.store(rX.load().to(self.dtype))
            if row < e["seqlen_k"]:
                g = cute.local_tile(out[e["batch"], row, e["head"], None], (cols,),
                                    (tidx // 128,))
                cute.autovec_copy(rO, g)

    # ------------------------------------------------------------------ role: dq_reduce
    def reduce_role(self, e, atom_dQ, mdQ):
        self.set_registers("dq_reduce")
        e = self.work(e)
        tmem = e["tmem"]
        self.sites.bar_sync("dq_reduce", "tmem")
        t = self.tmem_views(e, tmem.retrieve_ptr(Float32))
        self.reduce(e, t, atom_dQ, mdQ)
        self.sites.bar_arrive("dq_reduce", "tmem")

    @cute.jit
    def reduce(self, e, t, atom_dQ, mdQ):
        """Per step: dQ_j out of TMEM (this thread's query row), then chunk by chunk into this
        warp's staging box and a TMA reduce-add of it into dQ_accum (Note [sm100 backward, first
        version])."""
        smem = e["smem"]
        tidx = cute.arch.thread_idx()[0] % self.reduce_threads
        warp, lane = tidx // 32, tidx % 32
        warps = self.reduce_threads // 32
        mha = self.step_dq_target(e, None, atom_dQ, mdQ, e["head"], once=True)
        # dQ's columns in chunks: one tcgen05.ld of the whole row needs more registers than
        # one instruction may take
        loads = [self.tmem_copy(t["dQ"], c * self.dq_chunk, self.dq_chunk, False, tidx)
                 for c in range(self.dq_chunks)]
        for i in cutlass.range(e["steps"], unroll=1):
            head_q, m = self.query_step(e, i)
            tsdQ, tgdQ = self.step_dq_target(e, mha, atom_dQ, mdQ, head_q)
            self.wait("dq_reduce", smem, "dq_full", 0, i % 2)
            rdQ = []
            for thr, tdQ, cdQ in loads:
                r = cute.make_rmem_tensor(cdQ.shape, Float32)
                cute.copy(thr, tdQ, r)
                rdQ.append(r)
            cute.arch.fence_view_async_tmem_load()
            self.arrive("dq_reduce", smem, "dq_empty", 0)
            for c in cutlass.range_constexpr(self.dq_chunks):
                # buffer (j * chunks + c) % stages, a quarter per warp: chunks is even, so c's
                buf = (c % self.dq_stages) * warps + warp
                cute.arch.cp_async_bulk_wait_group(self.dq_stages - 1, read=True)
                cute.arch.sync_warp()
                cute.autovec_copy(rdQ[c], e["sdQ"][lane, None, buf])
                cute.arch.fence_view_async_shared()
                cute.arch.sync_warp()
                cute.copy(atom_dQ, tsdQ[None, buf],
                          tgdQ[None, m * (self.m_block // 32) + warp, c])
                cute.arch.cp_async_bulk_commit_group()
        cute.arch.cp_async_bulk_wait_group(0, read=True)

    def dq_target(self, e, atom_dQ, mdQ, head_q):
        """(SMEM, global) TMA partitions of query head `head_q`'s dQ_accum in (32, dq_chunk)
        boxes: one reduce warp's rows of one chunk."""
        gdQ = cute.local_tile(mdQ[None, None, head_q, e["batch"]], (32, self.dq_chunk),
                              (None, None))
        return cpasync.tma_partition(atom_dQ, 0, cute.make_layout(1),
                                     cute.group_modes(e["sdQ"], 0, 2),
                                     cute.group_modes(gdQ, 0, 2))

    def step_dq_target(self, e, mha, atom_dQ, mdQ, head_q, once=False):
        """`dq_target` of a step's query head: under MHA made once before the loop (`once`)
        and then `mha`, under GQA per step (None before the loop)."""
        if self.qhead_per_kvhead == 1:
            return self.dq_target(e, atom_dQ, mdQ, head_q) if once else mha
        return None if once else self.dq_target(e, atom_dQ, mdQ, head_q)
