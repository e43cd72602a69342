"""The value rules of the index tensors, checked on the device: verdicts that never stall a call.

A varlen or paged call (`fa4lab.attention_varlen`, `fa4lab.attention(..., page_table=...)`)
reads its lengths and pages from int32 tensors on the GPU (`fa4lab.varlen`'s layout). Their
values obey rules (`Rule`) that only the values can break: cu_seqlens start at 0, never
decrease and end at the packed total; seqused_k lies within its sequence's keys; every page a
sequence reads is a page of the cache; max_seqlen is at least every length. With
`check_indices="device"` (the default) one small kernel (`fa4lab.kernels.index_check`) checks
them on the GPU after the call is queued and leaves a `Verdict` in mapped host memory; the
next varlen or paged call, or `check_errors()`, raises its `InputError` (Note [index check on
the device]).

What is here, in plain Python and torch (no kernel, no CuTe DSL import):
- `Rule`, the rules in the order they are judged, and `IndexCheckPlan`, which of them a call
  has (what one compiled check kernel bakes in);
- `CheckContext` (the sizes a message names, from the shapes) and `message`, THE wording of a
  broken rule, used by the synchronous check (`fa4lab.varlen`) and the device verdicts alike;
- the pending verdicts: `slot_for` (a `Slot`: a device row, a mapped host row and a ticket,
  of a small per-device pool), `submit`, `poll` (raises the oldest finished bad verdict; never
  waits) and `check_errors` (waits for every pending verdict, then raises as `poll`);
- `queue_check`, the device check as the launch path installed it (`install_device_check`:
  Note [who launches the device check]).

    import fa4lab
    out = fa4lab.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k)   # checked on the device
    fa4lab.check_errors()      # raises InputError now if the call's indices were bad
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from enum import IntEnum

from fa4lab.errors import InputError
from fa4lab.tiling import ceil_div

__all__ = ["NO_INDEX", "CheckContext", "IndexCheckPlan", "Rule", "Slot", "Verdict", "check_errors",
           "install_device_check", "message", "pending", "poll", "queue_check", "slot_for",
           "submit"]

# Note [index check on the device]
# The synchronous check (`check_indices=True`) evaluates the rules as device masks and reads
# one flag per rule to the host: a synchronisation, the host waiting for every kernel queued
# before it, on every call (serving calls checked so ran at 0.52-0.74x upstream FA4's speed,
# whose varlen functions check nothing). The device check moves the whole verdict to the GPU
# and never waits for it:
# 1. One launch of the check kernel (`fa4lab.kernels.index_check`), on the call's stream, before
#    the attention kernel: a grid of small CTAs sweeps the batch's entries and the page table,
#    each keeping per rule the first broken index it saw (`Rule`; a broken entry of an earlier
#    rule wins, then the smaller index, as the synchronous check reads them); the CTAs fold
#    their minima into the slot's scratch words with atomics and the last CTA to finish writes
#    the `Verdict`: the rule, its first broken index and the two values its message needs, read
#    there and then (so a later change of the tensors cannot change the message), or all zeros.
#    It resets the scratch for the slot's next use, so no memset is launched. The verdict goes
#    straight to host memory: the slot's host row is pinned and mapped into the GPU's address
#    space (cudaHostAllocMapped), and the kernel stores the verdict's 4 words there, then a
#    system-scope fence, then the call's ticket (a number the host gave the launch) in the
#    row's TICKET_AT word: a host that reads the ticket reads a complete verdict after it.
# 2. The host keeps (pool, slot, ticket, `CheckContext`) in a queue. Every later varlen or paged
#    call first polls the queue (`poll`: the oldest entries' ticket words, read from host
#    memory, no CUDA call and no wait) and raises the first finished bad verdict's `InputError`
#    before it launches anything of its own (whatever its own check_indices);
#    `check_errors()` synchronises the devices of the pending checks and raises likewise. So a
#    bad index surfaces at the first varlen / paged call after its check has run on the GPU
#    (usually the next one), or at the next `check_errors()`, whichever comes first; the call
#    it describes has already run, and its outputs are not meaningful. The kernels clamp page
#    ids into the cache (Note [clamped indices] in fa4lab.kernels.device.paged) and each
#    sequence's rows into the packed tensors (Note [clamped lengths] in
#    fa4lab.kernels.device.seqlen), so a bad index costs a wrong answer, never a fault or a
#    store outside out and lse.
# Per call that is one kernel launch and a few list operations on the host, whatever the batch (an
# earlier form also copied the verdict to pinned memory and recorded an event: the check then cost
# about 90 us of host time per call on an H100, a paged decode call taking 259 us against 168 us
# with check_indices=False): the pool's rows (POOL_SLOTS per device, made and synchronised once per
# process) are reused, and a slot is handed out again only after its verdict was read (when all are
# in use, `slot_for` waits for the oldest: the host is then POOL_SLOTS calls ahead of the GPU). The
# message is built only when a rule is broken, from the verdict and the context (sizes the shapes
# gave at the call). On CPU tensors there is nothing to overlap: the check is the synchronous one,
# immediate. In a CUDA graph capture the check and the poll skip themselves (a replay runs on values
# the capture never sees; Note [reading the lengths] in fa4lab.varlen).

NO_INDEX = 2**31 - 1     # "no broken entry": the identity of the minima
POOL_SLOTS = 64
# One slot's device row: the kernel's scratch, the first broken index per rule (index rule - 1),
# then its CTA counter. Its host row (mapped): the verdict (VERDICT_WORDS words: rule, index,
# value, other), then the ticket of the check that wrote it.
SCRATCH_AT = 0
SLOT_WORDS = 16
VERDICT_WORDS = 4
TICKET_AT = VERDICT_WORDS
HOST_WORDS = 8


class Rule(IntEnum):
    """The value rules, in the order they are judged (the first broken rule is the one
    reported); 0 is "no rule broken"."""

    CU_Q_START = 1      # cu_seqlens_q[0] == 0
    CU_Q_ORDER = 2      # cu_seqlens_q[i + 1] >= cu_seqlens_q[i]   (index i)
    CU_Q_END = 3        # cu_seqlens_q[batch] == total_q
    CU_K_START = 4
    CU_K_ORDER = 5
    CU_K_END = 6
    SEQUSED_K = 7       # 0 <= seqused_k[b] <= the keys sequence b has   (index b)
    PAGE = 8            # 0 <= page_table[b, s] < num_pages for the slots b reads (b * pages + s)
    MAX_Q = 9           # max_seqlen_q >= every query length   (index b)
    MAX_K = 10          # max_seqlen_k >= every key count   (index b)


COUNTER_AT = SCRATCH_AT + len(Rule)
assert COUNTER_AT < SLOT_WORDS


@dataclass(frozen=True)
class IndexCheckPlan:
    """Which index tensors a call has: what one compiled check kernel bakes in. cu_q: a varlen
    call's cu_seqlens_q (and its max_seqlen rules; without it, `fa4lab.attention`'s dense q
    with a page table); cu_k: packed keys' cu_seqlens_k; seqused_k; paged: a page table (with
    cu_seqlens_q, instead of cu_k)."""

    cu_q: bool
    cu_k: bool
    seqused_k: bool
    paged: bool

    def __post_init__(self):
        if self.cu_q and self.cu_k == self.paged:
            raise ValueError("a varlen check has cu_seqlens_k or a page table, not both")
        if not self.cu_q and (self.cu_k or self.seqused_k or not self.paged):
            raise ValueError("a check without cu_seqlens_q is a dense q's page table alone")

    @property
    def rules(self) -> tuple[Rule, ...]:
        """The rules this call has, in judging order."""
        have = {Rule.CU_Q_START: self.cu_q, Rule.CU_Q_ORDER: self.cu_q, Rule.CU_Q_END: self.cu_q,
                Rule.CU_K_START: self.cu_k, Rule.CU_K_ORDER: self.cu_k, Rule.CU_K_END: self.cu_k,
                Rule.SEQUSED_K: self.seqused_k, Rule.PAGE: self.paged, Rule.MAX_Q: self.cu_q,
                Rule.MAX_K: self.cu_q}
        return tuple(r for r in Rule if have[r])

    def name(self, arch: str) -> str:
        """e.g. "indexcheck-sm90a-cuq-cuk-used": what one compiled kernel bakes in."""
        parts = [("cuq", self.cu_q), ("cuk", self.cu_k), ("used", self.seqused_k),
                 ("pages", self.paged)]
        return "-".join(["indexcheck", arch] + [p for p, on in parts if on])


@dataclass(frozen=True)
class CheckContext:
    """What a message names besides the verdict's values, all from the shapes (and the
    caller's max_seqlen): the packed totals, the cache's pages and page size, the table's
    slots per sequence and the max_seqlen bounds (None: not given, never broken)."""

    total_q: int = 0
    total_k: int = 0
    num_pages: int = 0
    page_size: int = 0
    pages_per_seq: int = 0
    max_seqlen_q: int | None = None
    max_seqlen_k: int | None = None
    entry: str = "fa4lab.attention_varlen"


class Verdict(tuple):
    """(rule, index, value, other): a check's outcome, rule 0 when every rule holds."""

    __slots__ = ()

    def __new__(cls, rule=0, index=0, value=0, other=0):
        return super().__new__(cls, (int(rule), int(index), int(value), int(other)))

    @property
    def broken(self) -> bool:
        return self[0] != 0


_CU = {Rule.CU_Q_START: ("cu_seqlens_q", "q"), Rule.CU_Q_ORDER: ("cu_seqlens_q", "q"),
       Rule.CU_Q_END: ("cu_seqlens_q", "q"), Rule.CU_K_START: ("cu_seqlens_k", "k"),
       Rule.CU_K_ORDER: ("cu_seqlens_k", "k"), Rule.CU_K_END: ("cu_seqlens_k", "k")}


def message(verdict: Verdict, ctx: CheckContext) -> str:
    """The error of a broken rule: what is wrong (the tensor, its first broken index and the
    values there) and what to do. The one wording of the synchronous and the device check."""
    rule, i, value, other = verdict
    rule = Rule(rule)
    if rule in _CU:
        name, what = _CU[rule]
        total = ctx.total_q if what == "q" else ctx.total_k
        if rule in (Rule.CU_Q_START, Rule.CU_K_START):
            return (f"{name} must start at 0, got {name}[0] = {value}; it is the cumulative sum "
                    f"of the lengths with a leading 0, e.g. torch.nn.functional.pad("
                    f"lengths.cumsum(0), (1, 0)).to(torch.int32)")
        if rule in (Rule.CU_Q_ORDER, Rule.CU_K_ORDER):
            return (f"{name} decreases at index {i + 1} ({name}[{i}] = {value}, {name}[{i + 1}] "
                    f"= {other}): it must be non-decreasing (sequence {i} cannot have a negative "
                    f"length)")
        return (f"{name}'s last entry is {value} but the packed {what} have {total} tokens: the "
                f"last entry must equal the total ({what}.shape[0])")
    if rule == Rule.SEQUSED_K:
        where = (f"its {ctx.pages_per_seq} pages of {ctx.page_size} hold" if ctx.page_size
                 else "cu_seqlens_k gives it")
        return (f"seqused_k[{i}] = {value} but {where} {other} keys: seqused_k counts the keys a "
                f"sequence uses, 0 <= seqused_k[b] <= {other}")
    if rule == Rule.PAGE:
        b, slot = divmod(i, max(ctx.pages_per_seq, 1))
        return (f"page_table[{b}, {slot}] = {value} is not a page of the cache (num_pages = "
                f"{ctx.num_pages}): sequence {b} reads {other} keys, so its slots "
                f"0..{ceil_div(other, ctx.page_size) - 1} must hold page indices in "
                f"[0, {ctx.num_pages})")
    name, bound, which = (("max_seqlen_q", ctx.max_seqlen_q, "query") if rule == Rule.MAX_Q
                          else ("max_seqlen_k", ctx.max_seqlen_k, "key"))
    return (f"{name}={bound} is smaller than sequence {i}'s {which} length {value}: pass at "
            f"least the longest length (max_seqlen sizes the launch grid)")


# --------------------------------------------------------------------------- pending verdicts


class _Mapped:
    """Pinned host memory mapped into the GPU's address space (cudaHostAllocMapped, portable):
    `host`, a numpy view the host reads without a CUDA call, and `rows`, a CUDA tensor of the
    same words that a kernel stores to. Never freed: one per device and process."""

    def __init__(self, shape: tuple[int, int], device):
        import ctypes

        import numpy as np
        import torch
        from cuda.bindings import runtime

        words = shape[0] * shape[1]
        flags = runtime.cudaHostAllocMapped | runtime.cudaHostAllocPortable
        err, ptr = runtime.cudaHostAlloc(4 * words, flags)
        _cuda_ok(err, "cudaHostAlloc")
        err, device_ptr = runtime.cudaHostGetDevicePointer(ptr, 0)
        _cuda_ok(err, "cudaHostGetDevicePointer")
        self.host = np.ctypeslib.as_array((ctypes.c_int32 * words).from_address(ptr))
        self.host = self.host.reshape(shape)
        self.host[:] = 0
        self.__cuda_array_interface__ = {"shape": shape, "typestr": "<i4", "strides": None,
                                         "data": (device_ptr, False), "version": 3}
        self.rows = torch.as_tensor(self, device=device)


def _cuda_ok(err, what: str) -> None:
    from cuda.bindings import runtime

    if err != runtime.cudaError_t.cudaSuccess:
        raise RuntimeError(f"{what} failed ({err}): the index check's verdict rows could not be "
                           f"allocated; pass check_indices=True (a synchronous check) instead")


class _Pool:
    """One device's slots: device rows (POOL_SLOTS, SLOT_WORDS) int32 (the scratch words start
    as NO_INDEX and a zero counter, and every check leaves them so), mapped host rows
    (POOL_SLOTS, HOST_WORDS) the verdicts land in (`_Mapped`), the last ticket handed out, and
    `free`, the slots not in the queue."""

    def __init__(self, device):
        import torch

        self.device = device
        self.device_rows = torch.zeros((POOL_SLOTS, SLOT_WORDS), dtype=torch.int32, device=device)
        self.device_rows[:, SCRATCH_AT:COUNTER_AT] = NO_INDEX
        mapped = _Mapped((POOL_SLOTS, HOST_WORDS), device)
        self.host_rows, self.mapped_rows = mapped.host, mapped.rows
        self.ticket = 0
        self.free = list(range(POOL_SLOTS))
        # Once per process and device: a check on another stream may take a slot next, and
        # must find its scratch words written.
        torch.cuda.synchronize(device)

    def wait(self) -> None:
        """Until every check queued on this device has run."""
        import torch

        torch.cuda.synchronize(self.device)


class Slot:
    """One check's slot, as `slot_for` hands it out: the kernel's arguments `device_row`
    (scratch), `host_row` (the mapped verdict row) and `ticket` (to write last)."""

    __slots__ = ("device_row", "host_row", "index", "pool", "ticket")

    def __init__(self, pool: _Pool, index: int, ticket: int):
        self.pool, self.index, self.ticket = pool, index, ticket
        self.device_row, self.host_row = pool.device_rows[index], pool.mapped_rows[index]


class _Pending:
    __slots__ = ("context", "pool", "slot", "ticket")

    def __init__(self, pool: _Pool, slot: int, ticket: int, context: CheckContext):
        self.pool, self.slot, self.ticket, self.context = pool, slot, ticket, context

    def done(self) -> bool:
        """The check has run: its ticket is in its host row."""
        return int(self.pool.host_rows[self.slot, TICKET_AT]) == self.ticket


_lock = threading.RLock()
_pools: dict[int, _Pool] = {}
_queue: deque[_Pending] = deque()


def pending() -> int:
    """Checks submitted whose verdicts have not been read yet."""
    return len(_queue)


def slot_for(device) -> Slot:
    """A free slot of `device`'s pool for one check, with a fresh ticket. When every slot is
    pending (the host is POOL_SLOTS calls ahead of the GPU) this waits for the oldest verdict
    and raises it if bad."""
    index = device.index if device.index is not None else _current_device()
    with _lock:
        pool = _pools.get(index)
        if pool is None:
            pool = _pools[index] = _Pool(device)
        while not pool.free:
            _read(_queue.popleft(), wait=True)
        pool.ticket = pool.ticket % (2**31 - 1) + 1     # 1, 2, ...: a zeroed row matches none
        return Slot(pool, pool.free.pop(), pool.ticket)


# Note [who launches the device check]
# The check kernel and its launch (`fa4lab.kernels.index_check.check_async`) belong to the
# kernels layer; the checks that ask for it (`fa4lab.varlen`'s, in "device" mode) sit below that
# layer and never import it. The launch path hands it down instead: `fa4lab.kernels.launch`
# installs it here when it is imported, which `fa4lab.api` does, so every `fa4lab.attention*`
# call and `fa4lab.scheduler_metadata` check on the device. Until something installs it,
# `queue_check` queues nothing and answers False, and the caller checks synchronously, as on a
# GPU the kernel is not built for.
_device_check = None


def install_device_check(check) -> None:
    """Make `check(context, cu_q, cu_k, used, table) -> bool` the launch `queue_check` runs
    (Note [who launches the device check])."""
    global _device_check
    _device_check = check


def queue_check(context: CheckContext, cu_q=None, cu_k=None, used=None, table=None) -> bool:
    """Queue the device check of these CUDA index tensors (None where the call has none) and
    its verdict for `poll` (Note [index check on the device]); False when nothing was queued
    (no check installed: Note [who launches the device check]; or none for this GPU): then the
    caller checks synchronously."""
    return _device_check is not None and _device_check(context, cu_q, cu_k, used, table)


def _current_device() -> int:
    import torch

    return torch.cuda.current_device()


def submit(slot: Slot, context: CheckContext) -> None:
    """After the check kernel of `slot` was queued: queue its verdict for `poll` (Note [index
    check on the device])."""
    entry = _Pending(slot.pool, slot.index, slot.ticket, context)
    with _lock:
        _queue.append(entry)


def _read(entry: _Pending, wait: bool) -> None:
    """Return the entry's slot to its pool and raise its error if its verdict is bad; `wait`
    synchronises its device first if the check has not run (else it must have)."""
    if wait and not entry.done():
        entry.pool.wait()
        if not entry.done():
            entry.pool.free.append(entry.slot)
            raise RuntimeError(f"the index check of an earlier call of {entry.context.entry} "
                               f"never reported (did its launch fail?); pass "
                               f"check_indices=True to check synchronously")
    verdict = Verdict(*entry.pool.host_rows[entry.slot, :VERDICT_WORDS].tolist())
    entry.pool.free.append(entry.slot)
    if verdict.broken:
        raise InputError(f"bad indices in an earlier call of {entry.context.entry} (checked on "
                         f"the device after it was queued, so that call ran and its outputs "
                         f"are not meaningful; check_indices=True checks before the launch): "
                         f"{message(verdict, entry.context)}")


def poll() -> None:
    """Read the verdicts whose checks have run (oldest first, never waiting) and raise the
    first bad one's InputError; what is still running stays queued. Called by every varlen and
    paged call before its own check (Note [index check on the device])."""
    if not _queue:
        return
    with _lock:
        while _queue and _queue[0].done():
            _read(_queue.popleft(), wait=False)


def check_errors() -> None:
    """Wait for every pending index check (`fa4lab.attention_varlen`'s default
    check_indices="device", and `fa4lab.attention` with a page_table) and raise the oldest bad
    verdict's InputError, naming the tensor and its first bad index. A synchronisation: call it
    where a stall is cheap (after a batch of requests, in tests), or pass check_indices=True
    for an error before the launch."""
    with _lock:
        while _queue:
            _read(_queue.popleft(), wait=True)
