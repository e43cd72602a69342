"""FlashAttention backward for Hopper (sm_90a) in the CuTe DSL: a first version, correct first.

What it computes: dK and dV of attention, and dQ's float32 partial sums, for q (batch,
seqlen_q, heads_q, d), k (batch, seqlen_k, heads_kv, d), v (batch, seqlen_k, heads_kv, dv),
the forward's LSE and the gradient dO of its output, with the forward's options: bottom-right
causal, a sliding window (runtime sizes, compile-time sides), softcap (runtime cap), GQA
(query head h reads KV head h // (heads_q // heads_kv)), any seqlen_q, seqlen_k >= 1. Per
(query block, key block) step, the five MMAs of Note [the FlashAttention backward] in
fa4lab.reference_backward, in `fa4lab.backward_blocks.backward_step`'s order:

    S  = Q K^T                 P  = exp2(S * scale_log2 - LSE_log2)   (no max, no sum)
    dP = dO V^T                dS = P * (dP - D)   (* (1 - t^2) under a softcap: t = S / cap)
    dV += P^T dO               dK += dS^T Q        dQ_accum += dS K   (float32 adds)

Constraints: (head_dim, head_dim_v) multiples of 32 (every pair of
`fa4lab.limits.KERNEL_HEAD_DIMS["sm90"]`), bf16 or fp16, last dim contiguous, 16-byte aligned
rows. LSE and D come in float32, (batch, heads_q, seqlen_q rounded up to m_block), LSE in
log2 units with +inf on rows that see no key and on the padding (so P = 0 there: Note [masked
rows in the backward]); D = rowsum(dO * O) - dLSE, 0 on the padding; dQ_accum (batch, heads_q,
padded seqlen_q, d) float32, zeroed. `fa4lab.kernels.launch_backward` prepares them and turns
dQ_accum into dQ (Note [sm90 backward, first version]).

How it is built (Note [sm90 backward, first version]): one CTA of 8 warps per (key block,
KV head, batch); K_j and V_j are loaded once into SMEM (cp.async, rows past seqlen_k zeroed),
dK and dV accumulate in registers over every query head of the KV head's group and every
query block that sees the key block (`fa4lab.tiling.query_block_range`), and are stored once.
Each step loads Q_i and dO_i (rows past seqlen_q zeroed), LSE_i and D_i; P and dS go through
SMEM as the A operands of the dV, dK and dQ MMAs. The MMAs are warp-level `mma.sync`
(m16n8k16) fed by ldmatrix, upstream's sm80 backward structure (flash_attn/cute/flash_bwd.py):
legal and exact on sm_90a, not yet Hopper's wgmma and TMA. Masking is `fa4lab.kernels.device
.mask`'s, the softcap's tanh `fa4lab.kernels.device.softmax`'s (the forward's own
approximation, so P is recomputed as the forward rounded it).

Deterministic mode (`key.deterministic`, Note [deterministic dQ]): the key blocks that add into
one query block take turns in ascending order through a semaphore per (batch, query head,
query block), so dQ_accum's additions happen in one order on every run.

Run: `fa4lab.kernels.launch_backward.backward(...)` on an H100/H200 (what `fa4lab.attention`'s
autograd calls); compile on any machine with
`fa4lab.kernels.launch_backward.compile_backward(key)`.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warp

from fa4lab import tiling
from fa4lab.kernels.device import mask as mask_mod
from fa4lab.kernels.device.softmax import softcap_row

# Note [sm90 backward, first version]
# Correctness first; speed is the next step. What this version chose and what it leaves:
# - MMAs: warp-level mma.sync m16n8k16 with ldmatrix from swizzled SMEM (upstream's sm80
#   backward, which runs on Hopper), 8 warps on 64 x 64 tiles: 64-row query blocks, 64-key key
#   blocks. Upstream's sm90 backward uses wgmma from TMA-loaded SMEM with a producer warp and
#   two consumer warpgroups, and pipelines Q/dO two stages deep; here one step's loads finish
#   before its MMAs start (cp.async, then wait).
# - GQA: one CTA per KV head walks every query head of its group, so dK and dV are summed in
#   registers and stored once, in the inputs' dtype: no float32 dK/dV buffer, no atomics for
#   them, and nothing to order in deterministic mode. The price is parallelism: a grid of
#   key blocks x heads_kv x batch CTAs (upstream: x heads_q, with float32 dK/dV atomics).
# - Pre- and postprocessing are torch ops in `fa4lab.kernels.launch_backward` (D =
#   rowsum(dO * O) - dLSE, LSE in log2 units with +inf on empty rows, dQ = scale * dQ_accum,
#   the sink's gradient), not kernels of their own as upstream's flash_bwd_preprocess.py and
#   flash_bwd_postprocess.py are.
# - Every step masks (the key tail, causal, a window's edges) whether its tile needs it or not.

# Note [deterministic dQ]
# Key block j adds its partial dQ of query block i when every key block j' < j that visits i
# has added its own: a counter per (batch, query head, query block) in global memory, zeroed by
# the host, counts the adds done; j waits (thread 0 spinning on an acquire load) until it
# equals j's turn, the number of key blocks before j whose query range holds i (the same
# `fa4lab.tiling.query_block_range` the loop uses, so the turns and the visits cannot
# disagree), adds, and counts itself with a release add after a fence. The waits cannot
# deadlock: j waits only on lower key blocks of its own (KV head, batch), CTAs of lower block
# index that the hardware dispatched before it (upstream's `deterministic=True` relies on the
# same order). Within a CTA each element of the partial is added by one thread, once.


def smem_atom(dtype, cols: int):
    """The swizzled (8, k) SMEM atom of a 16-bit tile with `cols` columns that ldmatrix reads
    without bank conflicts (upstream's sm80 `get_smem_layout_atom`)."""
    row_bytes = cols * dtype.width // 8
    block_bytes = 128 if row_bytes % 128 == 0 else (64 if row_bytes % 64 == 0 else 32)
    block = block_bytes * 8 // dtype.width
    bits = {128: 3, 64: 2, 32: 1}[block_bytes]
    return cute.make_composed_layout(cute.make_swizzle(bits, 3, 3), 0,
                                     cute.make_ordered_layout((8, block), order=(1, 0)))


def transpose_view(t: cute.Tensor) -> cute.Tensor:
    """(rows, cols, ...) -> (cols, rows, ...): the same bytes read as the transpose."""
    shape = (t.shape[1], t.shape[0], *t.shape[2:])
    order = (1, 0, *range(2, cute.rank(t)))
    return cute.composition(t, cute.make_ordered_layout(shape, order=order))


def acc_mn(acc: cute.Tensor) -> cute.Tensor:
    """An mma.sync accumulator ((2, 2), MMA_M, MMA_N) viewed as (rows, cols): each thread
    holds column pairs (the first 2) in two rows 8 apart (the second 2)."""
    lay = cute.make_layout(acc.layout.shape)
    s, d = lay.shape, lay.stride
    mn = cute.make_layout(((s[0][1], s[1]), (s[0][0], s[2])),
                          stride=((d[0][1], d[1]), (d[0][0], d[2])))
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, mn))


@cute.jit
def gemm_ss(tiled_mma: cute.TiledMma, thr_mma: cute.ThrMma, acc: cute.Tensor, sA: cute.Tensor,
            sB: cute.Tensor, copy_A: cute.TiledCopy, copy_B: cute.TiledCopy) -> None:
    """acc += A B with both operands read from SMEM (sA, sB) by ldmatrix, one k-block ahead."""
    tCrA = thr_mma.make_fragment_A(thr_mma.partition_A(sA))
    tCrB = thr_mma.make_fragment_B(thr_mma.partition_B(sB))
    tCsA, tCsB = copy_A.partition_S(sA), copy_B.partition_S(sB)
    tCrA_view, tCrB_view = copy_A.retile(tCrA), copy_B.retile(tCrB)
    cute.copy(copy_A, tCsA[None, None, 0], tCrA_view[None, None, 0])
    cute.copy(copy_B, tCsB[None, None, 0], tCrB_view[None, None, 0])
    for k in cutlass.range_constexpr(cute.size(tCsA.shape[2])):
        if const_expr(k < cute.size(tCsA.shape[2]) - 1):
            cute.copy(copy_A, tCsA[None, None, k + 1], tCrA_view[None, None, k + 1])
            cute.copy(copy_B, tCsB[None, None, k + 1], tCrB_view[None, None, k + 1])
        cute.gemm(tiled_mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)


class FlashBackwardSm90:
    """The sm90 backward kernel, configured once from a frozen `BackwardKey`
    (fa4lab.plan.key); no DSL code here."""

    arch = "sm90a"

    def __init__(self, key):
        self.key = key
        self.head_dim, self.head_dim_v = key.head_dim, key.head_dim_v
        self.m_block, self.n_block = key.m_block, key.n_block
        self.num_threads = key.num_threads
        self.warps_m = key.warps_m          # warps along M of every MMA (the rest along N)
        self.qhead_per_kvhead = key.qhead_per_kvhead
        self.causal = key.causal
        # Which sides of a window exist (their sizes are runtime): the stored form of
        # fa4lab.spec.normalize_mask, 0 standing for a side's runtime value.
        self.window_size = tuple(0 if side else None for side in key.window)
        self.softcap = key.softcap
        self.deterministic = key.deterministic
        for name, dim in (("head_dim", self.head_dim), ("head_dim_v", self.head_dim_v)):
            if dim % 32:
                raise ValueError(f"{name}={dim}: the sm90 backward takes multiples of 32")

    # ------------------------------------------------------------------ host
    def _tiled_mma(self, dtype):
        warps = self.num_threads // 32
        shape = (self.warps_m, warps // self.warps_m, 1)
        return cute.make_tiled_mma(warp.MmaF16BF16Op(dtype, Float32, (16, 8, 16)), shape,
                                   permutation_mnk=(shape[0] * 16, shape[1] * 16, 16))

    def _load_copy(self, dtype, cols: int):
        """cp.async of 16 bytes per thread, the threads laid out over the SMEM atom's width."""
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                   dtype, num_bits_per_copy=128)
        per_row = cute.size(smem_atom(dtype, cols).outer.shape[1]) // 8
        threads = cute.make_ordered_layout((self.num_threads // per_row, per_row), order=(1, 0))
        return cute.make_tiled_copy_tv(atom, threads, cute.make_layout((1, 8)))

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,       # (batch, seqlen_q, heads_q, head_dim)
        mK: cute.Tensor,       # (batch, seqlen_k, heads_kv, head_dim)
        mV: cute.Tensor,       # (batch, seqlen_k, heads_kv, head_dim_v)
        mdO: cute.Tensor,      # (batch, seqlen_q, heads_q, head_dim_v)
        mLSE: cute.Tensor,     # (batch, heads_q, seqlen_q padded) fp32, log2 units, +inf empty
        mD: cute.Tensor,       # (batch, heads_q, seqlen_q padded) fp32, rowsum(dO * O) - dLSE
        mdQaccum: cute.Tensor,  # (batch, heads_q, seqlen_q padded, head_dim) fp32, zeroed
        mdK: cute.Tensor,      # (batch, seqlen_k, heads_kv, head_dim)
        mdV: cute.Tensor,      # (batch, seqlen_k, heads_kv, head_dim_v)
        scale_log2: Float32,   # softmax_scale * log2(e) (softcap * log2(e) with a softcap)
        pre_scale: Float32,    # softmax_scale / softcap with a softcap, else unused
        softmax_scale: Float32,  # dK's factor
        window_left: Int32,    # the window's sides (Note [runtime window]); a side the key
        window_right: Int32,   # does not have is unused
        mSemaphore: cute.Tensor | None,  # (batch, heads_q, query blocks) int32, zeroed, with
                                         # deterministic=True (Note [deterministic dQ])
        stream: cuda.CUstream,
    ):
        dtype = mQ.element_type
        M, N, d, dv = self.m_block, self.n_block, self.head_dim, self.head_dim_v
        sQ_layout = cute.tile_to_shape(smem_atom(dtype, d), (M, d), (0, 1))
        sdO_layout = cute.tile_to_shape(smem_atom(dtype, dv), (M, dv), (0, 1))
        sK_layout = cute.tile_to_shape(smem_atom(dtype, d), (N, d), (0, 1))
        sV_layout = cute.tile_to_shape(smem_atom(dtype, dv), (N, dv), (0, 1))
        sPdS_layout = cute.tile_to_shape(smem_atom(dtype, N), (M, N), (0, 1))

        def region(layout, align=1024):
            return cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(layout)], align]

        @cute.struct
        class SharedStorage:
            sK: region(sK_layout)
            sV: region(sV_layout)
            sQ: region(sQ_layout)
            sdO: region(sdO_layout)
            sP: region(sPdS_layout, 128)
            sdS: region(sPdS_layout, 128)
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, M], 128]
            sD: cute.struct.Align[cute.struct.MemRange[Float32, M], 128]

        tiled_mma = self._tiled_mma(dtype)
        grid = (cute.ceil_div(mK.shape[1], N), cute.size(mK.shape[2]), cute.size(mK.shape[0]))
        self.kernel(
            mQ, mK, mV, mdO, mLSE, mD, mdQaccum, mdK, mdV, scale_log2, pre_scale, softmax_scale,
            window_left, window_right, mSemaphore, sQ_layout, sdO_layout, sK_layout, sV_layout,
            sPdS_layout, self._load_copy(dtype, d), self._load_copy(dtype, dv), tiled_mma,
            SharedStorage,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], smem=SharedStorage.size_in_bytes(),
                 stream=stream)

    # ------------------------------------------------------------------ device
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
               mLSE: cute.Tensor, mD: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor,
               mdV: cute.Tensor, scale_log2: Float32, pre_scale: Float32,
               softmax_scale: Float32, window_left: Int32, window_right: Int32,
               mSemaphore: cute.Tensor | None, sQ_layout: cute.ComposedLayout,
               sdO_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout, sPdS_layout: cute.ComposedLayout,
               copy_qk: cute.TiledCopy, copy_vdo: cute.TiledCopy, tiled_mma: cute.TiledMma,
               SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        n_block, kv_head, batch = cute.arch.block_idx()
        M, N, d, dv = self.m_block, self.n_block, self.head_dim, self.head_dim_v
        dtype = mQ.element_type
        seqlen_q, seqlen_k = mQ.shape[1], mK.shape[1]
        left, right = mask_mod.window_sides(self.window_size, self.causal, window_left,
                                            window_right)

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sQ_layout)
        sdO = storage.sdO.get_tensor(sdO_layout)
        sK = storage.sK.get_tensor(sK_layout)
        sV = storage.sV.get_tensor(sV_layout)
        sP = storage.sP.get_tensor(sPdS_layout)
        sdS = storage.sdS.get_tensor(sPdS_layout)
        sLSE = storage.sLSE.get_tensor(cute.make_layout(M))
        sD = storage.sD.get_tensor(cute.make_layout(M))

        # K_j and V_j, once per CTA (rows past seqlen_k zeroed: they meet dS's zero columns).
        key_rows = seqlen_k - n_block * N
        self.load_rows(copy_qk, cute.local_tile(mK[batch, None, kv_head, None], (N, d),
                                                (n_block, 0)), sK, key_rows)
        self.load_rows(copy_vdo, cute.local_tile(mV[batch, None, kv_head, None], (N, dv),
                                                 (n_block, 0)), sV, key_rows)
        cute.arch.cp_async_commit_group()

        thr_mma = tiled_mma.get_slice(tidx)
        acc_dK = cute.make_rmem_tensor(thr_mma.partition_shape_C((N, d)), Float32)
        acc_dV = cute.make_rmem_tensor(thr_mma.partition_shape_C((N, dv)), Float32)
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)

        m_block_min, m_block_max = tiling.query_block_range(
            n_block, N, M, seqlen_q, seqlen_k, left, right, imin=cutlass.min, imax=cutlass.max)
        for h in cutlass.range(self.qhead_per_kvhead, unroll=1):
            head = kv_head * self.qhead_per_kvhead + h
            for m_block in cutlass.range(m_block_min, m_block_max, unroll=1):
                self.step(mQ, mdO, mLSE, mD, mdQaccum, mSemaphore, sQ, sdO, sK, sV, sP, sdS,
                          sLSE, sD, copy_qk, copy_vdo, tiled_mma, acc_dK, acc_dV, tidx, batch,
                          head, n_block, m_block, seqlen_q, seqlen_k, left, right, scale_log2,
                          pre_scale)

        cute.arch.cp_async_wait_group(0)      # K, V landed even where no query block came
        # dK = scale * sum dS^T Q (the softcap's factor is in dS), dV = sum P^T dO: stored once.
        acc_dK.store(acc_dK.load() * softmax_scale)
        self.store_rows(acc_dK, cute.local_tile(mdK[batch, None, kv_head, None], (N, d),
                                                (n_block, 0)), thr_mma, key_rows, dtype)
        self.store_rows(acc_dV, cute.local_tile(mdV[batch, None, kv_head, None], (N, dv),
                                                (n_block, 0)), thr_mma, key_rows, dtype)

    @cute.jit
    def step(self, mQ: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mD: cute.Tensor,
             mdQaccum: cute.Tensor, mSemaphore: cute.Tensor | None, sQ: cute.Tensor,
             sdO: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor, sP: cute.Tensor,
             sdS: cute.Tensor, sLSE: cute.Tensor, sD: cute.Tensor, copy_qk: cute.TiledCopy,
             copy_vdo: cute.TiledCopy, tiled_mma: cute.TiledMma, acc_dK: cute.Tensor,
             acc_dV: cute.Tensor, tidx: Int32, batch: Int32, head: Int32, n_block: Int32,
             m_block: Int32, seqlen_q: Int32, seqlen_k: Int32, left, right,
             scale_log2: Float32, pre_scale: Float32):
        """One (query block, key block) step of Note [the FlashAttention backward]."""
        M, N, d, dv = self.m_block, self.n_block, self.head_dim, self.head_dim_v
        dtype = mQ.element_type
        cute.arch.barrier()      # the previous step's MMAs have read sQ, sdO, sP, sdS
        rows = seqlen_q - m_block * M
        self.load_rows(copy_qk, cute.local_tile(mQ[batch, None, head, None], (M, d),
                                                (m_block, 0)), sQ, rows)
        self.load_rows(copy_vdo, cute.local_tile(mdO[batch, None, head, None], (M, dv),
                                                 (m_block, 0)), sdO, rows)
        cute.arch.cp_async_commit_group()
        if tidx < M:             # the padded LSE and D: every row of the block is there
            sLSE[tidx] = mLSE[batch, head, m_block * M + tidx]
        elif tidx < 2 * M:
            sD[tidx - M] = mD[batch, head, m_block * M + tidx - M]
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()

        thr_mma = tiled_mma.get_slice(tidx)
        ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4),
                                   dtype)
        ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4),
                                     dtype)
        copy_A = cute.make_tiled_copy_A(ldsm, tiled_mma).get_slice(tidx)
        copy_B = cute.make_tiled_copy_B(ldsm, tiled_mma).get_slice(tidx)
        copy_At = cute.make_tiled_copy_A(ldsm_t, tiled_mma).get_slice(tidx)
        copy_Bt = cute.make_tiled_copy_B(ldsm_t, tiled_mma).get_slice(tidx)
        sPt, sdSt, sQt, sdOt, sKt = (transpose_view(t) for t in (sP, sdS, sQ, sdO, sK))

        # S = Q K^T and dP = dO V^T.
        acc_S = cute.make_rmem_tensor(thr_mma.partition_shape_C((M, N)), Float32)
        acc_S.fill(0.0)
        gemm_ss(tiled_mma, thr_mma, acc_S, sQ, sK, copy_A, copy_B)
        acc_dP = cute.make_rmem_tensor(thr_mma.partition_shape_C((M, N)), Float32)
        acc_dP.fill(0.0)
        gemm_ss(tiled_mma, thr_mma, acc_dP, sdO, sV, copy_A, copy_B)

        # P = exp2(S * scale_log2 - LSE) on the visible keys; dS = P * (dP - D) (* dt/du).
        s_mn, dp_mn = acc_mn(acc_S), acc_mn(acc_dP)
        coord = cute.make_identity_tensor((M, N))
        coord_mn = acc_mn(thr_mma.partition_C(coord))
        coord0_mn = acc_mn(tiled_mma.get_slice(0).partition_C(coord))
        t_mn = None
        if const_expr(self.softcap):     # t = tanh(S * pre_scale), kept for the chain rule
            acc_T = cute.make_fragment_like(acc_S)
            t_mn = acc_mn(acc_T)
            for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
                softcap_row(s_mn[r, None], pre_scale)
            acc_T.store(acc_S.load())
        limits = mask_mod.row_limits(coord_mn, coord0_mn, m_block * M, seqlen_q, seqlen_k,
                                     left, right)
        mask_mod.apply_limits(s_mn, coord0_mn, limits, n_block * N)
        for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
            row = coord_mn[r, 0][0]
            lse, d_row = sLSE[row], sD[row]
            for j in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                p = cute.math.exp2(s_mn[r, j] * scale_log2 - lse, fastmath=True)
                ds = p * (dp_mn[r, j] - d_row)
                if const_expr(self.softcap):
                    ds = ds * (1.0 - t_mn[r, j] * t_mn[r, j])
                s_mn[r, j] = p
                dp_mn[r, j] = ds

        # P and dS to SMEM, 16-bit: the A operands (transposed for dV and dK) of the rest.
        store_C = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype,
                                num_bits_per_copy=2 * dtype.width), tiled_mma).get_slice(tidx)
        rP = cute.make_fragment_like(acc_S, dtype)
        rP.store(acc_S.load().to(dtype))
        rdS = cute.make_fragment_like(acc_dP, dtype)
        rdS.store(acc_dP.load().to(dtype))
        cute.copy(store_C, store_C.retile(rP), store_C.partition_D(sP))
        cute.copy(store_C, store_C.retile(rdS), store_C.partition_D(sdS))
        cute.arch.barrier()

        # dV += P^T dO, dK += dS^T Q.
        gemm_ss(tiled_mma, thr_mma, acc_dV, sPt, sdOt, copy_At, copy_Bt)
        gemm_ss(tiled_mma, thr_mma, acc_dK, sdSt, sQt, copy_At, copy_Bt)

        # dQ_accum += dS K, float32 adds (in turn with deterministic=True).
        acc_dQ = cute.make_rmem_tensor(thr_mma.partition_shape_C((M, d)), Float32)
        acc_dQ.fill(0.0)
        gemm_ss(tiled_mma, thr_mma, acc_dQ, sdS, sKt, copy_A, copy_Bt)
        tdQg = thr_mma.partition_C(cute.local_tile(mdQaccum[batch, head, None, None], (M, d),
                                                   (m_block, 0)))
        if const_expr(self.deterministic):
            self.wait_turn(mSemaphore, tidx, batch, head, n_block, m_block, seqlen_q,
                           seqlen_k, left, right)
        for i in cutlass.range(cute.size(acc_dQ), unroll_full=True):
            cute.arch.red(tdQg.iterator + cute.crd2idx(i, tdQg.layout), acc_dQ[i], op="add",
                          dtype=Float32, sem="relaxed", scope="gpu")
        if const_expr(self.deterministic):
            cute.arch.fence_acq_rel_gpu()
            cute.arch.barrier()
            if tidx == 0:
                cute.arch.red(mSemaphore.iterator + cute.crd2idx((batch, head, m_block),
                                                                 mSemaphore.layout),
                              Int32(1), op="add", dtype=Int32, sem="release", scope="gpu")

    @cute.jit
    def wait_turn(self, mSemaphore: cute.Tensor, tidx: Int32, batch: Int32, head: Int32,
                  n_block: Int32, m_block: Int32, seqlen_q: Int32, seqlen_k: Int32, left,
                  right):
        """Block until the key blocks before this one that visit `m_block` have added their dQ
        (Note [deterministic dQ]); the whole CTA leaves together."""
        turn = n_block
        if const_expr(left is not None or right is not None):
            turn = Int32(0)
            for j in cutlass.range(n_block, unroll=1):
                lo, hi = tiling.query_block_range(j, self.n_block, self.m_block, seqlen_q,
                                                  seqlen_k, left, right, imin=cutlass.min,
                                                  imax=cutlass.max)
                turn += Int32(lo <= m_block) * Int32(m_block < hi)
        if tidx == 0:
            ptr = mSemaphore.iterator + cute.crd2idx((batch, head, m_block), mSemaphore.layout)
            seen = cute.arch.load(ptr, Int32, sem="acquire", scope="gpu")
            while seen != turn:
                seen = cute.arch.load(ptr, Int32, sem="acquire", scope="gpu")
        cute.arch.barrier()

    @cute.jit
    def load_rows(self, tiled_copy: cute.TiledCopy, gX: cute.Tensor, sX: cute.Tensor, rows):
        """sX = gX's first `rows` rows (cp.async, 16 bytes per thread), the others zeroed: the
        tile's rows past the sequence must be finite zeros, not stale or uninitialised bits
        (0 * NaN is NaN in the MMAs that read them)."""
        thr = tiled_copy.get_slice(cute.arch.thread_idx()[0])
        tXg, tXs = thr.partition_S(gX), thr.partition_D(sX)
        tXc = thr.partition_S(cute.make_identity_tensor((cute.size(sX.shape[0]),
                                                             cute.size(sX.shape[1]))))
        zero = cute.make_fragment_like(tXs[None, 0, None])
        zero.fill(0.0)
        for m in cutlass.range_constexpr(cute.size(tXs.shape[1])):
            if tXc[0, m, 0][0] < rows:
                cute.copy(tiled_copy, tXg[None, m, None], tXs[None, m, None])
            else:
                cute.autovec_copy(zero, tXs[None, m, None])

    @cute.jit
    def store_rows(self, acc: cute.Tensor, gX: cute.Tensor, thr_mma, rows, dtype):
        """gX[r, :] = acc's values (as dtype) for the tile rows r < `rows`, from registers."""
        out = cute.make_fragment_like(acc, dtype)
        out.store(acc.load().to(dtype))
        tXg = thr_mma.partition_C(gX)
        tXc = thr_mma.partition_C(cute.make_identity_tensor((cute.size(gX.shape[0]),
                                                             cute.size(gX.shape[1]))))
        for i in cutlass.range(cute.size(out), unroll_full=True):
            if tXc[i][0] < rows:
                tXg[i] = out[i]
