"""Notebook 03's exercise: allocate the TMEM columns of S, P and O, as the sm100 plan does.

The student's `allocate_tmem(q_stage, n_block, head_dim_v)` returns the column map
`{(name, index): (first_col, n_cols)}` and the `tcgen05.alloc` size. The check draws sm100 plans
(`fa4lab.plan.plan_forward`) over the head dims the kernel builds (head_dim 256 with one Q tile,
the others with two), several n_block and both 16-bit dtypes, in a fresh random order, and
compares the student's map with each plan's `plan.tmem`, region by region. The plan is the only
answer key: whatever layout it settles on is what the check expects.
"""

from __future__ import annotations

from collections.abc import Callable

from fa4lab.errors import PlanError
from fa4lab.exercises._core import ExerciseFailed, call_student, fresh_rng
from fa4lab.limits import KERNEL_DTYPES, KERNEL_HEAD_DIMS
from fa4lab.plan import plan_forward
from fa4lab.spec import AttentionSpec

__all__ = ["check_allocate_tmem"]

# A combination the planner refuses (TMEM, SMEM or registers) is skipped: the grid follows it.
N_BLOCKS = (64, 96, 128)


def _plans(rng):
    """(dtype, plan) for every sm100 plan of the grid, in a random order."""
    grid = [(p, n, dt) for p in KERNEL_HEAD_DIMS["sm100"] for n in N_BLOCKS
            for dt in KERNEL_DTYPES]
    out = []
    for k in rng.permutation(len(grid)):
        (d, dv), n, dtype = grid[int(k)]
        seqlen = int(rng.integers(1, 4097))
        heads_kv = int(rng.choice((1, 2, 8)))
        spec = AttentionSpec(batch=1, seqlen_q=seqlen, seqlen_k=seqlen, heads_q=heads_kv,
                             heads_kv=heads_kv, head_dim=d, head_dim_v=dv, dtype=dtype,
                             causal=bool(rng.integers(2)))
        try:
            out.append((dtype, plan_forward(spec, "sm100", n_block=n)))
        except PlanError:
            continue
    if {plan.tiles.q_stage for _, plan in out} != {1, 2}:
        raise RuntimeError("the sm100 plans of the head dims the kernel builds should have one "
                           "Q tile (head_dim 256) and two (the others): a bug in fa4lab, not in "
                           "your answer")
    return out


def _plan_map(tmem) -> dict[tuple[str, int], tuple[int, int]]:
    """{(name, index): (first_col, n_cols)} in the plan's region order."""
    return {(r.name, r.stage): (r.col_offset, r.columns) for r in tmem.regions}


def _name(key) -> str:
    return f"{key[0]}[{key[1]}]"


def _cols(first: int, n: int) -> str:
    return f"columns {first}..{first + n - 1} ({n} columns)" if n > 0 else f"{n} columns"


def _as_answer(got, where: str) -> tuple[dict, int]:
    try:
        regions, alloc = got
        regions = {(str(k[0]), int(k[1])): (int(v[0]), int(v[1])) for k, v in regions.items()}
        return regions, int(alloc)
    except (TypeError, ValueError, IndexError, AttributeError):
        raise ExerciseFailed(
            f"allocate_tmem ({where}) returned {got!r}; return (regions, alloc_cols): regions a "
            f"dict {{(name, index): (first_col, n_cols)}} such as {{('S', 0): (0, 128), ...}}, "
            f"alloc_cols an int") from None


def check_allocate_tmem(allocate_tmem: Callable, *, seed: int | None = None) -> str:
    """Grade `allocate_tmem(q_stage, n_block, head_dim_v) -> (regions, alloc_cols)`.

    `regions` maps (name, index) -> (first_col, n_cols) for every TMEM region of the sm100 plan
    ("S", "P", "O"); `alloc_cols` is the `tcgen05.alloc` size. Compared with `plan.tmem` of
    sm100 plans of several head dims, n_block and dtypes. Raises ExerciseFailed at the first
    wrong region (name, columns, expected columns, hint); returns a summary.
    """
    rng, seed = fresh_rng(seed)
    checked = set()
    for dtype, plan in _plans(rng):
        t, tm = plan.tiles, plan.tmem
        shape = (t.q_stage, t.n_block, t.head_dim_v)
        want = _plan_map(tm)
        where = (f"q_stage={t.q_stage}, n_block={t.n_block}, head_dim_v={t.head_dim_v}: the "
                 f"plan of head_dim {t.head_dim}, {dtype}; seed {seed}")
        got, alloc = _as_answer(call_student(allocate_tmem, "allocate_tmem", q_stage=t.q_stage,
                                             n_block=t.n_block, head_dim_v=t.head_dim_v), where)
        missing = [k for k in want if k not in got]
        if missing:
            raise ExerciseFailed(
                f"allocate_tmem ({where}): no region {_name(missing[0])} in your map; the plan "
                f"has {', '.join(map(_name, want))}\n  hint: {_count_hint(missing[0])}")
        extra = [k for k in got if k not in want]
        if extra:
            raise ExerciseFailed(
                f"allocate_tmem ({where}): your map has {_name(extra[0])}, which the plan does "
                f"not; it has {', '.join(map(_name, want))}\n  hint: "
                f"{_count_hint(extra[0])}")
        for key, (first, n) in want.items():
            if got[key] != (first, n):
                g_first, g_n = got[key]
                raise ExerciseFailed(
                    f"allocate_tmem ({where}): {_name(key)} is {_cols(g_first, g_n)}, expected "
                    f"{_cols(first, n)}\n  hint: {_region_hint(key, got, want)}")
        if alloc != tm.alloc_cols:
            raise ExerciseFailed(
                f"allocate_tmem ({where}): alloc_cols is {alloc}, expected {tm.alloc_cols} for "
                f"the {tm.total_cols} columns the regions use\n  hint: {_alloc_hint(alloc)}")
        checked.add(shape)
    return (f"allocate_tmem: {len(checked)} layouts (q_stage, n_block, head_dim_v) match the "
            f"sm100 plans' TMEM maps (seed {seed})")


def _count_hint(key) -> str:
    name, _ = key
    if name in ("S", "P"):
        return ("two S buffers, S[0] and S[1] (one per Q tile when q_stage is 2; with one Q "
                "tile, consecutive key blocks alternate between them), each with its P inside")
    if name == "O":
        return "one O accumulator per Q tile: O[0] .. O[q_stage - 1]"
    return "the regions are S, P and O"


def _overlaps(a, b) -> bool:
    return a[0] < b[0] + b[1] and b[0] < a[0] + a[1]


def _region_hint(key, got, want) -> str:
    name, i = key
    first, n = got[key]
    if name == "S":
        return ("S[i] holds one fp32 score per key of the block: n_block columns. S[0] starts at "
                "column 0 and S[1] right after it")
    if name == "P":
        s_first, s_n = want["S", i]
        if n == s_n:
            return ("P is 16-bit: two values share one 32-bit column, so P[i] takes n_block / 2 "
                    "columns, not n_block")
        if not _overlaps((first, n), (s_first, s_n)):
            return ("P over S: P[i] takes no columns of its own; softmax writes it into the "
                    "columns of S[i], whose scores it no longer needs (Note [P aliases S])")
        return ("P[i] is the UPPER half of S[i]'s columns: it starts n_block / 2 columns into "
                "S[i] and ends where S[i] ends")
    if name == "O":
        hit = [k for k in want if k[0] == "S" and _overlaps((first, n), want[k])]
        if hit:
            return (f"O[{i}] overlaps {_name(hit[0])}: the score MMA writes S while the value "
                    f"MMA accumulates O, so O starts after BOTH S buffers, O[0] then O[1]")
        return ("O[i] is head_dim_v fp32 columns (V's width, not K's), after both S buffers: "
                "O[0] then O[1]")
    return "compare with the plan's map (plan.tmem.regions)"


def _alloc_hint(alloc: int) -> str:
    if alloc < 32 or alloc & (alloc - 1):
        return ("tcgen05.alloc takes a power of two of at least 32 columns: round the columns "
                "used up to the next one")
    return "the smallest power of two (at least 32) that holds every column the regions use"
