"""Notebook 04's exercise check (`fa4lab.exercises.barriers`): the lse warp's barrier list.

The instructor solution is taken from the notebook; the wrong programs are that solution with
one thing changed, so each test names the one mistake whose message it expects.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from fa4lab.exercises import ExerciseFailed, check_lse_program
from fa4lab.exercises import barriers as ex
from fa4lab.plan.protocol import If, Loop, Op, Step, Unroll, per_stage

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "04_roles_and_barriers.ipynb"
WAIT, RELEASE = Op("wait", "stats_full", "i"), Op("arrive", "stats_empty", "i")
READ, STORE = Step("read row sum", "i"), Step("store LSE", "i")


@pytest.fixture(scope="module")
def solution():
    """The notebook's instructor solution, run as the notebook runs it."""
    cells = nbformat.read(NOTEBOOK, as_version=4).cells
    (cell,) = [c for c in cells if c.metadata.get("nbgrader", {}).get("grade_id") ==
               "lse_program"]
    scope: dict = {}
    exec(cell.source, scope)
    return scope["lse_program"]


def _failure(body, seed=0) -> str:
    with pytest.raises(ExerciseFailed) as err:
        check_lse_program(lambda: body, seed=seed)
    return str(err.value)


def _edit(body, old, new):
    """`body` with every node equal to `old` replaced by `new` (a tuple of nodes: spliced)."""
    out = []
    for n in body:
        if n == old:
            out += list(new)
        elif isinstance(n, (Loop, If, Unroll)):
            out.append(type(n)(**{**n.__dict__, "body": _edit(n.body, old, new)}))
        else:
            out.append(n)
    return tuple(out)


def test_the_instructor_solution_passes_and_every_wait_is_needed(solution):
    summary = check_lse_program(solution, seed=3)
    assert "match" in summary and "seed 3" in summary
    waits = [d for _, d in ex._waits(solution())]
    assert waits and f"{len(waits)} waits is needed" in summary


def test_the_solution_runs_clean_beside_every_role(solution):
    plan = ex._plan(2)
    run = ex.run_with_role(plan, solution(), 5, 2)
    assert run.ok and not run.leftover and "lse" in run.lanes()
    # the lse warp really is waited for: each stats_empty phase needs its arrivals
    assert ex.lse_barriers(plan).barrier("stats_empty").arrive_count == \
        plan.barriers.barrier("stats_empty").arrive_count + ex.LSE_THREADS


def test_a_stub_says_not_implemented_yet():
    def lse_program():
        raise NotImplementedError()
    with pytest.raises(ExerciseFailed, match="not implemented yet: write lse_program"):
        check_lse_program(lse_program)


def test_a_missing_wait_is_a_read_of_the_wrong_post(solution):
    body = solution()
    msg = _failure(_edit(body, If("N > 0", (WAIT, READ, RELEASE)), [If("N > 0", (READ,
                                                                               RELEASE))]))
    assert "reads stats[0] after waiting only for phase" in msg and "row scale" in msg
    assert "hint:" in msg and "read after the last one" in msg and "seed 0" in msg


def test_a_wait_on_the_wrong_stage_names_both_stages(solution):
    wrong = Op("wait", "stats_full", "0")
    msg = _failure(_edit(solution(), If("N > 0", (WAIT, READ, RELEASE)),
                         [If("N > 0", (wrong, READ, RELEASE))]))
    assert "waits" in msg and "stats_full[0], which completes only" in msg
    assert "stats_full[1] gets fewer waits" in msg and "wrong stage" in msg


def test_a_missing_arrive_deadlocks_the_softmax(solution):
    loop = [n for n in solution() if isinstance(n, Loop)]
    assert loop, "the solution follows the posts in a Loop over the K/V blocks"
    msg = _failure(_edit(solution(), RELEASE if RELEASE in loop[0].body else loop[0],
                         [] if RELEASE in loop[0].body else
                         [Loop(loop[0].trips, (per_stage(WAIT),))]))
    plan = ex._plan(2)
    before = plan.barriers.barrier("stats_empty").arrive_count
    after = ex.lse_barriers(plan).barrier("stats_empty").arrive_count
    assert "DEADLOCK" in msg and "softmax0 waits stats_empty[0] phase 0" in msg
    assert f"{before} of its {after} arrivals" in msg and "released the mailbox only" in msg


def test_following_one_q_stage_at_a_time_deadlocks_on_longer_tiles():
    body = (per_stage(Loop("N", (WAIT, RELEASE)), If("N > 0", (WAIT, READ, RELEASE)), STORE),)
    msg = _failure(body)
    assert "N = 4" in msg and "DEADLOCK" in msg and "follow them in turn" in msg


def test_a_tile_without_blocks_needs_a_guard_and_a_store(solution):
    unguarded = _edit(solution(), If("N > 0", (WAIT, READ, RELEASE)), [WAIT, READ, RELEASE])
    msg = _failure(unguarded)
    assert "N = 0" in msg and "never returns" in msg and 'If("N > 0"' in msg
    no_store = _edit(_edit(solution(), STORE, []), If("N > 0", (WAIT, READ, RELEASE)),
                     [If("N > 0", (WAIT, READ, RELEASE, STORE))])
    msg = _failure(no_store)
    assert "N = 0" in msg and "LSE is -inf" in msg


def test_wrong_arrival_counts(solution):
    msg = _failure(_edit(solution(), RELEASE, [Op("arrive", "stats_empty", "i", one=True)]))
    assert "with 1 arrival(s)" in msg and "one=True" in msg
    msg = _failure(_edit(solution(), RELEASE, [RELEASE, RELEASE]))
    assert "arrive count overflow on stats_empty" in msg
    last = If("N > 0", (WAIT, READ, RELEASE))
    msg = _failure(_edit(solution(), last, [If("N > 0", (WAIT, READ))]))
    assert "at exit stats_empty[0] holds" in msg and "never completes" in msg


def test_a_redundant_wait_is_named(solution):
    extra = Op("wait", "q_full", "i")     # Q landed long before the last post: orders nothing
    msg = _failure(_edit(solution(), READ, [extra, READ]))
    assert "wait Op('wait', 'q_full', 'i')" in msg and "redundant" in msg


def test_bad_vocabulary_is_explained():
    assert "no barrier 'stats'" in _failure((per_stage(Op("wait", "stats", "i")),))
    assert "no step 'load'" in _failure((Step("load", "i"),))
    assert "cannot commit" in _failure((Op("commit", "stats_empty", "i"),))
    assert "tuple of nodes" in _failure(None)
    assert "cannot expand" in _failure((Loop("blocks", (WAIT,)),))

def test_stages_spelled_out_fail_on_one_q_stage():
    """Numbers for the stages pass with two Q tiles and fail on a q_stage 1 plan."""
    def at(s):
        return Op("wait", "stats_full", s), Op("arrive", "stats_empty", s)
    body = (Loop("N", at("0") + at("1")),) + tuple(
        n for s in "01" for n in (If("N > 0", (at(s)[0], Step("read row sum", s), at(s)[1])),
                                  Step("store LSE", s)))
    assert ex._diagnose(ex._Case(2, 3, 0), body) is None
    msg = _failure(body)
    assert "q_stage 1" in msg and "per_stage" in msg


def test_random_tiles_are_replayable(solution):
    assert check_lse_program(solution, seed=7) == check_lse_program(solution, seed=7)
