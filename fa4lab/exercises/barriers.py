"""Notebook 04's exercise: the barrier list of a new role, graded by the protocol simulator.

The new role, `lse`, is one warp (the sm100 plan's spare warp 15, which only holds registers)
that takes the LSE off the correction warpgroup: it reads each Q tile's final row sum and row
max from the softmax -> correction mailbox (SMEM `stats`) and stores the LSE to global memory.
It joins the mailbox as a second consumer (`lse_barriers`): `stats_full[i]` now wakes it too,
and `stats_empty[i]` counts its 32 arrivals besides the correction warpgroup's. Nothing else in
the plan changes: every other role runs its program from `plan.protocol` as before.

The student writes the role's program in the protocol table's vocabulary
(`fa4lab.plan.protocol`: Op, Step, Loop, If, per_stage) with two work steps of its own
(`STEPS`). `check_lse_program`:

  1. runs the protocol simulator with the role added (`run_with_role`), on work tiles of fresh
     random lengths, a tile with no K/V block (N = 0) and both Q-stage counts, and reports a
     deadlock (who waits on which barrier at which phase, and how many arrivals the open phase
     holds), a hazard (which region is read or written unordered), arrivals of the wrong count
     or left over at exit, or a read of the mailbox before the softmax's final post;
  2. the mutation check: removes each of the student's waits in turn; every removal must be
     caught by step 1 on some tile, else that wait is redundant.

The simulator's hazards come from happens-before (Note [hazards by happens-before] in
`fa4lab.plan.simulate`), so a verdict does not depend on the simulated timing.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from collections.abc import Callable

from fa4lab.exercises._core import ExerciseFailed, call_student, fresh_rng
from fa4lab.limits import ELEMENT_BYTES
from fa4lab.plan import plan_forward
from fa4lab.plan.barriers import BarrierGraph
from fa4lab.plan.costs import DEFAULT_COSTS
from fa4lab.plan.protocol import If, Loop, Op, Program, Protocol, Step, Unroll, expand
from fa4lab.plan.simulate import Arrive, Ref, SimResult, Simulator, Wait, Work, programs_for
from fa4lab.spec import AttentionSpec

__all__ = ["ROLE", "LSE_THREADS", "STEPS", "lse_barriers", "lse_protocol", "run_with_role",
           "program_text", "check_lse_program"]

ROLE = "lse"
LSE_THREADS = 32                      # one warp; every thread arrives (it read its own rows)
MAILBOX, FULL, EMPTY = "stats", "stats_full", "stats_empty"
STEPS = {"read row sum": "read Q tile i's final row sum and row max from the mailbox stats[i]",
         "store LSE": "write Q tile i's LSE from them (as fa4lab.kernels.device.softmax's "
                      "finalize_row: -inf for a row that saw no key)"}
# The plan's shape only; the checked tiles take their K/V block counts from `_cases`.
_SPEC = dict(batch=1, seqlen_q=256, seqlen_k=1024, heads_q=1, heads_kv=1, head_dim=128)


# ---- the plan with the role added ----
@functools.lru_cache(maxsize=4)
def _plan(q_stage: int):
    return plan_forward(AttentionSpec(**_SPEC), "sm100", q_stage=q_stage)


def lse_barriers(plan) -> BarrierGraph:
    """The plan's barriers with the lse warp as a second mailbox consumer: it waits on
    stats_full, and each phase of stats_empty needs its LSE_THREADS arrivals too."""
    out = []
    for b in plan.barriers.barriers:
        if b.name == FULL:
            b = dataclasses.replace(b, consumer=f"{b.consumer},{ROLE}")
        elif b.name == EMPTY:
            b = dataclasses.replace(b, producer=f"{b.producer},{ROLE}",
                                    arrive_count=b.arrive_count + LSE_THREADS)
        out.append(b)
    return BarrierGraph(tuple(out))


def lse_protocol(plan, body) -> Protocol:
    """The plan's protocol table plus the lse role's program `body`."""
    return Protocol(lse_barriers(plan),
                    plan.protocol.programs + (Program(ROLE, (ROLE,), tuple(body)),))


def _catalogue(plan, costs=DEFAULT_COSTS):
    """The lse role's steps as simulator ops (the other roles' come from the plan)."""
    rows, fp32 = plan.tiles.m_block, ELEMENT_BYTES["fp32"]

    def step(s: Step, env: dict, stage) -> list:
        if not isinstance(stage, int):
            raise _Wrong(f"Step({s.what!r}, {s.stage!r}) names no Q stage",
                         'give the Q stage, e.g. Step("read row sum", "i") inside per_stage')
        if not 0 <= stage < plan.tiles.q_stage:
            raise _Wrong(f"Step({s.what!r}, {s.stage!r}) is Q stage {stage}, and this plan has "
                         f"q_stage {plan.tiles.q_stage}",
                         'use "i" inside per_stage(...): it runs once per Q stage of the plan')
        if s.what == "read row sum":
            return [Work(f"read row sum {stage}", costs.smem_cycles(plan.hardware, 2 * rows * fp32),
                         reads=(Ref("smem", MAILBOX, stage),))]
        return [Work(f"store LSE{stage}", costs.tma_cycles(rows * fp32))]

    return step


def _needed(graph: BarrierGraph) -> dict:
    return {(b.name, s): b.arrive_count for b in graph.barriers for s in range(b.stages)}


def _simulate(plan, progs: dict, graph: BarrierGraph, n_blocks: int) -> SimResult:
    return Simulator(progs, _needed(graph), DEFAULT_COSTS, plan.arch, n_blocks, 1).run()


def _lse_ops(plan, body, n_blocks: int, masked_blocks: int) -> list:
    return expand(lse_protocol(plan, body), ROLE, LSE_THREADS, n_blocks, masked_blocks,
                  plan.tiles.q_stage, _catalogue(plan))


def run_with_role(plan, body, n_blocks: int, masked_blocks: int = 0) -> SimResult:
    """Simulate one work tile of `n_blocks` K/V blocks with the lse role running `body` (a
    timeline with an "lse" lane for `fa4lab.viz.plan.draw_timeline`)."""
    progs = dict(programs_for(plan, n_blocks, 1, DEFAULT_COSTS, masked_blocks))
    progs[ROLE] = _lse_ops(plan, body, n_blocks, masked_blocks)
    return _simulate(plan, progs, lse_barriers(plan), n_blocks)


@functools.lru_cache(maxsize=64)
def _baseline(q_stage: int, n_blocks: int, masked_blocks: int) -> SimResult:
    plan = _plan(q_stage)
    return _simulate(plan, programs_for(plan, n_blocks, 1, DEFAULT_COSTS, masked_blocks),
                     plan.barriers, n_blocks)


# ---- the student's program: shape ----
class _Wrong(Exception):
    """A problem with the student's program: (what, hint)."""

    def __init__(self, what: str, hint: str, short: str = ""):
        super().__init__(what)
        self.what, self.hint, self.short = what, hint, short or what.split(":")[0]


def _validate(body, barriers: BarrierGraph, where: str = "your program") -> None:
    if not isinstance(body, (tuple, list)):
        raise _Wrong(f"{where} is {type(body).__name__} {body!r}",
                     "return a tuple of nodes, e.g. (per_stage(Op(...), Step(...), ...),)")
    for n in body:
        if isinstance(n, Op):
            if n.kind not in ("wait", "arrive"):
                raise _Wrong(f"{n} in {where}: the lse warp cannot {n.kind}",
                             "an ordinary warp only waits on and arrives at mbarriers; "
                             "expect_tx belongs to the TMA producer, commit to the MMA warp")
            if n.barrier not in {b.name for b in barriers.barriers}:
                raise _Wrong(f"{n} in {where}: no barrier {n.barrier!r}",
                             f"the barriers are {[b.name for b in barriers.barriers]}")
        elif isinstance(n, Step):
            if n.what not in STEPS:
                raise _Wrong(f"{n} in {where}: the lse role has no step {n.what!r}",
                             f"its steps are {list(STEPS)}")
        elif isinstance(n, (Loop, If, Unroll)):
            _validate(n.body, barriers, f"{_node(n)} of {where}")
        else:
            raise _Wrong(f"{where} holds {type(n).__name__} {n!r}",
                         "use the protocol vocabulary: Op, Step, Loop, If, per_stage")


def _node(n) -> str:
    if isinstance(n, Op):
        one = ", one=True" if n.one else ""
        return f"Op({n.kind!r}, {n.barrier!r}, {n.stage!r}{one})"
    if isinstance(n, Loop):
        return f"Loop({n.trips!r})"
    if isinstance(n, If):
        return f"If({n.cond!r})"
    if isinstance(n, Unroll):
        return "per_stage(...)" if (n.var, n.count) == ("i", "q") else f"Unroll({n.var!r})"
    return repr(n)


def program_text(body, indent: str = "") -> str:
    """A program as indented lines, one node a line: a role's row of the protocol table."""
    lines = []
    for n in body:
        if isinstance(n, (Loop, If, Unroll)):
            head = "per_stage" if _node(n) == "per_stage(...)" else _node(n)
            lines += [f"{indent}{head}:", program_text(n.body, indent + "    ")]
        elif isinstance(n, Step):
            lines.append(f"{indent}Step({n.what!r}, {n.stage!r})")
        else:
            lines.append(f"{indent}{_node(n)}")
    return "\n".join(lines)


def _waits(body, path=()) -> list[tuple[tuple, str]]:
    """(path, description) of every wait node in the program tree."""
    out = []
    for k, n in enumerate(body):
        if isinstance(n, Op) and n.kind == "wait":
            out.append(((*path, k), _node(n)))
        elif isinstance(n, (Loop, If, Unroll)):
            out += [(p, f"{d} inside {_node(n)}") for p, d in _waits(n.body, (*path, k))]
    return out


def _without(body, path: tuple) -> tuple:
    k, rest = path[0], path[1:]
    if not rest:
        return tuple(body[:k]) + tuple(body[k + 1:])
    n = body[k]
    return tuple(body[:k]) + (dataclasses.replace(n, body=_without(n.body, rest)),) \
        + tuple(body[k + 1:])


# ---- one tile ----
@dataclasses.dataclass(frozen=True)
class _Case:
    q_stage: int
    n_blocks: int
    masked_blocks: int

    def __str__(self) -> str:
        return (f"q_stage {self.q_stage}, a work tile of N = {self.n_blocks} K/V block(s)"
                + (f", {self.masked_blocks} masked" if self.masked_blocks else ""))


def _hkey(h) -> tuple:
    return (h.kind, h.region.split(" cols")[0], h.first.split(" @")[0],
            h.second.split(" @")[0])


def _diagnose(case: _Case, body) -> _Wrong | None:
    """The first thing wrong with the lse role running `body` on this tile, or None."""
    plan = _plan(case.q_stage)
    graph = lse_barriers(plan)
    try:
        ops = _lse_ops(plan, body, case.n_blocks, case.masked_blocks)
    except _Wrong as w:
        return w
    except Exception as e:   # an expression the table cannot evaluate: Loop("n"), If("x > 0")
        return _Wrong(f"the protocol table cannot expand your program: {type(e).__name__}: "
                      f"{e}", "expressions may use N (K/V blocks of the tile), M (masked "
                      "blocks), q (Q stages), i (the Q stage inside per_stage), j (block step)")
    base = _baseline(case.q_stage, case.n_blocks, case.masked_blocks)
    waits = Counter((op.barrier, op.stage) for op in ops if isinstance(op, Wait))
    arrives = Counter((op.barrier, op.stage) for op in ops if isinstance(op, Arrive))
    for op in ops:
        if isinstance(op, (Wait, Arrive)):
            b = graph.barrier(op.barrier)
            if op.stage >= b.stages:
                return _Wrong(f"your program uses {op.barrier}[{op.stage}], and {op.barrier} has "
                              f"{b.stages} stage(s) here (one per Q stage)",
                              'use "i" inside per_stage(...): it runs once per Q stage')
        if isinstance(op, Arrive) and op.barrier != EMPTY:
            b = graph.barrier(op.barrier)
            return _Wrong(f"the lse warp arrives on {op.barrier}[{op.stage}], whose phases count "
                          f"only {b.producer}'s {b.arrive_count} arrival(s)",
                          f"an arrival tells a producer its buffer is free again; the lse warp "
                          f"frees only the mailbox: arrive on {EMPTY}")
        if isinstance(op, Arrive) and op.count != LSE_THREADS:
            need = graph.barrier(EMPTY).arrive_count
            return _Wrong(f"the lse warp arrives on {op.barrier}[{op.stage}] with {op.count} "
                          f"arrival(s); each phase of {EMPTY} needs {need} = "
                          f"{need - LSE_THREADS} (correction) + {LSE_THREADS} (lse)",
                          "every thread of the warp arrives (it read its own rows): leave out "
                          "one=True")
    done = base.completions
    for (name, s), w in sorted(waits.items()):
        b = graph.barrier(name)
        if (name, s) in arrives:
            continue
        c = done.get(f"{name}[{s}]", 0)
        if w > c + b.starts_released:
            k = w - 1 - b.starts_released
            return _Wrong(f"the lse warp waits {w} time(s) on {name}[{s}], which completes only "
                          f"{c} time(s) on such a tile: its wait for phase {k} never returns",
                          _overwait_hint(case, name, s, waits, done))
    early = _final_read(case, ops, done)
    if early is not None:
        return early
    run = run_with_role(plan, body, case.n_blocks, case.masked_blocks)
    if run.deadlock:
        return _Wrong(_deadlock_text(run, graph), _deadlock_hint(run, waits, arrives, case),
                      "deadlock")
    new = [h for h in run.hazards if _hkey(h) not in {_hkey(x) for x in base.hazards}]
    new.sort(key=_hazard_rank)
    if new:
        return _Wrong(f"{len(new)} hazard(s), the first: {new[0]}", _hazard_hint(new[0]),
                      f"{new[0].kind} on {new[0].region}")
    left = {k: v for k, v in run.leftover.items() if k not in base.leftover}
    if left:
        name, (got, _) = next(iter(left.items()))
        need = graph.barrier(name.split("[")[0]).arrive_count
        return _Wrong(f"at exit {name} holds {got} of the {need} arrivals of a phase that never "
                      f"completes", "the lse warp must release (arrive on stats_empty[i]) every "
                      "post it waited for, the last one too: a persistent CTA's next work tile "
                      "would wait on that phase forever", f"arrivals left on {name}")
    return None


def _final_read(case: _Case, ops: list, done: dict) -> _Wrong | None:
    """Each Q tile's LSE is stored after its row sum was read following the softmax's last post
    to the mailbox (on a tile with no K/V block: stored all the same, -inf)."""
    for i in range(case.q_stage):
        posts = done.get(f"{FULL}[{i}]", 0)
        last = None               # the phase of the latest wait on stats_full[i]
        read_at = []              # that phase at each read of stats[i]
        stored = False
        for op in ops:
            if isinstance(op, Wait) and (op.barrier, op.stage) == (FULL, i):
                last = op.k
            elif isinstance(op, Work) and any(r.name == MAILBOX and r.stage == i
                                              for r in op.reads):
                read_at.append(last)
            elif isinstance(op, Work) and op.label == f"store LSE{i}":
                stored = stored or posts == 0 or posts - 1 in read_at
        if posts and posts - 1 not in read_at:
            if not read_at:
                return _Wrong(f"the lse warp never reads stats[{i}] (Q tile {i}'s row sum and "
                              f"max)", 'read it with Step("read row sum", "i") after the last '
                              'post, then Step("store LSE", "i")', f"no read of stats[{i}]")
            k = max((x for x in read_at if x is not None), default=None)
            seen = ("no post" if k is None else f"post {k} of {posts}, block step {k}'s row "
                    f"scale")
            return _Wrong(f"the lse warp reads stats[{i}] after waiting only for phase {k} of "
                          f"{FULL}[{i}]: the mailbox then holds {seen}, not the row sum and max",
                          f"softmax{i} posts N + 1 = {posts} times per tile (a row scale per K/V "
                          f"block, then the row sum and max); wait for every post, and read "
                          f"after the last one (phase {posts - 1})",
                          f"a read of stats[{i}] before the last post")
        if not stored:
            where = ("after reading the row sum" if posts else
                     "on a tile with no K/V block too: its rows see no key, their LSE is -inf "
                     "(Note [empty rows] in fa4lab.kernels.device.softmax)")
            return _Wrong(f"the lse warp never stores Q tile {i}'s LSE {where}",
                          'every Q tile gets its LSE: Step("store LSE", "i") after the read, '
                          'outside the If("N > 0", ...) that guards the mailbox ops',
                          f"no LSE store for Q tile {i}")
    return None


def _overwait_hint(case, name, s, waits, done) -> str:
    others = [t for (n, t), w in waits.items() if n == name and t != s
              and w < done.get(f"{n}[{t}]", 0)]
    missing = [t for t in range(case.q_stage) if (name, t) not in waits and t != s]
    if others or missing:
        t = (others or missing)[0]
        return (f"and {name}[{t}] gets fewer waits than it has phases: a wait on the wrong "
                f"stage? Inside per_stage(...) stage \"i\" is the Q stage of the pass; a number "
                f"names the same Q tile in every pass")
    if case.n_blocks == 0:
        return ("a tile with no K/V block (N = 0: every key of the CTA's rows is masked) gets "
                "no post at all: guard the mailbox ops with If(\"N > 0\", ...), as the "
                "correction's program does")
    return ("the k-th wait on a stage waits for its k-th phase: wait once per post "
            "(the softmax posts N + 1 times per Q tile)")


def _deadlock_text(run: SimResult, graph: BarrierGraph) -> str:
    """The stuck lse warp and mailbox users (the roles stuck behind them only summed up), with
    the arrivals the open phases of their barriers hold."""
    def key(line):
        return not (line.startswith(ROLE) or f" {FULL}[" in line or f" {EMPTY}[" in line)
    lines = sorted(run.deadlock, key=key)
    shown = [x for x in lines if not key(x)] or lines[:2]
    out = "DEADLOCK: " + "; ".join(shown)
    if len(lines) > len(shown):
        rest = sorted({x.split(" ")[0] for x in lines[len(shown):]})
        out += f" (and {', '.join(rest)} stuck behind them)"
    for name, (got, _) in run.leftover.items():
        if any(f" {name} " in x for x in shown):
            need = graph.barrier(name.split("[")[0]).arrive_count
            out += f"; {name}'s open phase has {got} of its {need} arrivals"
    return out


def _deadlock_hint(run: SimResult, waits, arrives, case) -> str:
    for i in range(case.q_stage):
        w, a = waits.get((FULL, i), 0), arrives.get((EMPTY, i), 0)
        if a < w:
            return (f"the lse warp waited for {w} post(s) on {FULL}[{i}] but released the "
                    f"mailbox only {a} time(s): {EMPTY}[{i}] now counts its {LSE_THREADS} "
                    f"threads too, so softmax{i} cannot post again until it arrives; arrive "
                    f"on {EMPTY}[{i}] after each post it waited for")
    stuck = {line.split(" waits ")[0]: line.split(" waits ")[1].split(" phase")[0]
             for line in run.deadlock if " waits " in line}
    mine = stuck.get(ROLE, "")
    for t in range(case.q_stage):
        if mine.startswith(f"{FULL}[") and stuck.get(f"softmax{t}") == f"{EMPTY}[{t}]" \
                and mine != f"{FULL}[{t}]":
            return (f"the lse warp waits for the next post on {mine} while softmax{t} waits for "
                    f"the lse warp to release {EMPTY}[{t}]: the Q tiles advance together (the "
                    f"MMA warp alternates them), so follow them in turn, one post of each Q "
                    f"stage per K/V block: a per_stage(...) inside the Loop over the blocks, as "
                    f"the correction's program does, not all posts of one Q stage first")
    return ("a role waits for a phase that never completes: compare, per Q stage, the posts "
            "you wait for with the releases you arrive")


def _hazard_rank(h) -> int:
    """Hazards of the lse warp's own reads first: they name the missing wait."""
    if h.region.startswith(f"{MAILBOX}["):
        return 0 if h.second.startswith(ROLE) else 1
    return 2 if h.kind == "arrive count overflow" else 3


def _hazard_hint(h) -> str:
    mailbox = h.region.startswith(f"{MAILBOX}[")
    if mailbox and h.kind == "read before written":
        return ("the lse warp reads a mailbox nothing was posted to: on a tile with no K/V "
                "block (N = 0) guard the read with If(\"N > 0\", ...)")
    if mailbox and h.second.startswith(ROLE):
        return (f"the read is not ordered after softmax's post: wait on {FULL}[i] before "
                f"reading stats[i]")
    if mailbox:
        return (f"softmax posts again while the lse warp may still read: arrive on {EMPTY}[i] "
                f"only after the read, and only after waiting for that post")
    if h.kind == "arrive count overflow":
        return (f"the lse warp arrived again before the phase completed: arrive on {EMPTY}[i] "
                f"once per post, each arrival after the wait for that post")
    if h.kind == "phase overrun":
        return (f"{h.region} completed twice past the phase a wait expected: a wait checks a "
                f"parity bit, so it must follow every phase of its stage; does the lse warp "
                f"need that wait at all?")
    return "order the two accesses with a wait on the barrier whose producer makes the first"


# ---- the check ----
def _cases(rng, tiles: int) -> list[_Case]:
    """The shortest tile, a longer one with both Q stages (where their posts must be followed
    in turn), q_stage 1, `tiles` random ones, and last a tile with no K/V block."""
    out = [_Case(2, 1, 0), _Case(2, 4, 1), _Case(1, 2, 1)]
    for _ in range(tiles):
        n = int(rng.integers(2, 8))
        out.append(_Case(int(rng.choice((1, 2))), n, int(rng.integers(0, n + 1))))
    return out + [_Case(2, 0, 0)]


def _first_problem(cases, body):
    for case in cases:
        wrong = _diagnose(case, body)
        if wrong is not None:
            return case, wrong
    return None


def check_lse_program(lse_program: Callable, *, seed: int | None = None,
                      tiles: int = 4) -> str:
    """Grade `lse_program() -> tuple of protocol nodes`, the lse warp's program.

    The program runs in the protocol simulator beside the plan's roles on fixed and random
    work tiles; then each of its waits is removed in turn, and each removal must be caught.
    Raises ExerciseFailed on the first problem; returns a summary.
    """
    rng, seed = fresh_rng(seed)
    body = call_student(lse_program, "lse_program")
    cases = _cases(rng, tiles)
    try:
        _validate(body, _plan(2).barriers)
    except _Wrong as w:
        raise ExerciseFailed(f"lse_program: {w.what}\n  hint: {w.hint}") from None
    body = tuple(body)
    found = _first_problem(cases, body)
    if found:
        case, w = found
        raise ExerciseFailed(f"lse_program ({case}; seed {seed}): {w.what}\n  hint: {w.hint}")
    needed = []
    for path, desc in _waits(body):
        found = _first_problem(cases, _without(body, path))
        if found is None:
            raise ExerciseFailed(
                f"lse_program (seed {seed}): your wait {desc} is redundant: with it removed the "
                f"simulator finds no deadlock, no hazard, and the lse warp still reads each Q "
                f"tile's last post, on every tile tried\n  hint: wait only where the lse warp must "
                f"not run ahead of a producer (its read of stats[i]); an extra wait costs "
                f"latency and makes the role depend on one more barrier")
        needed.append(f"{desc}: {found[1].short}")
    return (f"lse_program: the protocol with your role matches the plan's on {len(cases)} tiles "
            f"(q_stage 1 and 2, N = {', '.join(str(c.n_blocks) for c in cases)}): no deadlock, "
            f"no hazard, no arrival left over, the LSE read after the last post; each of your "
            f"{len(needed)} waits is needed (without {'; without '.join(needed)}) (seed {seed})")
