"""What every check shares: the failure it raises, and calling a student's function safely."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


class ExerciseFailed(AssertionError):
    """A check found a wrong answer; the message says where, what was expected, and a hint.

    An AssertionError, so pytest and nbgrader both count it as a failed test; the autograder
    (`fa4lab.exercises.notebook.grade`) reports its message as the exercise's feedback.
    """


def call_student(fn: Callable, name: str, *args, **kwargs):
    """fn(*args, **kwargs), turning the release's stub and crashes into a readable failure."""
    if not callable(fn):
        raise ExerciseFailed(f"{name}: expected a function, got {type(fn).__name__} {fn!r}")
    try:
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
        raise ExerciseFailed(f"{name} raised {type(e).__name__}: {e}\n  on the input "
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
