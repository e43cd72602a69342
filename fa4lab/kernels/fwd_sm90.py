"""FlashAttention forward for Hopper (sm_90a) in the CuTe DSL: the FA3-style port of the FA4 ideas.

What it computes: O = softmax(Q K^T * scale) V and, if asked, LSE = logsumexp per query row
(natural log), for q (batch, seqlen_q, heads_q, d), k/v (batch, seqlen_k, heads_kv, d), with
GQA (query head h reads kv head h // (heads_q // heads_kv)), bottom-right causal masking, a
sliding window (left, right) and a learnable sink per query head (`fa4lab.spec`'s semantics),
softcap, any seqlen_q, seqlen_k >= 1. Rows that see no key give O = 0 and LSE = -inf (the
sink's logit with a sink).

Constraints: (head_dim, head_dim_v) one of `fa4lab.limits.KERNEL_HEAD_DIMS["sm90"]` (the plan
checks), bf16 or fp16, last dim contiguous, 16-byte aligned rows; sm_90a (wgmma, setmaxnreg, TMA).

How it is built (every number from `plan_forward(spec, arch="sm90")`):

* Roles (warpgroups of 128 threads): WG0 is the producer -- it gives registers away
  (`setmaxnreg` down) and its warp 0 issues TMA loads of Q (once) and K, V (per key block);
  WG1, WG2 (and WG3 for head_dim 64) are consumers -- they take registers (`setmaxnreg` up) and
  each owns one Q tile of `m_block` = 64 rows (one wgmma M), so a CTA covers `cta_m` = 128
  (192) query rows. On B200 the same work is split over softmax, correction, MMA and load
  warps because S/P/O live in TMEM; on Hopper the accumulators live in the consumers'
  registers, so one warpgroup does it all.
* Barriers (the plan's BarrierGraph): `q_full` (one phase, every consumer's Q tile; Q is loaded
  once, so no q_empty), `pipeline_k` / `pipeline_v` (k_full/k_empty, v_full/v_empty, kv_stage
  slots each: full = TMA bytes landed, empty = every consumer released the slot, per thread or
  per warp as the plan counts), and one named barrier `mma_turn<i>` per consumer for the
  ping-pong (a ring: consumer i passes the turn to consumer i + 1 mod q_stage), and one
  `epilogue<i>` per consumer. All of them are the protocol table `plan.protocol`
  (fa4lab.plan.sm90.build_protocol): every op goes through `self.sites` (fa4lab.kernels.protocol)
  by name, named barriers in their unaligned form with the table's ids and thread counts.
* Per key block, a consumer: S = Q K^T (wgmma, A and B from SMEM), mask if the block is MASKED
  or TAIL (the blocks outside a window are never visited; Note [block visit order] in
  fa4lab.tiling gives the order the producer and the consumers share), online softmax in
  base 2 with the conditional rescale (`fa4lab.kernels.device.softmax`), P converted to 16
  bits in registers and fed as wgmma's A operand for O += P V (B = V^T view). Intra-warpgroup
  overlap (FA3): the value wgmma of block j+1 runs while the softmax of block j does; the
  ping-pong hands the tensor core round the consumers; O is multiplied only when some row's
  max grew past the threshold (the point of the conditional rescale).
* Epilogue: O / row_sum (with a sink in the sum: Note [sinks]) to SMEM (stmatrix; in Q's bytes
  when the plan aliases them), TMA store to global (out-of-range rows are clipped by TMA); LSE
  written directly from registers.
* Paged K/V (`spec.page_size`, Note [paged key blocks] in fa4lab.kernels.device.paged): k, v
  are a cache of pages and the producer reads each key block's pages from the page table: one
  TMA box per block for pages of a multiple of n_block, a gather of one box per page for
  smaller pages (16, 32, 64), all on the block's one full barrier; every other page size (1 to
  15, 100, ...) copied row by row with cp.async by the four producer warps, each thread's
  copies arriving on the full barrier (Note [cp.async gather] in
  fa4lab.kernels.device.page_rows); split-KV too (below).
* pack-GQA (`plan.tiles.pack_gqa`, Note [sm90 pack-GQA kernel]): a CTA serves the
  qhead_per_kvhead query heads of one KV head, its rows being packed rows; only the Q/O views,
  the grid, the block ranges, the mask's row index and the LSE and sink addresses change.
* split-KV (`spec.split_kv`, `fa4lab.kernels.device.split`): num_splits (a runtime Int32) CTAs
  per tile, the split folded into the grid's head axis; each visits its split's blocks of the
  tile's range (of its sequence's own keys with seqused_k, as over a paged cache) and stores
  its float32 partial O (normalised over its keys) and LSE straight from registers
  (`epilogue_split`) for the combine kernel; no sink (the combine adds it).

Variable-length batches (spec.varlen, `fa4lab.attention_varlen`): packed q/k/v, one launch over
the batch's real tiles in LPT order from a tile table, O and LSE stored row by row: Note [sm90
varlen].

Tile order (`plan.tiles.order`, Note [tile order] in `fa4lab.kernels.device.scheduler`): causal
tiles run in FA4's LPT order, one CTA per tile; non-causal plans (but head_dim 256) run
persistent CTAs, min(tiles, SMs), each looping over tiles c, c + gridDim.x, ... with the next
tile's K/V loading under this tile's epilogue (Note [sm90 persistent CTAs] in fa4lab.plan.sm90,
which also says why causal stays one CTA per tile). Not done yet (notebook 06 lists it): cluster
multicast of K/V.

Run: `fa4lab.attention(q, k, v)` on an H100/H200 or `fa4lab.kernels.launch.attention_sm90(...)`;
compile on any machine with `fa4lab.kernels.compile.compile_forward(spec, arch="sm90a")`.
"""

from __future__ import annotations

from functools import partial

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from fa4lab.kernels.device import arguments, page_rows, paged, scheduler, seqlen, storage
from fa4lab.kernels.device import mask as mask_mod
from fa4lab.kernels.device import split as split_mod
from fa4lab.kernels.device.mods import ModRows, tile_rows
from fa4lab.kernels.device.opaque import opaque_zero
from fa4lab.kernels.device.pack_gqa import packed_tma as _packed_tma
from fa4lab.kernels.device.softmax import (
    OnlineSoftmax,
    rescale_rows,
    sink_log2,
    softcap_row,
    store_lse,
)
from fa4lab.kernels.protocol import Sites
from fa4lab.mods import refuse_split_with_mods
from fa4lab.plan.sm90 import MAX_CONSUMERS, kernel_registers

_WG = 128  # threads per warpgroup
_MAX_CONSUMERS = MAX_CONSUMERS  # named barrier ids (epilogue<i>, mma_turn<i>) come from the table


# ---- layouts of the wgmma accumulator (sm90-specific) ----

def acc_mn_view(acc: cute.Tensor) -> cute.Tensor:
    """((2, 2, V), MMA_M, MMA_N) accumulator -> ((2, MMA_M), (2, V, MMA_N)) = (rows, cols).

    A wgmma m64nN accumulator gives each thread pairs of adjacent columns (the first 2) in two
    rows 8 apart (the second 2), repeated every 8 columns (V = N / 8).
    """
    lay = cute.make_layout(acc.layout.shape)  # column-major over the same shape
    s, d = lay.shape, lay.stride
    mn = cute.make_layout(
        ((s[0][1], s[1]), (s[0][0], s[0][2], s[2])),
        stride=((d[0][1], d[1]), (d[0][0], d[0][2], d[2])),
    )
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, mn))


def acc_as_operand_a(acc: cute.Tensor) -> cute.Tensor:
    """View an m64nN fp32 accumulator as the register A operand of the next wgmma (K = N).

    ((2, 2, N/8), MMA_M, MMA_N) -> ((2, 2, 2), MMA_M, (N/16, MMA_N)): each k-block of 16 takes
    two consecutive 8-column groups, which is exactly the A-fragment order of a 16-bit wgmma.
    """
    lay = acc.layout
    l = cute.logical_divide(lay, ((None, None, 2), None, None))
    view = cute.make_layout(
        ((l.shape[0][0], l.shape[0][1], l.shape[0][2][0]), l.shape[1],
         (l.shape[0][2][1], l.shape[2])),
        stride=((l.stride[0][0], l.stride[0][1], l.stride[0][2][0]), l.stride[1],
                (l.stride[0][2][1], l.stride[2])),
    )
    return cute.make_tensor(acc.iterator, view)


# Note [sm90 pack-GQA kernel]
# With g = qhead_per_kvhead query heads per KV head packed into M (fa4lab.tiling's Note
# [pack-GQA rows]: packed row r is position r // g of query head kv * g + r % g), the grid's
# head axis runs over KV heads and its row axis over ceil(seqlen_q * g / cta_m) tiles. Q and O
# keep their TMA: the (seqlen, d, heads, batch) tensor is viewed as ((heads, seqlen), d, batch)
# and tiled by ((g, m_block / g), d), i.e. a TMA box of g heads x m_block / g positions whose
# SMEM rows come out head-fastest -- exactly the packed order (the plan checks g | m_block).
# The TMA coordinate tensor is then re-split into ((g, seqlen), d, heads_kv, batch), so a
# consumer's 64-row tile is local_tile over the packed mode and the KV head picks the group.
# Since g | m_block, every tile starts at head 0 of a position: rows past seqlen_q * g are
# positions past seqlen_q, which TMA zero-fills on load and clips on store, as without packing.
# The mask (causal, a window's edges) compares keys with the position (m_offset + row) // g, and
# the block ranges are fa4lab.tiling's packed ones: a CTA covers positions
# [m_block * cta_m / g, (m_block + 1) * cta_m / g) (`scheduler.block_range` with pack = g). LSE
# and the learnable sink use the same r -> (r // g, kv * g + r % g) map (`unpack_row`). The
# views are fa4lab.kernels.device.pack_gqa's (`packed_tma`), shared with the sm100 kernel.


def _smem_layout(dtype, rows: int, cols: int, stages: int):
    """(rows, cols, stages), cols contiguous, with the widest wgmma swizzle that fits."""
    atom = warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, cols), dtype)
    return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))


@cute.jit
def _gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, tA: cute.Tensor, tB: cute.Tensor,
          zero_init: cutlass.Constexpr[bool]) -> None:
    """acc (+)= A B over all k-blocks as one wgmma group (the caller waits on it)."""
    warpgroup.fence()
    # A fresh atom per call: its ACCUMULATE field is mutated below.
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in cutlass.range_constexpr(cute.size(tA.shape[2])):
        cute.gemm(atom, acc, tA[None, None, k], tB[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()


class FlashForwardSm90:
    """The sm90 forward kernel, configured once from a frozen `Plan`; no DSL code here."""

    arch = "sm90a"
    # Skip the O multiply when none of a thread's rows changed its max (FA4's point of the
    # conditional rescale); a class knob so a benchmark can compare both.
    skip_unneeded_rescale = True

    def __init__(self, plan, mutation=None, mods=None):
        spec = plan.spec
        t = plan.tiles
        self.plan = plan
        self.head_dim = t.head_dim
        self.head_dim_v = t.head_dim_v
        self.m_block = t.m_block          # rows per consumer warpgroup (one wgmma M)
        self.q_stage = t.q_stage          # consumer warpgroups = Q tiles per CTA
        self.cta_m = t.m_block * t.q_stage
        self.n_block = t.n_block
        self.kv_stage = t.kv_stage
        self.causal = spec.causal
        self.tile_order = t.order  # Note [tile order] in fa4lab.kernels.device.scheduler
        # Note [sm90 persistent CTAs] in fa4lab.plan.sm90: min(tiles, SMs) CTAs loop over tiles.
        self.persistent = plan.protocol.persistent
        self.num_ctas = plan.hardware.num_sms
        self.bytes_per_key = spec.element_bytes * (t.head_dim + t.head_dim_v)  # K + V rows
        self.qhead_per_kvhead = spec.qhead_per_kvhead
        # See Note [sm90 pack-GQA kernel]: g query heads per CTA row group, else 1.
        self.pack_gqa = bool(getattr(t, "pack_gqa", False))
        self.pack = self.qhead_per_kvhead if self.pack_gqa else 1
        if self.m_block % self.pack:
            raise ValueError(f"pack-GQA needs qhead_per_kvhead ({self.pack}) to divide m_block "
                             f"({self.m_block})")
        self.rescale_threshold = float(plan.rescale_threshold)
        self.softcap = bool(spec.softcap)  # its value is a runtime argument (Note [softcap])
        # score_mod / mask_mod (fa4lab.mods.KernelMods), compiled in: fa4lab.kernels.device.mods
        self.mods = mods if mods else None
        self.has_score_mod = self.mods is not None and mods.score_mod is not None
        self.has_mask_mod = self.mods is not None and mods.mask_mod is not None
        # Split-KV (fa4lab.kernels.device.split): float32 partials, num_splits at run time.
        self.split_kv = spec.split_kv
        refuse_split_with_mods(self.split_kv, self.mods is not None)
        # Which sides of a window the kernel has; their sizes are runtime arguments (Note
        # [runtime window]): causal is right = 0, a constant.
        self.window_size = spec.window_size
        # A paged K/V cache of page_size-token pages (Note [paged key blocks]), or None.
        self.page_size = spec.page_size
        # Pages no TMA read fits: every producer thread copies rows with cp.async (Note
        # [cp.async gather]).
        self.cp_async = t.kv_load == "cp.async"
        if self.page_size is not None and not self.cp_async:
            paged.check_page_size(self.page_size, self.n_block)
        self.row_threads = page_rows.row_threads(self.head_dim, self.head_dim_v, cutlass.BFloat16)
        self.producer_regs, self.consumer_regs = kernel_registers(plan)
        self.num_consumers = t.q_stage
        if not 1 <= self.num_consumers <= _MAX_CONSUMERS:
            raise ValueError(f"q_stage={self.num_consumers}: the sm90 kernel runs 1 to "
                             f"{_MAX_CONSUMERS} consumer warpgroups")
        self.num_threads = _WG * (1 + self.num_consumers)
        # Barrier arrive counts come from the plan's graph (the audit reads the same numbers).
        graph = plan.barriers
        self.q_arrivals = graph.barrier("q_full").arrive_count
        self.q_releases = graph.barrier("q_empty").arrive_count if self.persistent else 0
        self.kv_releases = graph.barrier("k_empty").arrive_count
        consumer_threads = _WG * self.num_consumers
        if self.kv_releases not in (consumer_threads, 4 * self.num_consumers):
            raise ValueError(f"k_empty arrive_count {self.kv_releases}: the kernel releases "
                             f"per consumer thread ({consumer_threads}) or per warp")
        names = {b.name for b in graph.barriers}
        # Note [ping-pong]: the consumers take turns issuing wgmmas (named barrier mma_turn<i>
        # is consumer i's turn), so one warpgroup's softmax overlaps the others' GEMMs.
        turns = {f"mma_turn{i}" for i in range(self.num_consumers)}
        self.pingpong = self.num_consumers >= 2 and turns <= names
        o_region = plan.smem.region("o")
        self.o_in_q = o_region.alias_of == "q"
        # Every barrier op by name from the protocol table (fa4lab.kernels.protocol).
        self.sites = Sites(plan, mutation)
        # A variable-length batch (Note [sm90 varlen]): packed q/k/v, the tile table's tiles.
        self.varlen = spec.varlen
        arguments.check_variant(self.varlen, self.split_kv, self.pack_gqa, "Note [sm90 varlen]")

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,    # (batch, seqlen_q, heads_q, head_dim)
        mK: cute.Tensor,    # (batch, seqlen_k, heads_kv, head_dim)
        mV: cute.Tensor,    # (batch, seqlen_k, heads_kv, head_dim_v)
        mO: cute.Tensor,    # (batch, seqlen_q, heads_q, head_dim_v)
        mLSE: cute.Tensor | None,  # (batch, heads_q, seqlen_q) fp32
        mSink: cute.Tensor | None,  # (heads_q,) fp32 learnable sink logits: Note [sinks]
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
        arguments.check_call(self, "Note [sm90 varlen]", mask_blocks, mCuSeqlensQ,
                             mCuSeqlensK, mSeqUsedK, mTileTable, mPageTable, mOPartial,
                             mLSEPartial)
        dtype = self.dtype = mQ.element_type
        mQ, mK, mV, mO, mLSE = arguments.packed_views(self.varlen, self.page_size is not None,
                                                      mQ, mK, mV, mO, mLSE)
        # (b, s, h, d) -> (s, d, h, b): TMA boxes are (rows, head_dim) of one (head, batch). A
        # paged cache (pages, page_size, h, d) becomes (page_size, d, h, pages) the same way.
        mQ, mK, mV, mO = [
            cute.make_tensor(x.iterator, cute.select(x.layout, mode=[1, 3, 2, 0]))
            for x in (mQ, mK, mV, mO)
        ]
        if const_expr(mLSE is not None):
            mLSE = cute.make_tensor(mLSE.iterator, cute.select(mLSE.layout, mode=[2, 1, 0]))

        K_MAJOR = OperandMajorMode.K
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, K_MAJOR, K_MAJOR, Float32, (1, 1, 1), (self.m_block, self.n_block))
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, K_MAJOR, OperandMajorMode.MN, Float32, (1, 1, 1),
            (self.m_block, self.head_dim_v), warpgroup.OperandSource.RMEM)

        sQ_layout = _smem_layout(dtype, self.m_block, self.head_dim, self.q_stage)
        sK_layout = _smem_layout(dtype, self.n_block, self.head_dim, self.kv_stage)
        sV_layout = _smem_layout(dtype, self.n_block, self.head_dim_v, self.kv_stage)
        sO_layout = _smem_layout(dtype, self.m_block, self.head_dim_v, self.q_stage)

        load = cpasync.CopyBulkTensorTileG2SOp()
        store = cpasync.CopyBulkTensorTileS2GOp()
        if const_expr(self.pack_gqa):
            tma_atom_Q, tma_Q = _packed_tma(load, mQ, cute.select(sQ_layout, mode=[0, 1]),
                                            (self.m_block, self.head_dim), self.pack)
            tma_atom_O, tma_O = _packed_tma(store, mO, cute.select(sO_layout, mode=[0, 1]),
                                            (self.m_block, self.head_dim_v), self.pack)
        else:
            tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(
                load, mQ, cute.select(sQ_layout, mode=[0, 1]), (self.m_block, self.head_dim))
            tma_atom_O, tma_O = cpasync.make_tiled_tma_atom(
                store, mO, cute.select(sO_layout, mode=[0, 1]), (self.m_block, self.head_dim_v))
        if const_expr(self.cp_async):   # Note [cp.async gather]: no TMA for K and V
            tma_atom_K, tma_K, tma_atom_V, tma_V = None, mK, None, mV
        elif const_expr(self.page_size is not None):   # Note [paged key blocks]
            tma_atom_K, tma_K = paged.page_tma(load, mK, cute.select(sK_layout, mode=[0, 1]),
                                               self.n_block, self.head_dim, self.page_size)
            tma_atom_V, tma_V = paged.page_tma(load, mV, cute.select(sV_layout, mode=[0, 1]),
                                               self.n_block, self.head_dim_v, self.page_size)
        else:
            tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(
                load, mK, cute.select(sK_layout, mode=[0, 1]), (self.n_block, self.head_dim))
            tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(
                load, mV, cute.select(sV_layout, mode=[0, 1]), (self.n_block, self.head_dim_v))
        self.q_bytes = cute.size_in_bytes(dtype, sQ_layout)  # all consumers' tiles, one phase
        self.k_bytes = cute.size_in_bytes(dtype, cute.select(sK_layout, mode=[0, 1]))
        self.v_bytes = cute.size_in_bytes(dtype, cute.select(sV_layout, mode=[0, 1]))

        # Declared from plan.smem in its order (fa4lab.kernels.device.storage): q, k, v, [o],
        # then the table's mbarriers. O staging has its own bytes unless the plan aliases it
        # onto Q.
        self.shared_storage = storage.storage_struct(self.plan, {
            "q": (dtype, cute.cosize(sQ_layout)), "k": (dtype, cute.cosize(sK_layout)),
            "v": (dtype, cute.cosize(sV_layout)), "o": (dtype, cute.cosize(sO_layout))})
        # With pack-GQA: seqlen_q * g packed rows per KV head (Note [sm90 pack-GQA kernel]).
        heads = cute.size(mK.shape[2]) if const_expr(self.pack_gqa) else cute.size(mQ.shape[2])
        if const_expr(self.split_kv):   # the splits fold into the head axis
            heads = heads * num_splits
        if const_expr(self.varlen):   # Note [varlen tile table] in ...device.scheduler
            tiles = scheduler.varlen_num_tiles(mTileTable, heads)
            grid = (cutlass.min(tiles, self.num_ctas) if const_expr(self.persistent) else tiles,
                    1, 1)
        else:
            grid = scheduler.grid_shape(cute.size(mQ.shape[0]) * self.pack, heads,
                                        cute.size(mQ.shape[3]), self.cta_m, self.tile_order,
                                        self.num_ctas if const_expr(self.persistent) else None)
        self.kernel(
            tiled_mma_qk, tiled_mma_pv,
            tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_V, tma_V, tma_atom_O, tma_O, mLSE,
            mSink, scale_log2, pre_scale, window_left, window_right, aux, mask_blocks, mPageTable,
            num_splits, mOPartial, mLSEPartial, sQ_layout, sK_layout, sV_layout, sO_layout,
            (mO if const_expr(self.varlen) else None, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK,
             mTileTable),
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(
        self,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        # mQ, mO: (seqlen_q, d, heads_q, batch), or ((g, seqlen_q), d, heads_kv, batch) packed
        tma_atom_Q: cute.CopyAtom, mQ: cute.Tensor,
        # mK, mV: (seqlen_k, d, heads_kv, batch), or paged (page_size, d, heads_kv, num_pages);
        # no atom when cp.async copies them (Note [cp.async gather])
        tma_atom_K: cute.CopyAtom | None, mK: cute.Tensor,
        tma_atom_V: cute.CopyAtom | None, mV: cute.Tensor,
        tma_atom_O: cute.CopyAtom, mO: cute.Tensor,
        mLSE: cute.Tensor | None,                     # (seqlen_q, heads_q, batch)
        mSink: cute.Tensor | None,                    # (heads_q,)
        scale_log2: Float32,
        pre_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        aux: tuple | None,
        mask_blocks: cute.Tensor | None,              # (cta tiles, 4) int32
        mPageTable: cute.Tensor | None,               # (batch, pages_per_seq) int32
        num_splits: Int32,
        mOPartial: cute.Tensor | None,   # (num_splits, batch, seqlen_q, heads_q, dv) fp32
        mLSEPartial: cute.Tensor | None,  # (num_splits, batch, seqlen_q, heads_q) fp32
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        # (mO (total_q, dv, heads_q, 1) or None, cu_seqlens_q, cu_seqlens_k, seqused_k, tile
        # table): Note [sm90 varlen]; all None but seqused_k's when not varlen
        varlen: tuple,
    ):
        self.sites.start()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O):
                if const_expr(atom is not None):
                    cpasync.prefetch_descriptor(atom)

        smem = cutlass.memory.SmemAllocator().allocate(self.shared_storage)

        # ---- barriers: the protocol table's, with its stages, counts and bytes ----
        # One tile per CTA loads Q once, so no q_empty; a persistent CTA has one.
        mbar_q = smem.q_full.data_ptr()
        mbar_q_empty = smem.q_empty.data_ptr() if const_expr(self.persistent) else None
        if warp_idx == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(mbar_q, self.q_arrivals)
                if const_expr(self.persistent):
                    cute.arch.mbarrier_init(mbar_q_empty, self.q_releases)
        pipeline_k = self.make_pipeline(smem, "k")
        pipeline_v = self.make_pipeline(smem, "v")
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sQ = smem.q.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = smem.k.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = smem.v.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sO = getattr(smem, "q" if self.o_in_q else "o").get_tensor(sO_layout.outer,
                                                                  swizzle=sO_layout.inner)

        if warp_idx < 4:
            # ===================== producer warpgroup (role "load") =====================
            cute.arch.setmaxregister_decrease(self.producer_regs)
            load = partial(self.load, tma_atom_Q, mQ, tma_atom_K, mK, tma_atom_V, mV, sQ, sK, sV,
                           (mbar_q, mbar_q_empty), pipeline_k, pipeline_v, window_left,
                           window_right, mask_blocks, varlen, mPageTable, num_splits)
            if const_expr(self.cp_async):   # all four warps copy K and V
                load()
            elif warp_idx == 0:
                load()
        else:
            # ========== consumer warpgroups (roles "consumer0", "consumer1", ...) ==========
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self.consume(tiled_mma_qk, tiled_mma_pv, tma_atom_O, mO, mLSE, mSink, sQ, sK, sV,
                         sO, (mbar_q, mbar_q_empty), pipeline_k, pipeline_v, self.seqlen_q_of(mQ),
                         paged.launch_seqlen_k(self.page_size, mK, mPageTable), scale_log2,
                         pre_scale, aux,
                         mask_blocks, varlen, num_splits, mOPartial, mLSEPartial,
                         *self.window(window_left, window_right))
        self.sites.finish()

    @cute.jit
    def softcap_scores(self, acc_S: cute.Tensor, pre_scale: Float32):
        """Scores -> tanh(score * pre_scale) when the plan caps them (Note [softcap]); with a
        score_mod, `mod_scores` caps them."""
        if const_expr(self.softcap and not self.has_score_mod):
            softcap_row(acc_S, pre_scale)

    @cute.jit
    def mod_scores(self, acc_S_mn: cute.Tensor, tScS0_mn: cute.Tensor, n_block: Int32,
                   mod_rows, pre_scale: Float32, scale_log2: Float32,
                   masked: cutlass.Constexpr[bool]):
        """Scores -> score_mod(scaled, capped score): Note [score_mod and the scale]."""
        if const_expr(self.has_score_mod):
            mod_rows.scores_mn(acc_S_mn, tScS0_mn, n_block * self.n_block, pre_scale,
                               scale_log2, self.softcap, masked)

    @cute.jit
    def mask_scores(self, acc_S_mn: cute.Tensor, tScS0_mn: cute.Tensor, limits: cute.Tensor,
                    n_block: Int32, mod_rows, masked: cutlass.Constexpr[bool]):
        """The key-length / causal / window limits and the mask_mod in a masked block; an
        unmasked block is visible whole (Note [mask_mod blocks])."""
        if const_expr(masked):
            mask_mod.apply_limits(acc_S_mn, tScS0_mn, limits, n_block * self.n_block)
            if const_expr(self.has_mask_mod):
                mod_rows.mask_mn(acc_S_mn, tScS0_mn, n_block * self.n_block, True)

    def make_pipeline(self, smem, x: str):
        """The TMA pipeline over the table's `{x}_full` / `{x}_empty` (x = "k" or "v"), or the
        cp.async one (Note [cp.async gather]: every producer thread arrives, no bytes)."""
        pb = storage.pipeline_barriers(self.plan, f"{x}_full", f"{x}_empty")
        if self.cp_async:
            return pipeline.PipelineCpAsync.create(
                barrier_storage=getattr(smem, pb.full).data_ptr(), num_stages=pb.stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, pb.producers),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, pb.consumers),
                defer_sync=True)
        nbytes = self.k_bytes if x == "k" else self.v_bytes
        if pb.tx_bytes != nbytes:
            raise ValueError(f"{pb.full}: the TMA brings {nbytes} bytes, the table expects "
                             f"{pb.tx_bytes}")
        return pipeline.PipelineTmaAsync.create(
            barrier_storage=getattr(smem, pb.full).data_ptr(), num_stages=pb.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, pb.producers),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, pb.consumers),
            tx_count=pb.tx_bytes, defer_sync=True)

    def seqlen_q_of(self, mQ):
        """Query positions (not packed rows) of the Q coordinate tensor."""
        if const_expr(self.pack_gqa):
            return cute.size(mQ.shape[0][1])
        return cute.size(mQ.shape[0])

    def window(self, window_left, window_right):
        """(left, right) for the mask and the block ranges (`mask.window_sides`)."""
        return mask_mod.window_sides(self.window_size, self.causal, window_left, window_right)

    def visit_plan(self, m_block, seqlen_q, seqlen_k, left, right, mask_blocks=None,
                   split=None, num_splits=1):
        """(n_blocks, n_masked, order) of this CTA: it visits n_blocks key blocks, the first
        n_masked of them masked, step s being block scheduler.visit_block(s, *order) (Note
        [block visit order] in fa4lab.tiling). The producer and the consumers both call this,
        so they walk the same blocks in the same order. Block ranges are the whole CTA's (one
        K/V stream feeds every consumer), so a consumer may mask a block its own rows see whole.
        With a mask_mod, `mask_blocks` is its block table (Note [mask_mod block table]); with
        split-KV, `split` the CTA's split of `num_splits` (Note [empty splits]).
        """
        n_min, n_max = scheduler.block_range(m_block, self.cta_m, self.pack, self.n_block,
                                             seqlen_q, seqlen_k, left, right)
        row = scheduler.table_row(mask_blocks, m_block)
        if row is not None:
            n_min, n_max = scheduler.table_range(n_min, n_max, row)
        if split is not None:   # the split's blocks of the range: fa4lab.kernels.device.split
            n_min, n_max, _ = split_mod.narrow(n_min, n_max, seqlen_k, self.n_block,
                                               num_splits, split)
        # Note [fully masked CTAs]: a CTA whose rows all see no key (causal or a window's right
        # side with seqlen_q > seqlen_k: the range is [0, 0)) still visits block 0 fully
        # masked, which yields O = 0 and LSE = -inf through the normal path (no special case,
        # no uninitialised output).
        n_max = cutlass.max(n_max, n_min + 1)
        left_end, mask_min = scheduler.mask_split(m_block, self.cta_m, self.pack, self.n_block,
                                                  seqlen_q, seqlen_k, left, right, n_min, n_max)
        if row is not None:
            left_end, mask_min = scheduler.table_split(n_min, n_max, left_end, mask_min, row)
        # The first block visited is always masked (`first_block`): n_max - 1 in the right run.
        mask_min = cutlass.min(mask_min, n_max - 1)
        left_run = None
        if left is not None or row is not None:
            left_end = cutlass.min(left_end, mask_min)
            left_run = (n_min, left_end)
        n_masked = (n_max - mask_min) + (left_end - n_min)
        return n_max - n_min, n_masked, (n_max, mask_min, left_run)

    # Note [sm90 varlen]
    # A variable-length batch (spec.varlen) comes packed: q, out (total_q, heads, d), k, v
    # (total_k, heads_kv, d), LSE (heads_q, total_q). The kernel views each as a batch of one
    # (`seqlen.as_batch_of_one`), so the TMA descriptors are the padded kernel's over the
    # packed tensors; a tile (from the tile table: Note [varlen tile table]) reads its
    # sequence's offsets and lengths (`seqlen.sequence`) and shifts its Q, K, V, O and LSE views
    # to the sequence's first row (`seqlen.at_offset`); from there on positions, masks and block
    # ranges are the sequence's own. O is not stored by TMA but row by row from the SMEM
    # staging, and LSE row by row, both predicated on the sequence's seqlen_q: Note [varlen rows
    # past a sequence] in fa4lab.kernels.device.seqlen. seqused_k works with or without varlen.

    def sequence(self, batch, seqlen_q, seqlen_k, varlen):
        """Sequence `batch`'s offsets and lengths (`seqlen.sequence`): the fixed sizes when
        the launch has neither cu_seqlens nor seqused_k."""
        return seqlen.of_launch(batch, seqlen_q, seqlen_k, varlen)

    def split_keys(self, m_block, seqlen_q, seqlen_k, left, right, split, num_splits):
        """The key length the CTA's row limits use: seqlen_k, or 0 for a split that keeps no
        block of the tile's range (Note [empty splits] in fa4lab.kernels.device.split)."""
        if const_expr(not self.split_kv):
            return seqlen_k
        n_min, n_max = scheduler.block_range(m_block, self.cta_m, self.pack, self.n_block,
                                             seqlen_q, seqlen_k, left, right)
        _, _, seen = split_mod.narrow(n_min, n_max, seqlen_k, self.n_block, num_splits, split)
        return split_mod.keys_seen(seqlen_k, seen)

    @cute.jit
    def load(self, tma_atom_Q, mQ, tma_atom_K, mK, tma_atom_V, mV, sQ, sK, sV, mbars,
             pipeline_k, pipeline_v, window_left: Int32, window_right: Int32, mask_blocks,
             varlen, mPageTable, num_splits: Int32):
        """Producer warp: for each work tile, Q once, then K and V block by block in the visit
        order (`visit_plan`); a persistent CTA waits for q_empty before each tile's Q."""
        args = (tma_atom_Q, mQ, tma_atom_K, mK, tma_atom_V, mV, sQ, sK, sV, mbars[0], pipeline_k,
                pipeline_v, *self.window(window_left, window_right), mask_blocks, varlen,
                mPageTable, num_splits)
        seqlen_k = paged.launch_seqlen_k(self.page_size, mK, mPageTable)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.kv_stage)
        if const_expr(self.persistent):
            q_phase = Int32(1)   # q_empty starts released
            first, stop, step = scheduler.work_tiles(self, mQ, varlen, num_splits)
            for tile in cutlass.range(first, stop, step, unroll=1):
                self.sites("load", "wait q_empty", cute.arch.mbarrier_wait, mbars[1], q_phase,
                           stage=0)
                q_phase = q_phase ^ 1
                work = scheduler.work(self, mQ, seqlen_k, varlen, num_splits, tile)
                state = self.load_tile(*args, work, tile, state)
        else:
            self.load_tile(*args, scheduler.work(self, mQ, seqlen_k, varlen, num_splits), None,
                           state)

    @cute.jit
    def load_tile(self, tma_atom_Q, mQ, tma_atom_K, mK, tma_atom_V, mV, sQ, sK, sV, mbar_q,
                  pipeline_k, pipeline_v, left, right, mask_blocks, varlen, mPageTable,
                  num_splits, coords, tile, state):
        """One work tile's loads (`coords` those of linear tile `tile`, None: the CTA's one
        tile); returns the K/V ring's next slot.

        Order K of step 0, then (K of step s + 1, V of step s) pairs, then V of the last step: a
        consumer issues the score wgmma of step s + 1 before the value wgmma of step s (see
        `consume_tile`), so K runs one ahead. With a paged cache a block's page indices are
        read before its K slot is waited for, and its V copy reuses them.
        """
        m_block, head, batch, split = coords
        # Packed: the grid's head index is already the KV head and Q is viewed per KV head.
        head_kv = head if const_expr(self.pack_gqa) else head // self.qhead_per_kvhead
        launch_k = paged.launch_seqlen_k(self.page_size, mK, mPageTable)
        seq = self.sequence(batch, self.seqlen_q_of(mQ), launch_k, varlen)
        seqlen_q, seqlen_k = seq.seqlen_q, seq.seqlen_k
        mQ = seqlen.at_offset(mQ, seq.offset_q, self.varlen)
        b = seqlen.view_batch(self.varlen, batch)
        gQ = cute.local_tile(mQ[None, None, head, b], (self.m_block, self.head_dim), (None, 0))
        one = cute.make_layout(1)
        tQsQ, tQgQ = cpasync.tma_partition(tma_atom_Q, 0, one, cute.group_modes(sQ, 0, 2),
                                           cute.group_modes(gQ, 0, 2))
        tKsK, tKgK = self.kv_partition(tma_atom_K, mK, sK, head_kv, b, seq.offset_k,
                                       self.head_dim, mPageTable)
        tVsV, tVgV = self.kv_partition(tma_atom_V, mV, sV, head_kv, b, seq.offset_k,
                                       self.head_dim_v, mPageTable)
        # The page table's row is the sequence's, `batch` (b is 0 in a packed varlen batch).
        pages = partial(self.block_pages, mPageTable, batch, seqlen_k)

        if const_expr(self.cp_async):   # warp 0 of the four issues Q's TMA
            if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0:
                self.load_q(tma_atom_Q, tQgQ, tQsQ, mbar_q, m_block)
        else:
            self.load_q(tma_atom_Q, tQgQ, tQsQ, mbar_q, m_block)

        n_blocks, _, order = self.visit_plan(m_block, seqlen_q, seqlen_k, left, right,
                                             mask_blocks, split, num_splits)
        n_first = scheduler.visit_block(0, *order)
        page_k = pages(n_first)
        self.fill(pipeline_k, "k", state, tma_atom_K, tKgK, tKsK, n_first, page_k, pages)
        if const_expr(self.split_kv and mPageTable is not None):
            # The page table's row is read again for the block loop rather than kept live from
            # the tile's coordinates: in the producer's registers a split kernel's LPT
            # coordinates (causal) spilled it (page 16: one STL and one LDL, measured).
            _, _, batch, _ = scheduler.work(
                self, mQ, paged.launch_seqlen_k(self.page_size, mK, mPageTable), varlen,
                num_splits, tile)
            pages = partial(self.block_pages, mPageTable, batch, seqlen_k)
        for i in cutlass.range(n_blocks - 1, unroll=1):
            prev = state.clone()
            state.advance()
            n_next = scheduler.visit_block(i + 1, *order)
            page_v = page_k
            page_k = pages(n_next)
            self.fill(pipeline_k, "k", state, tma_atom_K, tKgK, tKsK, n_next, page_k, pages)
            self.fill(pipeline_v, "v", prev, tma_atom_V, tVgV, tVsV,
                      scheduler.visit_block(i, *order), page_v, pages)
        self.fill(pipeline_v, "v", state, tma_atom_V, tVgV, tVsV,
                  scheduler.visit_block(n_blocks - 1, *order), page_k, pages)
        state.advance()
        return state

    @cute.jit
    def load_q(self, tma_atom_Q, tQgQ, tQsQ, mbar_q, m_block):
        """The CTA's Q tiles, one TMA each, on q_full (one warp; one thread arms it)."""
        with cute.arch.elect_one():
            self.sites("load", "expect_tx q_full", cute.arch.mbarrier_arrive_and_expect_tx,
                       mbar_q, self.q_bytes, stage=0)
        for w in cutlass.range_constexpr(self.q_stage):
            cute.copy(tma_atom_Q, tQgQ[None, m_block * self.q_stage + w], tQsQ[None, w],
                      tma_bar_ptr=mbar_q)

    def fill(self, pipe, x: str, state, atom, tXgX, tXsX, n_block, page, pages):
        """Key block n_block into ring slot `state` of K or V (x = "k", "v"): wait for the slot,
        then TMA on its armed full barrier, or cp.async copies and each thread's arrival
        (Note [cp.async gather])."""
        if self.cp_async:
            self.sites("load", f"wait {x}_empty", pipe.producer_acquire, state)
            self.copy_kv(atom, tXgX, tXsX, n_block, page, state, pipe, pages)
            self.sites("load", f"cp_async_arrive {x}_full", pipe.producer_commit, state)
        else:
            self.sites("load", f"wait {x}_empty; expect_tx {x}_full", pipe.producer_acquire,
                       state)
            self.copy_kv(atom, tXgX, tXsX, n_block, page, state, pipe, pages)

    def kv_partition(self, atom, mX, sX, head_kv, b, offset_k, cols: int, mPageTable):
        """(tXsX, tXgX) of K or V: SMEM ((TMA), stage) and the block's coordinates ((TMA), n)
        in batch b of the views, from packed row offset_k when varlen; paged, ((TMA), piece,
        stage) and ((TMA), row block, page) (Note [paged key blocks]: never offset)."""
        one = cute.make_layout(1)
        if const_expr(self.cp_async):   # the stages and the cache view of this KV head
            return sX, mX[None, None, head_kv, None]
        if const_expr(mPageTable is not None):
            gX = paged.page_coords(mX, head_kv, self.n_block, cols, self.page_size)
            return cpasync.tma_partition(
                atom, 0, one, paged.stage_pieces(sX, self.n_block, cols, self.page_size),
                cute.group_modes(gX, 0, 2))
        mX = seqlen.at_offset(mX, offset_k, self.varlen)
        gX = cute.local_tile(mX[None, None, head_kv, b], (self.n_block, cols), (None, 0))
        return cpasync.tma_partition(atom, 0, one, cute.group_modes(sX, 0, 2),
                                     cute.group_modes(gX, 0, 2))

    @cute.jit
    def block_pages(self, mPageTable, batch, seqlen_k, n_block: Int32,
                    group: cutlass.Constexpr[int] = 0):
        """This lane's page of key block n_block's pieces of `group` (`paged.read_pages`); 0,
        unused, unpaged."""
        if const_expr(mPageTable is None):
            return Int32(0)
        if const_expr(self.cp_async):
            tidx, _, _ = cute.arch.thread_idx()
            return page_rows.row_page(mPageTable, batch, n_block, seqlen_k, tidx,
                                      self.page_size, self.n_block, self.row_threads)
        return paged.read_pages(mPageTable, batch, n_block, seqlen_k, self.page_size,
                                self.n_block, group)

    @cute.jit
    def copy_kv(self, atom, tXgX, tXsX, n_block: Int32, page: Int32, state, pipe, pages):
        """Key block n_block into the ring's slot `state`: TMA on its full barrier, or this
        thread's cp.async rows (Note [cp.async gather]); `page` this lane's page of the block
        (`pages(n_block)`), `pages` for a block of more than 32 pages (`paged.page_groups`)."""
        if const_expr(self.cp_async):
            tidx, _, _ = cute.arch.thread_idx()
            page_rows.copy_rows(page_rows.row_copy(tXgX.element_type, self.row_threads), tXgX,
                                tXsX[None, None, state.index], n_block, page, tidx,
                                self.page_size, self.n_block, self.row_threads)
        elif const_expr(self.page_size is None):
            cute.copy(atom, tXgX[None, n_block], tXsX[None, state.index],
                      tma_bar_ptr=pipe.producer_get_barrier(state))
        else:
            paged.copy_block(atom, tXgX, tXsX, n_block, page, state.index,
                             pipe.producer_get_barrier(state), self.page_size, self.n_block,
                             partial(pages, n_block))

    @cute.jit
    def consume(self, tiled_mma_qk, tiled_mma_pv, tma_atom_O, mO, mLSE, mSink, sQ, sK, sV, sO,
                mbars, pipeline_k, pipeline_v, seqlen_q: Int32, seqlen_k: Int32,
                scale_log2: Float32, pre_scale: Float32, aux, mask_blocks, varlen,
                num_splits: Int32, mOPartial, mLSEPartial, left, right):
        """Consumer warpgroup: for each work tile, the key-block loop for its 64 query rows,
        then the epilogue. The ping-pong ring opens and closes once per CTA."""
        args = (tiled_mma_qk, tiled_mma_pv, tma_atom_O, mO, mLSE, mSink, sQ, sK, sV, sO, mbars,
                pipeline_k, pipeline_v, seqlen_q, seqlen_k, scale_log2, pre_scale, aux,
                mask_blocks, varlen, num_splits, mOPartial, mLSEPartial, left, right)
        wg = self._consumer_index()  # 0 .. q_stage-1
        if const_expr(self.pingpong):
            if wg == self.num_consumers - 1:  # the ring's last consumer lets consumer0 go first
                self.pass_turn()
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.kv_stage)
        if const_expr(self.persistent):
            q_phase = Int32(0)
            first, stop, step = scheduler.work_tiles(self, mO, varlen, num_splits)
            for tile in cutlass.range(first, stop, step, unroll=1):
                state = self.consume_tile(*args, tile, state, q_phase)
                q_phase = q_phase ^ 1
            self.close_ring()
            cute.arch.cp_async_bulk_wait_group(0, read=False)   # the last O store
        else:
            self.consume_tile(*args, None, state, Int32(0))

    @cute.jit
    def close_ring(self):
        """The ring's last consumer passed the turn once more than consumer0 took it (its first
        pass lets consumer0 start): consumer0 takes that pass, so no arrival is left on
        mma_turn0 at exit. By now the last consumer has issued its last wgmmas."""
        if const_expr(self.pingpong):
            if self._consumer_index() == 0:
                self.sites.bar_sync("consumer", "mma_turn0")

    @cute.jit
    def consume_tile(self, tiled_mma_qk, tiled_mma_pv, tma_atom_O, mO, mLSE, mSink, sQ, sK, sV,
                     sO, mbars, pipeline_k, pipeline_v, seqlen_q: Int32, seqlen_k: Int32,
                     scale_log2: Float32, pre_scale: Float32, aux, mask_blocks, varlen,
                     num_splits: Int32, mOPartial, mLSEPartial, left, right, tile, state,
                     q_phase: Int32):
        """One work tile (linear `tile` of a persistent CTA, None: the CTA's one tile) from the
        K/V ring's slot `state`; returns the ring's next slot."""
        tidx, _, _ = cute.arch.thread_idx()
        wg = self._consumer_index()  # 0 .. q_stage-1
        tid = tidx % _WG
        m_block, head, batch, split = scheduler.work(self, mO, seqlen_k, varlen, num_splits, tile)
        launch = (seqlen_q, seqlen_k)   # Note [the launch's sizes]
        seq = self.sequence(batch, *launch, varlen)
        seqlen_q, seqlen_k = seq.seqlen_q, seq.seqlen_k
        m_offset = (m_block * self.q_stage + wg) * self.m_block
        thr_qk = tiled_mma_qk.get_slice(tid)
        thr_pv = tiled_mma_pv.get_slice(tid)
        tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ))   # (MMA, M, K, q_stage)
        tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sK))   # (MMA, N, K, kv_stage)
        # V^T view (dv, n_block): B of O += P V, dv-contiguous = MN-major.
        sVt = cute.composition(sV, cute.make_ordered_layout(
            (self.head_dim_v, self.n_block, self.kv_stage), order=(1, 0, 2)))
        tOrVt = thr_pv.make_fragment_B(thr_pv.partition_B(sVt))
        acc_O = thr_pv.make_fragment_C(thr_pv.partition_shape_C((self.m_block, self.head_dim_v)))
        acc_O.fill(0.0)
        cS = cute.make_identity_tensor((self.m_block, self.n_block))
        tScS_mn = acc_mn_view(thr_qk.partition_C(cS))
        # Thread 0's coordinates are compile-time constants (Note [static columns] in mask).
        tScS0_mn = acc_mn_view(tiled_mma_qk.get_slice(0).partition_C(cS))
        # Each row's first hidden key, once per tile (masked blocks then only compare).
        limits = mask_mod.row_limits(tScS_mn, tScS0_mn, m_offset, seqlen_q,
                                     self.split_keys(m_block, seqlen_q, seqlen_k, left, right,
                                                     split, num_splits),
                                     left, right, self.pack)
        mod_rows = None
        if const_expr(self.mods is not None):  # fa4lab.kernels.device.mods
            mod_rows = ModRows(self.mods, aux, batch, head, tile_rows(tScS_mn, m_offset),
                               seqlen_q, seqlen_k, self.pack,
                               col_offset=tScS_mn[0, 0][1] - tScS0_mn[0, 0][1])
        # P stays in registers between its softmax and the next block's value wgmma.
        tOrP = cute.make_rmem_tensor_like(
            acc_as_operand_a(cute.make_rmem_tensor(
                tiled_mma_qk.partition_shape_C((self.m_block, self.n_block)), Float32)),
            self.dtype)

        softmax = OnlineSoftmax(cute.size(tScS_mn, mode=[0]), scale_log2,
                                self.rescale_threshold, threads_per_row=4)
        softmax.reset()

        # See Note [fully masked CTAs] in visit_plan.
        n_blocks, n_masked, order = self.visit_plan(m_block, seqlen_q, seqlen_k, left, right,
                                                    mask_blocks, split, num_splits)

        self.sites("consumer", "wait q_full", cute.arch.mbarrier_wait, mbars[0], q_phase,
                   stage=0)
        tSrQ_w = tSrQ[None, None, None, wg]
        common = dict(tiled_mma_qk=tiled_mma_qk, tiled_mma_pv=tiled_mma_pv, tSrQ=tSrQ_w,
                      tSrK=tSrK, tOrVt=tOrVt, acc_O=acc_O, tOrP=tOrP, tScS0_mn=tScS0_mn,
                      limits=limits, softmax=softmax, pipeline_k=pipeline_k,
                      pipeline_v=pipeline_v, pre_scale=pre_scale, mod_rows=mod_rows)
        step = partial(self.block_step, **common)

        # The masked blocks (the diagonal, a window's edges, the key-length tail) first, then
        # the FULL ones (Note [block visit order] in fa4lab.tiling).
        self.first_block(state, scheduler.visit_block(0, *order), **common)
        for s in cutlass.range(1, n_masked, unroll=1):
            state = step(state, scheduler.visit_block(s, *order), masked=True)
        for s in cutlass.range(n_masked, n_blocks, unroll=1):
            state = step(state, scheduler.visit_block(s, *order), masked=False)
        if const_expr(self.persistent):   # every score wgmma of the tile has completed
            self.sites("consumer", "arrive q_empty", cute.arch.mbarrier_arrive, mbars[1],
                       stage=0)
        # The last block's value wgmma.
        self.wait_full(pipeline_v, "v", state)
        _gemm(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, state.index], zero_init=False)
        warpgroup.wait_group(0)
        self.release(pipeline_v, state, "v_empty")
        if const_expr(not self.persistent):
            self.close_ring()

        # Note [the launch's sizes]
        # The tile's coordinates are read again rather than kept live through the block loop
        # (registers are the scarce resource there; these reads are cheap special registers).
        # With LSE at head_dim 64, causal, this saves 4 spill instructions. The re-reads take
        # the launch's seqlen_q and seqlen_k, as the first reads did, never the tile's own: the
        # LPT order's L2 swizzle reads seqlen_k (a paged or seqused_k launch's own key count
        # would give another swizzle, and the tile's output would go to another tile's rows),
        # and the sequence's clamp reads both totals (Note [clamped lengths] in
        # fa4lab.kernels.device.seqlen).
        m_block, head, batch, split = scheduler.work(self, mO, launch[1], varlen, num_splits,
                                                     tile)
        wg = self._consumer_index()
        m_offset = (m_block * self.q_stage + wg) * self.m_block
        sinks = None
        # Note [sinks]: each row's own query head; a split leaves the sink to the combine.
        if const_expr(mSink is not None and not self.split_kv):
            sinks = cute.make_rmem_tensor(softmax.num_rows, Float32)
            for r in cutlass.range_constexpr(softmax.num_rows):
                sinks[r] = sink_log2(mSink, m_offset + tScS_mn[r, 0][0], head, self.pack)
        inv_sum, lse = softmax.finalize(sinks)
        softmax.rescale(acc_mn_view(acc_O), inv_sum)
        seq = self.sequence(batch, *launch, varlen)
        if const_expr(self.split_kv):
            self.epilogue_split(tiled_mma_pv, mOPartial, mLSEPartial, acc_O, lse, tScS_mn, wg,
                                tidx % _WG, head, batch, split, m_offset, seq.seqlen_q)
        else:
            if const_expr(self.varlen):   # Note [sm90 varlen]: the sequence's own rows
                mO = seqlen.at_offset(varlen[0], seq.offset_q, True)
                if const_expr(mLSE is not None):
                    mLSE = seqlen.at_offset(mLSE, seq.offset_q, True)
            self.epilogue(tiled_mma_pv, tma_atom_O, mO, mLSE, sO, acc_O, lse, tScS_mn, wg,
                          tidx % _WG, m_block, head, seqlen.view_batch(self.varlen, batch),
                          m_offset, seq.seqlen_q)
        state.advance()
        return state

    @cute.jit
    def first_block(self, state, n_block: Int32, tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrVt,
                    acc_O, tOrP, tScS0_mn, limits, softmax: OnlineSoftmax, pipeline_k,
                    pipeline_v, pre_scale: Float32, mod_rows):
        """The first block visited: S = Q K^T, mask, softmax; its P V waits for the next step."""
        acc_S = cute.make_rmem_tensor(
            tiled_mma_qk.partition_shape_C((self.m_block, self.n_block)), Float32)
        self.wait_full(pipeline_k, "k", state)
        if const_expr(self.pingpong):
            self.wait_turn()
        _gemm(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, state.index], zero_init=True)
        if const_expr(self.pingpong):
            self.pass_turn()
        warpgroup.wait_group(0)
        self.release(pipeline_k, state, "k_empty")
        acc_S_mn = acc_mn_view(acc_S)
        self.softcap_scores(acc_S, pre_scale)
        self.mod_scores(acc_S_mn, tScS0_mn, n_block, mod_rows, pre_scale, softmax.scale_log2,
                        masked=True)
        self.mask_scores(acc_S_mn, tScS0_mn, limits, n_block, mod_rows, masked=True)
        softmax.step(acc_S_mn, is_first=True)
        tOrP.store(acc_as_operand_a(acc_S).load().to(self.dtype))

    @cute.jit
    def block_step(self, state, n_block: Int32, tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrVt,
                   acc_O, tOrP, tScS0_mn, limits, softmax: OnlineSoftmax, pipeline_k,
                   pipeline_v, pre_scale: Float32, mod_rows, masked: cutlass.Constexpr[bool]):
        """Block j with the previous block's P V in flight (FA3's intra-warpgroup overlap).

        Issue S_j = Q K_j^T and O += P_{j+1} V_{j+1}; when S_j lands, mask and run the softmax
        while the value wgmma still runs; then rescale O (basis of the new max) and keep P_j.
        """
        prev = state.clone()
        state.advance()
        acc_S = cute.make_rmem_tensor(
            tiled_mma_qk.partition_shape_C((self.m_block, self.n_block)), Float32)
        self.wait_full(pipeline_k, "k", state)
        if const_expr(self.pingpong):
            self.wait_turn()
        _gemm(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, state.index], zero_init=True)
        self.wait_full(pipeline_v, "v", prev)
        _gemm(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, prev.index], zero_init=False)
        if const_expr(self.pingpong):
            self.pass_turn()
        warpgroup.wait_group(1)  # the score wgmma is done; the value wgmma may still run
        self.release(pipeline_k, state, "k_empty")

        acc_S_mn = acc_mn_view(acc_S)
        self.softcap_scores(acc_S, pre_scale)
        self.mod_scores(acc_S_mn, tScS0_mn, n_block, mod_rows, pre_scale, softmax.scale_log2,
                        masked)
        self.mask_scores(acc_S_mn, tScS0_mn, limits, n_block, mod_rows, masked)
        row_scale = softmax.step(acc_S_mn)
        acc_O_mn = acc_mn_view(acc_O)
        # The value wgmma's wait in both arms of a branch every warp takes the same way, on a
        # value the block's exponentials make: Note [sm90 wait after the softmax].
        need = softmax.needs_rescale(row_scale) if const_expr(self.skip_unneeded_rescale) \
            else True
        summed = softmax.all_summed()
        if summed:
            warpgroup.wait_group(0)
            if need:
                rescale_rows(acc_O_mn, row_scale)
        else:   # never taken; a wait on every path, so ptxas adds none of its own
            warpgroup.wait_group(0)
        self.release(pipeline_v, prev, "v_empty")
        tOrP.store(acc_as_operand_a(acc_S).load().to(self.dtype))
        return state

    # Note [sm90 wait after the softmax]
    # The point of the intra-warpgroup overlap is that block j's softmax runs while the value
    # wgmma of the previous block is still in flight; the consumer waits for it
    # (wgmma.wait_group 0) only before it touches O (the rescale) or P (the next A operand).
    # ptxas, though, moves that wait as early as its latency model allows inside a basic
    # block: with the softmax in the same block it landed among the row-max instructions,
    # before any exp2, so the value wgmma and the exponentials never overlapped. The wait is
    # therefore issued in both arms of a branch on the row sums (`OnlineSoftmax.all_summed`:
    # true in every warp, NaN included, but the compiler cannot know it), which puts a
    # basic-block boundary between the exponentials and the wait; a wait on one arm only made
    # ptxas add its own waits at the loop's top. It used to sit in both arms of the rescale
    # branch, but that branch is voted per warp (`OnlineSoftmax.needs_rescale`), and
    # wgmma.wait_group must be one instruction for the whole warpgroup: compute-sanitizer
    # synccheck caught the four warps at two different waits (H200, 2026-12-01). The rescale
    # branch (inside the taken arm) must still be warp-uniform: a per-thread branch makes
    # ptxas move the loop's pipeline state out of uniform registers, one R2UR per wgmma
    # descriptor operand. Measured on an H200, 2026-11-30 (hd128, non-causal, bf16, with the
    # chains of Note [sm90 softmax chains] in fa4lab.kernels.device.softmax; upstream FA4 in
    # the same run 635-672): s4096 609 -> 632 TFLOP/s, s8192 616 -> 648, s16384 566 -> 657.
    # tests/test_sm90_sass.py checks the order in the compiled loop.

    @cute.jit
    def wait_full(self, pipe, x: str, state):
        """Wait for the K or V slot `state` (x = "k", "v") to land; rows copied by cp.async
        were written by the generic proxy, so fence them for wgmma's async-proxy reads (Note
        [cp.async gather])."""
        self.sites("consumer", f"wait {x}_full", pipe.consumer_wait, state)
        if self.cp_async:
            cute.arch.fence_proxy("async.shared", space="cta")

    def release(self, pipe, state, name: str):
        """Free a K or V slot: one arrive per consumer warp or per thread, as the plan counts."""
        if const_expr(self.kv_releases == 4 * self.num_consumers):
            self.sites("consumer", f"arrive {name}", pipe.consumer_release, state)
        else:
            self.sites("consumer", f"arrive {name}", cute.arch.mbarrier_arrive,
                       pipe.sync_object_empty.get_barrier(state.index))

    # The consumer index is re-read from the thread index at each turn, and each consumer's
    # barrier ids are immediates in their own branch, rather than two ids kept live across the
    # block loop: with three consumers at 160 registers a thread has none to spare.
    @staticmethod
    def _consumer_index():
        return cute.arch.make_warp_uniform(cute.arch.warp_idx()) // 4 - 1

    @cute.jit
    def wait_turn(self):
        """See Note [ping-pong]: block until the previous consumer has issued its wgmmas."""
        wg = self._consumer_index()
        for c in cutlass.range_constexpr(self.num_consumers):
            if wg == c:
                self.sites.bar_sync("consumer", f"mma_turn{c}")

    @cute.jit
    def pass_turn(self):
        """Hand the turn to the next consumer of the ring (wg + 1 mod num_consumers)."""
        wg = self._consumer_index()
        for c in cutlass.range_constexpr(self.num_consumers):
            if wg == c:
                self.sites.bar_arrive("consumer", f"mma_turn{(c + 1) % self.num_consumers}")

    @cute.jit
    def epilogue(self, tiled_mma_pv, tma_atom_O, mO, mLSE, sO, acc_O, lse, tScS_mn, wg, tid,
                 m_block, head, batch, m_offset, seqlen_q):
        """O (16-bit) -> SMEM staging (stmatrix) -> TMA store; LSE straight from registers."""
        dtype = sO.element_type
        # In a persistent CTA the branches on tid compare with an opaque zero (Note [opaque
        # zero] in fa4lab.kernels.device.opaque), so the tile loop is not unswitched on them.
        zero = opaque_zero() if const_expr(self.persistent) else 0
        if const_expr(mLSE is not None):
            if tid % 4 == zero:  # the quad's first thread holds column 0 of its rows
                for r in cutlass.range_constexpr(cute.size(lse)):
                    store_lse(mLSE, m_offset + tScS_mn[r, 0][0], lse[r], head, batch,
                              seqlen_q, self.pack)

        rO = cute.make_rmem_tensor_like(acc_O, dtype)
        rO.store(acc_O.load().to(dtype))
        epilogue_id = self.sites.named_id("epilogue0") + wg
        if const_expr(self.persistent):
            # The last tile's store must have read this consumer's O staging before its warps
            # overwrite it (Note [sm90 persistent CTAs]); the first warp issued it, and the
            # others have no store to wait for.
            cute.arch.cp_async_bulk_wait_group(0, read=True)
            self.sites.bar_sync("consumer", "epilogue{c}", barrier_id=epilogue_id)
        r2s = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), dtype),
            tiled_mma_pv)
        thr_r2s = r2s.get_slice(tid)
        # Each consumer writes only its own slot; with O staged in Q's bytes that slot is the
        # Q tile only this consumer read, and its last score wgmma has completed.
        cute.copy(r2s, thr_r2s.retile(rO), thr_r2s.partition_D(sO[None, None, wg]))
        if const_expr(self.varlen):
            # Row by row, only the sequence's own: Note [varlen rows past a sequence]. mO is
            # the (rows, dv, heads, 1) tensor itself, from the sequence's first row.
            self.sites.bar_sync("consumer", "epilogue{c}", barrier_id=epilogue_id)
            gO = cute.local_tile(mO[None, None, head, batch], (self.m_block, self.head_dim_v),
                                 (m_block * self.q_stage + wg, 0))
            seqlen.store_rows(sO[None, None, wg], gO, seqlen_q - m_offset, tid, _WG)
        else:
            # Generic-proxy SMEM writes must be visible to the TMA (async proxy) before the
            # store.
            cute.arch.fence_proxy("async.shared", space="cta")
            self.sites.bar_sync("consumer", "epilogue{c}", barrier_id=epilogue_id)
            if tid // 32 == zero:
                gO = cute.local_tile(mO[None, None, head, batch],
                                     (self.m_block, self.head_dim_v), (None, 0))
                tOsO, tOgO = cpasync.tma_partition(tma_atom_O, 0, cute.make_layout(1),
                                                   cute.group_modes(sO, 0, 2),
                                                   cute.group_modes(gO, 0, 2))
                cute.copy(tma_atom_O, tOsO[None, wg], tOgO[None, m_block * self.q_stage + wg])
                cute.arch.cp_async_bulk_commit_group()
                if const_expr(not self.persistent):
                    cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def epilogue_split(self, tiled_mma_pv, mOPartial, mLSEPartial, acc_O, lse, tScS_mn, wg, tid,
                       head, batch, split, m_offset, seqlen_q):
        """Split-KV: the normalised float32 O and the LSE of this split straight from
        registers into the combine's layout (`fa4lab.kernels.device.split`); no SMEM staging.
        The epilogue's named barriers are kept, so the protocol is the table's."""
        zero = opaque_zero() if const_expr(self.persistent) else 0
        mOP, mLP = split_mod.split_views(mOPartial, mLSEPartial, split)
        if tid % 4 == zero:  # the quad's first thread holds column 0 of its rows
            for r in cutlass.range_constexpr(cute.size(lse)):
                store_lse(mLP, m_offset + tScS_mn[r, 0][0], lse[r], head, batch, seqlen_q,
                          self.pack)
        epilogue_id = self.sites.named_id("epilogue0") + wg
        if const_expr(self.persistent):
            self.sites.bar_sync("consumer", "epilogue{c}", barrier_id=epilogue_id)
        cO = cute.make_identity_tensor((self.m_block, self.head_dim_v))
        tOcO_mn = acc_mn_view(tiled_mma_pv.get_slice(tid).partition_C(cO))
        split_mod.store_partial(mOP, acc_mn_view(acc_O), tOcO_mn, m_offset, head, batch,
                                seqlen_q, self.pack)
        self.sites.bar_sync("consumer", "epilogue{c}", barrier_id=epilogue_id)

