"""The loss curves of a `fa4lab bench --training` record.

    from fa4lab.bench import load_records
    from fa4lab.viz.training import plot_training
    fig = plot_training(load_records(kinds=("training",))[-1])

Left: the training loss of fa4lab and SDPA (and the noise yardstick, SDPA one precision up)
at every step. Right: what the verdict compared, on a log scale: the windowed |loss_fa4lab -
loss_sdpa| against its tolerance, beside the raw per-step differences (Note [bf16 noise] in
`fa4lab.bench.training`).
"""

from __future__ import annotations

from collections.abc import Mapping

from fa4lab.bench.records import OK, training_results_of
from fa4lab.viz._live import subplots
from fa4lab.viz.bench import STYLE

CURVES = {"fa4lab": dict(color=STYLE["fa4lab"]["color"], lw=1.6, label="fa4lab"),
          "sdpa": dict(color=STYLE["sdpa-flash"]["color"], lw=1.2, ls="--", label="SDPA"),
          "sdpa-wide": dict(color="0.55", lw=0.9, ls=":",
                            label="SDPA one precision up (noise yardstick)")}


def plot_training(record: Mapping, *, title: str | None = None):
    """Loss against step for each attention of the record, and the verdict's comparison."""
    runs = {r.provider: r.losses for r in training_results_of(record) if r.status == OK}
    if "fa4lab" not in runs or "sdpa" not in runs:
        raise ValueError(f"the record has no fa4lab and SDPA curves to plot (runs: "
                         f"{sorted(runs)})")
    verdict = record.get("verdict", {})
    fig, (ax, bx) = subplots(1, 2, figsize=(11, 3.8))
    for name, losses in runs.items():
        ax.plot(range(len(losses)), losses, **CURVES.get(name, dict(label=name)))
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, frameon=False)
    sdpa, steps = runs["sdpa"], range(len(runs["sdpa"]))
    lines = {"|fa4lab - SDPA|": ([abs(a - b) for a, b in zip(runs["fa4lab"], sdpa)],
                                 dict(color=STYLE["fa4lab"]["color"], lw=0.6, alpha=0.35))}
    if "sdpa-wide" in runs:
        lines["|SDPA up - SDPA| (noise)"] = ([abs(a - b) for a, b in zip(runs["sdpa-wide"], sdpa)],
                                             dict(color="0.55", lw=0.6, alpha=0.5))
    if verdict.get("windowed_diff"):
        lines["|fa4lab - SDPA|, windowed"] = (verdict["windowed_diff"],
                                              dict(color=STYLE["fa4lab"]["color"], lw=1.6))
        lines["tolerance"] = (verdict["tolerance"], dict(color="k", lw=1.2, ls="--"))
    # equal curves differ by 0 at some steps: drawn at the floor of the log scale
    floor = min((y for ys, _ in lines.values() for y in ys if y), default=1e-8) / 4
    for label, (ys, style) in lines.items():
        shown = [(i, max(y, floor)) for i, y in zip(steps, ys) if y is not None]
        bx.plot([i for i, _ in shown], [y for _, y in shown], label=label, **style)
    bx.set_yscale("log")
    bx.set_ylim(bottom=floor)
    bx.set_xlabel("step")
    bx.set_ylabel("loss difference")
    bx.grid(alpha=0.3)
    bx.legend(fontsize=7, frameon=False)
    say = ("within" if verdict.get("within_noise") else "NOT within") + \
        f" {verdict.get('dtype', '')} noise"
    cfg = record.get("config", {})
    fig.suptitle(title or f"{cfg.get('layers')}-layer decoder, {cfg.get('dtype')}, "
                          f"{cfg.get('steps')} steps on {record.get('gpu')}: fa4lab {say}",
                 fontsize=10)
    fig.tight_layout()
    return fig
