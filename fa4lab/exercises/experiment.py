"""Notebook 08's exercise: judge a falsifiable experiment by the plan report's rule.

The report (`fa4lab.plan.report`) predicts the TFLOP/s of the chosen plan and of a neighbouring
one, and states when the prediction fails: when the measured relative change has the other
sign, or is under half the predicted one. The check runs the student's judgement on borderline
cases and fresh random ones and compares it with `fa4lab.variants.judge`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fa4lab.exercises._core import ExerciseFailed, call_student, fresh_rng
from fa4lab.variants import judge

__all__ = ["check_prediction_held"]

# (predicted chosen, predicted other, measured chosen, measured other) TFLOP/s and what makes
# each case awkward; random ones follow.
FIXED_CASES = (
    (700.0, 770.0, 500.0, 540.0, "a gain, measured smaller but over half"),
    (700.0, 770.0, 500.0, 520.0, "a gain, measured under half the predicted change"),
    (512.0, 640.0, 256.0, 288.0, "exactly half the predicted change (held: not under half)"),
    (700.0, 770.0, 500.0, 490.0, "predicted a gain, measured a loss"),
    (700.0, 560.0, 450.0, 300.0, "a loss, measured larger than predicted"),
    (700.0, 560.0, 450.0, 430.0, "a loss, measured under half"),
    (700.0, 630.0, 450.0, 450.0, "predicted a loss, measured no change"),
    (1200.0, 1260.0, 600.0, 640.0, "absolute TFLOP/s gaps differ: only relative changes count"),
)


def _cases(rng, count: int):
    yield from FIXED_CASES
    for _ in range(count):
        pc, mc = (float(x) for x in rng.uniform(100.0, 1500.0, size=2))
        p_change = float(rng.choice([-1, 1])) * float(rng.uniform(0.01, 0.5))
        m_change = p_change * float(rng.uniform(-1.0, 2.0))
        yield pc, pc * (1 + p_change), mc, mc * (1 + m_change), "random"


def _hint(p: float, m: float) -> str:
    if (p > 0) != (m > 0) and m != 0:
        return ("the measured change has the other sign: that alone fails the prediction, "
                "however large it is")
    if m == 0:
        return "no measured change is under half of any predicted change: the prediction fails"
    if abs(m) > abs(p):
        return ("a change larger than predicted, with the predicted sign, still holds: the rule "
                "rejects only the other sign or under half the size")
    if abs(m) == abs(p) / 2:
        return "exactly half is not under half: the prediction holds (>=, not >)"
    if abs(m) < abs(p) / 2:
        return ("the predicted sign, but under half the predicted size: the prediction fails; "
                "compare relative changes (other / chosen - 1), not TFLOP/s gaps")
    return ("the predicted sign and at least half its size: the prediction holds; compare "
            "relative changes (other / chosen - 1), not TFLOP/s gaps: the model and the GPU "
            "run at different scales")


def check_prediction_held(prediction_held: Callable, seed: int | None = None) -> str:
    """Grade `prediction_held(pred_chosen, pred_other, meas_chosen, meas_other) -> bool`
    against `fa4lab.variants.judge` on FIXED_CASES and random ones; returns a summary."""
    rng, seed = fresh_rng(seed)
    name = "prediction_held"
    cases = list(_cases(rng, 40))
    for i, (pc, po, mc, mo, what) in enumerate(cases):
        p, m = po / pc - 1, mo / mc - 1
        expected, why = judge(p, m)
        got = call_student(prediction_held, name, pc, po, mc, mo)
        if isinstance(got, np.bool_):
            got = bool(got)
        if not isinstance(got, bool):
            raise ExerciseFailed(f"{name} returned {type(got).__name__} {got!r}; return True or "
                                 f"False (seed {seed})")
        if got != expected:
            raise ExerciseFailed(
                f"{name} (case {i}, {what}; seed {seed}): predicted {pc:.0f} -> {po:.0f} "
                f"TFLOP/s, measured {mc:.0f} -> {mo:.0f}: returned {got}, expected {expected} "
                f"({why}); hint: {_hint(p, m)}")
    return (f"{name}: all {len(cases)} cases match the report's rule "
            f"(fa4lab.variants.judge; seed {seed})")
