"""A key block of small pages copied row by row with cp.async (device code, the sm90 producer).

Note [cp.async gather]
Pages smaller than `fa4lab.limits.CP_ASYNC_PAGES_BELOW` (Note [cp.async pages] there) are not
read one TMA box per page, issued by one thread, but by the producer warpgroup's 128 threads,
16 bytes each per copy, the way upstream FA4's non-TMA paged loader reads them:
* Threads in groups of `tpr` (`fa4lab.limits.cp_async_row_threads`: 8, or 4 at head_dim 96)
  copy one row of K or V: thread t takes the 16-byte chunk t % tpr of every span of tpr chunks
  of row t // tpr + pass * rows_per_pass, for each of the block's n_block / rows_per_pass
  passes (`row_copy`; the plan keeps n_block a multiple of rows_per_pass and at most 128).
* A row's key is n * n_block + row, its page-table slot key // page_size and its row in the
  page key % page_size, so a block may hold any number of pages and a page start anywhere in
  the swizzled stage: the copy writes each 16-byte chunk where the stage's swizzled layout puts
  it (the layout's own partition, `partition_D`), so no alignment limits the page.
* The block's page indices are read once per block and thread (`row_page`): with at most 128
  rows a block has at most tpr passes, and lane l of a group reads the page of the group's row
  in pass l; the thread copying pass m takes it from lane m of its group by a shuffle. The
  index is clamped as the TMA gather's is (Note [clamped indices] in
  fa4lab.kernels.device.paged): the table's row and slot to the sequence's, the page into the
  cache. The V copy of a block reuses the pages its K copy read.
* Each thread then arms the slot's full barrier with cp.async.mbarrier.arrive.noinc, which
  arrives once the thread's copies landed: the barrier counts the 128 threads, not bytes. The
  data is written by the generic proxy and read by wgmma through the async proxy, so a consumer
  fences (fence.proxy.async.shared::cta) after its wait and before its wgmma (`FlashForwardSm90
  .wait_full`).
Rows past the sequence's keys are copied like any other row of its last page (and masked), as
the TMA gather reads them: a cache must not hold NaN or Inf there.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cute.nvgpu import cpasync

from fa4lab.limits import CP_ASYNC_COPY_BYTES, CP_ASYNC_THREADS, cp_async_row_threads


def row_threads(head_dim: int, head_dim_v: int, dtype) -> int:
    """Threads per row (`fa4lab.limits.cp_async_row_threads`) for elements of `dtype`."""
    return cp_async_row_threads(head_dim, head_dim_v, dtype.width // 8)


def row_copy(dtype, tpr: int) -> cute.TiledCopy:
    """The 128 producer threads' tiled cp.async copy: (rows_per_pass, tpr) threads, row-major,
    each copying 16 contiguous bytes (cp.async.cg: L2 only, as a streamed K/V tile wants)."""
    atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), dtype,
                               num_bits_per_copy=8 * CP_ASYNC_COPY_BYTES)
    threads = cute.make_ordered_layout((CP_ASYNC_THREADS // tpr, tpr), order=(1, 0))
    values = cute.make_layout((1, 8 * CP_ASYNC_COPY_BYTES // dtype.width))
    return cute.make_tiled_copy_tv(atom, threads, values)


@cute.jit
def row_page(mPageTable: cute.Tensor, batch, n, seqlen_k, tidx,
             page_size: cutlass.Constexpr[int], n_block: cutlass.Constexpr[int],
             tpr: cutlass.Constexpr[int]) -> Int32:
    """This thread's page of key block n of sequence `batch`: the page of its group's row in
    pass tidx % tpr (Note [cp.async gather]), clamped as Note [clamped indices] says (the
    cache's upper end by `copy_rows`)."""
    rows_per_pass = CP_ASYNC_THREADS // tpr
    passes = n_block // rows_per_pass
    m = cutlass.min(tidx % tpr, passes - 1)
    key = n * n_block + tidx // tpr + m * rows_per_pass
    last = cutlass.max(cutlass.min((seqlen_k + (page_size - 1)) // page_size,
                                   cute.size(mPageTable, mode=[1])) - 1, 0)
    row = cutlass.min(batch, cute.size(mPageTable, mode=[0]) - 1)
    return cutlass.max(mPageTable[row, cutlass.min(key // page_size, last)], 0)


@cute.jit
def copy_rows(tiled_copy: cute.TiledCopy, mX: cute.Tensor, sX: cute.Tensor, n, page: Int32,
              tidx, page_size: cutlass.Constexpr[int], n_block: cutlass.Constexpr[int],
              tpr: cutlass.Constexpr[int]):
    """cp.async copies of key block n into the SMEM stage `sX` (n_block, cols) from the cache
    view `mX` (page_size, cols, num_pages) of one KV head; `page` this thread's `row_page`."""
    thr = tiled_copy.get_slice(tidx)
    tXsX = thr.partition_D(sX)                                   # (CPY, passes, spans)
    rows_cols = (cute.size(sX, mode=[0]), cute.size(sX, mode=[1]))
    tXcX = thr.partition_S(cute.make_identity_tensor(rows_cols))  # their (row, col)
    last_page = cute.size(mX, mode=[2]) - 1
    group_lane = cute.arch.lane_idx() - tidx % tpr
    for m in cutlass.range_constexpr(cute.size(tXsX, mode=[1])):
        page_m = cutlass.min(cute.arch.shuffle_sync(page, group_lane + m % tpr), last_page)
        within = (n * n_block + tXcX[0, m, 0][0]) % page_size
        row = mX[within, None, page_m]
        for c in cutlass.range_constexpr(cute.size(tXsX, mode=[2])):
            dst = tXsX[None, m, c]
            at = row.iterator + tXcX[0, m, c][1]
            src = cute.make_tensor(
                cute.make_ptr(mX.element_type, at.toint(), cute.AddressSpace.gmem,
                              assumed_align=CP_ASYNC_COPY_BYTES), dst.layout)
            cute.copy(tiled_copy, src, dst)
