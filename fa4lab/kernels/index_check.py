"""The index check kernel: the value rules of a varlen or paged call's index tensors, on the GPU.

What it computes (Note [index check on the device] in `fa4lab.indexcheck`): for each rule of
the call's `IndexCheckPlan` (cu_seqlens start at 0, never decrease and end at the packed total;
seqused_k within its sequence's keys; every page a sequence reads inside the cache; max_seqlen
above every length) the first broken index, and from them one verdict, written to a slot's
slot's mapped host row (`fa4lab.indexcheck.HOST_WORDS` int32 words):

    cu_seqlens_q   (batch + 1,) int32, or None (dense q with a page table)
    cu_seqlens_k   (batch + 1,) int32, or None (a page table instead)
    seqused_k      (batch,) int32, or None
    page_table     (batch, pages_per_seq) int32, or None
    slot           (SLOT_WORDS,) int32: the scratch (first broken index per rule, CTA counter)
    host           (HOST_WORDS,) int32, mapped host memory: the verdict (rule, index, value,
                   other), then the ticket
    ticket         Int32: written to host[TICKET_AT] after the verdict, behind a system fence
    total_q, total_k, num_pages, page_size, max_seqlen_q, max_seqlen_k   Int32 (unused ones 0;
                   a max_seqlen not given is NO_INDEX, which no length exceeds)

One compile per `IndexCheckPlan` and arch, whatever the batch, the table's width or the values
(all runtime), through the same disk cache as the forward kernels. Plain loads, stores and
atomics only: the same code compiles for sm_90a and sm_100a.

The rules' per-entry tests (`entry_broken`, `entry_values`) are plain arithmetic on indexable
tensors, written once: the kernel runs them on DSL values and `replay` on numpy arrays, so the
CPU tests hold the kernel's own tests to the synchronous check (`fa4lab.varlen`). `check_async`
queues a check and its verdict (`fa4lab.indexcheck.submit`); `fa4lab.varlen`'s checks reach it
through `fa4lab.indexcheck.queue_check`, where the launch path installs it (Note [who launches
the device check] in `fa4lab.indexcheck`).

    from fa4lab.kernels.index_check import compile_index_check
    cc = compile_index_check(IndexCheckPlan(cu_q=True, cu_k=True, seqused_k=False,
                                            paged=False), arch="sm90a")   # on a CPU too
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from fa4lab.indexcheck import (
    COUNTER_AT,
    HOST_WORDS,
    NO_INDEX,
    SCRATCH_AT,
    SLOT_WORDS,
    TICKET_AT,
    VERDICT_WORDS,
    CheckContext,
    IndexCheckPlan,
    Rule,
    Verdict,
)

# Tuning knobs (Note [one verdict from many CTAs]).
CHECK_THREADS = 256
ENTRIES_PER_THREAD = 4        # a CTA per CHECK_THREADS * 4 entries of the longest sweep
MAX_CTAS = 1024
WARP = 32
WARPS = CHECK_THREADS // WARP

# Note [one verdict from many CTAs]
# The check sweeps two domains: the batch (b in [0, batch): every rule but PAGE, the rules on
# cu_seqlens' first and last entries at b = 0) and the page table's entries (flat i = b *
# pages_per_seq + slot: PAGE), each thread keeping per rule the smallest broken index it saw in
# a register. A page table can be large (batch x capacity / page_size slots, most of them past
# the sequences' ends), and one CTA walking it would wait out one load latency per few entries,
# so the grid has a CTA per CHECK_THREADS * ENTRIES_PER_THREAD entries of the longer domain (at
# most MAX_CTAS; grid-stride loops). Each CTA reduces its minima (a warp shuffle, then SMEM)
# and its thread 0 folds them into the slot's scratch words with atomic min, then counts itself
# with an acq_rel atomic add; the CTA that counts last has seen every other CTA's minima (their
# release, its acquire), swaps each scratch word back to NO_INDEX and the counter to 0 (ready
# for the slot's next check, so nothing has to clear it) and writes the verdict: the first rule
# (in `Rule` order) with a broken index, that index, and the two values its message needs, read
# from the index tensors then (`entry_values`). Every load is inside the tensors whatever their
# values say: indices come from the shapes, and values are only compared.


class CheckView(NamedTuple):
    """What the rules read: index tensors (cute tensors in the kernel, numpy arrays in
    `replay`; None where the plan has none) and sizes. batch is the sequences, pages the
    table's slots per sequence (0 without a table)."""

    cu_q: object
    cu_k: object
    used: object
    table: object
    batch: object
    pages: object
    total_q: object
    total_k: object
    num_pages: object
    page_size: object
    max_q: object
    max_k: object

    def have(self, b):
        """The keys sequence b has: cu_seqlens_k's difference, or its pages' capacity."""
        if self.cu_k is not None:
            return self.cu_k[b + 1] - self.cu_k[b]
        return self.pages * self.page_size

    def keys(self, b):
        """The keys sequence b attends to: seqused_k, else all it has."""
        return self.used[b] if self.used is not None else self.have(b)


def domain(rule: Rule) -> str:
    """The sweep a rule's index runs over: "first" (b = 0 only), "batch" or "pages"."""
    if rule in (Rule.CU_Q_START, Rule.CU_Q_END, Rule.CU_K_START, Rule.CU_K_END):
        return "first"
    return "pages" if rule == Rule.PAGE else "batch"


def _cu(rule: Rule, view: CheckView):
    if rule in (Rule.CU_Q_START, Rule.CU_Q_ORDER, Rule.CU_Q_END):
        return view.cu_q, view.total_q
    return view.cu_k, view.total_k


def _page_entry(view: CheckView, i):
    """(page, keys, slot, slots read) of flat page-table entry i."""
    b = i // view.pages
    slot = i - b * view.pages
    keys = view.keys(b)
    return view.table[b, slot], keys, slot, (keys + view.page_size - 1) // view.page_size


def entry_broken(rule: Rule, view: CheckView, i):
    """Whether `rule` is broken at index i of its domain (`domain`): a DSL Boolean or a bool.
    Plain arithmetic: no branch on a value, every index inside the tensors."""
    if rule in (Rule.CU_Q_START, Rule.CU_K_START):
        cu, _ = _cu(rule, view)
        return cu[0] != 0
    if rule in (Rule.CU_Q_ORDER, Rule.CU_K_ORDER):
        cu, _ = _cu(rule, view)
        return cu[i + 1] < cu[i]
    if rule in (Rule.CU_Q_END, Rule.CU_K_END):
        cu, total = _cu(rule, view)
        return cu[view.batch] != total
    if rule == Rule.SEQUSED_K:
        return (view.used[i] < 0) | (view.used[i] > view.have(i))
    if rule == Rule.PAGE:
        page, _, slot, read = _page_entry(view, i)
        return (slot < read) & ((page < 0) | (page >= view.num_pages))
    if rule == Rule.MAX_Q:
        return view.cu_q[i + 1] - view.cu_q[i] > view.max_q
    return view.keys(i) > view.max_k


def entry_values(rule: Rule, view: CheckView, i) -> tuple:
    """The (value, other) the message of `rule` broken at index i names
    (`fa4lab.indexcheck.message`)."""
    if rule in (Rule.CU_Q_START, Rule.CU_K_START):
        cu, _ = _cu(rule, view)
        return cu[0], 0
    if rule in (Rule.CU_Q_ORDER, Rule.CU_K_ORDER):
        cu, _ = _cu(rule, view)
        return cu[i], cu[i + 1]
    if rule in (Rule.CU_Q_END, Rule.CU_K_END):
        cu, _ = _cu(rule, view)
        return cu[view.batch], 0
    if rule == Rule.SEQUSED_K:
        return view.used[i], view.have(i)
    if rule == Rule.PAGE:
        page, keys, _, _ = _page_entry(view, i)
        return page, keys
    if rule == Rule.MAX_Q:
        return view.cu_q[i + 1] - view.cu_q[i], 0
    return view.keys(i), 0


class IndexCheck:
    """The check kernel of one `IndexCheckPlan` (Note [one verdict from many CTAs])."""

    def __init__(self, plan: IndexCheckPlan):
        self.plan = plan
        self.rules = plan.rules

    @cute.jit
    def __call__(
        self,
        mCuQ: cute.Tensor | None,     # (batch + 1,) int32
        mCuK: cute.Tensor | None,     # (batch + 1,) int32
        mUsed: cute.Tensor | None,    # (batch,) int32
        mTable: cute.Tensor | None,   # (batch, pages_per_seq) int32
        mSlot: cute.Tensor,           # (SLOT_WORDS,) int32: scratch, counter
        mHost: cute.Tensor,           # (HOST_WORDS,) int32, mapped host memory: verdict, ticket
        ticket: Int32,
        total_q: Int32, total_k: Int32, num_pages: Int32, page_size: Int32, max_q: Int32,
        max_k: Int32,
        stream,
    ):
        plan = self.plan
        for name, t, want in (("cu_seqlens_q", mCuQ, plan.cu_q), ("cu_seqlens_k", mCuK,
                              plan.cu_k), ("seqused_k", mUsed, plan.seqused_k),
                              ("page_table", mTable, plan.paged)):
            if const_expr((t is not None) != want):
                raise ValueError(f"this check kernel was built {'with' if want else 'without'} "
                                 f"{name}")
        batch = (cute.size(mCuQ.shape[0]) - 1 if const_expr(mCuQ is not None)
                 else cute.size(mTable.shape[0]))
        pages = cute.size(mTable.shape[1]) if const_expr(mTable is not None) else Int32(0)
        longest = cutlass.max(batch, batch * pages)
        chunk = CHECK_THREADS * ENTRIES_PER_THREAD
        grid = cutlass.max(cutlass.min((longest + chunk - 1) // chunk, MAX_CTAS), 1)
        self.kernel(mCuQ, mCuK, mUsed, mTable, mSlot, mHost, ticket, batch, pages, total_q,
                    total_k, num_pages, page_size, max_q, max_k).launch(
            grid=[grid, 1, 1], block=[CHECK_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mCuQ, mCuK, mUsed, mTable, mSlot: cute.Tensor, mHost: cute.Tensor,
               ticket: Int32, batch: Int32, pages: Int32,
               total_q: Int32, total_k: Int32, num_pages: Int32, page_size: Int32, max_q: Int32,
               max_k: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        view = CheckView(mCuQ, mCuK, mUsed, mTable, batch, pages, total_q, total_k, num_pages,
                         page_size, max_q, max_k)
        smem = cutlass.memory.SmemAllocator()
        sMin = smem.allocate_tensor(Int32, cute.make_layout((WARPS, len(self.rules))), 4)
        first = cute.make_rmem_tensor(len(self.rules), Int32)
        first.fill(NO_INDEX)
        start, step = bidx * CHECK_THREADS + tidx, grid * CHECK_THREADS
        self.sweep(view, first, "first", start, 1, step)
        self.sweep(view, first, "batch", start, batch, step)
        self.sweep(view, first, "pages", start, batch * pages, step)
        self.fold(view, first, sMin, mSlot, mHost, ticket, tidx, grid)

    @cute.jit
    def sweep(self, view: CheckView, first: cute.Tensor, which: cutlass.Constexpr[str], start,
              stop, step):
        """first[k] = the smallest broken index of rule k among this thread's entries of the
        `which` domain (start, start + step, ... < stop)."""
        picked = [k for k, rule in enumerate(self.rules) if domain(rule) == which]
        if const_expr(len(picked) > 0):
            for i in cutlass.range(start, stop, step, unroll=ENTRIES_PER_THREAD):
                for k in cutlass.range_constexpr(len(picked)):
                    rule = self.rules[picked[k]]
                    if entry_broken(rule, view, i):
                        first[picked[k]] = cutlass.min(first[picked[k]], i)

    @cute.jit
    def fold(self, view: CheckView, first: cute.Tensor, sMin: cute.Tensor, mSlot: cute.Tensor,
             mHost: cute.Tensor, ticket: Int32, tidx, grid):
        """The CTA's minima into the slot's scratch; the last CTA writes the verdict and resets
        the scratch (Note [one verdict from many CTAs])."""
        warp, lane = tidx // WARP, tidx % WARP
        for k in cutlass.range_constexpr(len(self.rules)):
            m = cute.arch.warp_reduction(first[k], cutlass.min)
            if lane == 0:
                sMin[warp, k] = m
        cute.arch.sync_threads()
        if tidx == 0:
            for k in cutlass.range_constexpr(len(self.rules)):
                m = sMin[0, k]
                for w in cutlass.range_constexpr(1, WARPS):
                    m = cutlass.min(m, sMin[w, k])
                if m != NO_INDEX:
                    cute.arch.atomic_min(self.word(mSlot, SCRATCH_AT + self.rules[k] - 1), m,
                                         sem="relaxed", scope="gpu")
            done = cute.arch.atomic_add(self.word(mSlot, COUNTER_AT), Int32(1), sem="acq_rel",
                                        scope="gpu")
            if done == grid - 1:
                self.write_verdict(view, mSlot, mHost, ticket)

    @cute.jit
    def write_verdict(self, view: CheckView, mSlot: cute.Tensor, mHost: cute.Tensor,
                      ticket: Int32):
        found = Int32(0)
        for k in cutlass.range_constexpr(len(self.rules)):
            rule = self.rules[k]
            at = cute.arch.atomic_exch(self.word(mSlot, SCRATCH_AT + rule - 1), Int32(NO_INDEX),
                                       sem="relaxed", scope="gpu")
            if found == 0:
                if at != NO_INDEX:
                    found = Int32(int(rule))
                    value, other = entry_values(rule, view, at)
                    mHost[0] = found
                    mHost[1] = at
                    mHost[2] = value
                    mHost[3] = Int32(other)
        if found == 0:
            for w in cutlass.range_constexpr(VERDICT_WORDS):
                mHost[w] = Int32(0)
        cute.arch.atomic_exch(self.word(mSlot, COUNTER_AT), Int32(0), sem="relaxed", scope="gpu")
        # The verdict before the ticket, for a reader on the host (Note [index check on the
        # device] in fa4lab.indexcheck).
        cute.arch.fence_acq_rel_sys()
        mHost[TICKET_AT] = ticket

    @staticmethod
    def word(mSlot: cute.Tensor, w: int):
        return mSlot.iterator + w


# ---- the replay on the CPU ----------------------------------------------------------------------
class _Ints:
    """A numpy array indexed as the kernel indexes a tensor, giving Python ints."""

    def __init__(self, a):
        self.a = a

    def __getitem__(self, i):
        return int(self.a[i])


def replay(context: CheckContext, cu_q=None, cu_k=None, used=None, table=None) -> Verdict:
    """The verdict `check_async` would give, computed on the CPU: the kernel's per-entry tests
    (`entry_broken`, `entry_values`) on every entry of each domain, and its choice (the first
    rule with a broken index, at its smallest). The arguments are `check_async`'s (index
    tensors on any device, read to the host here)."""
    import numpy as np

    def ints(t):
        return None if t is None else _Ints(np.asarray(t.cpu() if hasattr(t, "cpu") else t))

    plan = plan_of(cu_q, cu_k, used, table)
    batch = (len(cu_q) - 1) if cu_q is not None else len(table)
    pages = int(table.shape[1]) if table is not None else 0
    view = CheckView(ints(cu_q), ints(cu_k), ints(used), ints(table), batch, pages,
                     *launch_sizes(context))
    stops = {"first": 1, "batch": batch, "pages": batch * pages}
    for rule in plan.rules:
        for i in range(stops[domain(rule)]):
            if entry_broken(rule, view, i):
                return Verdict(rule, i, *entry_values(rule, view, i))
    return Verdict()


# ---- compile ------------------------------------------------------------------------------------
def fake_args(plan: IndexCheckPlan):
    """Fake cu_seqlens_q, cu_seqlens_k, seqused_k, page_table (None where the plan has none), the
    slot row, the host row, the ticket, the six Int32 sizes and the stream: the kernel's
    contract. Every index tensor has symbolic 64-bit strides (any int32 tensor passes), the slot
    and host rows stride 1."""
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    def ints(shape):
        return make_fake_tensor(Int32, shape, tuple(cute.sym_int64() for _ in shape),
                                assumed_align=4)

    b = cute.sym_int()
    cu_q = ints((cute.sym_int(),)) if plan.cu_q else None
    cu_k = ints((cute.sym_int(),)) if plan.cu_k else None
    used = ints((cute.sym_int(),)) if plan.seqused_k else None
    table = ints((b, cute.sym_int())) if plan.paged else None
    slot = make_fake_tensor(Int32, (SLOT_WORDS,), (1,), assumed_align=4)
    host = make_fake_tensor(Int32, (HOST_WORDS,), (1,), assumed_align=4)
    return [cu_q, cu_k, used, table, slot, host, Int32(0), *(Int32(0) for _ in range(6)),
            make_fake_stream(use_tvm_ffi_env_stream=True)]


def _compile(plan: IndexCheckPlan, arch: str, options: str = ""):
    from fa4lab.kernels.compile import target_arch

    with target_arch("sm_" + arch.removeprefix("sm")):
        t0 = time.perf_counter()
        compiled = cute.compile(IndexCheck(plan), *fake_args(plan),
                                options=" ".join(("--enable-tvm-ffi", options)))
    return compiled, time.perf_counter() - t0


@dataclass(frozen=True)
class CompiledIndexCheck:
    """One compiled check kernel and where its artifacts are."""

    arch: str
    plan: IndexCheckPlan
    compiled: object
    seconds: float
    keep_dir: Path
    ptx_path: Path
    cubin_path: Path


def compile_index_check(plan: IndexCheckPlan, *, arch: str = "sm100a",
                        keep_dir=None) -> CompiledIndexCheck:
    """Compile the check kernel of `plan` for `arch` with fake tensors (no GPU needed); PTX and
    cubin kept in keep_dir/<name>/ (a fresh temporary directory by default)."""
    from fa4lab.kernels.compile import compile_kept, normalize_arch

    arch = normalize_arch(arch)
    return CompiledIndexCheck(arch, plan, *compile_kept(
        plan.name(arch), lambda options: _compile(plan, arch, options), keep_dir))


# ---- launch -------------------------------------------------------------------------------------
def _kernel(plan: IndexCheckPlan, arch: str):
    """The compiled check of (plan, arch): this process's, else the disk cache's
    (`fa4lab.kernels.cache.memo_kernel`), else a compile."""
    from fa4lab.kernels import cache

    return cache.memo_kernel("indexcheck", plan.name(arch), lambda: _compile(plan, arch)[0])


def plan_of(cu_q=None, cu_k=None, used=None, table=None) -> IndexCheckPlan:
    """The plan of a check of these index tensors (None where the call has none)."""
    return _plan(cu_q is not None, cu_k is not None, used is not None, table is not None)


@functools.cache
def _plan(*have: bool) -> IndexCheckPlan:
    return IndexCheckPlan(*have)


def launch_sizes(context: CheckContext) -> tuple[int, ...]:
    """The kernel's Int32 sizes of a check: total_q, total_k, num_pages, page_size (at least 1:
    it divides), max_seqlen_q and max_seqlen_k (NO_INDEX, which no length exceeds, for None)."""

    def bound(m):
        return NO_INDEX if m is None else min(int(m), NO_INDEX)

    return (context.total_q, context.total_k, context.num_pages, max(context.page_size, 1),
            bound(context.max_seqlen_q), bound(context.max_seqlen_k))


def check_async(context: CheckContext, cu_q=None, cu_k=None, used=None, table=None) -> bool:
    """Queue the check of these CUDA index tensors (None where the call has none) on the
    current stream and its verdict for `fa4lab.indexcheck.poll` (Note [index check on the
    device]): one launch, its verdict stored to mapped host memory; no wait. `context` gives
    the sizes (`launch_sizes`). The tensors were checked for dtype, rank and device. False (nothing
    queued) on a GPU the kernel is not built for: the caller checks synchronously."""
    from fa4lab import indexcheck
    from fa4lab.kernels.compile import device_arch

    device = (cu_q if cu_q is not None else table).device
    arch = device_arch(device.index)
    if arch is None:
        return False
    fn = _kernel(plan_of(cu_q, cu_k, used, table), arch + "a")
    slot = indexcheck.slot_for(device)
    fn(cu_q, cu_k, used, table, slot.device_row, slot.host_row, slot.ticket,
       *launch_sizes(context))
    indexcheck.submit(slot, context)
    return True
