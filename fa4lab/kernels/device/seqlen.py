"""Where a sequence's rows are and how long it is, per batch index (device code).

Shared by the sm90 and sm100 kernels. A variable-length batch (`fa4lab.varlen`'s packed
layout, `AttentionSpec(varlen=True)`) keeps every sequence's queries on one packed axis,
sequence b's at rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]), and its keys likewise on the keys'
axis; `seqused_k[b]`, when given, caps the keys sequence b uses (the first seqused_k[b] of
them). seqused_k also works without cu_seqlens, on the ordinary (batch, seqlen_k, heads, d)
layout, where it makes the key count ragged (decode over a cache). Without any of them every
sequence has the launch's fixed sizes.

`sequence` reads these once per tile; the kernel then offsets its (rows, d, heads, batch) views
of the packed tensors by the sequence's first row (`at_offset`: a `cute.domain_offset`, which
shifts a TMA coordinate tensor as well as a global tensor), and every position, mask and block
range after that is the sequence's own (bottom-right causal on its own seqlen_q, seqlen_k).
With Python ints and lists the functions run on the CPU (tests).

Note [varlen rows past a sequence]
A tile's last rows may lie past its sequence's end: on the packed axis they are the next
sequence's rows (or past the tensor, which TMA zero-fills). Loading them is harmless: a query
row past seqlen_q is never stored, and a key past seqlen_k is masked (the seqlen_k tail is a
masked block of `fa4lab.kernels.device.scheduler.mask_split`). Storing them is not: a TMA store
of a whole tile would overwrite the next sequence's output, so a varlen kernel stores O and LSE
row by row, predicated on row < seqlen_q.

Note [clamped lengths]
The lengths come from tensors whose values nothing on the host has read (Note [reading the
lengths] in fa4lab.varlen): with the default device check a bad cu_seqlens or seqused_k is
reported after the launch (Note [index check on the device] in fa4lab.indexcheck), so the
kernel must stay inside its tensors whatever they say. What can leave them is a store and a
plain load; a TMA load cannot (the unit zero-fills a box outside the tensor's view). So
`sequence` clamps each sequence's rows into the packed tensors, whose row counts are the
launch's `seqlen_q` / `seqlen_k` when cu_seqlens are given: its first row into [0, total], its
end into [first row, total] (four min/max per tile and axis). Every predicated store of O and
LSE (Note [varlen rows past a sequence]) then writes rows of out and lse, and K / V offsets
stay inside the packed keys. On good values every clamp is a no-op; on bad ones the answer is
wrong, and nothing outside the tensors is touched.
The totals must be the launch's, never a sequence's own lengths: a kernel that asks for a
sequence again (the sm90 epilogue does, rather than keep the offsets live through the block
loop) passes the launch's sizes again, not the ones `sequence` returned the first time. (A
first version of this clamp was withdrawn after the sm90 epilogue passed its tile's own
seqlen_q as the total, which moved every later sequence's first row into the first sequence's
rows: wrong output on every varlen launch. The same re-read also feeds the tile order its L2
swizzle, which reads seqlen_k: Note [the launch's sizes] in fa4lab.kernels.fwd_sm90.)
seqused_k is not clamped: past a sequence's keys it only makes TMA loads read the next
sequence's keys or zeros, and the one plain load it steers, the page table's slot, is clamped
into the table's row by `fa4lab.kernels.device.paged.read_pages` (Note [clamped indices]
there). (A clamp of seqused_k into the page capacity made the sm100 load warp, at 48
registers, spill 6 instructions with pages of 16.)
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute


class Sequence(NamedTuple):
    """One sequence of the batch: its first query row and key row on the packed axes (0 when
    not packed) and its lengths; `cu_seqlens_k` and `batch` to read offset_k again."""

    offset_q: object
    seqlen_q: object
    offset_k: object
    seqlen_k: object
    cu_seqlens_k: object = None
    batch: object = None
    total_k: object = None

    def reread_offset_k(self):
        """offset_k loaded again from cu_seqlens_k (a load in a loop, rather than a value
        kept live through it where registers are scarce), clamped as `sequence` clamps it."""
        if self.cu_seqlens_k is None:
            return self.offset_k
        return _clamp(self.cu_seqlens_k[self.batch], 0, self.total_k)


def _clamp(x, lo, hi):
    return cutlass.min(cutlass.max(x, lo), hi)


def _within(start, end, total) -> tuple:
    """(first, length) of the rows [start, end) clamped into [0, total) (Note [clamped
    lengths])."""
    first = _clamp(start, 0, total)
    return first, _clamp(end, first, total) - first


def sequence(batch, seqlen_q, seqlen_k, cu_seqlens_q=None, cu_seqlens_k=None,
             seqused_k=None) -> Sequence:
    """Sequence `batch`'s offsets and lengths: from cu_seqlens_q / cu_seqlens_k ((batch + 1,)
    int32) where given, else 0 and the fixed `seqlen_q` / `seqlen_k`; `seqused_k` ((batch,)
    int32), where given, is the key count (it caps what cu_seqlens_k gives). With cu_seqlens
    the fixed sizes are the launch's packed totals, and every offset and length is clamped into
    them (Note [clamped lengths])."""
    offset_q, offset_k, total_k = 0, 0, seqlen_k
    if cu_seqlens_q is not None:
        offset_q, seqlen_q = _within(cu_seqlens_q[batch], cu_seqlens_q[batch + 1], seqlen_q)
    if cu_seqlens_k is not None:
        offset_k, seqlen_k = _within(cu_seqlens_k[batch], cu_seqlens_k[batch + 1], seqlen_k)
    if seqused_k is not None:     # not clamped: Note [clamped lengths]
        seqlen_k = seqused_k[batch]
    return Sequence(offset_q, seqlen_q, offset_k, seqlen_k, cu_seqlens_k, batch, total_k)


def of_launch(batch, seqlen_q, seqlen_k, varlen) -> Sequence:
    """`sequence` from a kernel's `varlen` tuple (mO or None, cu_seqlens_q, cu_seqlens_k,
    seqused_k, tile table): the kernels' one way to ask."""
    return sequence(batch, seqlen_q, seqlen_k, varlen[1], varlen[2], varlen[3])


def at_offset(mX, offset, packed: bool, mode: int = 0):
    """The kernel's view `mX` shifted so that index 0 of its sequence mode `mode` is packed
    row `offset` (the sequence's first), or `mX` itself when not packed."""
    if not packed:
        return mX
    return cute.domain_offset(tuple(offset if i == mode else 0 for i in range(cute.rank(mX))),
                              mX)


def view_batch(packed: bool, batch):
    """The batch index of a kernel's views: 0 for a packed (varlen) batch of one
    (`as_batch_of_one`), `batch` otherwise."""
    return 0 if packed else batch


def as_batch_of_one(x):
    """A packed tensor (total, ...) viewed as (1, total, ...): the batch mode the kernels'
    (batch, seqlen, heads, d) views expect, of extent 1 (each tile then offsets its rows to its
    sequence with `at_offset`)."""
    return cute.make_tensor(x.iterator, cute.prepend(x.layout, cute.make_layout(1)))


def store_rows_threads(cols: int, num_threads: int) -> tuple[int, int]:
    """(rows per pass, threads that copy) of `store_rows` for a tile of `cols` 16-byte
    chunks per row and `num_threads` threads: a whole row per group of `cols` threads, and a
    power of two of such groups, so that a pass's rows divide the tile's rows and the rows of
    its SMEM swizzle atom (8). Head dim 96 has 12 chunks per row: 128 threads copy 8 rows at a
    time with 96 of them (not 10 rows with 120, which no 64-row swizzled tile divides: Note
    [varlen rows past a sequence]); the other threads idle."""
    if cols < 1 or cols > num_threads:
        raise ValueError(f"a row of {cols} 16-byte chunks needs more than {num_threads} threads")
    rows = 1 << ((num_threads // cols).bit_length() - 1)
    return rows, rows * cols


@cute.jit
def store_rows(sX: cute.Tensor, gX: cute.Tensor, rows, tid,
               num_threads: cutlass.Constexpr[int], unroll: cutlass.Constexpr[bool] = True
               ) -> None:
    """gX[r, :] = sX[r, :] for the rows r < `rows` of a (tile rows, cols) tile staged in SMEM,
    by `num_threads` threads (thread `tid`), 16 bytes per copy: the predicated store of Note
    [varlen rows past a sequence], `store_rows_threads`' threads copying. Every thread of the
    group must have written its part of sX and synchronised before. `unroll` False keeps the
    row loop a loop (few registers)."""
    dtype = sX.element_type
    vec = 128 // dtype.width
    cols = cute.size(sX.shape[1]) // vec
    per_pass, active = store_rows_threads(cols, num_threads)
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=128)
    threads = cute.make_ordered_layout((per_pass, cols), order=(1, 0))
    copy = cute.make_tiled_copy_tv(atom, threads, cute.make_layout((1, vec)))
    thr = copy.get_slice(tid % active)
    tXsX, tXgX = thr.partition_S(sX), thr.partition_D(gX)
    tXcX = thr.partition_S(cute.make_identity_tensor((cute.size(sX.shape[0]),
                                                      cute.size(sX.shape[1]))))
    if tid < active:
        if cutlass.const_expr(unroll):
            for m in cutlass.range_constexpr(cute.size(tXgX, mode=[1])):
                if tXcX[0, m, 0][0] < rows:
                    cute.copy(atom, tXsX[None, m, None], tXgX[None, m, None])
        else:
            for m in cutlass.range(cute.size(tXgX, mode=[1]), unroll=1):
                if tXcX[0, m, 0][0] < rows:
                    cute.copy(atom, tXsX[None, m, None], tXgX[None, m, None])
