"""The checks of the data-carrying simulator (`fa4lab.plan.datasim`): its accuracy against the
float64 reference, and what removing one barrier does to the data.

    print(barrier_check("p_ready"))          # which read went wrong, which rows, how much
    findings = barrier_checks(plan)          # every barrier of the plan in turn

With every barrier in place the model's output matches the reference within `tolerance`; with
one removed, an adversarial interleaving (`datasim.adversary`, then a seeded random search over
role speeds) must corrupt it or raise a hazard. A property of the MODEL of the kernel, not a
proof about the binary (that is `fa4lab.kernels.audit`'s protocol check).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

import numpy as np

from fa4lab.plan.datasim import DataRun, persistent, plan_for, run_plan
from fa4lab.plan.datasim_memory import round16
from fa4lab.plan.interleavings import AS_PLANNED, adversary, random_schedules


# ---- accuracy and the barrier check ----
def tolerance(v: np.ndarray, dtype: str = "bf16") -> float:
    """The error the model may show against the float64 reference: P and O each rounded to
    16 bits (relative 2^-8 for bf16, 2^-11 for fp16) on outputs bounded by max |v|, times 2
    for the sum taken before P's rounding; the polynomial exp2's 1e-4 is far below."""
    eps = 2.0 ** -8 if dtype == "bf16" else 2.0 ** -11
    return 2.0 * eps * float(np.max(np.abs(v))) + 1e-6


def row_errors(run: DataRun, reference: np.ndarray) -> np.ndarray:
    """max |out - reference| per (batch, head, query row); inf where out is NaN or inf."""
    err = np.abs(run.out.astype(np.float64) - reference)
    err = np.where(np.isfinite(err), err, np.inf)
    return err.max(axis=-1).transpose(0, 2, 1)


@dataclass(frozen=True)
class Finding:
    """What removing one barrier did to the data-carrying simulation."""

    barrier: str
    schedule: str
    problem: str
    wrong_rows: tuple[str, ...]      # "rows 0..127 of Q tile 0 (batch 0, head 1)"
    max_error: float
    first_bad_read: str | None       # the earliest read that saw other data than with the edge
    hazards: tuple[str, ...]         # hazards the removal adds (the vector clocks')
    deadlock: tuple[str, ...]
    not_waited: str | None = None    # why the edge cannot matter in this model, if it cannot

    @property
    def wrong_output(self) -> bool:
        return bool(self.wrong_rows)

    @property
    def caught(self) -> bool:
        return self.wrong_output or bool(self.hazards) or bool(self.deadlock)

    @property
    def verdict(self) -> str:
        if self.wrong_output:
            return "wrong output"
        if self.deadlock:
            return "deadlock"
        if self.hazards:
            return "hazard only (output still right)"
        if self.not_waited:
            return "never waited on here"
        return "NOT CAUGHT"

    def __str__(self) -> str:
        head = f"without {self.barrier}: "
        if self.not_waited and not self.caught:
            return head + self.not_waited
        parts = []
        if self.first_bad_read:
            parts.append(self.first_bad_read)
        if self.wrong_rows:
            shown = "; ".join(self.wrong_rows[:4])
            more = f" (+{len(self.wrong_rows) - 4} more)" if len(self.wrong_rows) > 4 else ""
            err = "NaN/inf" if math.isinf(self.max_error) else f"{self.max_error:.3g}"
            parts.append(f"{shown}{more} wrong, max error {err}")
        elif self.deadlock:
            parts.append(f"deadlock: {self.deadlock[0]}")
        else:
            parts.append("output still right")
        if self.hazards:
            parts.append(f"hazard: {self.hazards[0]}")
        return head + " — ".join(parts) + f" [{self.schedule}; {self.problem}]"


def _row_ranges(bad: np.ndarray, plan) -> list[str]:
    """Bad (batch, head, row) flags -> "rows a..b of Q tile t (batch b, head h)" strings."""
    m = plan.tiles.m_block
    out = []
    for b, h in itertools.product(range(bad.shape[0]), range(bad.shape[1])):
        rows = np.flatnonzero(bad[b, h])
        if not len(rows):
            continue
        for tile in np.unique(rows // m):
            r = rows[rows // m == tile]
            runs = np.split(r, np.flatnonzero(np.diff(r) != 1) + 1)
            spans = ", ".join(f"{x[0]}..{x[-1]}" if len(x) > 1 else f"{x[0]}" for x in runs)
            out.append(f"rows {spans} of Q tile {tile} (batch {b}, head {h})")
    return out


def first_divergent_read(run: DataRun, clean: DataRun) -> str | None:
    """The earliest read of `run` that saw other data than the same read with every barrier."""
    expected = {(r.role, r.index, r.region): r.holds for r in clean.reads}
    for r in sorted(run.reads, key=lambda r: r.time):
        want = expected.get((r.role, r.index, r.region))
        if want is not None and want != r.holds:
            return (f"{r.role}'s {r.op!r} read {r.region} holding {' + '.join(r.holds)}, "
                    f"where the full protocol gives {' + '.join(want)}")
    return None


def check_problem(seed: int = 0, n_blocks: int = 3, heads: int = 2):
    """A small problem on which every barrier matters: `heads` work tiles of `n_blocks` K/V
    blocks; in each Q tile rows 0..63 see scores that rise by more than the rescale threshold
    from one K/V block to the next (so the correction really rescales), the others plain
    random scores. Returns (q, k, v, description)."""
    gen = np.random.default_rng(seed)
    n, d = 128, 64
    sq, sk = 256, n * n_blocks
    q = gen.standard_normal((1, sq, heads, d)).astype(np.float32)
    k = gen.standard_normal((1, sk, heads, d)).astype(np.float32)
    v = gen.standard_normal((1, sk, heads, d)).astype(np.float32)
    # The kernel walks the blocks from the last: later-visited (lower) blocks score higher.
    q[:, :, :, 0] = np.where((np.arange(sq) % 128 < 64)[None, :, None], 4.0, 0.0)
    k[:, :, :, 0] = 12.0 * (n_blocks - 1 - np.arange(sk) // n)[None, :, None]
    what = f"{heads} work tiles x {n_blocks} K/V blocks, rising scores, seed {seed}"
    return q, k, v, what


def _hazard_key(h) -> tuple:
    return (h.kind, h.region.split(" cols")[0], h.first.split(" @")[0], h.second.split(" @")[0])


def not_waited(plan, barrier: str) -> str | None:
    """Why removing `barrier` cannot change this model's run, or None. With one work tile per
    CTA, a barrier whose every wait is the first wait on a released stage never blocks
    (`Protocol.first_use_only`): it orders the work tiles of a persistent CTA. The reasons are
    `fa4lab.plan.simulate.unobservable`'s where it exists."""
    import fa4lab.plan.simulate as simulate

    if persistent(plan):
        return None
    if hasattr(simulate, "unobservable"):
        return simulate.unobservable(plan).get(barrier)
    first_use_only = getattr(getattr(plan, "protocol", None), "first_use_only", None)
    if first_use_only is not None and barrier in first_use_only(plan.tiles.q_stage):
        return ("waited only on its released first phase: it orders successive work tiles, "
                "and the kernels run one per CTA")
    return None


def barrier_check(barrier: str, *, seed: int = 0, random_trials: int = 12,
                  n_blocks=(3, 1)) -> Finding:
    """Remove `barrier` (its waits and arrivals) and look for an interleaving that corrupts
    the output: the adversary first (`adversary`), then the planned costs, then
    `random_trials` seeded random schedules, on tiles of each length in `n_blocks` (a
    one-block tile is where the Q buffers' reuse shows). Returns the first wrong output found
    (with the earliest read that saw other data than the full protocol gives), else what the
    vector clocks report (`fa4lab.plan.simulate`), which does not depend on the interleaving.
    Deterministic: the same arguments give the same finding.
    """
    from fa4lab.reference import attention_reference

    found = None
    for nb in n_blocks:
        q, k, v, what = check_problem(seed, nb)
        plan = plan_for(q, k, v)
        plan.barriers.barrier(barrier)
        skip = not_waited(plan, barrier)
        qb, kb, vb = (round16(x, plan.spec.dtype) for x in (q, k, v))
        ref = attention_reference(qb, kb, vb)
        tol = tolerance(vb, plan.spec.dtype)
        baseline = {_hazard_key(h) for h in run_plan(plan, q, k, v).hazards}
        schedules = [adversary(plan, barrier)]
        if skip is None:
            schedules += [AS_PLANNED] + random_schedules(plan, random_trials, seed)
        for sched in schedules:
            broken = run_plan(plan, q, k, v, schedule=sched, drop=barrier)
            err = row_errors(broken, ref)
            finding = Finding(
                barrier, str(sched), what, tuple(_row_ranges(~(err <= tol), plan)),
                float(err.max()), None,
                tuple(str(h) for h in broken.hazards if _hazard_key(h) not in baseline),
                tuple(broken.deadlock), skip)
            if finding.wrong_output:
                clean = run_plan(plan, q, k, v, schedule=sched)
                return dataclasses.replace(finding,
                                           first_bad_read=first_divergent_read(broken, clean))
            if found is None or (finding.caught and not found.caught):
                found = finding
    return found


def barrier_checks(plan=None, **kw) -> dict[str, Finding]:
    """`barrier_check` for every barrier of the sm100 plan."""
    if plan is None:
        q, k, v, _ = check_problem()
        plan = plan_for(q, k, v)
    return {b.name: barrier_check(b.name, **kw) for b in plan.barriers.barriers}
