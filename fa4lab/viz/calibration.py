"""The cost model's calibration: predicted against measured or published TFLOP/s, per point.

    from fa4lab.plan.calibration import load_table
    from fa4lab.viz.calibration import plot_calibration
    fig = plot_calibration(load_table("sm90"))          # benchmarks/calibration/h200_measured.json

Takes a table of `fa4lab.plan.calibration.table` (or the JSON it was saved as) and returns a
matplotlib Figure: left, predicted over the figure with the tolerance band (5% H200, 10%
B200); right, each point's error, so a head dim or causal pattern shows at a glance.
"""

from __future__ import annotations

from fa4lab.viz._live import subplots

_COLORS = {64: "#1f77b4", 96: "#17becf", 128: "#d62728", 192: "#8c564b", 256: "#2ca02c"}


def _name(r: dict) -> str:
    return f"hd{r['head_dim']} {'causal' if r['causal'] else 'dense'} {r['seqlen'] // 1024}k"


def plot_calibration(tab: dict, ax_size: float = 4.6):
    """Predicted vs figure (MEASURED or PUBLISHED, as the table labels them) per point, with
    the table's tolerance band, and the error per point."""
    fig, (ax, ax_err) = subplots(1, 2, figsize=(2.3 * ax_size, ax_size))
    rows, tol, label = tab["points"], tab["tolerance"], tab["figures"]
    xs = [r["figure_tflops"] for r in rows] + [r["predicted_tflops"] for r in rows]
    lo, hi = 0.85 * min(xs), 1.1 * max(xs)
    ax.plot([lo, hi], [lo, hi], color="black", lw=1)
    ax.fill_between([lo, hi], [lo * (1 - tol), hi * (1 - tol)], [lo * (1 + tol), hi * (1 + tol)],
                    color="#cccccc", alpha=0.5, label=f"within {tol:.0%}")
    for r in rows:
        ax.scatter(r["figure_tflops"], r["predicted_tflops"],
                   color=_COLORS.get(r["head_dim"], "gray"),
                   marker="^" if r["causal"] else "o", s=36, zorder=3)
    for hd in sorted({r["head_dim"] for r in rows}):
        for causal in (False, True):
            if any(r["head_dim"] == hd and r["causal"] == causal for r in rows):
                ax.scatter([], [], color=_COLORS.get(hd, "gray"), marker="^" if causal else "o",
                           label=f"hd{hd} {'causal' if causal else 'dense'}")
    if len(rows) <= 3:
        for r in rows:
            ax.annotate(_name(r), (r["figure_tflops"], r["predicted_tflops"]),
                        textcoords="offset points", xytext=(6, -10), fontsize=8)
    ax.set(xlim=(lo, hi), ylim=(lo, hi), xlabel=f"{label} TFLOP/s",
           ylabel="predicted TFLOP/s (fa4lab.plan.throughput)",
           title=f"{tab['hardware']}: predicted vs {label.lower()}")
    ax.legend(fontsize=7, loc="upper left")
    names = [_name(r) for r in rows]
    errs = [100 * r["error"] for r in rows]
    ax_err.barh(range(len(rows)), errs,
                color=[_COLORS.get(r["head_dim"], "gray") for r in rows])
    ax_err.axvspan(-100 * tol, 100 * tol, color="#cccccc", alpha=0.5)
    ax_err.axvline(0, color="black", lw=1)
    ax_err.set_yticks(range(len(rows)), names, fontsize=7)
    ax_err.invert_yaxis()
    ax_err.set(xlabel=f"error: predicted / {label.lower()} - 1 (%)",
               title=f"max |error| {100 * tab['max_abs_error']:.1f}% (band {tol:.0%})")
    fig.tight_layout()
    return fig
