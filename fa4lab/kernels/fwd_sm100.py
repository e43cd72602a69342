"""FlashAttention-4 forward on B200 (sm_100a) in the CuTe DSL, built from a `Plan`.

What it computes: O = softmax(Q K^T * scale) V per (batch, query head), and optionally
LSE = log(sum(exp(Q K^T * scale))) per row, with the semantics of `fa4lab.spec.AttentionSpec`:
GQA (query head h reads KV head h // (heads_q // heads_kv)), any seqlen_q >= 1 and
seqlen_k >= 1 (tails), causal bottom-right aligned, a sliding window (left, right), softcap and
a learnable sink per query head; a row that sees no key gives O = 0 and LSE = -inf (the sink's
logit with a sink). Key blocks outside the window are never loaded (Note [block visit order]
in fa4lab.tiling gives the order every role walks the others in).

Constraints: (head_dim, head_dim_v) one of `fa4lab.limits.KERNEL_HEAD_DIMS["sm100"]` (for
head_dim_v < head_dim see Note [sm100 head_dim_v < head_dim]); bf16 or fp16; last dim
contiguous. Variable-length batches (spec.varlen): Note [sm100 varlen].
Paged K/V (`spec.page_size`, Note [paged key blocks] in fa4lab.kernels.device.paged): one TMA
box per key block for pages of a multiple of n_block, a gather of one box per page for smaller
pages (16, 32, 64), all on the block's one kv_full barrier.

Scheduling (`plan.tiles.order`, fa4lab.kernels.device.scheduler): with two Q tiles and O staged
in its own SMEM (head_dim 64, 96, 128) the CTAs are persistent (Note [persistent CTAs] in
fa4lab.plan.sm100): min(work tiles, SMs) CTAs, each looping over linear tiles c, c + gridDim.x,
... (grid order; LPT for causal), every role carrying its pipeline states from tile to tile
(Note [pipeline states across tiles]), so the next tile's loads overlap this tile's epilogue.
The plans that stage O in Q's bytes ((192, 128), (256, 256)) run one CTA per 2 x m_block (or
m_block) query rows, per head, per batch, causal grids starting with each head's longest tile.

pack-GQA (`plan.tiles.pack_gqa`, Note [sm100 pack-GQA kernel]): optionally a CTA serves the
qhead_per_kvhead query heads of one KV head, its rows being packed rows; only the Q/O TMA views,
the grid, the block ranges, the causal row index and the LSE address change. Compiled and
audited for sm_100a on CPU; not yet run on a B200.

split-KV (`spec.split_kv`, `fa4lab.kernels.device.split`): num_splits (a runtime Int32) CTAs per
tile, folded into the grid's head axis; each visits its split's blocks of the tile's range (of
its sequence's own keys with seqused_k, as over a paged cache; none: an empty split, written as
a CTA with no key) and the correction warps store its float32 partial O and LSE from TMEM
(`correction_store_partial`); the epilogue warp keeps its hand-off and stores nothing. Compiled
and audited for sm_100a on CPU; not yet run on a B200.

How it works (the FA4 design; the numbers come from `plan`, see notebook 05):
  * one CTA owns cta_m = q_stage * m_block query rows as two Q tiles ("stages"), or with
    q_stage 1 (head_dim 256) one Q tile whose key blocks ping-pong between the two S buffers
    (Note [S ping-pong] in fa4lab.plan.sm100: `ping_pong` below; the load, MMA and correction
    roles have their own code for it, the softmax picks S buffer j % 2 at run time);
  * warp roles (plan.roles): softmax0 / softmax1 (one warpgroup per Q tile), correction
    (rescales O in TMEM, then normalises it into shared memory), mma (one thread issues every
    tcgen05.mma), load (TMA of Q, K, V), epilogue (TMA store of O), empty;
  * TMEM (plan.tmem): S_i (fp32) for each Q tile, P_i (16-bit) written over S_i, O_i (fp32);
  * barriers: the protocol table `plan.protocol` (fa4lab.plan.protocol_sm100.build_protocol). The
    SharedStorage struct is declared from plan.smem in its order, one Int64 array per mbarrier
    of the table; the mbarriers are built as DSL pipelines over the table's full/empty pairs
    (`_PIPELINES`), with the table's stages, arrival counts and TMA bytes; every wait / arrive /
    commit of every role goes through `self.sites` (fa4lab.kernels.protocol) by barrier name,
    and the TMEM hand-off is the table's named barrier `tmem` in its unaligned form:
      q      full q_full       load -> mma (TMA bytes)     empty q_empty     mma -> load
      kv     full kv_full      load -> mma (TMA bytes)     empty kv_empty    mma -> load
             K_j and V_j take turns in the same kv_stage buffers
      s      full s_full       mma -> softmax_i (commit)   empty p_ready     softmax_i -> mma
             (S_i is in TMEM / P_i is in TMEM: S_i has been read and may be overwritten)
      o      full o_final      mma -> correction (commit)  empty o_rescaled  correction -> mma
             (the last O_i += P_i V_j is done / O_i was rescaled, the next PV may accumulate)
      stats  full stats_full   softmax_i -> correction     empty stats_empty correction -> softmax_i
             (the mailbox sScale holds tile i's row scale, or the final row_sum and row_max)
      epi    full o_staged     correction -> epilogue      empty o_empty     epilogue -> correction
      p_part (two Q tiles)     softmax_i -> mma: P_i's first p_split keys are in TMEM; the
             value MMA takes them first, the rest after p_ready (`make_p_part`, Note [split P
             hand-off] in fa4lab.plan.sm100)
    The s, o, stats and epi pipelines are indexed by Q tile, not round robin: `phase_state`
    (fa4lab.kernels.device.storage).
    Orderings that need no barrier, because tcgen05 operations from the MMA thread run in issue
    order and a tcgen05.commit fires after everything issued before it:
      * S_i(j+1) is issued after O_i += P_i(j) V_j, so it cannot overwrite P_i(j) (which aliases
        S_i) before the PV MMA has read it;
      * softmax_i signals the scale for block j only after S_i(j) is complete, hence after
        O_i += P_i(j-1) V_{j-1} is complete: the correction may then rescale O_i.
"""

from __future__ import annotations

from functools import partial

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Boolean, Float32, Int32
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.tensor_utils import LayoutEnum

from fa4lab.kernels.device import arguments, paged, scheduler, seqlen, storage
from fa4lab.kernels.device import mask as mask_mod
from fa4lab.kernels.device import softmax as softmax_mod
from fa4lab.kernels.device import split as split_mod
from fa4lab.kernels.device.cta import Cta, Io, Launch, Mmas, Pipes, Smem, Tile, as_tuple
from fa4lab.kernels.device.exp2 import exp2_poly3_x2
from fa4lab.kernels.device.mods import ModRows
from fa4lab.kernels.device.opaque import opaque_zero
from fa4lab.kernels.device.pack_gqa import packed_a_tma, packed_tma, unpack_row
from fa4lab.kernels.device.storage import phase_state, stages_at
from fa4lab.kernels.protocol import Sites
from fa4lab.limits import kernel_builds, min_gather_page, unsupported_head_dims
from fa4lab.mods import refuse_split_with_mods
from fa4lab.online_softmax import emulated_pairs
from fa4lab.plan.sm100 import p_split

_DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}
# The DSL pipelines over the protocol table's barriers: (full side, empty side).
_PIPELINES = {"q": ("q_full", "q_empty"), "kv": ("kv_full", "kv_empty"),
              "s": ("s_full", "p_ready"), "o": ("o_final", "o_rescaled"),
              "stats": ("stats_full", "stats_empty"), "epi": ("o_staged", "o_empty")}
_PIPELINE_CLASSES = {"q": pipeline.PipelineTmaUmma, "kv": pipeline.PipelineTmaUmma,
                     "s": pipeline.PipelineUmmaAsync, "o": pipeline.PipelineUmmaAsync,
                     "stats": pipeline.PipelineAsync, "epi": pipeline.PipelineAsync}



# Note [sm100 pack-GQA kernel]
# The sm90 kernel's rule (Note [sm90 pack-GQA kernel] in fwd_sm90.py) on this kernel: with
# g = qhead_per_kvhead query heads packed into M, the grid's head axis runs over KV heads and its
# row axis over ceil(seqlen_q * g / cta_m) tiles. Q (both Q tiles) and O keep their TMA through
# the views of fa4lab.kernels.device.pack_gqa: Q's atom is the tcgen05 A-operand atom with the M
# tile (g, m_block / g), O's the plain store atom with the same box; local_tile over the packed
# mode then gives Q tile / O tile i exactly as without packing. A CTA covers positions
# [m * cta_m / g, (m + 1) * cta_m / g) and Q tile i positions from (m * q_stage + i) * m_block / g,
# so the scheduler's block ranges with pack = g (the CTA's in `visit_plan`, the Q tile's in the
# softmax) are fa4lab.tiling's packed ranges. The softmax's mask compares keys with the
# position (row_start + row) // g; the correction writes LSE and reads the learnable sink at
# (position, kv * g + row % g). TMEM, SMEM, barriers and the MMAs do not change.


# Note [sm100 head_dim_v < head_dim]
# With (head_dim, head_dim_v) = (192, 128) K and V still take turns in one ring of buffers, each
# as large as a K block (plan.smem "kv"). V's SMEM layout is built for its own (dv, n_block) tile
# and then given K's stage stride (`stages_at` in fa4lab.kernels.device.storage), so V_j lands at
# the start of the buffer K used; a V phase of kv_full expects the V box's bytes
# (`Barrier.slot_tx_bytes("V")`), passed to the producer's acquire. The plan stages O in Q's bytes
# at Q's stage stride (O_i inside Q_i): the correction writes O_i only after o_final, and that
# commit fires after every MMA issued before it, the last score MMAs of both Q tiles included.


class FlashForwardSm100:
    """The kernel class. `__init__` reads the plan (no DSL code); `__call__` launches."""

    def __init__(self, plan, mutation=None, mods=None):
        spec = plan.spec
        if plan.arch != "sm100":
            raise ValueError(f"FlashForwardSm100 needs an sm100 plan, got arch={plan.arch!r}")
        if not kernel_builds("sm100", spec.head_dim, spec.head_dim_v):
            raise ValueError(f"FlashForwardSm100: "
                             f"{unsupported_head_dims('sm100', spec.head_dim, spec.head_dim_v)}")
        self.plan = plan
        self.dtype = _DTYPES[spec.dtype]
        self.head_dim = spec.head_dim
        self.head_dim_v = spec.head_dim_v
        self.causal = spec.causal
        # Which sides of a window the kernel has; their sizes are runtime arguments (Note
        # [runtime window]): causal is right = 0, a constant.
        self.window_size = spec.window_size
        self.tile_order = plan.tiles.order  # Note [tile order] in fa4lab.kernels.device.scheduler
        # Note [persistent CTAs] in fa4lab.plan.sm100: min(tiles, SMs) CTAs loop over the tiles.
        self.persistent = plan.protocol.persistent
        self.num_ctas = plan.hardware.num_sms
        self.bytes_per_key = spec.element_bytes * (spec.head_dim + spec.head_dim_v)  # K + V rows
        self.return_lse = spec.return_lse
        self.qhead_per_kvhead = spec.qhead_per_kvhead
        tiles = plan.tiles
        # See Note [sm100 pack-GQA kernel]: g query heads per CTA row group, else 1.
        self.pack_gqa = bool(getattr(tiles, "pack_gqa", False))
        self.pack = self.qhead_per_kvhead if self.pack_gqa else 1
        if tiles.m_block % self.pack:
            raise ValueError(f"pack-GQA needs qhead_per_kvhead ({self.pack}) to divide m_block "
                             f"({tiles.m_block})")
        self.m_block = tiles.m_block
        self.n_block = tiles.n_block
        self.q_stage = tiles.q_stage
        self.kv_stage = tiles.kv_stage
        self.cta_m = tiles.m_block * tiles.q_stage
        if self.q_stage not in (1, 2) or self.m_block != 128:
            raise ValueError("FlashForwardSm100 is written for one or two Q tiles of 128 rows "
                             "per CTA")
        self.ping_pong = self.q_stage == 1   # Note [S ping-pong] in fa4lab.plan.sm100
        self.role_chain = self.ping_pong      # Note [role branches]
        self.mma_tiler_qk = (self.m_block, self.n_block, self.head_dim)
        self.mma_tiler_pv = (self.m_block, self.head_dim_v, self.n_block)
        tmem = plan.tmem
        s_buffers = plan.barriers.barrier("s_full").stages
        self.tmem_s_offset = tuple(tmem.s_offset(i) for i in range(s_buffers))
        self.tmem_p_offset = tuple(tmem.p_offset(i) for i in range(s_buffers))
        self.tmem_o_offset = tuple(tmem.o_offset(i) for i in range(self.q_stage))
        # Columns from S buffer 0 to buffer 1 (the ping-pong's run-time buffer step).
        self.s_stride = self.tmem_s_offset[1] - self.tmem_s_offset[0]
        if self.tmem_p_offset[1] - self.tmem_p_offset[0] != self.s_stride:
            raise ValueError("the plan's P buffers are not at the S buffers' stride")
        self.tmem_alloc_cols = tmem.alloc_cols
        roles = {r.name: r for r in plan.roles}
        self.softmax_warps = tuple(roles[f"softmax{i}"].warps for i in range(self.q_stage))
        self.correction_warps = roles["correction"].warps
        self.mma_warp = roles["mma"].warps[0]
        self.load_warp = roles["load"].warps[0]
        self.epilogue_warp = roles["epilogue"].warps[0]
        # Roles with no work ("empty", and with one Q tile "empty_idle"): their setmaxnreg.
        self.empty_roles = tuple(name for name in roles if name.startswith("empty"))
        self.empty_warps = {name: roles[name].warps for name in self.empty_roles}
        self.registers = {name: r.registers for name, r in roles.items()}
        self.threads_per_cta = plan.threads_per_cta
        self.rescale_threshold = plan.rescale_threshold
        self.softcap = bool(spec.softcap)  # its value is a runtime argument (Note [softcap])
        # score_mod / mask_mod (fa4lab.mods.KernelMods), compiled in: fa4lab.kernels.device.mods
        self.mods = mods if mods else None
        self.has_score_mod = self.mods is not None and mods.score_mod is not None
        self.has_mask_mod = self.mods is not None and mods.mask_mod is not None
        # Split-KV (fa4lab.kernels.device.split): float32 partials, num_splits at run time.
        self.split_kv = spec.split_kv
        refuse_split_with_mods(self.split_kv, self.mods is not None)
        # Code sites (the audit multiplies the plan's per-tile counts by them): each MMA is
        # issued in a peeled block and in the loop body, per Q tile; each Q tile's softmax
        # step exists in a masked and an unmasked variant.
        self.mma_sites = {"score": 2 * self.q_stage, "value": 2 * self.q_stage}
        self.softmax_step_sites = 2 * self.q_stage
        # With a learnable sink each Q tile's finalize takes two exp2 (Note [sinks]).
        self.finalize_exp2_sites = 2 * self.q_stage if spec.learnable_sink else 0
        # Compile-time choice of which exp2 pairs of a 128-wide row run on the FMA pipe.
        self.emulated = emulated_pairs(self.n_block, plan.exp2_emulation_fraction)
        # Every barrier op by name from the protocol table (fa4lab.kernels.protocol).
        self.sites = Sites(plan, mutation)
        bars = plan.barriers
        for full, empty in _PIPELINES.values():
            storage.pipeline_barriers(plan, full, empty)  # checks the table's order and stages
        self.arrivals = {b.name: b.arrive_count for b in bars.barriers}
        self.tx_bytes = {b.name: b.tx_bytes for b in bars.barriers}
        # Note [sm100 head_dim_v < head_dim]: a V phase of the ring expects fewer bytes than K's.
        v_bytes = bars.barrier("kv_full").slot_tx_bytes("V")
        self.v_acquire = {} if v_bytes == self.tx_bytes["kv_full"] else {"expected_tx": v_bytes}
        self.v_tx_bytes = v_bytes
        self.o_in_q = plan.smem.region("o").alias_of == "q"   # O staged in Q's bytes
        # A paged K/V cache of page_size-token pages (Note [paged key blocks]), or None.
        self.page_size = spec.page_size
        if self.page_size is not None:
            paged.check_page_size(self.page_size, self.n_block,
                                  min_gather_page(self.head_dim, self.head_dim_v))
        # Pages smaller than a key block: a gather of TMA boxes per block (1 to 64).
        self.gather = self.page_size is not None and self.page_size < self.n_block
        # Note [split P hand-off] in fa4lab.plan.sm100: keys of P handed over first (0: one
        # hand-off), with the table's p_part barrier.
        self.p_split = p_split(tiles)
        if bool(self.p_split) != ("p_part" in self.arrivals):
            raise ValueError("the plan's p_split and its p_part barrier disagree")
        self.varlen = spec.varlen   # Note [sm100 varlen]
        arguments.check_variant(self.varlen, self.split_kv, self.pack_gqa, "Note [sm100 varlen]")

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (batch, seqlen_q, heads_q, head_dim)
        mK: cute.Tensor,  # (batch, seqlen_k, heads_kv, head_dim)
        mV: cute.Tensor,  # (batch, seqlen_k, heads_kv, head_dim_v)
        mO: cute.Tensor,  # (batch, seqlen_q, heads_q, head_dim_v)
        mLSE: cute.Tensor | None,  # (batch, heads_q, seqlen_q) float32
        mSink: cute.Tensor | None,  # (heads_q,) float32 learnable sink logits: Note [sinks]
        scale_log2: Float32,  # softmax_scale * log2(e), a runtime value: Note [runtime scale]
        pre_scale: Float32,   # softmax_scale / softcap when capped (Note [softcap]), else unused
        window_left: Int32,   # the window's sides, runtime values (Note [runtime window]); a
        window_right: Int32,  # side the plan's spec does not have is unused
        aux: tuple | None,    # the mods' aux tensors (fa4lab.mods), or None
        mask_blocks: cute.Tensor | None,  # (cta tiles, 4) int32 with a mask_mod: Note [mask_mod
                                          # block table] in fa4lab.tiling; else None
        mCuSeqlensQ: cute.Tensor | None,  # (batch + 1,) int32, varlen only: Note [sm90 varlen]
        mCuSeqlensK: cute.Tensor | None,  # (batch + 1,) int32, varlen without a page table
        mSeqUsedK: cute.Tensor | None,    # (batch,) int32 keys per sequence, or None
        mTileTable: cute.Tensor | None,   # (rows, 2) int32 (batch, m_block), varlen only
        mPageTable: cute.Tensor | None,   # (batch, pages_per_seq) int32 with a paged cache
        num_splits: Int32,                # split-KV: splits per tile (1 and unused without)
        mOPartial: cute.Tensor | None,    # (num_splits, batch, seqlen_q, heads_q, dv) fp32
        mLSEPartial: cute.Tensor | None,  # (num_splits, batch, seqlen_q, heads_q) fp32
        stream: cuda.CUstream,
    ):
        arguments.check_call(self, "Note [sm100 varlen]", mask_blocks, mCuSeqlensQ,
                             mCuSeqlensK, mSeqUsedK, mTileTable, mPageTable, mOPartial,
                             mLSEPartial)
        mQ, mK, mV, mO, mLSE = arguments.packed_views(self.varlen, self.page_size is not None,
                                                      mQ, mK, mV, mO, mLSE)
        # (s, d, h, b) views for TMA: sequence is the M/N mode, head_dim the K mode.
        mQ, mK, mO = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))
                      for t in (mQ, mK, mO)]
        # V as (d, s, h, b): the PV MMA's B operand is MN-major.
        mV = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[3, 1, 2, 0]))
        if cutlass.const_expr(mLSE is not None):
            mLSE = cute.make_tensor(mLSE.iterator, cute.select(mLSE.layout, mode=[2, 1, 0]))

        cta_group = tcgen05.CtaGroup.ONE
        tiled_mma_qk = sm100_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, tcgen05.OperandMajorMode.K, tcgen05.OperandMajorMode.K,
            Float32, cta_group, self.mma_tiler_qk[:2])
        # P is the A operand of the second MMA and lives in TMEM.
        tiled_mma_pv = sm100_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, tcgen05.OperandMajorMode.K, tcgen05.OperandMajorMode.MN,
            Float32, cta_group, self.mma_tiler_pv[:2], tcgen05.OperandSource.TMEM)
        cluster_vmnk = cute.tiled_divide(cute.make_layout((1, 1, 1)),
                                         (tiled_mma_qk.thr_id.shape,))

        sQ_layout = sm100_utils.make_smem_layout_a(
            tiled_mma_qk, self.mma_tiler_qk, self.dtype, self.q_stage)
        sK_layout = sm100_utils.make_smem_layout_b(
            tiled_mma_qk, self.mma_tiler_qk, self.dtype, self.kv_stage)
        tP_layout = sm100_utils.make_smem_layout_a(
            tiled_mma_pv, self.mma_tiler_pv, self.dtype, 1)
        sV_layout = sm100_utils.make_smem_layout_b(
            tiled_mma_pv, self.mma_tiler_pv, self.dtype, self.kv_stage)
        self.epi_tile = (self.m_block, self.head_dim_v)
        sO_layout = sm100_utils.make_smem_layout_epi(
            self.dtype, LayoutEnum.ROW_MAJOR, self.epi_tile, self.q_stage)
        if cutlass.const_expr(self.head_dim_v != self.head_dim):
            sV_layout = stages_at(sV_layout, sK_layout)   # Note [sm100 head_dim_v < head_dim]
        if cutlass.const_expr(self.o_in_q):
            sO_layout = stages_at(sO_layout, sQ_layout)

        tma_load = cpasync.CopyBulkTensorTileG2SOp(cta_group)
        tma_atom_Q, tma_Q = packed_a_tma(tma_load, mQ, sQ_layout, tiled_mma_qk, self.mma_tiler_qk,
                                   cluster_vmnk.shape, self.pack)
        if cutlass.const_expr(self.gather):   # Note [paged key blocks]: boxes of one page
            tma_atom_K, tma_K = paged.page_tma(
                tma_load, mK, paged.plain(cute.select(sK_layout, mode=[0, 1, 2]), self.n_block,
                                          self.head_dim), self.n_block, self.head_dim,
                self.page_size)
            tma_atom_V, tma_V = paged.page_tma(
                tma_load, mV, paged.plain(cute.select(sV_layout, mode=[0, 1, 2]),
                                          self.head_dim_v, self.n_block), self.n_block,
                self.head_dim_v, self.page_size, keys_mode=1)
        else:
            tma_atom_K, tma_K = cute.nvgpu.make_tiled_tma_atom_B(
                tma_load, mK, cute.select(sK_layout, mode=[0, 1, 2]), self.mma_tiler_qk,
                tiled_mma_qk, cluster_vmnk.shape)
            tma_atom_V, tma_V = cute.nvgpu.make_tiled_tma_atom_B(
                tma_load, mV, cute.select(sV_layout, mode=[0, 1, 2]), self.mma_tiler_pv,
                tiled_mma_pv, cluster_vmnk.shape)
        if cutlass.const_expr(self.pack_gqa):
            tma_atom_O, tma_O = packed_tma(
                cpasync.CopyBulkTensorTileS2GOp(), mO, cute.select(sO_layout, mode=[0, 1]),
                self.epi_tile, self.pack)
        else:
            tma_atom_O, tma_O = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), mO, cute.select(sO_layout, mode=[0, 1]),
                self.epi_tile)
        self.check_tx_bytes(sQ_layout, sK_layout, sV_layout)
        self.shared_storage = self.storage_struct(sQ_layout, sK_layout, sO_layout)

        # seqlen_q * g packed rows per KV head with pack-GQA (Note [sm100 pack-GQA kernel]).
        heads = cute.size(mK.shape[2]) if cutlass.const_expr(self.pack_gqa) else cute.size(
            mQ.shape[2])
        if cutlass.const_expr(self.split_kv):   # the splits fold into the head axis
            heads = heads * num_splits
        if cutlass.const_expr(self.varlen):   # Note [varlen tile table] in ...device.scheduler
            tiles = scheduler.varlen_num_tiles(mTileTable, heads)
            grid = (cutlass.min(tiles, self.num_ctas) if cutlass.const_expr(self.persistent)
                    else tiles, 1, 1)
        else:
            grid = scheduler.grid_shape(cute.size(mQ.shape[0]) * self.pack, heads,
                                        cute.size(mQ.shape[3]), self.cta_m, self.tile_order,
                                        self.num_ctas if cutlass.const_expr(self.persistent)
                                        else None)
        self.kernel(
            tiled_mma_qk, tiled_mma_pv, tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_V, tma_V,
            tma_atom_O, tma_O, mLSE, mSink, scale_log2, pre_scale, window_left, window_right,
            aux, mask_blocks, mPageTable, num_splits, mOPartial, mLSEPartial, sQ_layout,
            sK_layout, tP_layout, sV_layout, sO_layout,
            (mO if cutlass.const_expr(self.varlen) else None, mCuSeqlensQ, mCuSeqlensK,
             mSeqUsedK, mTileTable),
        ).launch(grid=grid, block=[self.threads_per_cta, 1, 1], stream=stream,
                 min_blocks_per_mp=1)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        tma_atom_Q: cute.CopyAtom,
        # mQ, mO: (seqlen_q, d, heads_q, batch), or ((g, seqlen_q), d, heads_kv, batch) packed
        mQ: cute.Tensor,  # TMA coordinates
        tma_atom_K: cute.CopyAtom,
        mK: cute.Tensor,  # (seqlen_k, head_dim, heads_kv, batch); paged (page_size, .., page)
        tma_atom_V: cute.CopyAtom,
        mV: cute.Tensor,  # (head_dim_v, seqlen_k, heads_kv, batch); paged (.., page_size, ..)
        tma_atom_O: cute.CopyAtom,
        mO: cute.Tensor,
        mLSE: cute.Tensor | None,  # (seqlen_q, heads_q, batch)
        mSink: cute.Tensor | None,  # (heads_q,)
        scale_log2: Float32,
        pre_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        aux: tuple | None,
        mask_blocks: cute.Tensor | None,  # (cta tiles, 4) int32
        mPageTable: cute.Tensor | None,   # (batch, pages_per_seq) int32
        num_splits: Int32,
        mOPartial: cute.Tensor | None,    # (num_splits, batch, seqlen_q, heads_q, dv) fp32
        mLSEPartial: cute.Tensor | None,  # (num_splits, batch, seqlen_q, heads_q) fp32
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        tP_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        # (mO (total_q, dv, heads_q, 1) or None, cu_seqlens_q, cu_seqlens_k, seqused_k, tile
        # table): Note [sm100 varlen]; all None but seqused_k's when not varlen
        varlen: tuple,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        # Packed: `head` is the KV head and seqlen_q counts positions, not packed rows.
        seqlen_q = mQ.shape[0]
        if cutlass.const_expr(self.pack_gqa):
            seqlen_q = mQ.shape[0][1]
        seqlen_k = paged.launch_seqlen_k(self.page_size, mK, mPageTable)
        window = mask_mod.window_sides(self.window_size, self.causal, window_left, window_right)
        # Persistent: each role's tile loop (Note [one tile loop]); varlen: each role's
        # `own_tile` (Note [sm100 varlen]).
        tile = None
        if cutlass.const_expr(not self.persistent and not self.varlen):
            tile = Tile(*scheduler.work(self, mQ, seqlen_k, varlen, num_splits), None)

        if warp_idx == self.load_warp:
            for atom in (tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O):
                cpasync.prefetch_descriptor(atom)

        self.sites.start()
        smem = utils.SmemAllocator().allocate(self.shared_storage)
        pipe_q, pipe_kv, pipe_s, pipe_o, pipe_stats, pipe_epi = (
            self.make_pipeline(smem, key) for key in _PIPELINES)
        p_part = self.make_p_part(smem)
        # The TMEM hand-off goes through the table's named barrier "tmem" (self.sites.bar_*),
        # not the allocator's own (aligned) one.
        tmem = utils.TmemAllocator(smem.tmem_ptr.ptr, allocator_warp_id=self.mma_warp,
                                   barrier_for_retrieve=pipeline.NamedBarrier(
                                       barrier_id=self.sites.named_id("tmem"),
                                       num_threads=self.arrivals["tmem"]))
        pipeline.pipeline_init_arrive(is_relaxed=True)

        sQ = smem.q.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = smem.kv.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        # V shares K's stage buffers (at K's stage stride: Note [sm100 head_dim_v < head_dim]).
        sV = cute.make_tensor(cute.recast_ptr(sK.iterator, sV_layout.inner), sV_layout.outer)
        sO = getattr(smem, "q" if self.o_in_q else "o").get_tensor(sO_layout.outer,
                                                                  swizzle=sO_layout.inner)
        sScale = smem.stats.get_tensor(cute.make_layout(self.q_stage * self.m_block * 2))

        thr_mma_qk = tiled_mma_qk.get_slice(0)
        thr_mma_pv = tiled_mma_pv.get_slice(0)

        pipeline.pipeline_init_wait()

        # The role branches (Note [role branches]); each role's body is a method below.
        c = Cta(Io(tma_atom_Q, mQ, tma_atom_K, mK, tma_atom_V, mV, tma_atom_O, mO, mLSE, mSink,
                   mOPartial, mLSEPartial, mPageTable),
                Smem(sQ, sK, sV, sO, sScale),
                Pipes(pipe_q, pipe_kv, pipe_s, pipe_o, pipe_stats, pipe_epi, p_part),
                Mmas(tiled_mma_qk, tiled_mma_pv, thr_mma_qk, thr_mma_pv, tP_layout, tmem),
                Launch(seqlen_q, seqlen_k, *window, scale_log2, pre_scale, aux, mask_blocks,
                       varlen, num_splits),
                tile)
        sm_first, sm_last = self.softmax_warps[0][0], self.softmax_warps[-1][-1]
        cw = self.correction_warps
        if cutlass.const_expr(self.role_chain):
            if warp_idx >= sm_first and warp_idx <= sm_last:
                for stage in cutlass.range_constexpr(self.q_stage):
                    warps = self.softmax_warps[stage]
                    if warp_idx >= warps[0] and warp_idx <= warps[-1]:
                        self.softmax_role(stage, c)
            elif warp_idx >= cw[0] and warp_idx <= cw[-1]:
                self.correction_role(c)
            elif warp_idx == self.load_warp:
                self.load_role(c)
            elif warp_idx == self.epilogue_warp:
                self.epilogue_role(c)
            elif warp_idx == self.mma_warp:
                self.mma_role(c)
            else:
                self.empty_role(warp_idx)
        else:
            self.empty_role(warp_idx)
            if warp_idx == self.load_warp:
                self.load_role(c)
            if warp_idx == self.epilogue_warp:
                self.epilogue_role(c)
            for stage in cutlass.range_constexpr(self.q_stage):
                warps = self.softmax_warps[stage]
                if warp_idx >= warps[0] and warp_idx <= warps[-1]:
                    self.softmax_role(stage, c)
            if warp_idx >= cw[0] and warp_idx <= cw[-1]:
                self.correction_role(c)
            # Last in program order: the MMA role updates the tiled MMAs' ACCUMULATE state.
            if warp_idx == self.mma_warp:
                self.mma_role(c)
        self.sites.finish()

    @cute.jit
    def empty_role(self, warp_idx):
        """The roles with no work: their setmaxnreg (one branch per role: a Python loop)."""
        for name in self.empty_roles:
            warps = self.empty_warps[name]
            if warp_idx >= warps[0] and warp_idx <= warps[-1]:
                self.set_registers(name)

    # ---- the roles: one method each, one tile loop (`each_tile`) over a per-tile method ----
    # Note [pipeline states across tiles]
    # A persistent CTA (Note [persistent CTAs] in fa4lab.plan.sm100) initialises its barriers
    # once, so each role's phases run on from one work tile to the next: the per-tile method
    # (`load`, `mma_tile`, `softmax`, `correction`, `epilogue`) takes the role's pipeline
    # states and phase bits and returns them advanced, and `each_tile` carries them. A CTA
    # with one tile runs it once, with the states a fresh barrier starts at.

    def load_role(self, c: Cta):
        self.set_registers("load")
        c = self.own_tile(c)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                self.kv_stage)
        self.each_tile(c, partial(self.load, c), kv_state, Int32(1))  # q_empty starts released

    def epilogue_role(self, c: Cta):
        self.set_registers("epilogue")
        c = self.own_tile(c)
        self.each_tile(c, partial(self.epilogue, c), Int32(0))

    def softmax_role(self, stage: int, c: Cta):
        role = f"softmax{stage}"
        self.set_registers(role)
        c = self.own_tile(c)
        self.sites.bar_sync(role, "tmem")
        tStS, _, _ = self.tmem_views(c)
        self.each_tile(c, partial(self.softmax, stage, c, tStS[stage]), Int32(0), Int32(1))
        self.sites.bar_arrive(role, "tmem")

    def correction_role(self, c: Cta):
        self.set_registers("correction")
        c = self.own_tile(c)
        self.sites.bar_sync("correction", "tmem")
        _, tOtO, _ = self.tmem_views(c)
        stats_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                   self.q_stage)
        # o_empty starts released
        self.each_tile(c, partial(self.correction, c, tOtO), stats_state, Int32(0), Int32(1))
        self.sites.bar_arrive("correction", "tmem")

    def mma_role(self, c: Cta):
        self.set_registers("mma")
        c = self.own_tile(c)
        # The MMAs' negate fields as the constants they are, not as the tiled MMAs' fields read
        # from the kernel's parameters: the instruction descriptors fold to constants and no
        # predicate register carries the flags through the role (a paged, causal split kernel
        # spilled 3-10 instructions in this warp's registers, measured).
        for mma in (c.mmas.tiled_qk, c.mmas.tiled_pv):
            mma.set(tcgen05.Field.NEGATE_A, False)
            mma.set(tcgen05.Field.NEGATE_B, False)
        tmem = c.mmas.tmem
        tmem.allocate(self.tmem_alloc_cols)
        self.sites.bar_sync("mma", "tmem")
        tStS, tOtO, tOrP, tmem_ptr = self.tmem_views(c, with_ptr=True)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                self.kv_stage)
        self.each_tile(c, partial(self.mma_tile, c, (tStS, tOtO, tOrP)), c.mmas.tiled_qk,
                       c.mmas.tiled_pv, kv_state, Int32(0), Int32(0), Int32(1))
        tmem.relinquish_alloc_permit()
        self.sites.bar_sync("mma", "tmem")
        tmem.free(tmem_ptr)

    # Note [sm100 varlen]
    # The sm90 kernel's scheme (Note [sm90 varlen] in fwd_sm90.py) in the warp-specialised
    # kernel: every role looks its tile up (the tile table: Note [varlen tile table]) and reads
    # its sequence (`seqlen.of_launch`) itself, in its own branch, so nothing new lives across
    # setmaxnreg (Note [role branches]). The load shifts Q, K and V to the sequence's first
    # rows; the MMA and softmax roles walk the sequence's own blocks and masks; the correction
    # writes LSE at the sequence's rows; the epilogue warp stores O row by row from the SMEM
    # staging, only the sequence's rows (Note [varlen rows past a sequence] in
    # fa4lab.kernels.device.seqlen), instead of a TMA store. A sequence with no key visits no
    # block: O = 0 and LSE -inf (or the sink), the empty tile's usual path.
    #
    # Note [sm100 varlen ping-pong loads]
    # With one Q tile (head_dim 256) the load warp, at 48 registers, kept the K and V views'
    # sequence offset live through its block loop, and ptxas spilled the kernel's SMEM base
    # instead (40 spill instructions, 4 in the MMA warp's loop, measured on the compiled
    # binary). There each K/V load rebuilds its view from the offset read again from
    # cu_seqlens_k (`Sequence.reread_offset_k`: an L1 hit next to a TMA load): no spill.

    # Note [one tile loop]
    # Upstream's shape: each role loops over the tiles its scheduler hands it. A persistent CTA
    # loops over its linear work tiles (`scheduler.work_tiles`: c, c + gridDim.x, ...), a CTA
    # with one tile is a schedule of one: the per-tile method runs once, on the tile the launch
    # names (`Cta.tile`, or the varlen tile table's: `own_tile`), with no loop in the code.

    def each_tile(self, c: Cta, body, *state):
        """`state = body(tile, *state)` for each of this CTA's work tiles (Note [one tile
        loop])."""
        if cutlass.const_expr(not self.persistent):
            body(self.tile_at(c, None), *state)
        else:
            self.tile_loop(c, body, *state)

    @cute.jit
    def tile_loop(self, c: Cta, body, *state):
        first, stop, step = scheduler.work_tiles(self, c.io.mQ, c.launch.varlen,
                                                 c.launch.num_splits)
        carried = tuple(state)
        for t in cutlass.range(first, stop, step, unroll=1):
            carried = as_tuple(body(self.tile_at(c, t), *carried))

    def tile_at(self, c: Cta, t):
        """Linear work tile t (`scheduler.work`) with its sequence; None: the CTA's one tile."""
        tile = c.tile
        if t is not None:
            tile = Tile(*scheduler.work(self, c.io.mQ, c.launch.seqlen_k, c.launch.varlen,
                                        c.launch.num_splits, t), None)
        return tile._replace(seq=seqlen.of_launch(tile.batch, c.launch.seqlen_q,
                                                  c.launch.seqlen_k, c.launch.varlen))

    def own_tile(self, c: Cta) -> Cta:
        """`c` with its one tile looked up in the role's own branch with varlen: a value loaded
        before the role branches would live across every role's setmaxnreg (Note [role
        branches]; the MMA warp's 48 registers spilled). Persistent CTAs and padded launches:
        `c` as it is."""
        if self.persistent or not self.varlen:
            return c
        m_block, head, batch = scheduler.tile_coords(self.tile_order, c.io.mQ,
                                                     c.launch.seqlen_k, self.cta_m,
                                                     self.bytes_per_key, None,
                                                     tile_table=c.launch.varlen[4])
        return c._replace(tile=Tile(m_block, head, batch, None, None))

    def visit(self, c: Cta, tile: Tile):
        """`visit_plan` of a work tile."""
        return self.visit_plan(tile.m_block, tile.seq.seqlen_q, tile.seq.seqlen_k,
                               c.launch.left, c.launch.right, c.launch.mask_blocks, tile.split,
                               c.launch.num_splits)

    def tmem_views(self, c: Cta, with_ptr: bool = False):
        """The role's S, O and P views of TMEM, from the address the MMA warp allocated."""
        tmem_ptr = c.mmas.tmem.retrieve_ptr(Float32)
        views = self.tmem_tensors(c.mmas.thr_qk, c.mmas.thr_pv, c.mmas.tP_layout, tmem_ptr)
        return (*views, tmem_ptr) if with_ptr else views

    @cute.jit
    def mma_tile(self, c: Cta, views, tile: Tile, tiled_mma_qk, tiled_mma_pv, kv_state,
                 q_phase, p_phase, o_phase):
        """The MMA role's work tile: `mma`, or `mma_ping_pong` with one Q tile."""
        n_blocks = self.visit(c, tile)[0]
        tStS, tOtO, tOrP = views
        p = c.pipes
        if cutlass.const_expr(self.ping_pong):
            self.mma_ping_pong(tiled_mma_qk, tiled_mma_pv, c.smem.q, c.smem.k, c.smem.v,
                               tStS[0], tOtO[0], tOrP[0], p.q, p.kv, p.s, p.o, n_blocks)
            return tiled_mma_qk, tiled_mma_pv, kv_state, q_phase, p_phase, o_phase
        sQ, sK, sV = c.smem.q, c.smem.k, c.smem.v
        if cutlass.const_expr(self.persistent):
            # Note [operand descriptors per tile]
            # The score and value MMAs' SMEM descriptors (one 64-bit value per K step, per Q
            # tile) do not change from tile to tile, so the compiler hoists them out of the tile
            # loop, where they stay live across it: ptxas spilled 30-34 instructions in the MMA
            # warp (head_dim 128, setmaxnreg 48 and 64, measured). Offsetting the operands by a
            # zero it cannot see through rebuilds them in each tile, as one tile per CTA does.
            zero = cute.assume(opaque_zero(), divby=1024)
            sQ, sK, sV = (cute.make_tensor(s.iterator + zero, s.layout) for s in (sQ, sK, sV))
        return self.mma(tiled_mma_qk, tiled_mma_pv, sQ, sK, sV, tStS, tOtO, tOrP, p.q, p.kv,
                        p.s, p.o, p.p_part, n_blocks, kv_state, q_phase, p_phase, o_phase)

    # Note [role branches]
    # With sequential `if`s every warp walks past every role's branch, so a value computed
    # before them lives through all of them, under each role's setmaxnreg. The one-Q-tile plan
    # (Note [S ping-pong]) idles a warpgroup at 24 registers and, at head_dim 256, fills the
    # correction's 80: ptxas spilled such values there (8-14 spill instructions, measured on
    # the compiled binary). It dispatches through one if/elif chain instead, where a value a
    # role needs is not live in another's branch. The two-Q-tile plan keeps the sequential
    # form: as a chain, ptxas spilled its softmax loop state (28 instructions at head_dim 128,
    # causal), and as sequential `if`s it has none. The audit counts spills for both.

    def set_registers(self, role: str) -> None:
        """setmaxnreg to the role's count (plan.roles): .inc above the launch budget (the SM's
        register file over the CTA's threads), .dec below it (ptxas refuses a .dec above it)."""
        if self.registers[role] > self.plan.hardware.registers_per_sm // self.threads_per_cta:
            cute.arch.setmaxregister_increase(self.registers[role])
        else:
            cute.arch.setmaxregister_decrease(self.registers[role])

    def check_tx_bytes(self, sQ_layout, sK_layout, sV_layout):
        """The TMA boxes bring the bytes the table's full barriers expect."""
        for name, layout, want in (("q_full", sQ_layout, self.tx_bytes["q_full"]),
                                   ("kv_full", sK_layout, self.tx_bytes["kv_full"]),
                                   ("kv_full (V)", sV_layout, self.v_tx_bytes)):
            nbytes = cute.size_in_bytes(self.dtype, cute.select(layout, mode=[0, 1, 2]))
            if nbytes != want:
                raise ValueError(f"{name}: the TMA brings {nbytes} bytes, the table expects "
                                 f"{want}")

    def storage_struct(self, sQ_layout, sK_layout, sO_layout):
        """SharedStorage in plan.smem's order (fa4lab.kernels.device.storage)."""
        return storage.storage_struct(self.plan, {
            "q": (self.dtype, cute.cosize(sQ_layout)),
            "kv": (self.dtype, cute.cosize(sK_layout)),
            "o": (self.dtype, cute.cosize(sO_layout)),
            # softmax -> correction mailbox: a row scale per step, then row_sum | row_max
            "stats": (Float32, self.q_stage * self.m_block * 2)})

    def make_p_part(self, smem):
        """The table's p_part mbarriers (Note [split P hand-off] in fa4lab.plan.sm100), one per
        Q tile, each completed by its softmax warpgroup's threads; None with one hand-off."""
        if not self.p_split:
            return None
        return pipeline.MbarrierArray(
            smem.p_part.data_ptr(), self.plan.barriers.barrier("p_part").stages,
            (pipeline.PipelineOp.AsyncThread,
             pipeline.CooperativeGroup(pipeline.Agent.Thread, self.arrivals["p_part"])))

    def make_pipeline(self, smem, key: str):
        """The DSL pipeline over the table's barriers `_PIPELINES[key]` (full, then empty): its
        stages, arrival counts and transaction bytes from the table."""
        pb = storage.pipeline_barriers(self.plan, *_PIPELINES[key])
        cls = _PIPELINE_CLASSES[key]
        kw = {"tx_count": pb.tx_bytes} if cls is pipeline.PipelineTmaUmma else {}
        return cls.create(
            num_stages=pb.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, pb.producers),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, pb.consumers),
            barrier_storage=getattr(smem, pb.full).data_ptr(), defer_sync=True, **kw)

    def visit_plan(self, m_block, seqlen_q, seqlen_k, left, right, mask_blocks=None,
                   split=None, num_splits=1):
        """(n_blocks, n_masked, order) of this CTA (fa4lab.kernels.device.scheduler): it visits
        n_blocks key blocks, none when no row of it sees a key; step s is block
        scheduler.visit_block(s, *order) (Note [block visit order] in fa4lab.tiling), the
        first n_masked of them masked for some row of the CTA. With a mask_mod, `mask_blocks`
        is its block table (Note [mask_mod block table] in fa4lab.tiling); with split-KV,
        `split` the CTA's split of `num_splits`: its blocks of the range, none for an empty
        split (`fa4lab.kernels.device.split`; like a CTA no row of which sees a key).

        Each role computes it itself: a value computed before the role branches would live across
        setmaxnreg and, at the launch budget of 65536 / 512 = 128 registers, spill.
        """
        n_min, n_max = scheduler.block_range(m_block, self.cta_m, self.pack, self.n_block,
                                             seqlen_q, seqlen_k, left, right)
        row = scheduler.table_row(mask_blocks, m_block)
        if row is not None:
            n_min, n_max = scheduler.table_range(n_min, n_max, row)
        if split is not None:
            n_min, n_max, _ = split_mod.narrow(n_min, n_max, seqlen_k, self.n_block,
                                               num_splits, split)
        left_end, mask_min = scheduler.mask_split(m_block, self.cta_m, self.pack, self.n_block,
                                                  seqlen_q, seqlen_k, left, right, n_min, n_max)
        if row is not None:
            left_end, mask_min = scheduler.table_split(n_min, n_max, left_end, mask_min, row)
        left_run = None if left is None and row is None else (n_min, left_end)
        n_masked = (n_max - mask_min) + (left_end - n_min)
        return n_max - n_min, n_masked, (n_max, mask_min, left_run)

    @cute.jit
    def tmem_tensors(self, thr_mma_qk, thr_mma_pv, tP_layout, tmem_ptr):
        """S_i, O_i (fp32) and P_i (16-bit, A operand) views of TMEM at the plan's columns."""
        tS = thr_mma_qk.make_fragment_C(thr_mma_qk.partition_shape_C(self.mma_tiler_qk[:2]))
        tO = thr_mma_pv.make_fragment_C(thr_mma_pv.partition_shape_C(self.mma_tiler_pv[:2]))
        tP = thr_mma_pv.make_fragment_A(cute.make_tensor(tS.iterator, tP_layout.outer))
        tP = tP[None, None, None, 0]
        tStS = [cute.make_tensor(tmem_ptr + c, tS.layout) for c in self.tmem_s_offset]
        tOtO = [cute.make_tensor(tmem_ptr + c, tO.layout) for c in self.tmem_o_offset]
        tOrP = [cute.make_tensor(cute.recast_ptr(tmem_ptr + c, dtype=self.dtype), tP.layout)
                for c in self.tmem_p_offset]
        return tStS, tOtO, tOrP

    @staticmethod
    def s_buffer(t: cute.Tensor, buffer, s_stride: int) -> cute.Tensor:
        """`t` (a view of S or P buffer 0, or of a TMEM copy's partition of it) in S buffer
        `buffer`, a run-time value (Note [S ping-pong]): the same view `s_stride` fp32 columns
        on per buffer. A 16-bit view (P as the MMA's A operand) moves 2 elements per column."""
        per_column = 32 // t.element_type.width
        return cute.make_tensor(t.iterator + buffer * (s_stride * per_column), t.layout)

    # ------------------------------------------------------------------ role: load
    @cute.jit
    def load(self, c: Cta, tile: Tile, kv_state, q_phase):
        """One work tile's TMA: Q tile 0, K, Q tile 1, V of the first block, then (K, V) of each
        next block in the tile's visit order (`visit_plan`). Returns (kv_state, q_phase)
        advanced (Note [pipeline states across tiles]). With a paged cache a block's page is
        read before its K slot is waited for, and its V copy reuses it."""
        visit = self.visit(c, tile)
        n_blocks, _, order = visit
        m_block, head, batch, _, seq = tile
        io, thr_mma_qk = c.io, c.mmas.thr_qk
        tma_atom_Q, tma_atom_K, tma_atom_V = io.tma_atom_Q, io.tma_atom_K, io.tma_atom_V
        pipe_q, pipe_kv = c.pipes.q, c.pipes.kv
        # Packed: the grid's head index is already the KV head and Q is viewed per KV head.
        head_kv = head if cutlass.const_expr(self.pack_gqa) else head // self.qhead_per_kvhead
        # Note [sm100 varlen]: the sequence's own rows (V is (d, s, h, b): its mode 1).
        mQ = seqlen.at_offset(io.mQ, seq.offset_q, self.varlen)
        b = seqlen.view_batch(self.varlen, batch)
        gQ = cute.local_tile(mQ[None, None, head, b], cute.select(self.mma_tiler_qk, [0, 2]),
                             (None, 0))
        no_mcast = cute.make_layout(1)
        tQsQ, tQgQ = cpasync.tma_partition(tma_atom_Q, 0, no_mcast,
                                           cute.group_modes(c.smem.q, 0, 3),
                                           cute.group_modes(thr_mma_qk.partition_A(gQ), 0, 3))
        # K/V: the sequence's rows (varlen: from its first key row), or the cache's pages.
        views = partial(self.kv_partitions, thr_mma_qk, c.mmas.thr_pv, tma_atom_K, io.mK,
                        c.smem.k, tma_atom_V, io.mV, c.smem.v, head_kv, b)
        tKsK, tKgK, tVsV, tVgV = views(seq.offset_k)
        # The page table's row is the sequence's, `batch` (b is 0 in a packed varlen batch).
        pages = partial(self.block_pages, io.mPageTable, batch, seq.seqlen_k)
        if cutlass.const_expr(self.ping_pong):
            # With varlen each K/V load rebuilds its view from the sequence's offset, read
            # again (Note [sm100 varlen ping-pong loads]).
            reload = None
            if cutlass.const_expr(self.varlen and self.page_size is None):
                reload = lambda: views(seq.reread_offset_k())  # noqa: E731
            self.load_ping_pong(tma_atom_Q, tQgQ, tQsQ, tma_atom_K, tKgK, tKsK, tma_atom_V,
                                tVgV, tVsV, pipe_q, pipe_kv, kv_state, m_block, visit, pages,
                                reload)
        else:
            if n_blocks > 0:
                n_first = scheduler.visit_block(0, *order)
                page = pages(n_first)
                for stage in cutlass.range_constexpr(self.q_stage):
                    q_state = phase_state(self.q_stage, stage, q_phase)
                    self.sites("load", "wait q_empty; expect_tx q_full", pipe_q.producer_acquire,
                               q_state, stage=stage)
                    cute.copy(tma_atom_Q, tQgQ[None, m_block * self.q_stage + stage],
                              tQsQ[None, stage], tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
                    if cutlass.const_expr(stage == 0):
                        self.sites("load", "wait kv_empty; expect_tx kv_full",
                                   pipe_kv.producer_acquire, kv_state)
                        self.copy_kv(tma_atom_K, tKgK, tKsK, n_first, page, kv_state,
                                     pipe_kv, pages)
                        kv_state.advance()
                self.sites("load", "wait kv_empty; expect_tx kv_full", pipe_kv.producer_acquire,
                           kv_state, **self.v_acquire)
                self.copy_kv(tma_atom_V, tVgV, tVsV, n_first, page, kv_state, pipe_kv,
                             pages)
                kv_state.advance()
                for i in cutlass.range(n_blocks - 1, unroll=1):
                    n = scheduler.visit_block(i + 1, *order)
                    page = pages(n)
                    self.sites("load", "wait kv_empty; expect_tx kv_full", pipe_kv.producer_acquire,
                               kv_state)
                    self.copy_kv(tma_atom_K, tKgK, tKsK, n, page, kv_state, pipe_kv, pages)
                    kv_state.advance()
                    self.sites("load", "wait kv_empty; expect_tx kv_full", pipe_kv.producer_acquire,
                               kv_state, **self.v_acquire)
                    self.copy_kv(tma_atom_V, tVgV, tVsV, n, page, kv_state, pipe_kv, pages)
                    kv_state.advance()
                q_phase ^= 1
        return kv_state, q_phase

    @cute.jit
    def load_ping_pong(self, tma_atom_Q, tQgQ, tQsQ, tma_atom_K, tKgK, tKsK, tma_atom_V, tVgV,
                       tVsV, pipe_q, pipe_kv, kv_state, m_block, visit, pages, views=None):
        """One Q tile: Q, K of step 0, then (K of step j + 1, V of step j) per step, then V of
        the last (the order the MMA warp reads them in: Note [S ping-pong]); `pages` (a block's
        page, `block_pages`) is read once per block, its V reusing its K's."""
        n_blocks, _, order = visit
        if n_blocks > 0:
            q_state = phase_state(1, 0, 1)
            self.sites("load", "wait q_empty; expect_tx q_full", pipe_q.producer_acquire,
                       q_state, stage=0)
            cute.copy(tma_atom_Q, tQgQ[None, m_block], tQsQ[None, 0],
                      tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
            # (kv_state advances here, in the loop body: the tracer carries it as a local.)
            n_first = scheduler.visit_block(0, *order)
            page_k = pages(n_first)
            self.load_kv(tma_atom_K, tKgK, tKsK, pipe_kv, kv_state, n_first, page_k, pages,
                         False)
            kv_state.advance()
            for i in cutlass.range(n_blocks - 1, unroll=1):
                n_next = scheduler.visit_block(i + 1, *order)
                page_v = page_k
                page_k = pages(n_next)
                if cutlass.const_expr(views is not None):
                    _, tKgK, _, tVgV = views()
                self.load_kv(tma_atom_K, tKgK, tKsK, pipe_kv, kv_state, n_next, page_k, pages,
                             False)
                kv_state.advance()
                self.load_kv(tma_atom_V, tVgV, tVsV, pipe_kv, kv_state,
                             scheduler.visit_block(i, *order), page_v, pages, True)
                kv_state.advance()
            if cutlass.const_expr(views is not None):
                _, tKgK, _, tVgV = views()
            self.load_kv(tma_atom_V, tVgV, tVsV, pipe_kv, kv_state,
                         scheduler.visit_block(n_blocks - 1, *order), page_k, pages, True)

    @cute.jit
    def load_kv(self, atom, gmem, smem, pipe_kv, kv_state, n, page: Int32, pages,
                is_v: cutlass.Constexpr[bool]):
        """TMA of K or V block n into kv_state's ring buffer."""
        self.sites("load", "wait kv_empty; expect_tx kv_full", pipe_kv.producer_acquire,
                   kv_state, **(self.v_acquire if is_v else {}))
        self.copy_kv(atom, gmem, smem, n, page, kv_state, pipe_kv, pages)

    def kv_partitions(self, thr_mma_qk, thr_mma_pv, tma_atom_K, mK, sK, tma_atom_V, mV, sV,
                      head_kv, b, offset_k):
        """(tKsK, tKgK, tVsV, tVgV) of KV head head_kv: batch b of the views, from packed key
        row offset_k with varlen; paged, the cache's pages, never offset (Note [paged key
        blocks]): ((TMA), row block, page) coordinates, a gather's per piece."""
        if self.gather:
            return (*self.gather_partition(tma_atom_K, mK, sK, head_kv, self.head_dim, 0),
                    *self.gather_partition(tma_atom_V, mV, sV, head_kv, self.head_dim_v, 1))
        tiler_k = cute.select(self.mma_tiler_qk, [1, 2])
        tiler_v = cute.select(self.mma_tiler_pv, [1, 2])
        if self.page_size is not None:   # a page's key blocks are its row blocks
            gK = cute.local_tile(mK[None, None, head_kv, None], tiler_k, (None, 0, None))
            gV = cute.local_tile(mV[None, None, head_kv, None], tiler_v, (0, None, None))
        else:   # V is (d, s, h, b): the sequence is its mode 1
            gK = cute.local_tile(seqlen.at_offset(mK, offset_k, self.varlen)[None, None,
                                                                              head_kv, b],
                                 tiler_k, (None, 0))
            gV = cute.local_tile(seqlen.at_offset(mV, offset_k, self.varlen, mode=1)[
                None, None, head_kv, b], tiler_v, (0, None))
        no_mcast = cute.make_layout(1)
        tKsK, tKgK = cpasync.tma_partition(tma_atom_K, 0, no_mcast, cute.group_modes(sK, 0, 3),
                                           cute.group_modes(thr_mma_qk.partition_B(gK), 0, 3))
        tVsV, tVgV = cpasync.tma_partition(tma_atom_V, 0, no_mcast, cute.group_modes(sV, 0, 3),
                                           cute.group_modes(thr_mma_pv.partition_B(gV), 0, 3))
        return tKsK, tKgK, tVsV, tVgV

    def gather_partition(self, atom, mX, sX, head_kv, cols: int, keys_mode: int):
        """(tXsX, tXgX) of a gather: SMEM ((TMA), piece, stage) over the plain view of the
        MMA's operand stages, and the cache's ((TMA), row block, page)."""
        n, k = (self.n_block, cols) if keys_mode == 0 else (cols, self.n_block)
        sX_plain = cute.make_tensor(sX.iterator, paged.plain(sX.layout, n, k, self.kv_stage))
        gX = paged.page_coords(mX, head_kv, self.n_block, cols, self.page_size, keys_mode)
        return cpasync.tma_partition(
            atom, 0, cute.make_layout(1),
            paged.stage_pieces(sX_plain, self.n_block, cols, self.page_size, keys_mode),
            cute.group_modes(gX, 0, 2))

    @cute.jit
    def block_pages(self, mPageTable, batch, seqlen_k, n_block: Int32,
                    group: cutlass.Constexpr[int] = 0):
        """This lane's page of key block n_block's pieces of `group` (`paged.read_pages`); 0,
        unused, unpaged."""
        if cutlass.const_expr(mPageTable is None):
            return Int32(0)
        return paged.read_pages(mPageTable, batch, n_block, seqlen_k, self.page_size,
                                self.n_block, group)

    @cute.jit
    def copy_kv(self, atom, gmem, smem, n, page: Int32, kv_state, pipe_kv, pages):
        """The TMA of K or V block n into kv_state's buffer, on its kv_full barrier: one box at
        block n, or paged at (row block, page) (Note [paged key blocks]); `page` this lane's
        page of block n, `pages` for a block of more than 32 (`paged.page_groups`)."""
        barrier = pipe_kv.producer_get_barrier(kv_state)
        if cutlass.const_expr(self.page_size is None):
            cute.copy(atom, gmem[None, n], smem[None, kv_state.index], tma_bar_ptr=barrier)
        elif cutlass.const_expr(self.gather):
            paged.copy_block(atom, gmem, smem, n, page, kv_state.index, barrier, self.page_size,
                             self.n_block, partial(pages, n),
                             paged.gather_unroll(max(self.head_dim, self.head_dim_v), True))
        else:
            _, row_block, _ = paged.block_reads(n, self.page_size, self.n_block)[0]
            # Clamped to the cache's last page, as `paged.copy_block` does (Note [clamped
            # indices]).
            page = cutlass.min(page, cute.size(gmem, mode=[2]) - 1)
            cute.copy(atom, gmem[None, row_block, page], smem[None, kv_state.index],
                      tma_bar_ptr=barrier)

    # ------------------------------------------------------------------ role: mma
    @cute.jit
    def mma(self, tiled_mma_qk, tiled_mma_pv, sQ, sK, sV, tStS, tOtO, tOrP,
            pipe_q, pipe_kv, pipe_s, pipe_o, p_part, n_blocks, kv_state, q_phase, p_phase,
            o_phase):
        """One thread issues every tcgen05.mma: S_i = Q_i K_j^T and O_i += P_i V_j, for the
        n_blocks key blocks of one work tile the load warp brings, in its order. Returns the
        tiled MMAs, kv_state and the q_full, p_ready and o_rescaled phases, advanced (Note
        [pipeline states across tiles])."""
        tSrQ = tiled_mma_qk.make_fragment_A(sQ)
        tSrK = tiled_mma_qk.make_fragment_B(sK)
        tOrV = tiled_mma_pv.make_fragment_B(sV)
        if n_blocks > 0:
            for stage in cutlass.range_constexpr(self.q_stage):
                self.sites("mma", "wait q_full", pipe_q.consumer_wait,
                           phase_state(self.q_stage, stage, q_phase), stage=stage)
                if cutlass.const_expr(stage == 0):
                    self.sites("mma", "wait kv_full", pipe_kv.consumer_wait, kv_state)
                tiled_mma_qk = self.gemm(
                    tiled_mma_qk, tStS[stage], tSrQ[None, None, None, stage],
                    tSrK[None, None, None, kv_state.index], False)
                self.sites("mma", "commit s_full", pipe_s.producer_commit,
                           phase_state(self.q_stage, stage, 0), stage=stage)
            self.sites("mma", "commit kv_empty", pipe_kv.consumer_release, kv_state)
            kv_state.advance()
            accumulate = Boolean(False)
            for i in cutlass.range(n_blocks - 1, unroll=1):
                self.sites("mma", "wait kv_full", pipe_kv.consumer_wait, kv_state)  # V_j
                v_state = kv_state.clone()
                kv_state.advance()
                for stage in cutlass.range_constexpr(self.q_stage):
                    tiled_mma_pv = self.value_mma(  # ladder: value mma
                        tiled_mma_pv, tOtO[stage], tOrP[stage],
                        tOrV[None, None, None, v_state.index], pipe_s, pipe_o, p_part, stage,
                        p_phase, o_phase, accumulate)
                    if cutlass.const_expr(stage == self.q_stage - 1):
                        self.sites("mma", "commit kv_empty", pipe_kv.consumer_release, v_state)
                    if cutlass.const_expr(stage == 0):
                        self.sites("mma", "wait kv_full", pipe_kv.consumer_wait,
                                   kv_state)  # K_{j-1}
                    tiled_mma_qk = self.gemm(
                        tiled_mma_qk, tStS[stage], tSrQ[None, None, None, stage],
                        tSrK[None, None, None, kv_state.index], False)
                    self.sites("mma", "commit s_full", pipe_s.producer_commit,
                               phase_state(self.q_stage, stage, 0), stage=stage)
                self.sites("mma", "commit kv_empty", pipe_kv.consumer_release, kv_state)
                kv_state.advance()
                p_phase ^= 1
                o_phase ^= 1
                accumulate = Boolean(True)
            # Every score MMA of the tile is issued: Q is free once they are done, and the next
            # tile's Q loads while the last value MMAs wait for P (Note [persistent CTAs]).
            for stage in cutlass.range_constexpr(self.q_stage):
                self.sites("mma", "commit q_empty", pipe_q.consumer_release,
                           phase_state(self.q_stage, stage, 0), stage=stage)
            self.sites("mma", "wait kv_full", pipe_kv.consumer_wait,
                       kv_state)  # V of the last block
            for stage in cutlass.range_constexpr(self.q_stage):
                tiled_mma_pv = self.value_mma(
                    tiled_mma_pv, tOtO[stage], tOrP[stage],
                    tOrV[None, None, None, kv_state.index], pipe_s, pipe_o, p_part, stage,
                    p_phase, o_phase, accumulate)
                self.sites("mma", "commit o_final", pipe_o.producer_commit,
                           phase_state(self.q_stage, stage, 0), stage=stage)
            self.sites("mma", "commit kv_empty", pipe_kv.consumer_release, kv_state)
            kv_state.advance()
            q_phase ^= 1
            p_phase ^= 1
            o_phase ^= 1
        return tiled_mma_qk, tiled_mma_pv, kv_state, q_phase, p_phase, o_phase

    @cute.jit
    def value_mma(self, tiled_mma_pv, tOtO, tOrP, tOrV, pipe_s, pipe_o, p_part,
                  stage: cutlass.Constexpr[int], p_phase, o_phase, accumulate):
        """O_i += P_i V_j once P_i is in TMEM (p_ready) and O_i was rescaled (o_rescaled). With
        a split hand-off (Note [split P hand-off] in fa4lab.plan.sm100) the K blocks of P's
        first p_split keys go once p_part completed, the others once p_ready did."""
        p_state = phase_state(self.q_stage, stage, p_phase)
        if cutlass.const_expr(self.p_split > 0):
            self.sites("mma", "wait p_part", p_part.wait, stage, p_phase, stage=stage)
        else:
            self.sites("mma", "wait p_ready", pipe_s.producer_acquire, p_state, stage=stage)
        self.sites("mma", "wait o_rescaled", pipe_o.producer_acquire,
                   phase_state(self.q_stage, stage, o_phase), stage=stage)
        k_split = cute.size(tOrP, mode=[2]) * self.p_split // self.n_block
        if cutlass.const_expr(self.p_split > 0):
            tiled_mma_pv = self.gemm(tiled_mma_pv, tOtO, tOrP, tOrV, accumulate, 0, k_split)
            self.sites("mma", "wait p_ready", pipe_s.producer_acquire, p_state, stage=stage)
            tiled_mma_pv = self.gemm(tiled_mma_pv, tOtO, tOrP, tOrV, accumulate, k_split)
        else:
            tiled_mma_pv = self.gemm(tiled_mma_pv, tOtO, tOrP, tOrV, accumulate)
        return tiled_mma_pv

    @cute.jit
    def mma_ping_pong(self, tiled_mma_qk, tiled_mma_pv, sQ, sK, sV, tStS, tOtO, tOrP,
                      pipe_q, pipe_kv, pipe_s, pipe_o, n_blocks):
        """One Q tile (Note [S ping-pong]): S(0) = Q K_0^T into S buffer 0; per step j <
        n_blocks - 1, S(j+1) into buffer (j+1) % 2, then O += P(j) V_j from buffer j % 2; then
        the last O += P V. Every value MMA commits o_final (the correction waits for it)."""
        tSrQ = tiled_mma_qk.make_fragment_A(sQ)
        tSrK = tiled_mma_qk.make_fragment_B(sK)
        tOrV = tiled_mma_pv.make_fragment_B(sV)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                self.kv_stage)
        if n_blocks > 0:
            self.sites("mma", "wait q_full", pipe_q.consumer_wait, phase_state(1, 0, 0),
                       stage=0)
            self.sites("mma", "wait kv_full", pipe_kv.consumer_wait, kv_state)   # K_0
            tiled_mma_qk = self.gemm(tiled_mma_qk, tStS, tSrQ[None, None, None, 0],
                                     tSrK[None, None, None, kv_state.index], False)
            self.sites("mma", "commit s_full", pipe_s.producer_commit, phase_state(2, 0, 0))
            self.sites("mma", "commit kv_empty", pipe_kv.consumer_release, kv_state)
            kv_state.advance()
            for j in cutlass.range(n_blocks - 1, unroll=1):
                nxt = (j + 1) & 1
                self.sites("mma", "wait kv_full", pipe_kv.consumer_wait, kv_state)  # K_j+1
                tiled_mma_qk = self.gemm(tiled_mma_qk, self.s_buffer(tStS, nxt, self.s_stride),
                                         tSrQ[None, None, None, 0],
                                         tSrK[None, None, None, kv_state.index], False)
                self.sites("mma", "commit s_full", pipe_s.producer_commit,
                           phase_state(2, nxt, 0))
                self.sites("mma", "commit kv_empty", pipe_kv.consumer_release, kv_state)
                kv_state.advance()
                tiled_mma_pv = self.value_ping_pong(tiled_mma_pv, tOtO, tOrP, tOrV, pipe_kv,
                                                    pipe_s, pipe_o, kv_state, j)
                kv_state.advance()
            tiled_mma_pv = self.value_ping_pong(tiled_mma_pv, tOtO, tOrP, tOrV, pipe_kv, pipe_s,
                                                pipe_o, kv_state, n_blocks - 1)
            self.sites("mma", "commit q_empty", pipe_q.consumer_release, phase_state(1, 0, 0),
                       stage=0)

    @cute.jit
    def value_ping_pong(self, tiled_mma_pv, tOtO, tOrP, tOrV, pipe_kv, pipe_s, pipe_o,
                        kv_state, j):
        """O += P(j) V_j for block step j (a run-time value): P from S buffer j % 2 once the
        softmax wrote it (p_ready), O once the correction is done with it (o_rescaled)."""
        self.sites("mma", "wait kv_full", pipe_kv.consumer_wait, kv_state)          # V_j
        self.sites("mma", "wait p_ready", pipe_s.producer_acquire,
                   phase_state(2, j & 1, (j >> 1) & 1))
        # o_rescaled starts released: the wait of step j passes on parity (j + 1) % 2.
        self.sites("mma", "wait o_rescaled", pipe_o.producer_acquire,
                   phase_state(1, 0, (j + 1) & 1), stage=0)
        tiled_mma_pv = self.gemm(tiled_mma_pv, tOtO, self.s_buffer(tOrP, j & 1, self.s_stride),
                                 tOrV[None, None, None, kv_state.index], j > 0)
        self.sites("mma", "commit o_final", pipe_o.producer_commit, phase_state(1, 0, 0),
                   stage=0)
        self.sites("mma", "commit kv_empty", pipe_kv.consumer_release, kv_state)
        return tiled_mma_pv

    @cute.jit
    def gemm(self, tiled_mma, acc, tA, tB, accumulate, k_first: cutlass.Constexpr[int] = 0,
             k_end: cutlass.Constexpr[int] = None):
        """acc (+)= A B over K blocks [k_first, k_end) of one tile (all by default); accumulate
        is a runtime flag (a K block after the first always accumulates)."""
        k_end = cute.size(tA, mode=[2]) if cutlass.const_expr(k_end is None) else k_end
        for k in cutlass.range_constexpr(k_first, k_end):
            tiled_mma.set(tcgen05.Field.ACCUMULATE, accumulate or k != 0)  # ladder: accumulate
            cute.gemm(tiled_mma, acc, tA[None, None, k], tB[None, None, k], acc)
        # Returned so callers rebind it: the ACCUMULATE field is traced state that must flow
        # through the caller's staged loops and branches as a plain local variable.
        return tiled_mma

    # ------------------------------------------------------------------ role: softmax
    @cute.jit
    def softmax(self, stage: cutlass.Constexpr[int], c: Cta, tStS, tile: Tile, s_count,
                stats_phase):
        """Softmax warpgroup `stage` on one work tile: one thread per row of Q tile `stage`,
        the CTA's blocks in its visit order (Note [block visit order] in fa4lab.tiling).
        Returns (s_count, stats_phase) advanced (Note [pipeline states across tiles]).

        Masked blocks (causal diagonal, a window's edges, the seqlen_k tail) first, with the
        mask; then the fully visible ones without it (`softmax_plan`).
        """
        m_block, head, batch, split, seq = tile
        seqlen_q, seqlen_k = seq.seqlen_q, seq.seqlen_k
        launch, sScale, pipe_stats = c.launch, c.smem.scale, c.pipes.stats
        left, right = launch.left, launch.right
        thr_mma_qk = c.mmas.thr_qk
        tidx = cute.arch.thread_idx()[0] % (32 * len(self.softmax_warps[stage]))
        tSAcc = tStS[(None, None), 0, 0]  # (m_block, n_block) fp32 columns
        tScS = thr_mma_qk.partition_C(cute.make_identity_tensor(self.mma_tiler_qk[:2]))
        tScS = tScS[(None, None), 0, 0]
        load_atom = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(32)),
                                        Float32)
        thr_load = tcgen05.make_tmem_copy(load_atom, tSAcc).get_slice(tidx)
        tStS_t2r = thr_load.partition_S(tSAcc)
        tScS_t2r = thr_load.partition_D(tScS)
        # P: n_block 16-bit values per row = n_block // 2 fp32 columns at the plan's P offset.
        p_cols = self.n_block * self.dtype.width // 32
        tStP = cute.make_tensor(tSAcc.iterator + (self.tmem_p_offset[stage]
                                                  - self.tmem_s_offset[stage]),
                                cute.composition(tSAcc.layout,
                                                 cute.make_layout((self.m_block, p_cols))))
        store_atom = cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(16)),
                                         Float32)
        thr_store = tcgen05.make_tmem_copy(store_atom, tStP).get_slice(tidx)
        tStP_r2t = thr_store.partition_D(tStP)
        tScP_shape = thr_store.partition_S(
            cute.make_identity_tensor((self.m_block, p_cols))).shape

        row_start = (m_block * self.q_stage + stage) * self.m_block
        # This thread's row's visible keys, once per tile (fa4lab.kernels.device.mask).
        limit = mask_mod.key_range(row_start + tScS_t2r[0][0], seqlen_q, seqlen_k, left, right,
                                   self.pack)
        n_blocks, n_masked, order, unmasked_end = self.softmax_plan(
            stage, m_block, seqlen_q, seqlen_k, left, right, launch.mask_blocks, split,
            launch.num_splits)
        n_max, mask_min, left_run = order
        mod_rows = None
        if cutlass.const_expr(self.mods is not None):  # fa4lab.kernels.device.mods
            mod_rows = ModRows(self.mods, launch.aux, batch, head, [row_start + tScS_t2r[0][0]],
                               seqlen_q, seqlen_k, self.pack)

        row_max = -Float32.inf
        row_sum = Float32(0.0)
        # s_count: the S buffer's phase, or (ping-pong) the block steps done; stats_phase:
        # stats_empty's (it starts released).
        step = (tStS_t2r, tScS_t2r, thr_load, thr_store, tStP_r2t, tScP_shape, sScale,
                c.pipes.s, pipe_stats, c.pipes.p_part, stage, tidx, limit, launch.scale_log2,
                launch.pre_scale,
                mod_rows)
        for i in cutlass.range(n_masked, unroll=1):
            row_max, row_sum, s_count, stats_phase = self.softmax_step(
                scheduler.visit_block(i, n_max, mask_min, left_run), True, row_max, row_sum,
                s_count, stats_phase, *step)
        for n in cutlass.range(mask_min - 1, unmasked_end - 1, -1, unroll=1):
            row_max, row_sum, s_count, stats_phase = self.softmax_step(
                n, False, row_max, row_sum, s_count, stats_phase, *step)
        if n_blocks > 0:
            # Final statistics for the correction warpgroup's normalisation and LSE.
            stats_state = phase_state(self.q_stage, stage, stats_phase)
            role = f"softmax{stage}"
            self.sites(role, "wait stats_empty", pipe_stats.producer_acquire, stats_state,
                       stage=stage)
            sScale[stage * self.m_block + tidx] = row_sum
            sScale[(self.q_stage + stage) * self.m_block + tidx] = row_max
            self.sites(role, "arrive stats_full", pipe_stats.producer_commit, stats_state,
                       stage=stage)
            if cutlass.const_expr(self.persistent):
                stats_phase ^= 1
        return s_count, stats_phase

    def softmax_plan(self, stage: int, m_block, seqlen_q, seqlen_k, left, right,
                     mask_blocks=None, split=None, num_splits=1):
        """(n_blocks, n_masked, order, unmasked_end) of Q tile `stage`'s softmax: it walks the
        CTA's n_blocks blocks, steps [0, n_masked) masked (block scheduler.visit_block(s,
        *order)), then blocks order[1] - 1 down to unmasked_end unmasked.

        Note [sm100 masked blocks]
        All roles walk the CTA's blocks in one order (`visit_plan`). Without a window's left
        side that order is plain n_max - 1 down, so each Q tile masks only the blocks ITS rows
        need masked: [mask_min, n_max) by the fa4lab.tiling rule for this Q tile (its first
        row, position row_start / g packed: Note [sm100 pack-GQA kernel]) within the CTA's
        range. With a left side (or a mask_mod's block table: its runs need not be the Q tile's
        own) the order puts the CTA's masked runs first, and both Q tiles mask those (each Q
        tile's own masked blocks are among them: at most one block per edge more than its own
        rule would mask).
        """
        n_blocks, n_masked, order = self.visit_plan(m_block, seqlen_q, seqlen_k, left, right,
                                                    mask_blocks, split, num_splits)
        n_max, mask_min, left_run = order
        if left_run is not None:
            return n_blocks, n_masked, order, left_run[1]
        # The range starts at block 0, but a split's starts where the split does.
        n_min = n_max - n_blocks if cutlass.const_expr(self.split_kv) else 0
        _, mask_min = scheduler.mask_split(m_block * self.q_stage + stage, self.m_block,
                                           self.pack, self.n_block, seqlen_q, seqlen_k, left,
                                           right, n_min, n_max)
        return n_blocks, n_max - mask_min, (n_max, mask_min, left_run), n_min

    @cute.jit
    def softmax_step(self, n_block, mask: cutlass.Constexpr[bool], row_max, row_sum, s_count,
                     stats_phase, tStS_t2r, tScS_t2r, thr_load, thr_store, tStP_r2t, tScP_shape,
                     sScale, pipe_s, pipe_stats, p_part, stage: cutlass.Constexpr[int], tidx,
                     limit, scale_log2: Float32, pre_scale: Float32, mod_rows):
        """One block: S -> (mask) -> row max -> scale to correction -> P = exp2 -> TMEM.

        Two Q tiles: S buffer `stage`, and `s_count` is its phase, flipped each step (as a
        count masked with & 1 instead, ptxas spilled up to 64 instructions in the softmax at
        head_dim 64 with a window and a sink, measured). Ping-pong (Note [S ping-pong]):
        `s_count` counts the block steps done; S buffer s_count % 2, used for the
        (s_count // 2)-th time, its S and P views moved there at run time."""
        sb = stage   # the S buffer's index in the table (None: the block step's, run time)
        if cutlass.const_expr(self.ping_pong):
            sb = None
            s_state = phase_state(2, s_count & 1, (s_count >> 1) & 1)
            tStS_t2r = self.s_buffer(tStS_t2r, s_count & 1, self.s_stride)
            tStP_r2t = self.s_buffer(tStP_r2t, s_count & 1, self.s_stride)
        else:
            s_state = phase_state(2, stage, s_count)   # the phase itself: it flips each step
        role = f"softmax{stage}"
        self.sites(role, "wait s_full", pipe_s.consumer_wait, s_state, stage=sb)
        tSrS = cute.make_rmem_tensor(tScS_t2r.shape, Float32)
        cute.copy(thr_load, tStS_t2r, tSrS)
        if cutlass.const_expr(self.softcap and not self.has_score_mod):  # Note [softcap]
            softmax_mod.softcap_row(tSrS, pre_scale)
        if cutlass.const_expr(self.has_score_mod):  # Note [score_mod and the scale]
            mod_rows.scores(0, tSrS, tScS_t2r, n_block * self.n_block, pre_scale, scale_log2,
                            self.softcap, mask)
        if cutlass.const_expr(mask):
            first, end = limit
            if cutlass.const_expr(first is None):
                mask_mod.mask_row(tSrS, tScS_t2r, end - n_block * self.n_block)
            else:
                mask_mod.mask_row(tSrS, tScS_t2r, end - n_block * self.n_block,
                                  first - n_block * self.n_block)
        if cutlass.const_expr(self.has_mask_mod and mask):  # Note [mask_mod blocks]
            mod_rows.mask(0, tSrS, tScS_t2r, n_block * self.n_block, True)
        block_max = tSrS[0]
        for j in cutlass.range_constexpr(1, cute.size(tSrS)):
            block_max = cute.arch.fmax(block_max, tSrS[j])
        # Note [conditional rescale] in fa4lab.kernels.device.softmax.
        row_max, row_scale = softmax_mod.update_max(row_max, block_max, scale_log2,
                                                Float32(self.rescale_threshold))
        stats_state = phase_state(self.q_stage, stage, stats_phase)
        self.sites(role, "wait stats_empty", pipe_stats.producer_acquire, stats_state,
                   stage=stage)
        sScale[stage * self.m_block + tidx] = row_scale
        self.sites(role, "arrive stats_full", pipe_stats.producer_commit, stats_state,
                   stage=stage)

        neg_basis = -softmax_mod.exp2_basis(row_max, scale_log2)
        # P in chunks of 32 columns: exp2, sum, cast, store to TMEM; the fp32 chunk then dies,
        # which keeps the softmax within its register budget (plan.roles).
        tSrP_f32 = cute.make_rmem_tensor(tScP_shape, Float32)
        tSrP = cute.make_tensor(cute.recast_ptr(tSrP_f32.iterator, dtype=self.dtype),
                                tSrS.layout)
        chunk = 32
        tSrS_c = cute.logical_divide(tSrS, cute.make_layout(chunk))
        tSrP_c = cute.logical_divide(tSrP, cute.make_layout(chunk))
        # P's row sum on f32x2 pairs (Note [packed exp2]), one packed chain: four spilled 6
        # instructions at head_dim 64 with a softcap (measured), two spilled as many.
        sum_chains = []
        for c in cutlass.range_constexpr(cute.size(tSrS) // chunk):
            for k in cutlass.range_constexpr(0, chunk, 2):
                j = c * chunk + k
                tSrS[j], tSrS[j + 1] = cute.arch.fma_packed_f32x2(
                    (tSrS[j], tSrS[j + 1]), (scale_log2, scale_log2), (neg_basis, neg_basis))
                if cutlass.const_expr(self.emulated[j // 2]):
                    tSrS[j], tSrS[j + 1] = exp2_poly3_x2(tSrS[j], tSrS[j + 1])
                else:
                    tSrS[j] = cute.math.exp2(tSrS[j], fastmath=True)
                    tSrS[j + 1] = cute.math.exp2(tSrS[j + 1], fastmath=True)
                softmax_mod.chain_into(sum_chains, j // 2, (tSrS[j], tSrS[j + 1]),
                                       cute.arch.add_packed_f32x2, width=1)
            tSrP_c[None, c].store(tSrS_c[None, c].load().to(self.dtype))
            cute.copy(thr_store, tSrP_f32[None, None, c], tStP_r2t[None, None, c])  # ladder: p-tmem
            if cutlass.const_expr((c + 1) * chunk == self.p_split):
                # P's first p_split keys are in TMEM: Note [split P hand-off]
                cute.arch.fence_view_async_tmem_store()
                self.sites(role, "arrive p_part", p_part.arrive, stage, None, stage=sb)
        cute.arch.fence_view_async_tmem_store()
        self.sites(role, "arrive p_ready", pipe_s.consumer_release, s_state,
                   stage=sb)  # P is in TMEM
        block_sum = softmax_mod.join_chains(sum_chains, cute.arch.add_packed_f32x2)
        row_sum = softmax_mod.update_sum(row_sum, row_scale, block_sum[0] + block_sum[1])
        s_next = s_count + 1 if cutlass.const_expr(self.ping_pong) else s_count ^ 1
        return row_max, row_sum, s_next, stats_phase ^ 1

    # ------------------------------------------------------------------ role: correction
    @cute.jit
    def correction(self, c: Cta, tOtO, tile: Tile, stats_state, o_phase, epi_phase):
        """One work tile: rescale O_i when a row max moved (per step), then O_i / row_sum ->
        sO (the sink in the sum: Note [sinks]), and LSE. Split-KV: O_i / row_sum (float32) and
        the LSE straight to the split's partials, no sink (`fa4lab.kernels.device.split`); the
        o_empty / o_staged hand-off with the epilogue warp stays, so the protocol is the
        table's. The LSE's rows are the sequence's, read again where LSE is stored
        (`seqlen.of_launch`), not kept live through the block loop. Returns stats_state and the
        o_final and o_empty phases, advanced (Note [pipeline states across tiles])."""
        n_blocks = self.visit(c, tile)[0]
        m_block, head, batch, split, _ = tile
        thr_mma_pv, sScale, io = c.mmas.thr_pv, c.smem.scale, c.io
        pipe_o, pipe_stats, pipe_epi = c.pipes.o, c.pipes.stats, c.pipes.epi
        tidx = cute.arch.thread_idx()[0] % (32 * len(self.correction_warps))
        for i in cutlass.range(n_blocks, unroll=1):
            for stage in cutlass.range_constexpr(self.q_stage):
                self.sites("correction", "wait stats_full", pipe_stats.consumer_wait, stats_state,
                           stage=stage)
                row_scale = sScale[stage * self.m_block + tidx]
                self.sites("correction", "arrive stats_empty", pipe_stats.consumer_release,
                           stats_state, stage=stage)
                stats_state.advance()
                if i > 0:  # before block 0 O_i holds nothing: the first value MMA overwrites it
                    if cutlass.const_expr(self.ping_pong):   # O += P(i-1) V is done
                        self.sites("correction", "wait o_final", pipe_o.consumer_wait,
                                   phase_state(1, 0, (i - 1) & 1), stage=0)
                    # A warp rescales only if one of its 32 rows moved its max past the threshold.
                    if softmax_mod.warp_rescale_needed(row_scale):
                        self.correction_rescale(thr_mma_pv, tOtO[stage], tidx, row_scale)
                    self.sites("correction", "arrive o_rescaled", pipe_o.consumer_release,
                               phase_state(self.q_stage, stage, 0), stage=stage)
        for stage in cutlass.range_constexpr(self.q_stage):
            row_sum = Float32(0.0)
            row_max = -Float32.inf
            if n_blocks > 0:
                self.sites("correction", "wait stats_full", pipe_stats.consumer_wait, stats_state,
                           stage=stage)
                row_sum = sScale[stage * self.m_block + tidx]
                row_max = sScale[(self.q_stage + stage) * self.m_block + tidx]
                self.sites("correction", "arrive stats_empty", pipe_stats.consumer_release,
                           stats_state, stage=stage)
                stats_state.advance()
                # The last value MMA's commit: the tile's one with two Q tiles, the n-th
                # ping-pong (one tile per CTA).
                final = (n_blocks - 1) & 1 if cutlass.const_expr(self.ping_pong) else o_phase
                self.sites("correction", "wait o_final", pipe_o.consumer_wait,
                           phase_state(self.q_stage, stage, final), stage=stage)
            row = (m_block * self.q_stage + stage) * self.m_block + tidx
            # Note [empty rows] and Note [sinks] in fa4lab.kernels.device.softmax.
            sink = None
            if cutlass.const_expr(io.mSink is not None and not self.split_kv):
                sink = softmax_mod.sink_log2(io.mSink, row, head, self.pack)
            inv_sum, lse = softmax_mod.finalize_row(row_sum, row_max, c.launch.scale_log2, sink)
            epi_state = phase_state(self.q_stage, stage, epi_phase)
            self.sites("correction", "wait o_empty", pipe_epi.producer_acquire, epi_state,
                       stage=stage)
            if cutlass.const_expr(self.split_kv):
                mOP, mLP = split_mod.split_views(io.mOPartial, io.mLSEPartial, split)
                seqlen_q = c.launch.seqlen_q   # split-KV is not varlen: the launch's
                self.correction_store_partial(thr_mma_pv, tOtO[stage], tidx, inv_sum,
                                              n_blocks > 0, mOP, row, head, batch, seqlen_q)
                softmax_mod.store_lse(mLP, row, lse, head, batch, seqlen_q, self.pack)
            else:
                self.correction_epilogue(thr_mma_pv, tOtO[stage], c.smem.o[None, None, stage],
                                         tidx,
                                         inv_sum, n_blocks > 0)
            cute.arch.fence_view_async_shared()
            self.sites("correction", "arrive o_staged", pipe_epi.producer_commit, epi_state,
                       stage=stage)
            if n_blocks > 0:
                cute.arch.fence_view_async_tmem_load()
                self.sites("correction", "arrive o_rescaled", pipe_o.consumer_release,
                           phase_state(self.q_stage, stage, 0), stage=stage)  # O_i read
            # At the sequence's rows with varlen.
            if cutlass.const_expr(self.return_lse and not self.split_kv):
                seq = seqlen.of_launch(batch, c.launch.seqlen_q, c.launch.seqlen_k,
                                       c.launch.varlen)
                softmax_mod.store_lse(seqlen.at_offset(io.mLSE, seq.offset_q, self.varlen), row,
                                      lse, head, seqlen.view_batch(self.varlen, batch),
                                      seq.seqlen_q, self.pack)
        if n_blocks > 0:
            o_phase ^= 1
        return stats_state, o_phase, epi_phase ^ 1

    @cute.jit
    def correction_rescale(self, thr_mma_pv, tOtO, tidx, row_scale):
        """O_i[row, :] *= row_scale, 16 columns at a time through registers."""
        cols = 16
        tOcO = thr_mma_pv.partition_C(cute.make_identity_tensor(self.mma_tiler_pv[:2]))
        load_atom = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(cols)),
                                        Float32)
        store_atom = cute.make_copy_atom(
            tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(cols)), Float32)
        tOtO_c = cute.composition(tOtO, cute.make_layout((self.m_block, cols)))
        tOcO_c = cute.composition(tOcO, cute.make_layout((self.m_block, cols)))
        thr_load = tcgen05.make_tmem_copy(load_atom, tOtO_c).get_slice(tidx)
        thr_store = tcgen05.make_tmem_copy(store_atom, tOtO_c).get_slice(tidx)
        tOtO_t2r = thr_load.partition_S(tOtO_c)
        tOtO_r2t = thr_store.partition_D(tOtO_c)
        frag_shape = thr_load.partition_D(tOcO_c).shape
        for c in cutlass.range_constexpr(self.head_dim_v // cols):
            tOrO = cute.make_rmem_tensor(frag_shape, Float32)
            cute.copy(thr_load, cute.make_tensor(tOtO_t2r.iterator + c * cols, tOtO_t2r.layout),
                      tOrO)
            for j in cutlass.range_constexpr(0, cute.size(tOrO), 2):
                tOrO[j], tOrO[j + 1] = cute.arch.mul_packed_f32x2(  # ladder: o-rescale
                    (tOrO[j], tOrO[j + 1]), (row_scale, row_scale))
            cute.copy(thr_store, tOrO,
                      cute.make_tensor(tOtO_r2t.iterator + c * cols, tOtO_r2t.layout))
        cute.arch.fence_view_async_tmem_store()

    @cute.jit
    def correction_store_partial(self, thr_mma_pv, tOtO, tidx, inv_sum, has_work, mOP, row,
                                 head, batch, seqlen_q):
        """Split-KV: this thread's row of O_i * inv_sum, float32, into the split's out_partial
        `mOP` (batch, seqlen_q, heads_q, head_dim_v), 16 columns at a time through registers;
        a row past seqlen_q (packed: seqlen_q * g) is dropped, a packed row goes to its
        (position, query head) (`unpack_row`)."""
        cols = 16
        tOcO = thr_mma_pv.partition_C(cute.make_identity_tensor(self.mma_tiler_pv[:2]))
        load_atom = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(cols)),
                                        Float32)
        tOtO_c = cute.composition(tOtO, cute.make_layout((self.m_block, cols)))
        tOcO_c = cute.composition(tOcO, cute.make_layout((self.m_block, cols)))
        thr_load = tcgen05.make_tmem_copy(load_atom, tOtO_c).get_slice(tidx)
        tOtO_t2r = thr_load.partition_S(tOtO_c)
        tOcO_t2r = thr_load.partition_D(tOcO_c)
        pos, q_head = unpack_row(row, head, self.pack)
        out_row = mOP[batch, pos, q_head, None]
        for c in cutlass.range_constexpr(self.head_dim_v // cols):
            tOrO = cute.make_rmem_tensor(tOcO_t2r.shape, Float32)
            if has_work:
                cute.copy(thr_load,
                          cute.make_tensor(tOtO_t2r.iterator + c * cols, tOtO_t2r.layout), tOrO)
            else:
                tOrO.fill(0.0)
            if row < seqlen_q * self.pack:
                for j in cutlass.range_constexpr(cute.size(tOrO)):
                    out_row[c * cols + tOcO_t2r[j][1]] = tOrO[j] * inv_sum

    @cute.jit
    def correction_epilogue(self, thr_mma_pv, tOtO, sO, tidx, inv_sum, has_work):
        """O_i * inv_sum, cast to 16 bits, into the swizzled sO staging tile for the TMA store."""
        cols = 32 * 8 // self.dtype.width
        tOsO = thr_mma_pv.partition_C(sO)
        tOcO = thr_mma_pv.partition_C(cute.make_identity_tensor(self.mma_tiler_pv[:2]))
        tOtO_c = cute.logical_divide(tOtO, cute.make_layout((self.m_block, cols)))
        tOcO_c = cute.logical_divide(tOcO, cute.make_layout((self.m_block, cols)))
        tOsO_c = cute.logical_divide(tOsO, cute.make_layout((self.m_block, cols)))
        load_atom = sm100_utils.get_tmem_load_op(
            self.mma_tiler_pv, LayoutEnum.ROW_MAJOR, self.dtype, Float32,
            (self.m_block, cols), use_2cta_instrs=False)
        tiled_load = tcgen05.make_tmem_copy(load_atom, tOtO_c[(None, None), 0])
        thr_load = tiled_load.get_slice(tidx)
        smem_atom = sm100_utils.get_smem_store_op(
            LayoutEnum.ROW_MAJOR, self.dtype, Float32, tiled_load)
        tiled_smem_store = cute.make_tiled_copy_D(smem_atom, tiled_load)
        tOtO_t2r = thr_load.partition_S(tOtO_c[(None, None), None])
        tOsO_r2s = thr_load.partition_D(tOsO_c[(None, None), None])
        tOcO_t2r = thr_load.partition_D(tOcO_c[(None, None), None])
        for c in cutlass.range_constexpr(self.head_dim_v // cols):
            tOrO = cute.make_rmem_tensor(tOcO_t2r[None, 0, 0, c].shape, Float32)
            if has_work:
                cute.copy(tiled_load, tOtO_t2r[None, 0, 0, c], tOrO)
            else:
                tOrO.fill(0.0)
            for j in cutlass.range_constexpr(0, cute.size(tOrO), 2):
                tOrO[j], tOrO[j + 1] = cute.arch.mul_packed_f32x2(
                    (tOrO[j], tOrO[j + 1]), (inv_sum, inv_sum))
            tOrO_16 = cute.make_rmem_tensor(tOrO.shape, self.dtype)
            tOrO_16.store(tOrO.load().to(self.dtype))
            cute.copy(tiled_smem_store, tOrO_16, tOsO_r2s[None, 0, 0, c])

    # ------------------------------------------------------------------ role: epilogue
    @cute.jit
    def epilogue(self, c: Cta, tile: Tile, epi_phase):
        """TMA store of one work tile's normalised O tiles (rows past seqlen_q are clipped by
        the TMA); with varlen, row by row into `mO_rows` (Note [sm100 varlen]). Returns the
        o_staged phase, advanced (Note [pipeline states across tiles])."""
        m_block, head, batch, _, seq = tile
        if cutlass.const_expr(self.varlen):
            self.epilogue_rows(c.launch.varlen[0], c.smem.o, c.pipes.epi, m_block, head, seq,
                               epi_phase)
        else:
            self.epilogue_tma(c.io.tma_atom_O, c.io.mO, c.smem.o, c.pipes.epi, m_block, head,
                              batch, epi_phase)
        return epi_phase ^ 1

    @cute.jit
    def epilogue_rows(self, mO_rows, sO, pipe_epi, m_block, head, seq, epi_phase):
        """The varlen store: each staged O tile's rows of the sequence, 16 bytes per lane."""
        lane = cute.arch.lane_idx()
        gO = cute.local_tile(seqlen.at_offset(mO_rows, seq.offset_q, True)[None, None, head, 0],
                             self.epi_tile, (None, 0))
        for stage in cutlass.range_constexpr(self.q_stage):
            self.sites("epilogue", "wait o_staged", pipe_epi.consumer_wait,
                       phase_state(self.q_stage, stage, epi_phase), stage=stage)
        for stage in cutlass.range_constexpr(self.q_stage):
            tile = m_block * self.q_stage + stage
            rows = seq.seqlen_q - tile * self.m_block
            if rows > 0:   # a Q tile past the sequence's end stores nothing
                # A loop, not unrolled: one warp at the epilogue's registers (plan.roles).
                seqlen.store_rows(sO[None, None, stage], gO[None, None, tile], rows, lane, 32,
                                  unroll=False)
        cute.arch.sync_warp()   # every lane has read its rows of the staging tiles
        for stage in cutlass.range_constexpr(self.q_stage):
            with cute.arch.elect_one():
                self.sites("epilogue", "arrive o_empty", pipe_epi.consumer_release,
                           phase_state(self.q_stage, stage, 0), stage=stage)

    @cute.jit
    def epilogue_tma(self, tma_atom_O, mO, sO, pipe_epi, m_block, head, batch, epi_phase):
        """The TMA store of the staged O tiles."""
        gO = cute.local_tile(mO[None, None, head, batch], self.epi_tile, (None, 0))
        tOsO, tOgO = cpasync.tma_partition(tma_atom_O, 0, cute.make_layout(1),
                                           cute.group_modes(sO, 0, 2), cute.group_modes(gO, 0, 2))
        for stage in cutlass.range_constexpr(self.q_stage):
            self.sites("epilogue", "wait o_staged", pipe_epi.consumer_wait,
                       phase_state(self.q_stage, stage, epi_phase), stage=stage)
            if cutlass.const_expr(not self.split_kv):   # split-KV: the correction stored O
                cute.copy(tma_atom_O, tOsO[None, stage],
                          tOgO[None, m_block * self.q_stage + stage])
                cute.arch.cp_async_bulk_commit_group()
        for stage in cutlass.range_constexpr(self.q_stage):
            # The smem tile may be reused once the TMA has read it; drain before exit.
            cute.arch.cp_async_bulk_wait_group(self.q_stage - 1 - stage, read=True)
            with cute.arch.elect_one():
                self.sites("epilogue", "arrive o_empty", pipe_epi.consumer_release,
                           phase_state(self.q_stage, stage, 0), stage=stage)
