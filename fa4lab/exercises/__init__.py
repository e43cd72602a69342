"""Graded exercises for the notebooks: the checks their autograded cells call.

One check per exercise, each taking the student's function, running it on small adversarial
problems drawn fresh, and comparing it with the library's own implementation and with the
float64 reference (or brute force over the element mask). A wrong answer raises
`ExerciseFailed` (an AssertionError) saying where it is wrong, what was expected and a hint; the
release's stub (`raise NotImplementedError()`) gives "not implemented yet: write ...". A pass
returns a one-line summary.

    notebook 01: check_update_state, check_merge_states       (fa4lab.online_softmax)
    notebook 02: check_n_block_range, check_classify_tiles    (fa4lab.tiling)

Each check takes `seed=` to replay a failure (messages quote the seed). Releasing and grading
the notebooks: `fa4lab.exercises.notebook`, or `python -m fa4lab.exercises release|grade`.
"""

from fa4lab.exercises._core import ExerciseFailed
from fa4lab.exercises.softmax import check_merge_states, check_update_state
from fa4lab.exercises.tiles import check_classify_tiles, check_n_block_range

__all__ = ["ExerciseFailed", "check_update_state", "check_merge_states", "check_n_block_range",
           "check_classify_tiles"]
