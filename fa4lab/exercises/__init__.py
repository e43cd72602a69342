"""Graded exercises for the notebooks: the checks their autograded cells call.

One check per exercise, each taking the student's function, running it on small adversarial
problems drawn fresh, and comparing it with the library's own implementation and with the
float64 reference (or brute force over the element mask). A wrong answer raises
`ExerciseFailed` (an AssertionError) saying where it is wrong, what was expected and a hint; the
release's stub (`raise NotImplementedError()`) gives "not implemented yet: write ...". A pass
returns a one-line summary.

    notebook 01: check_update_state, check_merge_states       (fa4lab.online_softmax)
    notebook 02: check_n_block_range, check_classify_tiles    (fa4lab.tiling)
    notebook 03: check_allocate_tmem                          (fa4lab.plan: plan.tmem)
    notebook 04: check_lse_program                            (fa4lab.plan.simulate)
    notebook 05: check_softcap_score_mod                      (fa4lab.mods, the sm100 kernel)
    notebook 06: check_chunked_local_mask                     (fa4lab.mods, the sm90 kernel)
    notebook 08: check_prediction_held                        (fa4lab.variants.judge)
    notebook 10: check_backward_step                          (fa4lab.backward_blocks)

Each check takes `seed=` to replay a failure (messages quote the seed). A failure of fa4lab or
of the machine rather than of the answer is a `GradingError`, or a part the summary says was
not graded, and why (Note [whose failure] in `fa4lab.exercises.variants`). Releasing and
grading the notebooks: `fa4lab.exercises.notebook`, or `python -m fa4lab.exercises
release|grade`.
"""

from fa4lab.exercises._core import ExerciseFailed, GradingError
from fa4lab.exercises.backward import check_backward_step
from fa4lab.exercises.barriers import check_lse_program
from fa4lab.exercises.experiment import check_prediction_held
from fa4lab.exercises.masks import check_chunked_local_mask
from fa4lab.exercises.softmax import check_merge_states, check_update_state
from fa4lab.exercises.tiles import check_classify_tiles, check_n_block_range
from fa4lab.exercises.tmem import check_allocate_tmem
from fa4lab.exercises.variants import check_softcap_score_mod

__all__ = ["ExerciseFailed", "GradingError", "check_update_state", "check_merge_states",
           "check_n_block_range", "check_classify_tiles", "check_allocate_tmem",
           "check_lse_program", "check_softcap_score_mod", "check_chunked_local_mask",
           "check_prediction_held", "check_backward_step"]
