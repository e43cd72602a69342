"""Figures of the data-carrying simulator (`fa4lab.plan.datasim`): per-row error of its output.

    from fa4lab.viz.datasim import draw_row_errors
    fig = draw_row_errors({"all barriers": run, "without p_ready": broken}, reference, tol)
"""

from __future__ import annotations

import numpy as np

from fa4lab.plan.datasim_check import row_errors
from fa4lab.viz._live import subplots


def draw_row_errors(runs: dict, reference: np.ndarray, tol: float, batch: int = 0,
                    head: int = 0, ax=None):
    """max |out - reference| of each query row (one head), one line per run, log scale; rows
    whose output is NaN or inf sit at the top of the axis; the tolerance as a dashed line."""
    own = ax is None
    if own:
        fig, ax = subplots(figsize=(10, 3.4))
    else:
        fig = ax.figure
    errs = {label: row_errors(run, reference)[batch, head] for label, run in runs.items()}
    finite = [e[np.isfinite(e)] for e in errs.values()]
    top = max([tol * 10] + [float(f.max()) * 4 for f in finite if f.size])
    floor = tol * 1e-4
    for (label, e), color in zip(errs.items(), ("#1f77b4", "#d62728", "#2ca02c", "#9467bd")):
        shown = np.clip(np.where(np.isfinite(e), e, top), floor, top)
        ax.plot(np.arange(len(e)), shown, lw=1.2, color=color, label=label)
    ax.axhline(tol, color="#555555", ls="--", lw=0.8, label=f"tolerance {tol:.3g}")
    ax.set_yscale("log")
    ax.set_ylim(floor, top * 1.5)
    ax.set_xlabel(f"query row (batch {batch}, head {head})")
    ax.set_ylabel("max |out - reference|")
    ax.legend(fontsize=8, loc="center right")
    if own:
        fig.tight_layout()
    return fig
