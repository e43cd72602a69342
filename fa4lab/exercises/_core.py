"""What every check shares: the failure it raises, and calling a student's function safely."""

from __future__ import annotations

import contextlib
import linecache
import traceback
from collections.abc import Callable

import numpy as np


class ExerciseFailed(AssertionError):
    """A check found a wrong answer; the message says where, what was expected, and a hint.

    An AssertionError, so pytest and nbgrader both count it as a failed test; the autograder
    (`fa4lab.exercises.notebook.grade`) reports its message as the exercise's feedback.
    """


class GradingError(RuntimeError):
    """fa4lab itself failed while grading (a library bug, a broken install), not the answer:
    the message says so and what to do. Not an AssertionError: nbgrader and pytest show it as
    an error of the grader, not as a wrong answer."""


def raised_at(err: BaseException, fn: Callable) -> str:
    """Where in the student's code `err` was raised: ' at line N of f (`source`)' for the
    innermost traceback frame in the file that defines `fn` (the notebook cell), plus the
    function it called when the error came from deeper; '' when no frame of that file is in
    the traceback, nor in those of the errors it was raised from (a library error wrapping one
    the student's code raised, e.g. fa4lab.mods.ModCompileError, is still the student's)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return ""
    seen, mine = set(), []
    while err is not None and id(err) not in seen and not mine:
        seen.add(id(err))
        frames = list(traceback.walk_tb(err.__traceback__))
        mine = [i for i, (frame, _) in enumerate(frames) if frame.f_code.co_filename ==
                code.co_filename]
        err = err.__cause__ or err.__context__
    if not mine:
        return ""
    frame, line = frames[mine[-1]]
    text = linecache.getline(frame.f_code.co_filename, line, frame.f_globals).strip()
    at = f" at line {line} of {frame.f_code.co_name}" + (f" (`{text}`)" if text else "")
    if mine[-1] + 1 < len(frames):
        inner = frames[mine[-1] + 1][0]
        at += (f", inside {inner.f_globals.get('__name__', '?')}.{inner.f_code.co_name} which "
               f"that line called")
    return at


# Note [delegation]
# An exercise asks for a function the library already has: the check compares the student's
# answer with it. A student who returns the library's own answer (`return osm.merge_states(a,
# b)`) would score full marks for nothing, so while the student's function runs, the library
# functions that answer its exercise (ANSWERS) are unavailable: the module's attribute and any
# name in the student's globals bound to the same function raise `Delegated` (an
# ExerciseFailed: 0 points, the message says why); they are put back the moment it returns.
# What this cannot stop: a student can read the library's source (inspect.getsource), as any
# installed package's; notebooks/README.md tells instructors so.
ANSWERS: dict[str, tuple[tuple[str, str], ...]] = {
    "update_state": (("fa4lab.online_softmax", "update_state"),),
    "merge_states": (("fa4lab.online_softmax", "merge_states"),),
    "n_block_range": (("fa4lab.tiling", "n_block_range"),),
    "classify_tiles": (("fa4lab.tiling", "classify_tiles"),),
    "allocate_tmem": (("fa4lab.plan", "plan_forward"), ("fa4lab.plan.forward", "plan_forward")),
    "backward_step": (("fa4lab.backward_blocks", "backward_step"),),
}


class Delegated(ExerciseFailed):
    """The student's function called the library's answer to its exercise (Note
    [delegation])."""


@contextlib.contextmanager
def _answers_unavailable(name: str, fn: Callable):
    """While the block runs, ANSWERS[name] raise `Delegated` wherever the student's code can
    reach them: their modules' attributes, the names of fn's globals and the cells of its
    closure bound to them."""
    import importlib

    patched = []        # (namespace dict or module, attribute, original)
    scope = getattr(fn, "__globals__", {})
    for module_name, attr in ANSWERS.get(name, ()):
        module = importlib.import_module(module_name)
        original = getattr(module, attr)
        where = f"{module_name}.{attr}"

        def refuse(*args, _where=where, **kwargs):
            raise Delegated(f"{name}: your function called {_where}, the library's own answer "
                            f"to this exercise; it is unavailable while grading, so the answer "
                            f"scores 0: write {name} yourself from the lesson's rule")

        patched.append((module, attr, original))
        setattr(module, attr, refuse)
        for key, value in list(scope.items()):
            if value is original:
                patched.append((scope, key, original))
                scope[key] = refuse
        for cell in getattr(fn, "__closure__", None) or ():
            if cell.cell_contents is original:
                patched.append((cell, "cell_contents", original))
                cell.cell_contents = refuse
    try:
        yield
    finally:
        for where, attr, original in reversed(patched):
            if isinstance(where, dict):
                where[attr] = original
            else:
                setattr(where, attr, original)


def call_student(fn: Callable, name: str, *args, **kwargs):
    """fn(*args, **kwargs), turning the release's stub and crashes into a readable failure;
    the library's answers to `name` are unavailable meanwhile (Note [delegation])."""
    if not callable(fn):
        raise ExerciseFailed(f"{name}: expected a function, got {type(fn).__name__} {fn!r}")
    try:
        with _answers_unavailable(name, fn):
            return fn(*args, **kwargs)
    except NotImplementedError:
        own = getattr(fn, "__name__", "")
        own = own if own.isidentifier() else name     # the student's name for it, if any
        raise ExerciseFailed(f"{name}: not implemented yet: write {own} in the cell above "
                             f"(replace `raise NotImplementedError()` with your code), run "
                             f"that cell, then run this one again") from None
    except ExerciseFailed:
        raise
    except Exception as e:
        raise ExerciseFailed(f"your function {name} raised {type(e).__name__}"
                             f"{raised_at(e, fn)}: {e}\n  on the input "
                             f"{_describe(args, kwargs)}") from e


def _describe(args, kwargs) -> str:
    def short(x):
        if isinstance(x, np.ndarray):
            return f"array{x.shape}"
        if hasattr(x, "row_max"):
            return f"SoftmaxState(rows {np.shape(x.row_max)})"
        return repr(x)
    parts = [short(a) for a in args] + [f"{k}={short(v)}" for k, v in kwargs.items()]
    return ", ".join(parts)


def fresh_rng(seed: int | None = None) -> tuple[np.random.Generator, int]:
    """(generator, seed): a new seed each call unless one is given; messages quote it so a
    failure can be replayed with `check_...(fn, seed=...)`."""
    if seed is None:
        seed = int(np.random.SeedSequence().entropy % 2**31)
    return np.random.default_rng(seed), seed
