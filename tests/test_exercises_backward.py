"""Notebook 10's exercise check: the instructor's backward step passes, typical wrong ones fail
with a message naming the tile, the row, the gradient and the mistake."""

from __future__ import annotations

import numpy as np
import pytest
from test_course import _instructor_function

from fa4lab import exercises
from fa4lab.backward_blocks import backward_step as library_step
from fa4lab.exercises._core import Delegated

NOTEBOOK = "10_backward.ipynb"


@pytest.fixture(scope="module")
def solution():
    return _instructor_function(NOTEBOOK, "backward_step", "my_backward_step")


def _failure(fn, seed=None) -> str:
    with pytest.raises(exercises.ExerciseFailed) as err:
        exercises.check_backward_step(fn, seed=seed)
    return str(err.value)


def _student(*, subtract=lambda d: d[:, None], normalise="lse", grad_scale=True,
             p_transposed=True, empty_rows="zero", mask=True):
    """A backward step written as a student might, with the given slips."""
    def step(q, k, v, dout, lse, d_row, softmax_scale, visible):
        s = softmax_scale * (q @ k.T)
        show = visible if mask else np.ones_like(visible)
        if normalise == "lse":
            p = np.where(show, np.exp(s - lse[:, None]), 0.0)
        elif normalise == "split_exp":
            p = np.where(show, np.exp(s) / np.exp(lse[:, None]), 0.0)
        else:                                       # a softmax over this block's keys
            e = np.where(show, np.exp(s - s.max(axis=1, keepdims=True)), 0.0)
            p = e / np.maximum(e.sum(axis=1, keepdims=True), 1e-300)
        if empty_rows == "zero":
            p = np.where(np.isfinite(lse)[:, None], p, 0.0)
        elif empty_rows == "times_mask":
            p = np.exp(s - lse[:, None]) * visible
        elif empty_rows == "minus_inf_scores":
            p = np.exp(np.where(visible, s, -np.inf) - lse[:, None])
        dv = p.T @ dout if p_transposed else p @ dout
        ds = p * (dout @ v.T - subtract(d_row))
        g = softmax_scale if grad_scale else 1.0
        return g * (ds @ k), g * (ds.T @ q), dv
    return step


def test_instructor_solution_passes(solution):
    msg = exercises.check_backward_step(solution, seed=3)
    assert "match" in msg and "seed 3" in msg and "float64 reference backward" in msg


def test_a_correct_student_step_passes():
    with np.errstate(all="ignore"):
        assert "match" in exercises.check_backward_step(_student(), seed=4)


def test_forgetting_d_names_the_row_of_ds():
    msg = _failure(_student(subtract=lambda d: 0.0))
    assert "of dQ" in msg and "row" in msg and "of dS differs" in msg
    assert "did you subtract D = rowsum(dO * O)" in msg


def test_adding_d_is_told_to_subtract():
    assert "D is subtracted, not added" in _failure(_student(subtract=lambda d: -d[:, None]))


def test_d_along_the_columns_is_told_per_row():
    msg = _failure(_student(subtract=lambda d: d[None, :]))
    assert "square 4 x 4 blocks" in msg and "one number per query ROW" in msg


def test_a_softmax_over_the_block_is_told_to_use_the_lse():
    with np.errstate(all="ignore"):
        msg = _failure(_student(normalise="block"))
    assert "of dV" in msg and "P comes from the saved LSE" in msg


def test_a_missing_scale_in_the_gradients_is_named():
    msg = _failure(_student(grad_scale=False))
    assert "dQ = softmax_scale * dS K" in msg


def test_p_not_transposed_is_caught_on_the_square_tile():
    msg = _failure(_student(p_transposed=False))
    assert "of dV" in msg and "dV = P^T dO" in msg


def test_hidden_keys_left_in_p_are_named():
    msg = _failure(_student(mask=False))
    assert "keys the mask hides have P = 0" in msg


@pytest.mark.parametrize("empty_rows", ["times_mask", "minus_inf_scores"])
def test_nan_on_rows_that_see_no_key_is_explained(empty_rows):
    with np.errstate(all="ignore"):
        msg = _failure(_student(empty_rows=empty_rows))
    assert "see no key" in msg and "got nan" in msg and "LSE" in msg


def test_exp_of_s_over_exp_of_lse_overflows_on_large_scores():
    with np.errstate(all="ignore"):
        msg = _failure(_student(normalise="split_exp"))
    assert "scores in the thousands" in msg and "exp(S) / exp(LSE) overflows" in msg


def test_changing_an_input_in_place_is_named(solution):
    def scales_q_in_place(q, k, v, dout, lse, d_row, softmax_scale, visible):
        q *= softmax_scale
        return solution(q / softmax_scale, k, v, dout, lse, d_row, softmax_scale, visible)
    assert "changed its input q in place" in _failure(scales_q_in_place)


def test_state_kept_between_calls_fails_the_whole_walk(solution):
    """Right on every tile the check grades one by one, wrong once the walk runs the step again:
    the check's last stage (the walk against the reference) catches a step that remembers."""
    summary = exercises.check_backward_step(solution, seed=5)
    graded = int(summary.split(": ")[1].split()[0])       # "backward_step: N tiles of ..."
    calls = {"n": 0}

    def remembers(*args):
        calls["n"] += 1
        dq, dk, dv = solution(*args)
        return (dq * 1.5 if calls["n"] > graded else dq), dk, dv

    msg = _failure(remembers, seed=5)
    assert calls["n"] > graded
    assert "the whole walk" in msg and "keep state between calls" in msg


def test_wrong_return_shape_and_stub_are_explained(solution):
    msg = _failure(lambda *args: solution(*args)[:2])
    assert "return (dq, dk, dv)" in msg
    msg = _failure(lambda *args: (solution(*args)[0][:, :-1], *solution(*args)[1:]))
    assert "dQ has shape (4, 3), expected (4, 4)" in msg

    def my_backward_step(q, k, v, dout, lse, d_row, softmax_scale, visible):
        raise NotImplementedError()
    assert "write my_backward_step" in _failure(my_backward_step)


def test_calling_the_library_step_scores_nothing():
    import fa4lab.backward_blocks as bb

    with pytest.raises(Delegated, match="the library's own answer"):
        exercises.check_backward_step(lambda *args: library_step(*args))
    with pytest.raises(Delegated):
        exercises.check_backward_step(lambda *args: bb.backward_step(*args))
    assert bb.backward_step is library_step


def test_a_failure_replays_with_its_seed():
    wrong = _student(subtract=lambda d: 0.0)
    first = _failure(wrong, seed=11)
    assert "seed 11" in first and _failure(wrong, seed=11) == first
