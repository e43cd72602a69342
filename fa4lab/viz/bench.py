"""Throughput figures for `fa4lab bench` records (and lists of `fa4lab.bench.Result`).

    from fa4lab.bench import load_records
    from fa4lab.viz.bench import plot_throughput
    fig = plot_throughput(load_records()[-1])

Every function returns a matplotlib Figure. A provider that was not measured (missing, failed
its check, raised) is named in the legend with its status instead of silently vanishing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from fa4lab.bench.records import OK, Result, results_of
from fa4lab.bench.sweep import OURS, PROVIDER_LABELS
from fa4lab.bench.table import providers_in
from fa4lab.viz._live import subplots

STYLE = {
    OURS: dict(color="#d62728", marker="o", lw=2.2),
    "fa4": dict(color="#1f77b4", marker="s", lw=1.6),
    "sdpa-cudnn": dict(color="#2ca02c", marker="^", lw=1.6),
    "sdpa-flash": dict(color="#9467bd", marker="v", lw=1.6),
}


def _results_and_meta(data) -> tuple[list[Result], dict]:
    if isinstance(data, Mapping):
        return results_of(data), dict(data)
    return list(data), {}


def _legend_label(provider: str, results: Sequence[Result]) -> str:
    label = PROVIDER_LABELS.get(provider, provider)
    mine = [r for r in results if r.provider == provider]
    if mine and not any(r.status == OK for r in mine):
        return f"{label} ({mine[0].status})"
    return label


def plot_throughput(data, *, gemm_tflops: float | None = None, title: str | None = None,
                    predicted: Mapping[tuple[int, bool, int], float] | None = None,
                    predicted_label: str = "fa4lab sm90 plan, simulated"):
    """TFLOP/s against seqlen, one panel per (head_dim, causal), one line per provider.

    data: a bench record (dict) or a sequence of Result. gemm_tflops (default: the record's)
    is drawn as the dense-GEMM ceiling. predicted: {(head_dim, causal, seqlen): TFLOP/s} from
    the planner's simulation, drawn dotted and labelled as simulated.
    """
    results, meta = _results_and_meta(data)
    if not results:
        raise ValueError("no results to plot: run `fa4lab bench` on a GPU or load a record "
                         "from benchmarks/")
    gemm = gemm_tflops if gemm_tflops is not None else meta.get("gemm_tflops")
    head_dims = sorted({r.head_dim for r in results})
    causals = sorted({r.causal for r in results})
    seqlens = sorted({r.seqlen for r in results} | {k[2] for k in (predicted or {})})
    fig, axes = subplots(len(head_dims), len(causals), squeeze=False, sharex=True,
                             figsize=(4.6 * len(causals), 2.9 * len(head_dims) + 0.6))
    provs = providers_in(results)
    top = max([r.tflops for r in results if r.status == OK and r.tflops] + [gemm or 0, 1])
    if predicted:
        top = max([top] + list(predicted.values()))
    for i, d in enumerate(head_dims):
        for j, c in enumerate(causals):
            ax = axes[i][j]
            for p in provs:
                pts = sorted((r.seqlen, r.tflops) for r in results
                             if r.provider == p and r.head_dim == d and r.causal == c
                             and r.status == OK)
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, label=_legend_label(p, results), ms=5,
                            **STYLE.get(p, dict(marker=".")))
                elif i == 0 and j == 0:
                    # keep the legend honest: a provider with no point still gets an entry
                    ax.plot([], [], label=_legend_label(p, results), **STYLE.get(p, {}))
            if predicted:
                pts = sorted((s, t) for (hd, cz, s), t in predicted.items() if hd == d and cz == c)
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, ls=":", color=STYLE[OURS]["color"], marker="x",
                            label=predicted_label)
            if gemm:
                ax.axhline(gemm, color="0.4", ls="--", lw=1,
                           label=f"dense bf16 GEMM ({gemm:.0f})")
            ax.set_xscale("log", base=2)
            ax.set_xticks(seqlens, [f"{x // 1024}k" if x >= 1024 else str(x) for x in seqlens])
            ax.minorticks_off()
            ax.set_ylim(0, top * 1.12)
            ax.set_title(f"head_dim {d}, {'causal' if c else 'not causal'}", fontsize=10)
            ax.grid(alpha=0.3)
            if j == 0:
                ax.set_ylabel("TFLOP/s")
            if i == len(head_dims) - 1:
                ax.set_xlabel("seqlen (batch = total tokens / seqlen)")
    handles, labels = {}, []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in handles:
                handles[lab] = h
                labels.append(lab)
    fig.legend([handles[x] for x in labels], labels, loc="lower center",
               ncol=min(3, len(labels)), fontsize=8, frameon=False)
    where = meta.get("gpu", "")
    when = meta.get("date", "")
    fig.suptitle(title or (f"forward attention, {where} {when}".strip() if meta else
                           "forward attention throughput"), fontsize=11)
    rows = (len(labels) + 2) // 3
    inches = 0.25 + 0.18 * rows
    fig.tight_layout(rect=(0, inches / fig.get_figheight(), 1, 0.97))
    return fig


def plot_sources(record: Mapping | None, published: Mapping, *, head_dim: int = 128,
                 causal: bool = False):
    """Where each number comes from: the published FA4 B200 peak (labelled published, never
    measured here) beside the best measured value per provider in `record` for one
    (head_dim, causal), and the GEMM ceiling of the same run."""
    fig, ax = subplots(figsize=(7.5, 3.2))
    names, values, colors = [], [], []
    names.append(f"FA4 on B200\n(published: {published.get('source', '?').split(',')[0]})")
    values.append(float(published["peak_bf16_tflops"]))
    colors.append("#bbbbbb")
    if record:
        results = results_of(record)
        for p in providers_in(results):
            ok = [r.tflops for r in results if r.provider == p and r.status == OK
                  and r.head_dim == head_dim and r.causal == causal]
            if ok:
                names.append(f"{PROVIDER_LABELS.get(p, p)}\n(measured, {record['gpu']})")
                values.append(max(ok))
                colors.append(STYLE.get(p, {}).get("color", "#444444"))
        if record.get("gemm_tflops"):
            names.append(f"bf16 GEMM 8192^3\n(measured, {record['gpu']})")
            values.append(float(record["gemm_tflops"]))
            colors.append("#555555")
    bars = ax.barh(range(len(values)), values, color=colors)
    for b, v in zip(bars, values):
        ax.text(v, b.get_y() + b.get_height() / 2, f" {v:.0f}", va="center", fontsize=8)
    ax.set_yticks(range(len(values)), names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("TFLOP/s (bf16 forward; best over seqlen)")
    ax.set_xlim(0, max(values) * 1.15)
    date = f", {record['date']}" if record else ""
    ax.set_title(f"published vs measured here (head_dim {head_dim}, "
                 f"{'causal' if causal else 'not causal'}{date})", fontsize=10)
    fig.tight_layout()
    return fig


def plot_plan_prediction(sim, predicted_tflops: float, *, recorded: Mapping[str, float] | None
                         = None, gemm_tflops: float | None = None, measured: Mapping[str, float]
                         | None = None, title: str = ""):
    """Left: the simulated timeline of one work tile (`fa4lab.plan.simulate.simulate`, drawn by
    `fa4lab.viz.plan.draw_timeline`). Right: the planner's predicted TFLOP/s beside recorded
    (or, on a GPU, just measured) numbers for the same shape, each bar labelled with where it
    comes from."""
    from fa4lab.viz.plan import draw_timeline

    fig, (ax, bx) = subplots(1, 2, figsize=(11, 3.4), gridspec_kw={"width_ratios": [3, 2]})
    draw_timeline(sim, ax=ax, title=f"one simulated tile: {sim.n_blocks} K/V blocks, "
                                    f"{sim.cycles:.0f} cycles")
    names, values, colors, hatches = [f"{OURS}\n(simulated)"], [predicted_tflops], \
        [STYLE[OURS]["color"]], ["//"]
    for source, data in (("measured now", measured), ("recorded", recorded)):
        for p, v in (data or {}).items():
            names.append(f"{PROVIDER_LABELS.get(p, p)}\n({source})")
            values.append(v)
            colors.append(STYLE.get(p, {}).get("color", "#555555"))
            hatches.append("")
    bars = bx.barh(range(len(values)), values, color=colors)
    for b, h, v in zip(bars, hatches, values):
        b.set_hatch(h)
        if h:
            b.set_alpha(0.55)
        bx.text(v, b.get_y() + b.get_height() / 2, f" {v:.0f}", va="center", fontsize=8)
    if gemm_tflops:
        bx.axvline(gemm_tflops, color="0.4", ls="--", lw=1)
        bx.text(gemm_tflops, len(values) - 0.4, f" GEMM {gemm_tflops:.0f}", fontsize=7,
                color="0.3")
    bx.set_yticks(range(len(values)), names, fontsize=7)
    bx.invert_yaxis()
    bx.set_xlim(0, max(values + [gemm_tflops or 0]) * 1.2)
    bx.set_xlabel("TFLOP/s")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


FEATURE_STYLE = {OURS: "#d62728", "fa4": "#1f77b4", "sdpa": "#2ca02c", "flex": "#ff7f0e"}


def plot_features(data, *, title: str | None = None):
    """`fa4lab bench --features`: TFLOP/s (visible pairs only) per feature, one bar per
    provider (fa4lab, FA4, SDPA, Flex), grouped by feature. A provider not measured on a
    feature gets its status written where its bar would be, never a silent gap.

    data: a "features" record (dict) or a sequence of `fa4lab.bench.FeatureResult`."""
    from fa4lab.bench.features import FEATURE_LABELS, FEATURE_NAMES, FEATURE_PROVIDERS
    from fa4lab.bench.records import feature_results_of

    results = feature_results_of(data) if isinstance(data, Mapping) else list(data)
    meta = dict(data) if isinstance(data, Mapping) else {}
    if not results:
        raise ValueError("no results to plot: run `fa4lab bench --features` on a GPU or load a "
                         "features record from benchmarks/")
    order = {n: i for i, n in enumerate(FEATURE_NAMES)}
    features = sorted({r.feature for r in results}, key=lambda n: order.get(n, len(order)))
    provs = [p for p in FEATURE_PROVIDERS if any(r.provider == p for r in results)]
    cell = {(r.feature, r.provider): r for r in results}
    top = max([r.tflops for r in results if r.status == OK and r.tflops] + [1])
    width = 0.8 / max(1, len(provs))
    fig, ax = subplots(figsize=(max(7.0, 0.95 * len(features) + 2), 3.8))
    for j, p in enumerate(provs):
        xs = [i + (j - (len(provs) - 1) / 2) * width for i in range(len(features))]
        for x, f in zip(xs, features):
            r = cell.get((f, p))
            if r is not None and r.status == OK:
                ax.bar(x, r.tflops, width, color=FEATURE_STYLE.get(p, "#777777"))
            elif r is not None:
                ax.text(x, top * 0.02, r.status, rotation=90, ha="center", va="bottom",
                        fontsize=6, color="0.4")
        ax.bar([], [], color=FEATURE_STYLE.get(p, "#777777"),
               label=FEATURE_LABELS.get(p, PROVIDER_LABELS.get(p, p)))
    ax.set_xticks(range(len(features)), features, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("TFLOP/s (visible pairs)")
    ax.set_ylim(0, top * 1.15)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, frameon=False, loc="upper right")
    shape = meta.get("config", {}).get("shape", {})
    where = f", {meta['gpu']} {meta.get('date', '')}" if meta.get("gpu") else ""
    at = f"hd{shape['head_dim']} s{shape['seqlen']}" if shape else "attention features"
    ax.set_title(title or f"forward attention by feature, {at}{where}".strip(), fontsize=10)
    fig.tight_layout()
    return fig
