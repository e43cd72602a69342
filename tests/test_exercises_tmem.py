"""Notebook 03's exercise check: the instructor's allocator passes, typical wrong ones fail with
a message naming the region, its columns, the expected columns and the rule they broke."""

from __future__ import annotations

import pytest
from test_course import _instructor_function

from fa4lab import exercises
from fa4lab.exercises.tmem import _plan_map
from fa4lab.plan import plan_forward
from fa4lab.spec import AttentionSpec

NOTEBOOK = "03_tmem_layout.ipynb"


@pytest.fixture(scope="module")
def solution():
    return _instructor_function(NOTEBOOK, "allocate_tmem", "my_allocate_tmem")


def _failure(fn, seed=None) -> str:
    with pytest.raises(exercises.ExerciseFailed) as err:
        exercises.check_allocate_tmem(fn, seed=seed)
    return str(err.value)


def _edit(solution, change):
    """solution's answer, passed through change(regions, alloc, q_stage, n_block, head_dim_v)."""
    def wrong(q_stage, n_block, head_dim_v):
        regions, alloc = solution(q_stage, n_block, head_dim_v)
        return change(dict(regions), alloc, q_stage, n_block, head_dim_v)
    return wrong


def test_instructor_solution_passes_and_covers_one_and_two_q_tiles(solution):
    msg = exercises.check_allocate_tmem(solution, seed=3)
    assert "match" in msg and "seed 3" in msg
    # the grid the check draws holds a one-Q-tile plan (head_dim 256) and two-Q-tile plans
    spec = AttentionSpec(batch=1, seqlen_q=128, seqlen_k=128, heads_q=1, heads_kv=1,
                         head_dim=256)
    one = plan_forward(spec, "sm100")
    two = plan_forward(spec.with_(head_dim=128, head_dim_v=128), "sm100", n_block=64)
    for plan in (one, two):
        t = plan.tiles
        regions, alloc = solution(t.q_stage, t.n_block, t.head_dim_v)
        assert regions == _plan_map(plan.tmem) and alloc == plan.tmem.alloc_cols
    assert {one.tiles.q_stage, two.tiles.q_stage} == {1, 2}


def test_p_in_columns_of_its_own_is_named(solution):
    def separate(regions, alloc, q, n, dv):
        end = max(a + b for a, b in regions.values())
        for i in range(2):
            regions["P", i] = (end + i * (n // 2), n // 2)
        return regions, alloc
    msg = _failure(_edit(solution, separate))
    assert "P[0] is columns" in msg and "expected columns" in msg
    assert "P over S" in msg and "seed" in msg


def test_p_as_wide_as_s_is_told_two_per_column(solution):
    def wide(regions, alloc, q, n, dv):
        for i in range(2):
            regions["P", i] = (i * n, n)
        return regions, alloc
    msg = _failure(_edit(solution, wide))
    assert "P[0]" in msg and "two values share one 32-bit column" in msg


def test_p_in_the_lower_half_is_told_upper(solution):
    def lower(regions, alloc, q, n, dv):
        for i in range(2):
            regions["P", i] = (regions["S", i][0], n // 2)
        return regions, alloc
    msg = _failure(_edit(solution, lower))
    assert "UPPER half" in msg


def test_o_overlapping_s_is_named(solution):
    def after_one_s(regions, alloc, q, n, dv):
        for i in range(q):
            regions["O", i] = (n + i * dv, dv)
        return regions, alloc
    msg = _failure(_edit(solution, after_one_s))
    assert "O[0] is columns" in msg and "overlaps S[1]" in msg and "BOTH S buffers" in msg


@pytest.mark.parametrize("alloc_of", [lambda used: used, lambda used: used + 1],
                         ids=["columns_used", "odd"])
def test_alloc_not_a_power_of_two_is_named(solution, alloc_of):
    def exact(regions, alloc, q, n, dv):
        return regions, alloc_of(max(a + b for a, b in regions.values()))
    msg = _failure(_edit(solution, exact))
    assert "alloc_cols is" in msg and "power of two of at least 32" in msg


def test_alloc_always_512_is_caught_on_a_small_plan(solution):
    msg = _failure(_edit(solution, lambda r, a, q, n, dv: (r, 512)))
    assert "alloc_cols is 512, expected 256" in msg and "smallest power of two" in msg


def test_one_s_per_q_tile_misses_the_second_s_buffer(solution):
    """With one Q tile the plan still keeps two S buffers (the S ping-pong)."""
    def per_q_tile(regions, alloc, q, n, dv):
        for i in range(q, 2):
            del regions["S", i], regions["P", i]
        return regions, alloc
    msg = _failure(_edit(solution, per_q_tile))
    assert "no region S[1]" in msg and "two S buffers" in msg


def test_wrong_return_shape_and_stub_are_explained():
    msg = _failure(lambda q_stage, n_block, head_dim_v: {("S", 0): (0, n_block)})
    assert "return (regions, alloc_cols)" in msg

    def my_allocate_tmem(q_stage, n_block, head_dim_v):
        raise NotImplementedError()
    assert "write my_allocate_tmem" in _failure(my_allocate_tmem)


def test_a_failure_replays_with_its_seed(solution):
    wrong = _edit(solution, lambda r, a, q, n, dv: (r, 512))
    first = _failure(wrong, seed=11)
    assert "seed 11" in first and _failure(wrong, seed=11) == first
