"""Ladder step 1: one tcgen05.mma into TMEM and a tcgen05.ld back.

What it computes: S = Q K^T (fp32, unscaled) for one Q tile of at most m_block rows and one K
tile of at most n_block rows: q (seqlen_q, head_dim), k (seqlen_k, head_dim), 16-bit, s
(seqlen_q, seqlen_k) float32, seqlen_q <= m_block and seqlen_k <= n_block (a tail is read
zero-filled by the TMA and never stored). One CTA of four warps (128 threads, one per S row):

  1. warp 0 allocates S's TMEM columns (`tcgen05.alloc`, the plan's S_0 region) and every
     thread reads the address back after a CTA barrier;
  2. one thread of warp 0 arms the mbarrier `load_full` with the bytes of both tiles and
     issues the two TMA loads (global -> shared memory);
  3. warp 0 waits `load_full`, and one thread issues the head_dim / 16 `tcgen05.mma` of the
     tile and a `tcgen05.commit` on the mbarrier `s_full`: it arrives when every MMA issued
     before it is complete;
  4. all 128 threads wait `s_full` and read their row of S with `tcgen05.ld` (32 columns per
     instruction), then store it to global memory;
  5. warp 0 frees the columns (`tcgen05.dealloc`).

The numbers (m_block, n_block, S's columns) come from the sm100 plan of the spec
(`fa4lab.kernels.ladder.step_plan`). Compile it on any machine with
`fa4lab.kernels.ladder.compile_step(1)`; running it needs a B200-class GPU.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32, Int64
from cutlass.cute.nvgpu import cpasync, tcgen05

from fa4lab.plan.tmem import alloc_columns

_DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}
THREADS = 128        # one thread per row of S: the 128 TMEM lanes
LD_COLUMNS = 32      # columns per tcgen05.ld (32x32b, repetition 32)


class ScoreTileSm100:
    """S = Q K^T for one tile. `__init__` reads the plan (no DSL code); `__call__` launches."""

    def __init__(self, plan):
        tiles = plan.tiles
        self.plan = plan
        self.dtype = _DTYPES[plan.spec.dtype]
        self.m_block, self.n_block, self.head_dim = tiles.m_block, tiles.n_block, tiles.head_dim
        if self.m_block != THREADS:
            raise ValueError(f"step 1 reads one S row per thread: m_block must be {THREADS}, "
                             f"the plan has {self.m_block}")
        self.mma_tiler = (self.m_block, self.n_block, self.head_dim)
        self.s_cols = plan.tmem.region("S", 0).columns     # fp32: one column per key
        self.alloc_cols = alloc_columns(self.s_cols)
        self.threads_per_cta = THREADS
        # The audit's expectations (fa4lab.kernels.ladder.audit_step).
        self.expected = {"tcgen05.alloc": 1, "tcgen05.mma": self.head_dim // 16,
                         "tcgen05.commit": 1, "tcgen05.ld": self.n_block // LD_COLUMNS,
                         "tcgen05.dealloc": 1, "mbarrier.init": 2}

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (seqlen_q, head_dim), seqlen_q <= m_block
        mK: cute.Tensor,  # (seqlen_k, head_dim), seqlen_k <= n_block
        mS: cute.Tensor,  # (seqlen_q, seqlen_k) float32
        stream: cuda.CUstream,
    ):
        tiled_mma = sm100_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, tcgen05.OperandMajorMode.K, tcgen05.OperandMajorMode.K,
            Float32, tcgen05.CtaGroup.ONE, self.mma_tiler[:2])
        cluster = cute.tiled_divide(cute.make_layout((1, 1, 1)), (tiled_mma.thr_id.shape,))
        sQ_layout = sm100_utils.make_smem_layout_a(tiled_mma, self.mma_tiler, self.dtype, 1)
        sK_layout = sm100_utils.make_smem_layout_b(tiled_mma, self.mma_tiler, self.dtype, 1)
        tma_load = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
        tma_atom_Q, tma_Q = cute.nvgpu.make_tiled_tma_atom_A(
            tma_load, mQ, cute.select(sQ_layout, mode=[0, 1, 2]), self.mma_tiler, tiled_mma,
            cluster.shape)
        tma_atom_K, tma_K = cute.nvgpu.make_tiled_tma_atom_B(
            tma_load, mK, cute.select(sK_layout, mode=[0, 1, 2]), self.mma_tiler, tiled_mma,
            cluster.shape)
        self.tx_bytes = (cute.size_in_bytes(self.dtype, cute.select(sQ_layout, mode=[0, 1, 2]))
                         + cute.size_in_bytes(self.dtype, cute.select(sK_layout, mode=[0, 1, 2])))

        @cute.struct
        class SharedStorage:
            load_full: cute.struct.MemRange[Int64, 1]   # TMA -> MMA thread (tx bytes)
            s_full: cute.struct.MemRange[Int64, 1]      # tcgen05.commit -> the 128 readers
            tmem_ptr: Int32                             # tcgen05.alloc writes S's address
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]

        self.shared_storage = SharedStorage
        self.kernel(tiled_mma, tma_atom_Q, tma_Q, tma_atom_K, tma_K, mS, sQ_layout,
                    sK_layout).launch(grid=[1, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, tma_atom_Q: cute.CopyAtom, mQ: cute.Tensor,
               tma_atom_K: cute.CopyAtom, mK: cute.Tensor, mS: cute.Tensor,
               sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout):
        tidx = cute.arch.thread_idx()[0]
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        smem = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
        load_full = smem.load_full.data_ptr()
        s_full = smem.s_full.data_ptr()
        sQ = smem.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = smem.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)

        # ---- setup: the two mbarriers (one arrival each) and S's TMEM columns
        if tidx == 0:
            cute.arch.mbarrier_init(load_full, 1)
            cute.arch.mbarrier_init(s_full, 1)
            cute.arch.mbarrier_init_fence()
        if warp_idx == 0:
            cute.arch.alloc_tmem(self.alloc_cols, smem.tmem_ptr)       # ladder: alloc
        cute.arch.barrier()
        tmem_ptr = cute.arch.retrieve_tmem_ptr(Float32, 16, smem.tmem_ptr)
        thr_mma = tiled_mma.get_slice(0)
        tS = thr_mma.make_fragment_C(thr_mma.partition_shape_C(self.mma_tiler[:2]))
        tStS = cute.make_tensor(tmem_ptr, tS.layout)

        # ---- warp 0: TMA Q and K, then the score MMA and its commit. The TMA copies and the
        # MMAs are issued by one elected thread of the warp (the DSL's atoms elect it); the
        # barrier ops are elected here.
        if warp_idx == 0:
            gQ = cute.local_tile(mQ, cute.select(self.mma_tiler, [0, 2]), (None, 0))
            gK = cute.local_tile(mK, cute.select(self.mma_tiler, [1, 2]), (None, 0))
            tQsQ, tQgQ = cpasync.tma_partition(
                tma_atom_Q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 3),
                cute.group_modes(thr_mma.partition_A(gQ), 0, 3))
            tKsK, tKgK = cpasync.tma_partition(
                tma_atom_K, 0, cute.make_layout(1), cute.group_modes(sK, 0, 3),
                cute.group_modes(thr_mma.partition_B(gK), 0, 3))
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(load_full, self.tx_bytes)  # ladder: load
            cute.copy(tma_atom_Q, tQgQ[None, 0], tQsQ[None, 0], tma_bar_ptr=load_full)
            cute.copy(tma_atom_K, tKgK[None, 0], tKsK[None, 0], tma_bar_ptr=load_full)
            cute.arch.mbarrier_wait(load_full, 0)
            tSrQ = tiled_mma.make_fragment_A(sQ)
            tSrK = tiled_mma.make_fragment_B(sK)
            for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):       # ladder: mma
                tiled_mma.set(tcgen05.Field.ACCUMULATE, k != 0)
                cute.gemm(tiled_mma, tStS, tSrQ[None, None, k, 0], tSrK[None, None, k, 0], tStS)
            with cute.arch.elect_one():
                tcgen05.commit(s_full)                                        # ladder: commit

        # ---- every thread: wait s_full, read its row of S from TMEM, store it
        cute.arch.mbarrier_wait(s_full, 0)                                    # ladder: read
        tSAcc = tStS[(None, None), 0, 0]
        tScS = thr_mma.partition_C(cute.make_identity_tensor(self.mma_tiler[:2]))
        load_atom = cute.make_copy_atom(
            tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(LD_COLUMNS)), Float32)
        thr_load = tcgen05.make_tmem_copy(load_atom, tSAcc).get_slice(tidx)
        tScS_t2r = thr_load.partition_D(tScS[(None, None), 0, 0])
        tSrS = cute.make_rmem_tensor(tScS_t2r.shape, Float32)
        cute.copy(thr_load, thr_load.partition_S(tSAcc), tSrS)
        seqlen_q, seqlen_k = mS.shape
        for j in cutlass.range_constexpr(cute.size(tSrS)):
            row, col = tScS_t2r[j]
            if row < seqlen_q and col < seqlen_k:
                mS[row, col] = tSrS[j]

        # ---- teardown: every read of TMEM is done before warp 0 frees the columns
        cute.arch.fence_view_async_tmem_load()
        cute.arch.barrier()
        if warp_idx == 0:
            cute.arch.relinquish_tmem_alloc_permit()
            cute.arch.dealloc_tmem(tmem_ptr, self.alloc_cols)                 # ladder: free


KERNEL = ScoreTileSm100


def fake_args(plan):
    """Fake q (seqlen_q, d), k (seqlen_k, d), s (seqlen_q, seqlen_k) and the stream: symbolic
    sequence lengths, 16-byte aligned rows (what TMA needs), the last dim contiguous."""
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    dtype = _DTYPES[plan.spec.dtype]
    sq, sk = cute.sym_int(), cute.sym_int()
    d = plan.tiles.head_dim
    q = make_fake_tensor(dtype, (sq, d), (cute.sym_int64(divisibility=8), 1), assumed_align=16)
    k = make_fake_tensor(dtype, (sk, d), (cute.sym_int64(divisibility=8), 1), assumed_align=16)
    s = make_fake_tensor(Float32, (sq, sk), (cute.sym_int64(), 1), assumed_align=4)
    return [q, k, s, make_fake_stream(use_tvm_ffi_env_stream=True)]
