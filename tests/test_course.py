"""The course machinery: release strips the solutions, the checks teach, the autograder scores.

Fast tests run the checks in-process on the instructor solutions (taken from the notebooks) and
on typical wrong answers. The slow ones execute the released notebooks with a kernel, as the
grader does: solutions put back give full marks, the raw release zero with each check's own
"not implemented yet" message (four notebook runs in parallel: a minute or two on a 2-core
CPU). That the instructor notebooks themselves run is `make test`'s nbmake pass.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
import numpy as np
import pytest

from fa4lab import exercises, tiling
from fa4lab import online_softmax as osm
from fa4lab.exercises import notebook as course
from fa4lab.exercises.__main__ import main
from fa4lab.tiling import TileKind

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
# notebook -> (solution grade_id, the name the solution cell defines, its check), in order
EXERCISES = {
    "01_online_softmax.ipynb": [("update_state", "update_state", exercises.check_update_state),
                                ("merge_states", "merge_states", exercises.check_merge_states)],
    "02_tiles_masks_gqa.ipynb": [
        ("n_block_range", "my_n_block_range", exercises.check_n_block_range),
        ("classify_tiles", "my_classify_tiles", exercises.check_classify_tiles)],
    "03_tmem_layout.ipynb": [("allocate_tmem", "my_allocate_tmem", exercises.check_allocate_tmem)],
    "04_roles_and_barriers.ipynb": [("lse_program", "lse_program", exercises.check_lse_program)],
    "05_b200_kernel.ipynb": [("softcap_score_mod", "softcap_score_mod",
                              exercises.check_softcap_score_mod)],
    "06_hopper_port.ipynb": [("chunked_local_mask", "chunked_local_mask",
                              exercises.check_chunked_local_mask)],
    "08_design_your_variant.ipynb": [("prediction_held", "prediction_held",
                                      exercises.check_prediction_held)],
    "10_backward.ipynb": [("backward_step", "my_backward_step", exercises.check_backward_step)],
}


def _nb(name):
    return nbformat.read(NOTEBOOKS / name, as_version=4)


def _meta(cell):
    return cell.metadata.get("nbgrader", {})


# Wrong answers built from the library's right ones: behind a partial, which the grader's
# guard against delegation (Note [delegation] in fa4lab.exercises._core) does not replace.
_library_update_state = functools.partial(osm.update_state)
_library_classify_tiles = functools.partial(tiling.classify_tiles)


def _solution_source(name, grade_id):
    (cell,) = [c for c in _nb(name).cells if _meta(c).get("grade_id") == grade_id]
    assert _meta(cell)["solution"] and not _meta(cell)["grade"]
    return cell.source


def _instructor_function(name, grade_id, defined):
    scope = {"np": np, "osm": osm, "TileKind": TileKind}
    exec(_solution_source(name, grade_id), scope)
    return scope[defined]


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    out = tmp_path_factory.mktemp("release")
    assert main(["release", str(NOTEBOOKS), str(out)]) == 0
    return out


# ------------------------------------------------------------------------------ the notebooks

def test_every_exercise_has_task_solution_and_locked_test_cell():
    for name, exs in EXERCISES.items():
        cells = _nb(name).cells
        ids = [_meta(c).get("grade_id") for c in cells]
        for grade_id, defined, check in exs:
            i = ids.index(grade_id)
            task, sol, test = cells[i - 1], cells[i], cells[i + 1]
            assert task.cell_type == "markdown" and "Exercise" in task.source
            assert course.BEGIN_SOLUTION in sol.source and f"def {defined}(" in sol.source
            meta = _meta(test)
            assert meta["grade"] and meta["locked"] and meta["points"] > 0, (name, grade_id)
            assert meta["schema_version"] == 3 and not meta["solution"]
            assert f"{check.__name__}({defined})" in test.source


def test_instructor_solutions_do_not_call_what_they_are_graded_against():
    graded = {"update_state": "osm.update_state", "merge_states": "osm.merge_states",
              "n_block_range": "tiling.", "classify_tiles": "tiling.", "allocate_tmem": "plan",
              "lse_program": "plan.protocol.program", "chunked_local_mask": "same_chunk",
              "softcap_score_mod": "reference", "prediction_held": "judge",
              "backward_step": "backward_blocks"}
    for name, exs in EXERCISES.items():
        for grade_id, _, _ in exs:
            assert graded[grade_id] not in _solution_source(name, grade_id), grade_id


@pytest.mark.parametrize("name,grade_id,defined,check",
                         [(n, *e) for n, exs in EXERCISES.items() for e in exs],
                         ids=lambda x: x if isinstance(x, str) else "")
def test_instructor_solution_passes_its_check(name, grade_id, defined, check):
    assert "match" in check(_instructor_function(name, grade_id, defined))


# ------------------------------------------------------------------------------ the checks

def _failure(check, fn) -> str:
    with pytest.raises(exercises.ExerciseFailed) as err:
        check(fn)
    return str(err.value)


@pytest.mark.parametrize("mistake", ["skip_rescale", "normalize_early"])
def test_update_state_check_names_the_row_and_hints(mistake):
    def wrong(state, s, v_block, rescale_threshold=0.0):
        return _library_update_state(state, s, v_block, rescale_threshold=rescale_threshold,
                                     mistake=mistake)[0]
    msg = _failure(exercises.check_update_state, wrong)
    assert "step" in msg and "row" in msg and "expected" in msg and "hint:" in msg
    assert "alpha" in msg


def test_update_state_check_catches_an_ignored_threshold():
    def eager(state, s, v_block, rescale_threshold=0.0):
        return _library_update_state(state, s, v_block, rescale_threshold=0.0)[0]
    msg = _failure(exercises.check_update_state, eager)
    assert "row_max" in msg and "rescale_threshold" in msg


def test_update_state_check_catches_greater_or_equal_at_the_threshold():
    """A rise of exactly rescale_threshold keeps the basis (the library's `>`): a student's
    `>=` moves it, and the message names the row, the rise and the rule."""
    solution = _instructor_function("01_online_softmax.ipynb", "update_state", "update_state")

    def at_least(state, s, v_block, rescale_threshold=0.0):
        # the instructor's step, with the threshold lowered by the smallest amount: `>=`
        return solution(state, s, v_block,
                        rescale_threshold=np.nextafter(rescale_threshold, -np.inf))
    msg = _failure(exercises.check_update_state, at_least)
    assert "exactly rescale_threshold" in msg and "row_max" in msg, msg
    assert f"exactly rescale_threshold = {osm.FA4_RESCALE_THRESHOLD:g}" in msg, msg
    assert "head" in msg and "row" in msg and "not >=" in msg and "seed" in msg, msg


def test_merge_check_catches_nan_from_empty_states():
    def unguarded(a, b):
        m = np.maximum(a.row_max, b.row_max)
        with np.errstate(invalid="ignore"):
            wa, wb = (np.exp2((x.row_max - m) * x.scale_log2) for x in (a, b))
        return osm.SoftmaxState(m, wa * a.row_sum + wb * b.row_sum,
                                wa[..., None] * a.acc_o + wb[..., None] * b.acc_o, a.scale_log2)
    # one problem always has rows that see no key: causal with seqlen_q > seqlen_k
    msg = _failure(exercises.check_merge_states, unguarded)
    assert "NaN" in msg and "weight 0" in msg


def test_n_block_range_check_spots_top_left_alignment():
    solution = _instructor_function("02_tiles_masks_gqa.ipynb", "n_block_range",
                                    "my_n_block_range")

    def top_left(m_block, *, seqlen_q, seqlen_k, **kw):
        return solution(m_block, seqlen_q=seqlen_k, seqlen_k=seqlen_k, **kw)
    msg = _failure(exercises.check_n_block_range, top_left)
    assert "bottom right" in msg and "m_block" in msg


@pytest.mark.parametrize("mistake", ["unclamped end", "one block at least"])
def test_n_block_range_check_explains_an_empty_range(mistake):
    """A tile that sees no key (causal with seqlen_q > seqlen_k): a reversed or non-empty
    answer gets a hint saying what empty means, the library's convention and the clamp."""
    solution = _instructor_function("02_tiles_masks_gqa.ipynb", "n_block_range",
                                    "my_n_block_range")

    def wrong(m_block, **kw):
        lo, hi = solution(m_block, **kw)
        if lo < hi:
            return lo, hi
        if mistake == "one block at least":
            return 0, 1
        last = min((m_block + 1) * kw["m_block_size"], kw["seqlen_q"]) - 1
        end = last + kw["seqlen_k"] - kw["seqlen_q"] + 1       # never clamped at 0
        return 0, -(-end // kw["n_block_size"])
    msg = _failure(exercises.check_n_block_range, wrong)
    assert "see no key" in msg and "hint: an empty range means" in msg, msg
    assert "n_block_min == n_block_max" in msg and "max(end, 0)" in msg, msg
    assert "m_block" in msg and "seed" in msg


def test_classify_check_names_the_tile_and_a_witness():
    def tail_is_masked(sq, sk, bm, bn, causal, window_size=(None, None)):
        kinds = np.array(_library_classify_tiles(sq, sk, bm, bn, causal,
                                                 window_size=window_size).kinds)
        kinds[kinds == TileKind.TAIL] = TileKind.MASKED
        return kinds
    msg = _failure(exercises.check_classify_tiles, tail_is_masked)
    assert "m_block" in msg and "n_block" in msg and "in bounds" in msg


def test_a_crash_is_reported_with_its_line_and_input():
    def crashes(m_block, **kw):
        return m_block // 0
    msg = _failure(exercises.check_n_block_range, crashes)
    assert "your function n_block_range raised ZeroDivisionError" in msg and "seqlen_q=" in msg
    assert "of crashes (`return m_block // 0`)" in msg, msg


def test_the_report_shows_what_a_passing_check_left_ungraded():
    said = "softcap_score_mod: ...; the audit of the binary NOT GRADED: cuobjdump not found"
    report = course.GradeReport("05.ipynb", [course.ExerciseResult("t", 3.0, 3.0, said)])
    assert said in report.text()


# ------------------------------------------------------------------------------ release

def test_release_strips_every_solution_and_keeps_signatures(released):
    summary = json.loads((released / "points.json").read_text())
    assert summary["total"] == sum(sum(p.values()) for p in summary["notebooks"].values()) > 0
    assert sorted(summary["notebooks"]) == sorted(EXERCISES)
    for name, exs in EXERCISES.items():
        cells = nbformat.read(released / name, as_version=4).cells
        by_id = {_meta(c).get("grade_id"): c for c in cells}
        for grade_id, _, _ in exs:
            stub, solution = by_id[grade_id].source, _solution_source(name, grade_id)
            assert "raise NotImplementedError()" in stub and course.BEGIN_SOLUTION not in stub
            assert stub.split("    # YOUR CODE HERE")[0] == solution.split(
                f"    {course.BEGIN_SOLUTION}")[0], "signature and docstring must stay"
            test = by_id[f"test_{grade_id}"]
            assert test.metadata["editable"] is False and test.metadata["deletable"] is False
        assert not any(c.get("outputs") for c in cells if c.cell_type == "code")
    assert sorted(p.name for p in released.glob("*.ipynb")) == sorted(
        p.name for p in NOTEBOOKS.glob("*.ipynb"))


def test_strip_solutions_indents_the_stub_and_rejects_broken_markers():
    src = f"def f():\n    '''doc'''\n    {course.BEGIN_SOLUTION}\n    return 1\n" \
          f"    {course.END_SOLUTION}\n"
    assert course.strip_solutions(src) == ("def f():\n    '''doc'''\n    # YOUR CODE HERE\n"
                                           "    raise NotImplementedError()")
    with pytest.raises(ValueError, match="never closed"):
        course.strip_solutions(f"{course.BEGIN_SOLUTION}\nx = 1")
    with pytest.raises(ValueError, match="without"):
        course.strip_solutions(f"x = 1\n{course.END_SOLUTION}")


def test_release_refuses_unmarked_solutions_and_overwriting(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(f"{course.BEGIN_SOLUTION}\nx = 1\n"
                                          f"{course.END_SOLUTION}")]
    nbformat.write(nb, tmp_path / "a.ipynb")
    with pytest.raises(ValueError, match="no nbgrader solution metadata"):
        course.release(tmp_path, tmp_path / "out")
    with pytest.raises(ValueError, match="overwrite"):
        course.release(tmp_path, tmp_path)
    assert main(["release", str(tmp_path / "none"), str(tmp_path / "out")]) == 2


# ------------------------------------------------------------------------------ grading

@pytest.fixture(scope="module")
def graded(released):
    """{(notebook, "solutions" | "raw"): the grader's JSON report}, through the command line
    as an instructor runs it; a few runs at a time (each is a kernel mostly waiting, but all
    fourteen at once on a 2-core machine left kernels unanswered past their start timeout)."""
    def run(key):
        name, kind = key
        extra = ["--solutions-from", str(NOTEBOOKS / name)] if kind == "solutions" else []
        proc = subprocess.run([sys.executable, "-m", "fa4lab.exercises", "grade",
                               str(released / name), "--json", *extra],
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"{key}: grading exited {proc.returncode}\n{proc.stderr}"
        # the kernel runs over IPC: no warning of TCP without encryption, nothing left running
        assert "[IPKernelApp] WARNING" not in proc.stderr, proc.stderr
        return json.loads(proc.stdout)

    keys = [(name, kind) for name in EXERCISES for kind in ("solutions", "raw")]
    with ThreadPoolExecutor(max_workers=min(4, 2 * (os.cpu_count() or 1))) as pool:
        return dict(zip(keys, pool.map(run, keys), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_release_with_solutions_put_back_gets_full_marks(graded, name):
    report = graded[name, "solutions"]
    assert report["possible"] > 0 and report["earned"] == report["possible"], report
    assert report["cell_errors"] == []


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_raw_release_gets_zero_and_each_check_says_what_to_write(graded, name):
    report = graded[name, "raw"]
    assert report["earned"] == 0 and report["possible"] > 0
    for ex, (_, defined, _) in zip(report["exercises"], EXERCISES[name], strict=True):
        assert ex["earned"] == 0
        assert f"write {defined} " in ex["message"], (ex["message"], report["cell_errors"])
    # the stubs break only their own graded cells: the rest of the lesson still runs
    assert report["cell_errors"] == []


@pytest.mark.slow
def test_grading_scores_what_ran_when_execution_stops(tmp_path):
    def graded_cell(src, gid, points):
        return nbformat.v4.new_code_cell(src, metadata={"nbgrader": {
            "grade": True, "grade_id": gid, "locked": True, "points": points,
            "schema_version": 3, "solution": False, "task": False}})
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("x = 1"), graded_cell("assert x == 1", "a", 1),
                graded_cell("assert x == 2, 'x is not 2'", "b", 2),
                nbformat.v4.new_code_cell("import time\ntime.sleep(60)"),
                graded_cell("pass", "c", 4)]
    nbformat.write(nb, tmp_path / "t.ipynb")
    report = course.grade(tmp_path / "t.ipynb", timeout=3)
    assert [(e.grade_id, e.earned, e.points) for e in report.exercises] == [
        ("a", 1, 1), ("b", 0, 2), ("c", 0, 4)]
    assert "x is not 2" in report.exercises[1].message
    assert "did not run" in report.exercises[2].message
    assert any("execution stopped" in e for e in report.cell_errors)


def _nbgrader_cell(cell, gid, **flags):
    cell.metadata["nbgrader"] = {"grade": False, "grade_id": gid, "locked": False,
                                 "schema_version": 3, "solution": False, "task": False, **flags}
    return cell


def test_release_records_a_checksum_of_every_locked_graded_and_solution_cell(released):
    for name in EXERCISES:
        cells = nbformat.read(released / name, as_version=4).cells
        marked = [c for c in cells if _meta(c)]
        assert marked and all(_meta(c)["checksum"] == course.compute_checksum(c)
                              and _meta(c)["cell_type"] == c.cell_type for c in marked), name
        for cell in marked:   # any change of source, points or grade_id shows
            for edit in ("source", "points", "grade_id"):
                changed = nbformat.from_dict(json.loads(json.dumps(cell)))
                if edit == "source":
                    changed.source += " "
                elif edit == "points" and _meta(cell)["grade"]:
                    changed.metadata.nbgrader.points += 1
                elif edit == "grade_id":
                    changed.metadata.nbgrader.grade_id += "_"
                else:
                    continue
                assert course.compute_checksum(changed) != _meta(cell)["checksum"], edit


def test_checksums_are_nbgraders_own(released):
    nbgrader_utils = pytest.importorskip("nbgrader.utils")
    cells = [c for name in EXERCISES for c in nbformat.read(released / name, as_version=4).cells]
    cells.append(_nbgrader_cell(nbformat.v4.new_markdown_cell("fixed text"), "fixed",
                                locked=True))
    for cell in cells:
        if _meta(cell):
            assert course.compute_checksum(cell) == nbgrader_utils.compute_checksum(cell)


@pytest.mark.slow
def test_grading_restores_locked_cells_the_student_edited(tmp_path):
    """A student who rewrites a graded cell to pass, deletes another and edits a locked one is
    graded from the released cells, and the report says which were modified."""
    v4 = nbformat.v4
    nb = v4.new_notebook()
    nb.cells = [
        _nbgrader_cell(v4.new_code_cell("LIMIT = 1"), "setup", locked=True),
        _nbgrader_cell(v4.new_code_cell(f"def f():\n    {course.BEGIN_SOLUTION}\n    return 1\n"
                                        f"    {course.END_SOLUTION}"), "f", solution=True),
        _nbgrader_cell(v4.new_code_cell("assert f() == LIMIT, 'f() is not LIMIT'"), "test_a",
                       grade=True, locked=True, points=2),
        _nbgrader_cell(v4.new_code_cell("assert f() + 1 == 2"), "test_b", grade=True,
                       locked=True, points=1)]
    (tmp_path / "src").mkdir()
    nbformat.write(nb, tmp_path / "src" / "t.ipynb")
    course.release(tmp_path / "src", tmp_path / "release")
    student = nbformat.read(tmp_path / "release" / "t.ipynb", as_version=4)
    student.cells[0].source = "LIMIT = 99"
    student.cells[1].source = "def f():\n    return 2"
    student.cells[2].source = "pass"
    del student.cells[3]
    nbformat.write(student, tmp_path / "student.ipynb")

    report = course.grade(tmp_path / "student.ipynb", release_from=tmp_path / "release" / "t.ipynb")
    a, b = report.exercises
    assert (a.grade_id, a.earned, a.points) == ("test_a", 0, 2) and "f() is not LIMIT" in a.message
    assert a.note == "cell 2 (test_a) was modified, graded from the released version"
    assert (b.grade_id, b.earned) == ("test_b", 0) and "missing" in b.message
    assert "cell 0 (setup) was modified, graded from the released version" in report.cell_errors
    assert a.note in report.text()

    alone = course.grade(tmp_path / "student.ipynb")     # no released copy: found, not trusted
    (a,) = alone.exercises
    assert a.earned == 0 and "was modified after the release" in a.message
    assert "release_from=" in a.message


def test_make_course_releases_into_the_ignored_folder():
    root = NOTEBOOKS.parent
    run = subprocess.run(["make", "--no-print-directory", "-n", "course"], cwd=root,
                         capture_output=True, text=True, timeout=60)
    assert "-m fa4lab.exercises release notebooks course/release" in run.stdout, run.stdout
    assert "/course/" in (root / ".gitignore").read_text().splitlines()


def test_a_delegating_answer_scores_nothing_and_says_why():
    """Note [delegation]: returning the library's answer (by its module or under another name)
    fails the check with a message that says so; the library is whole afterwards."""
    from fa4lab.exercises._core import Delegated
    from fa4lab.online_softmax import merge_states as lib_merge
    from fa4lab.tiling import n_block_range as lib_range

    answers = [(exercises.check_merge_states, lambda a, b: osm.merge_states(a, b)),
               (exercises.check_merge_states, lambda a, b: lib_merge(a, b)),
               (exercises.check_update_state, lambda st, s, v, **kw: osm.update_state(st, s, v,
                                                                                   **kw)),
               (exercises.check_n_block_range, lambda m, **kw: lib_range(m, **kw))]
    for check, answer in answers:
        with pytest.raises(Delegated, match="the library's own answer to this exercise; it is "
                                            "unavailable while grading, so the answer scores 0"):
            check(answer)
    assert osm.merge_states is lib_merge and tiling.n_block_range is lib_range
    # a real answer still scores: the instructor's, which computes without the library's
    assert exercises.check_merge_states(_instructor_function(
        "01_online_softmax.ipynb", "merge_states", "merge_states"))


def test_the_softmax_keys_run_without_numpy_warnings():
    """The instructor's update_state and merge_states compute exp2 only where its value is
    used: a row's first block of scores far below 0 (the basis far below 0, the old row_max
    -inf) and a merge with one side unseen raise no overflow warning, and agree with the
    library."""
    import warnings

    name = "01_online_softmax.ipynb"
    update = _instructor_function(name, "update_state", "update_state")
    merge = _instructor_function(name, "merge_states", "merge_states")
    scale = 1.4426950408889634
    empty = osm.SoftmaxState(np.full((1, 2), -np.inf), np.zeros((1, 2)), np.zeros((1, 2, 4)),
                             scale)
    s = np.full((1, 2, 8), -5000.0)
    s[0, 1, :3] = -np.inf
    v = np.arange(32.0).reshape(1, 8, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got = update(empty, s, v)
        both = merge(got, empty)
    want = osm.update_state(empty, s, v)[0]
    for a, b in ((got, want), (both, want)):
        np.testing.assert_allclose(a.row_sum, b.row_sum)
        np.testing.assert_allclose(a.acc_o, b.acc_o)


def test_every_notebook_runs_once_in_make_test():
    """`make test` runs the notebooks without a graded cell under nbmake
    (`python -m fa4lab.exercises ungraded`) and the graded ones here, whole, with their solutions
    put back: together every notebook, none twice."""
    from fa4lab.exercises.notebook import ungraded

    plain = {p.name for p in ungraded(NOTEBOOKS)}
    assert plain and not plain & set(EXERCISES)
    assert plain | set(EXERCISES) == {p.name for p in NOTEBOOKS.glob("*.ipynb")}
    assert main(["ungraded", str(NOTEBOOKS / "none")]) == 2
