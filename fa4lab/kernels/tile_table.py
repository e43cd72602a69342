"""The tile table kernel: a varlen launch's work tiles and lengths, built on the GPU in one launch.

What it computes is `fa4lab.varlen_tiles.launch_tile_rows` and `launch_lengths` (Note [launch
tile table] there), the same rows in the same order, from the same tensors:

    cu_seqlens_q   (batch + 1,) int32             the caller's
    keys           (batch,) int32                 the keys each sequence attends to
    cu_seqlens_k   (batch + 1,) int32, or None    (None with a page table)
    ->  cu_q_out   (batch + 2,)  cu_seqlens_q and its last entry again (the phantom sequence)
        keys_out   (batch + 1,)  keys and a 0
        cu_k_out   (batch + 2,)  as cu_q_out, or None
        table      (rows, 2)     (batch, m_block) rows: LPT order by sequence, padding last

with Int32 sizes rows (`max_tile_rows`), m_block (a CTA's query rows) and cap (the keys a
window lets one tile see, `fa4lab.varlen_tiles.seen_cap`; NO_CAP without a window). Note [one
CTA builds the table].

    from fa4lab.kernels.tile_table import build_launch_tables
    cu_q, cu_k, keys, table = build_launch_tables(lengths, rows, m_block=128, causal=True)
"""

from __future__ import annotations

import time

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

__all__ = ["KERNEL_BY_DEFAULT", "MAX_BATCH", "NO_CAP", "TileTableKernel", "build_launch_tables",
           "compile_tile_table"]

THREADS = 1024
MAX_BATCH = 1024          # a larger batch builds its table with torch ops (`launch_tile_rows`)
NO_CAP = 2**31 - 1
# Whether a launch builds its table with the kernel unless told. On since it ran on an H100: its
# four outputs equal the torch build's in tests/test_tile_table.py (good and bad lengths, batch
# 1 to 1024), and the varlen, paged decode, chunked prefill and index check GPU tests pass with
# it as the default.
KERNEL_BY_DEFAULT = True
_LOG2_SEARCH = 11         # binary-search steps over at most MAX_BATCH ends (2^11 > 1024)
_MAX_QUERIES = 2**30      # a query count is clamped here first: ceil-division cannot overflow

# Note [one CTA builds the table]
# The torch build (`launch_tile_rows`) is about thirty small kernels before every varlen launch
# (sort, scans, searchsorted, gathers, the appended phantom entries), 2-3 us each on the GPU:
# tens of microseconds in front of a paged decode whose kernel takes a few hundred. One CTA of
# THREADS threads does the same work in one launch, its per-sequence arrays in SMEM (hence
# MAX_BATCH): (1) each sequence's tile count, clamped into [0, rows], and the keys its busiest
# tile sees (capped by a window's span); (2) each sequence's place in the order, by counting the
# sequences before it (more keys seen, or as many and a smaller index: torch's stable
# descending argsort) -- batch^2 / THREADS comparisons, under a microsecond at 256 sequences;
# (3) the running tile counts in that order (thread 0, each end clamped to rows: a bad length
# cannot overflow, and a row below rows finds the same sequence as without the clamp); (4) each
# row's sequence by binary search over the ends (torch.searchsorted(right=True)), its m_block
# counted from the sequence's last tile when causal. Rows past the real ones are padding rows
# (batch, 0) as in Note [tile rows on the device]. Every load is inside the tensors: indices
# come from the shapes, and the values are only compared and counted.


class TileTableKernel:
    """The tile table of a varlen launch (Note [one CTA builds the table]); `causal` and whether
    cu_seqlens_k is given are compiled in."""

    def __init__(self, causal: bool, with_cu_k: bool):
        self.causal = causal
        self.with_cu_k = with_cu_k

    @cute.jit
    def __call__(
        self,
        mCuQ: cute.Tensor,            # (batch + 1,) int32
        mKeys: cute.Tensor,           # (batch,) int32
        mCuK: cute.Tensor | None,     # (batch + 1,) int32
        mCuQOut: cute.Tensor,         # (batch + 2,) int32
        mKeysOut: cute.Tensor,        # (batch + 1,) int32
        mCuKOut: cute.Tensor | None,  # (batch + 2,) int32
        mTable: cute.Tensor,          # (rows, 2) int32
        m_block: Int32, cap: Int32,
        stream,
    ):
        if const_expr((mCuK is not None) != self.with_cu_k):
            raise ValueError(f"this tile table kernel was built "
                             f"{'with' if self.with_cu_k else 'without'} cu_seqlens_k")
        batch = cute.size(mKeys.shape[0])
        rows = cute.size(mTable.shape[0])
        self.kernel(mCuQ, mKeys, mCuK, mCuQOut, mKeysOut, mCuKOut, mTable, batch, rows, m_block,
                    cap).launch(grid=[1, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mCuQ, mKeys, mCuK, mCuQOut, mKeysOut, mCuKOut, mTable: cute.Tensor,
               batch: Int32, rows: Int32, m_block: Int32, cap: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        smem = cutlass.memory.SmemAllocator()
        layout = cute.make_layout(MAX_BATCH + 1)
        sTiles = smem.allocate_tensor(Int32, layout, 4)   # per sequence b: its tile count
        sSeen = smem.allocate_tensor(Int32, layout, 4)    # per b: the keys its tiles see
        sOrder = smem.allocate_tensor(Int32, layout, 4)   # per place: the sequence there
        sEnds = smem.allocate_tensor(Int32, layout, 4)    # per place: running tile count

        # The launch's lengths: the caller's, and the phantom sequence (no query, no key).
        for i in cutlass.range(tidx, batch + 2, THREADS, unroll=1):
            last = cutlass.min(i, batch)
            mCuQOut[i] = mCuQ[last]
            if const_expr(mCuK is not None):
                mCuKOut[i] = mCuK[last]
            if i <= batch:
                keys = Int32(0)
                if i < batch:
                    keys = mKeys[i]
                mKeysOut[i] = keys

        # (1) tile counts and the keys each sequence's busiest tile sees
        for b in cutlass.range(tidx, batch, THREADS, unroll=1):
            queries = cutlass.min(cutlass.max(mCuQ[b + 1] - mCuQ[b], 0), _MAX_QUERIES)
            sTiles[b] = cutlass.min((queries + m_block - 1) // m_block, rows)
            sSeen[b] = cutlass.min(mKeys[b], cap)
        cute.arch.sync_threads()

        # (2) each sequence's place: stable, most keys first
        for b in cutlass.range(tidx, batch, THREADS, unroll=1):
            mine = sSeen[b]
            place = Int32(0)
            for j in cutlass.range(batch, unroll=4):
                other = sSeen[j]
                if (other > mine) | ((other == mine) & (j < b)):
                    place = place + 1
            sOrder[place] = b
        cute.arch.sync_threads()

        # (3) running tile counts in that order, each clamped to rows
        if tidx == 0:
            end = Int32(0)
            for p in cutlass.range(batch, unroll=1):
                end = cutlass.min(end + sTiles[sOrder[p]], rows)
                sEnds[p] = end
        cute.arch.sync_threads()

        # (4) each row's sequence and m_block; padding rows (batch, 0) past the real ones
        total = Int32(0)
        if batch > 0:
            total = sEnds[batch - 1]
        for r in cutlass.range(tidx, rows, THREADS, unroll=1):
            seq, m = batch, Int32(0)
            if r < total:
                lo, hi = Int32(0), batch       # the first place whose end exceeds r
                for _ in cutlass.range_constexpr(_LOG2_SEARCH):
                    mid = (lo + hi) // 2
                    if lo < hi:
                        if sEnds[mid] <= r:
                            lo = mid + 1
                        else:
                            hi = mid
                place = cutlass.min(lo, batch - 1)
                seq = sOrder[place]
                tiles = sTiles[seq]
                start = Int32(0)               # the place's first row: the previous end, which
                if place > 0:                  # is at most r < rows, so never clamped
                    start = sEnds[place - 1]
                into = r - start
                m = into
                if const_expr(self.causal):
                    m = tiles - 1 - into
            mTable[r, 0] = seq
            mTable[r, 1] = m


# ---- compile ------------------------------------------------------------------------------------
def fake_args(with_cu_k: bool):
    """The kernel's contract: fake int32 index tensors of any length and stride (the table
    row-major, two columns), the two Int32 sizes and the stream."""
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    def ints(n=None):
        return make_fake_tensor(Int32, (cute.sym_int() if n is None else n,),
                                (cute.sym_int64(),), assumed_align=4)

    table = make_fake_tensor(Int32, (cute.sym_int(), 2), (2, 1), assumed_align=4)
    return [ints(), ints(), ints() if with_cu_k else None, ints(), ints(),
            ints() if with_cu_k else None, table, Int32(128), Int32(NO_CAP),
            make_fake_stream(use_tvm_ffi_env_stream=True)]


def name(causal: bool, with_cu_k: bool, arch: str) -> str:
    """e.g. "tiletable-sm90a-causal-cuk": what one compiled kernel bakes in."""
    parts = [("causal", causal), ("cuk", with_cu_k)]
    return "-".join(["tiletable", arch] + [p for p, on in parts if on])


def _compile(causal: bool, with_cu_k: bool, arch: str, options: str = ""):
    from fa4lab.kernels.compile import target_arch

    with target_arch("sm_" + arch.removeprefix("sm")):
        t0 = time.perf_counter()
        compiled = cute.compile(TileTableKernel(causal, with_cu_k), *fake_args(with_cu_k),
                                options=" ".join(("--enable-tvm-ffi", options)))
    return compiled, time.perf_counter() - t0


def compile_tile_table(causal: bool, with_cu_k: bool, *, arch: str = "sm100a", keep_dir=None):
    """(compiled, seconds, keep dir, ptx path, cubin path) of one tile table kernel for `arch`,
    compiled with fake tensors (no GPU needed)."""
    from fa4lab.kernels.compile import compile_kept, normalize_arch

    arch = normalize_arch(arch)
    return compile_kept(name(causal, with_cu_k, arch),
                        lambda options: _compile(causal, with_cu_k, arch, options), keep_dir)


def _kernel(causal: bool, with_cu_k: bool, arch: str):
    """This process's compiled kernel, else the disk cache's, else a compile."""
    from fa4lab.kernels import cache

    return cache.memo_kernel("tiletable", name(causal, with_cu_k, arch),
                             lambda: _compile(causal, with_cu_k, arch)[0])


# ---- launch -------------------------------------------------------------------------------------
def build_launch_tables(lengths, rows: int, *, m_block: int, causal: bool = False,
                        window_size=(None, None), kernel: bool | None = None) -> tuple:
    """(cu_seqlens_q, cu_seqlens_k or None, seqused_k, tile table) of a varlen launch, as
    `launch_lengths` and `launch_tile_rows` give them: by one launch of the tile table kernel
    on the lengths' GPU (Note [one CTA builds the table]), or by those torch ops where the
    batch exceeds MAX_BATCH, the GPU has no build of the kernel, or `kernel` is False (None:
    KERNEL_BY_DEFAULT). No device-to-host copy."""
    import torch

    from fa4lab.kernels.compile import device_arch
    from fa4lab.varlen_tiles import launch_lengths, launch_tile_rows, seen_cap

    batch = lengths.batch
    cu_q, keys, cu_k = lengths.cu_q, lengths.keys, lengths.cu_k
    arch = device_arch(cu_q.device.index) if cu_q.is_cuda else None
    if kernel is None:
        kernel = KERNEL_BY_DEFAULT
    if not kernel or arch is None or batch > MAX_BATCH:
        lens_q = (cu_q[1:] - cu_q[:-1]).long()
        return (*launch_lengths(lengths),
                launch_tile_rows(lens_q, keys.long(), rows, m_block_size=m_block, causal=causal,
                                 window_size=window_size))
    cap = seen_cap(m_block, causal, window_size)
    ints = dict(dtype=torch.int32, device=cu_q.device)
    cu_q_out = torch.empty(batch + 2, **ints)
    keys_out = torch.empty(batch + 1, **ints)
    cu_k_out = None if cu_k is None else torch.empty(batch + 2, **ints)
    table = torch.empty((rows, 2), **ints)
    fn = _kernel(bool(causal), cu_k is not None, arch + "a")
    fn(cu_q.to(torch.int32), keys.to(torch.int32),
       None if cu_k is None else cu_k.to(torch.int32), cu_q_out, keys_out, cu_k_out, table,
       m_block, NO_CAP if cap is None else cap)
    return cu_q_out, cu_k_out, keys_out, table
