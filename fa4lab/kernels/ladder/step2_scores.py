"""Ladder step 2: S only -- the score MMA over the key blocks and an online softmax, no P, no O.

What it computes: LSE = log(sum_j exp(scale * q_i . k_j)) per (batch, query head, row), non-causal,
with GQA (query head h reads KV head h // qhead_per_kvhead) and any seqlen_q, seqlen_k >= 1
(the key tail is masked). q (batch, seqlen_q, heads_q, head_dim), k (batch, seqlen_k, heads_kv,
head_dim), 16-bit; lse (batch, heads_q, seqlen_q) float32, natural log; scale_log2 = softmax_scale
* log2(e) is a runtime argument (Note [runtime scale] in fa4lab.kernels.compile).

One CTA per (m_block query rows, head, batch), five warps:
  * warps 0-3, softmax: one thread per row; per key block: wait s_full, read S with tcgen05.ld,
    mask the tail, row max, the conditional rescale (`fa4lab.kernels.device.softmax`), the block
    sum of exp2, arrive p_ready (S was read: the MMA may overwrite it); at the end LSE;
  * warp 4, load + mma: one elected thread issues the TMA of Q, then of each K block into the
    K ring (kv_full / kv_empty), and the score MMA of each block into the one S buffer: it waits
    p_ready before overwriting S and commits s_full after it.
The barriers keep the protocol table's names and numbers (`plan.protocol`: kv_full's stages and
TMA bytes, s_full's and p_ready's arrival counts); S has one buffer here, so the MMA of block j+1
waits until the softmax has read block j -- the serialisation step 3 removes with two S buffers.
Compile it with `fa4lab.kernels.ladder.compile_step(2)`; running it needs a B200-class GPU.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32, Int64
from cutlass.cute.nvgpu import cpasync, tcgen05

from fa4lab.kernels.device import mask as mask_mod
from fa4lab.kernels.device import softmax as softmax_mod
from fa4lab.kernels.device.storage import pipeline_barriers
from fa4lab.kernels.ladder.step1_mma import _DTYPES, LD_COLUMNS, THREADS
from fa4lab.plan.tmem import alloc_columns

MMA_WARP = THREADS // 32     # the warp after the softmax warpgroup


class ScoreSoftmaxSm100:
    """LSE of each query row, S in TMEM. `__init__` reads the plan (no DSL code)."""

    def __init__(self, plan):
        spec, tiles = plan.spec, plan.tiles
        if spec.causal or spec.window_size != (None, None) or spec.softcap or \
                spec.learnable_sink:
            raise ValueError("ladder step 2 computes plain (non-causal, unwindowed, uncapped, "
                             "sink-free) attention's LSE; the full kernel (step 4) has the rest")
        if tiles.m_block != THREADS:
            raise ValueError(f"step 2 runs one softmax thread per row: m_block must be "
                             f"{THREADS}, the plan has {tiles.m_block}")
        self.plan = plan
        self.dtype = _DTYPES[spec.dtype]
        self.m_block, self.n_block, self.head_dim = tiles.m_block, tiles.n_block, tiles.head_dim
        self.qhead_per_kvhead = spec.qhead_per_kvhead
        self.mma_tiler = (self.m_block, self.n_block, self.head_dim)
        self.kv = pipeline_barriers(plan, "kv_full", "kv_empty")   # the K ring of the table
        self.s = pipeline_barriers(plan, "s_full", "p_ready")      # one S buffer's arrivals
        self.q_tx_bytes = plan.barriers.barrier("q_full").tx_bytes
        self.alloc_cols = alloc_columns(plan.tmem.region("S", 0).columns)
        self.rescale_threshold = plan.rescale_threshold
        self.threads_per_cta = THREADS + 32
        # The audit's expectations (fa4lab.kernels.ladder.audit_step): the score MMA at one
        # site, S read 32 columns per tcgen05.ld, the barriers above (q_full, the ring, s_full
        # and p_ready of one buffer), and exp2 of every score on the MUFU.
        self.expected = {"tcgen05.alloc": 1, "tcgen05.mma": self.head_dim // 16,
                         "tcgen05.commit": 2, "tcgen05.ld": self.n_block // LD_COLUMNS,
                         "tcgen05.dealloc": 1, "mbarrier.init": 1 + 2 * self.kv.stages + 2}

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,    # (batch, seqlen_q, heads_q, head_dim)
        mK: cute.Tensor,    # (batch, seqlen_k, heads_kv, head_dim)
        mLSE: cute.Tensor,  # (batch, heads_q, seqlen_q) float32
        scale_log2: Float32,
        stream: cuda.CUstream,
    ):
        # (s, d, h, b) views for TMA, as the full kernel's; LSE as (s, h, b).
        mQ, mK = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))
                  for t in (mQ, mK)]
        mLSE = cute.make_tensor(mLSE.iterator, cute.select(mLSE.layout, mode=[2, 1, 0]))
        tiled_mma = sm100_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, tcgen05.OperandMajorMode.K, tcgen05.OperandMajorMode.K,
            Float32, tcgen05.CtaGroup.ONE, self.mma_tiler[:2])
        cluster = cute.tiled_divide(cute.make_layout((1, 1, 1)), (tiled_mma.thr_id.shape,))
        sQ_layout = sm100_utils.make_smem_layout_a(tiled_mma, self.mma_tiler, self.dtype, 1)
        sK_layout = sm100_utils.make_smem_layout_b(tiled_mma, self.mma_tiler, self.dtype,
                                                   self.kv.stages)
        tma_load = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
        tma_atom_Q, tma_Q = cute.nvgpu.make_tiled_tma_atom_A(
            tma_load, mQ, cute.select(sQ_layout, mode=[0, 1, 2]), self.mma_tiler, tiled_mma,
            cluster.shape)
        tma_atom_K, tma_K = cute.nvgpu.make_tiled_tma_atom_B(
            tma_load, mK, cute.select(sK_layout, mode=[0, 1, 2]), self.mma_tiler, tiled_mma,
            cluster.shape)
        self.check_tx_bytes(sQ_layout, sK_layout)

        @cute.struct
        class SharedStorage:
            q_full: cute.struct.MemRange[Int64, 1]
            kv_full: cute.struct.MemRange[Int64, self.kv.stages]
            kv_empty: cute.struct.MemRange[Int64, self.kv.stages]
            s_full: cute.struct.MemRange[Int64, 1]
            p_ready: cute.struct.MemRange[Int64, 1]
            tmem_ptr: Int32
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]

        self.shared_storage = SharedStorage
        grid = (cute.ceil_div(cute.size(mQ.shape[0]), self.m_block), cute.size(mQ.shape[2]),
                cute.size(mQ.shape[3]))
        self.kernel(tiled_mma, tma_atom_Q, tma_Q, tma_atom_K, tma_K, mLSE, scale_log2,
                    sQ_layout, sK_layout).launch(grid=grid, block=[self.threads_per_cta, 1, 1],
                                                 stream=stream)

    def check_tx_bytes(self, sQ_layout, sK_layout):
        """The TMA boxes bring the bytes the table's full barriers expect."""
        for name, layout, want in (("q_full", sQ_layout, self.q_tx_bytes),
                                   ("kv_full", sK_layout, self.kv.tx_bytes)):
            got = cute.size_in_bytes(self.dtype, cute.select(layout, mode=[0, 1, 2]))
            if got != want:
                raise ValueError(f"{name}: the TMA brings {got} bytes, the table expects {want}")

    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, tma_atom_Q: cute.CopyAtom, mQ: cute.Tensor,
               tma_atom_K: cute.CopyAtom, mK: cute.Tensor, mLSE: cute.Tensor,
               scale_log2: Float32, sQ_layout: cute.ComposedLayout,
               sK_layout: cute.ComposedLayout):
        tidx = cute.arch.thread_idx()[0]
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        m_block, head, batch = cute.arch.block_idx()
        seqlen_q, seqlen_k = mQ.shape[0], mK.shape[0]
        n_blocks = cute.ceil_div(seqlen_k, self.n_block)
        smem = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
        sQ = smem.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = smem.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        q_full = smem.q_full.data_ptr()
        pipe_kv = pipeline.PipelineTmaUmma.create(
            num_stages=self.kv.stages, tx_count=self.kv.tx_bytes,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.kv.producers),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.kv.consumers),
            barrier_storage=smem.kv_full.data_ptr(), defer_sync=True)
        pipe_s = pipeline.PipelineUmmaAsync.create(
            num_stages=1,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.s.producers),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.s.consumers),
            barrier_storage=smem.s_full.data_ptr(), defer_sync=True)
        if tidx == 0:
            cute.arch.mbarrier_init(q_full, 1)
        if warp_idx == MMA_WARP:
            cute.arch.alloc_tmem(self.alloc_cols, smem.tmem_ptr)
        pipeline.pipeline_init_arrive()
        pipeline.pipeline_init_wait()       # a CTA barrier: the inits and the address are seen
        tmem_ptr = cute.arch.retrieve_tmem_ptr(Float32, 16, smem.tmem_ptr)
        thr_mma = tiled_mma.get_slice(0)
        tS = thr_mma.make_fragment_C(thr_mma.partition_shape_C(self.mma_tiler[:2]))
        tStS = cute.make_tensor(tmem_ptr, tS.layout)

        if warp_idx == MMA_WARP:     # the whole warp: the DSL's atoms and pipelines elect
            self.load_and_mma(tiled_mma, thr_mma, tma_atom_Q, mQ, tma_atom_K, mK, sQ, sK, tStS,
                              q_full, pipe_kv, pipe_s, m_block, head, batch, n_blocks)
        if warp_idx < MMA_WARP:
            row_max, row_sum = self.softmax(thr_mma, tStS, pipe_s, tidx, seqlen_k, n_blocks,
                                            scale_log2)
            _, lse = softmax_mod.finalize_row(row_sum, row_max, scale_log2)
            softmax_mod.store_lse(mLSE, m_block * self.m_block + tidx, lse, head, batch,
                                  seqlen_q, 1)
        # Teardown: the softmax has read S for the last time before warp 4 frees the columns.
        cute.arch.fence_view_async_tmem_load()
        cute.arch.barrier()
        if warp_idx == MMA_WARP:
            cute.arch.relinquish_tmem_alloc_permit()
            cute.arch.dealloc_tmem(tmem_ptr, self.alloc_cols)

    @cute.jit
    def load_and_mma(self, tiled_mma, thr_mma, tma_atom_Q, mQ, tma_atom_K, mK, sQ, sK, tStS,
                     q_full, pipe_kv, pipe_s, m_block, head, batch, n_blocks):
        """Warp 4 (one elected thread issues): TMA of Q, then per key block TMA K_j (kv_full) and
        S = Q K_j^T (s_full), the MMA waiting for the ring (kv_full) and for S to be read
        (p_ready)."""
        head_kv = head // self.qhead_per_kvhead
        gQ = cute.local_tile(mQ[None, None, head, batch], cute.select(self.mma_tiler, [0, 2]),
                             (None, 0))
        gK = cute.local_tile(mK[None, None, head_kv, batch], cute.select(self.mma_tiler, [1, 2]),
                             (None, 0))
        tQsQ, tQgQ = cpasync.tma_partition(tma_atom_Q, 0, cute.make_layout(1),
                                           cute.group_modes(sQ, 0, 3),
                                           cute.group_modes(thr_mma.partition_A(gQ), 0, 3))
        tKsK, tKgK = cpasync.tma_partition(tma_atom_K, 0, cute.make_layout(1),
                                           cute.group_modes(sK, 0, 3),
                                           cute.group_modes(thr_mma.partition_B(gK), 0, 3))
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(q_full, self.q_tx_bytes)
        cute.copy(tma_atom_Q, tQgQ[None, m_block], tQsQ[None, 0], tma_bar_ptr=q_full)
        tSrQ = tiled_mma.make_fragment_A(sQ)
        tSrK = tiled_mma.make_fragment_B(sK)
        load_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                  self.kv.stages)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                self.kv.stages)
        s_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        # The ring is filled up to kv.stages blocks ahead of the MMA.
        prefetch = cutlass.min(n_blocks, self.kv.stages)
        for j in cutlass.range(prefetch, unroll=1):
            pipe_kv.producer_acquire(load_state)
            cute.copy(tma_atom_K, tKgK[None, j], tKsK[None, load_state.index],
                      tma_bar_ptr=pipe_kv.producer_get_barrier(load_state))
            load_state.advance()
        cute.arch.mbarrier_wait(q_full, 0)
        for j in cutlass.range(n_blocks, unroll=1):
            pipe_kv.consumer_wait(kv_state)                 # wait kv_full: K_j is in SMEM
            pipe_s.producer_acquire(s_state)                # wait p_ready: S was read
            for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
                tiled_mma.set(tcgen05.Field.ACCUMULATE, k != 0)
                cute.gemm(tiled_mma, tStS, tSrQ[None, None, k, 0],
                          tSrK[None, None, k, kv_state.index], tStS)
            pipe_s.producer_commit(s_state)                 # commit s_full
            pipe_kv.consumer_release(kv_state)              # commit kv_empty
            kv_state.advance()
            s_state.advance()
            if j + prefetch < n_blocks:
                pipe_kv.producer_acquire(load_state)        # wait kv_empty: a free slot
                cute.copy(tma_atom_K, tKgK[None, j + prefetch], tKsK[None, load_state.index],
                          tma_bar_ptr=pipe_kv.producer_get_barrier(load_state))
                load_state.advance()

    @cute.jit
    def softmax(self, thr_mma, tStS, pipe_s, tidx, seqlen_k, n_blocks, scale_log2: Float32):
        """One thread per row: per key block, S from TMEM -> (tail mask) -> row max, the
        conditional rescale and the block sum; returns (row_max, row_sum)."""
        tSAcc = tStS[(None, None), 0, 0]
        tScS = thr_mma.partition_C(cute.make_identity_tensor(self.mma_tiler[:2]))
        load_atom = cute.make_copy_atom(
            tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(LD_COLUMNS)), Float32)
        thr_load = tcgen05.make_tmem_copy(load_atom, tSAcc).get_slice(tidx)
        tStS_t2r = thr_load.partition_S(tSAcc)
        tScS_t2r = thr_load.partition_D(tScS[(None, None), 0, 0])
        s_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        row_max = -Float32.inf
        row_sum = Float32(0.0)
        threshold = Float32(self.rescale_threshold)
        for j in cutlass.range(n_blocks, unroll=1):
            pipe_s.consumer_wait(s_state)                   # wait s_full
            tSrS = cute.make_rmem_tensor(tScS_t2r.shape, Float32)
            cute.copy(thr_load, tStS_t2r, tSrS)
            cute.arch.fence_view_async_tmem_load()
            pipe_s.consumer_release(s_state)                # arrive p_ready: S was read
            s_state.advance()
            mask_mod.mask_row(tSrS, tScS_t2r, seqlen_k - j * self.n_block)
            block_max = tSrS[0]
            for c in cutlass.range_constexpr(1, cute.size(tSrS)):
                block_max = cute.arch.fmax(block_max, tSrS[c])
            row_max, row_scale = softmax_mod.update_max(row_max, block_max, scale_log2,
                                                        threshold)
            basis = softmax_mod.exp2_basis(row_max, scale_log2)
            block_sum = Float32(0.0)
            for c in cutlass.range_constexpr(cute.size(tSrS)):
                block_sum += cute.math.exp2(tSrS[c] * scale_log2 - basis, fastmath=True)
            row_sum = softmax_mod.update_sum(row_sum, row_scale, block_sum)
        return row_max, row_sum


KERNEL = ScoreSoftmaxSm100


def fake_args(plan):
    """Fake q, k (batch, seqlen, heads, head_dim), lse (batch, heads_q, seqlen_q), scale_log2
    and the stream: symbolic sizes and 64-bit strides, as `fa4lab.kernels.compile.fake_args`."""
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    from fa4lab.kernels.device.arguments import scale_args

    spec = plan.spec
    dtype = _DTYPES[spec.dtype]
    b, sq, sk, hq, hkv = (cute.sym_int() for _ in range(5))

    def bshd(s, h):
        strides = tuple(cute.sym_int64(divisibility=8) for _ in range(3))
        return make_fake_tensor(dtype, (b, s, h, spec.head_dim), (*strides, 1), assumed_align=16)

    lse = make_fake_tensor(Float32, (b, hq, sq), (cute.sym_int64(), cute.sym_int64(), 1),
                           assumed_align=4)
    scale_log2, _ = scale_args(spec.softmax_scale, spec.head_dim)
    return [bshd(sq, hq), bshd(sk, hkv), lse, Float32(scale_log2),
            make_fake_stream(use_tvm_ffi_env_stream=True)]
