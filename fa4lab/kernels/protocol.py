"""The kernels' side of the protocol table: every barrier op goes through `Sites`, by name.

    self.sites = Sites(plan)                 # in the kernel's __init__ (no DSL code)
    self.sites("mma", "wait kv_full", pipe_kv.consumer_wait, kv_state)          # a ring slot
    self.sites("load", "wait q_empty; expect_tx q_full", pipe_q.producer_acquire, st, stage=i)
    self.sites.bar_sync("mma", "tmem")       # named barriers: id and threads from the table

At trace time each op is checked against the next site of that code path in
`plan.protocol.sites(path)` (kind, barrier, stage; a mismatch raises `ProtocolMismatch` naming
both), and announced in the PTX by one marker comment, right before the DSL call that issues it:

    // fa4lab-proto mma wait kv_full[ring]
    // fa4lab-proto softmax1 arrive p_ready[1]

(see Note [protocol markers]). `fa4lab.kernels.audit` reads the markers back and checks the
binary's barrier instructions against the table. Named barriers are issued in their unaligned
forms (`barrier.sync` / `barrier.arrive`): their threads come from different role branches.

A `Mutation` (tests only, passed through `compile_forward(..., mutation=...)`) drops one op or
swaps two adjacent ones in the compiled code, to show that the audit catches it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

MARKER = "// fa4lab-proto"

# Note [protocol markers]
# A marker is side-effecting inline assembly with no operands whose text is a PTX comment:
# LLVM keeps it in place relative to the other side-effecting operations (barrier ops are),
# so it lands in the PTX right before the op it announces, in the same basic block, and ptxas
# drops it (the SASS is unchanged). A DSL call that performs two ops (a pipeline's
# producer_acquire: wait on the empty side, then arrive.expect_tx on the full side) is preceded
# by two markers; the audit pairs a run of markers with the barrier instructions that follow
# it, in order.


class ProtocolMismatch(ValueError):
    """The kernel's code asked for a barrier op the protocol table does not have there."""


@dataclass(frozen=True)
class Mutation:
    """Compile a deliberately broken kernel: "drop" the `index`-th op of `path`, or "swap" it
    with the next one (the two must be single-op calls issued back to back)."""

    kind: str       # "drop" | "swap"
    path: str
    index: int


def _mark(text: str) -> None:
    from cutlass._mlir.dialects import llvm

    llvm.inline_asm(None, [], f"{MARKER} {text}", "", has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


class Sites:
    def __init__(self, plan, mutation: Mutation | None = None):
        proto = plan.protocol
        self.barriers = proto.barriers
        self.expected = {p: proto.sites(p, plan.tiles.q_stage) for p in proto.paths()}
        self.cursor: dict[str, int] = defaultdict(int)
        self.mutation = mutation
        self._deferred = None
        if mutation is not None and mutation.kind not in ("drop", "swap"):
            raise ValueError(f"mutation kind {mutation.kind!r}: use 'drop' or 'swap'")

    def start(self) -> None:
        """Reset the cursors: each trace of the kernel walks the table from the top."""
        self.cursor.clear()
        self._deferred = None

    # ---- mbarrier ops through a DSL call ----
    def __call__(self, path: str, ops: str, fn, *args, stage: int | None = None, **kw):
        marks = [self._next(path, op.split()[0], op.split()[1], stage)
                 for op in ops.split(";")]
        self._emit(path, marks, lambda: fn(*args, **kw))

    # ---- named barriers ----
    def bar_sync(self, path: str, name: str, barrier_id=None) -> None:
        self._named(path, "sync", name, barrier_id)

    def bar_arrive(self, path: str, name: str, barrier_id=None) -> None:
        self._named(path, "named_arrive", name, barrier_id)

    def named_id(self, name: str) -> int:
        return self.barriers.barrier(name).named_id

    def _named(self, path, kind, name, barrier_id) -> None:
        from cutlass import Int32
        from cutlass._mlir.dialects import nvvm

        # A template ("epilogue{c}") names a family of barriers with one thread count; the
        # kernel passes the runtime id.
        family = [b for b in self.barriers.barriers
                  if b.name == name or (("{" in name) and b.name.startswith(name.split("{")[0]))]
        b = family[0]
        marks = [self._next(path, kind, name, 0)]
        bid = Int32(b.named_id if barrier_id is None else barrier_id).ir_value()
        threads = Int32(b.arrive_count).ir_value()
        if kind == "sync":
            self._emit(path, marks, lambda: nvvm.barrier_cta_sync(
                barrier_id=bid, thread_count=threads, aligned=False))
        else:
            self._emit(path, marks, lambda: nvvm.barrier_cta_arrive(
                barrier_id=bid, thread_count=threads, aligned=False))

    # ---- the table walk ----
    def _next(self, path: str, kind: str, barrier: str, stage) -> str:
        sites = self.expected.get(path)
        if sites is None:
            raise ProtocolMismatch(f"no code path {path!r} in the protocol table; have "
                                   f"{list(self.expected)}")
        k = self.cursor[path]
        if k >= len(sites):
            raise ProtocolMismatch(f"{path}: {kind} {barrier} after the table's last op "
                                   f"({len(sites)} ops)")
        site = sites[k]
        if (site.kind, site.barrier, site.stage) != (kind, barrier, stage):
            raise ProtocolMismatch(f"{path} op {k}: the code does {kind} {barrier}"
                                   f"[{'ring' if stage is None else stage}], the protocol table "
                                   f"has {site}")
        self.cursor[path] = k + 1
        return f"{path} {site}"

    def finish(self) -> None:
        """Every op of the table was issued (the end of a trace)."""
        for path, sites in self.expected.items():
            if self.cursor[path] != len(sites):
                nxt = sites[self.cursor[path]] if self.cursor[path] < len(sites) else "-"
                raise ProtocolMismatch(f"{path}: the code issued {self.cursor[path]} of the "
                                       f"table's {len(sites)} ops; next: {nxt}")
        if self._deferred is not None:
            raise ValueError("a swapped op was never emitted (no op followed it)")

    def _emit(self, path: str, marks: list[str], call) -> None:
        m = self.mutation
        index = self.cursor[path] - len(marks)
        if self._deferred is not None:
            deferred, self._deferred = self._deferred, None
            self._emit_now(marks, call)
            self._emit_now(*deferred)
            return
        if m is not None and m.path == path and index <= m.index < index + len(marks):
            if len(marks) != 1:
                raise ValueError(f"mutation {m}: op {m.index} of {path} is part of a "
                                 f"{len(marks)}-op call")
            if m.kind == "drop":
                return
            self._deferred = (marks, call)
            return
        self._emit_now(marks, call)

    @staticmethod
    def _emit_now(marks, call) -> None:
        for text in marks:
            _mark(text)
        call()
