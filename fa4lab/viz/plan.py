"""Figures of a `Plan` and of its simulation: the TMEM map, the role table, the barrier graph,
the Gantt timeline by role, and the live widgets of notebooks 03 and 04.

    from fa4lab.plan import plan_forward
    from fa4lab.viz.plan import draw_tmem, draw_barrier_graph
    fig = draw_tmem(plan_forward(spec, "sm100"))

Every `draw_*` function returns a matplotlib Figure (matplotlib only; no graphviz). The
`*_widget` factories return `LiveFigure`s; a plan that does not fit raises PlanError inside the
render function, which the widget shows in red.
"""

from __future__ import annotations

import html

from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

from fa4lab.errors import PlanError
from fa4lab.limits import equal_head_dims
from fa4lab.plan.plan import ARCHS
from fa4lab.viz._live import LiveFigure, View, close, subplots

ROLE_COLORS = {
    "softmax0": "#1f77b4", "softmax1": "#17becf", "correction": "#9467bd", "mma": "#d62728",
    "load": "#2ca02c", "epilogue": "#ff7f0e", "empty": "#c7c7c7", "consumer0": "#1f77b4",
    "consumer1": "#17becf", "tensor": "#d62728", "tma": "#2ca02c", "tma_store": "#ff7f0e",
}
REGION_COLORS = {"S": "#aec7e8", "P": "#1f77b4", "O": "#ffbb78"}


def _role_color(name: str) -> str:
    return ROLE_COLORS.get(name, "#7f7f7f")


# ---- TMEM ----
def draw_tmem(plan, ax=None):
    """TMEM as 128 lanes x 512 columns: S_i, P_i (inside S_i's upper half), O_i, the unused
    columns and the tcgen05.alloc boundary."""
    tm = plan.tmem
    if tm is None:
        raise PlanError(f"{plan.arch} has no tensor memory: S, P and O live in the consumer "
                        f"warpgroups' registers (plan.tmem is None)")
    own = ax is None
    if own:
        fig, ax = subplots(figsize=(10, 3.2))
    else:
        fig = ax.figure
    lanes, cap = tm.lanes, tm.capacity_cols
    ax.add_patch(Rectangle((0, 0), cap, lanes, facecolor="#f4f4f4", edgecolor="#999999"))
    for r in tm.regions:
        if r.alias_of:
            continue
        ax.add_patch(Rectangle((r.col_offset, 0), r.columns, lanes,
                               facecolor=REGION_COLORS.get(r.name, "#dddddd"),
                               edgecolor="black", lw=1.0))
        aliased = any(a.alias_of == r.name and a.stage == r.stage for a in tm.regions)
        width = r.columns / 2 if aliased else r.columns   # label the part P does not cover
        ax.text(r.col_offset + width / 2, lanes / 2,
                f"{r.name}{r.stage}\n({r.dtype})\ncols {r.col_offset}-{r.col_end - 1}",
                ha="center", va="center", fontsize=8)
    for r in tm.regions:
        if not r.alias_of:
            continue
        # P covers every lane (row) but only its columns: two 16-bit values per column.
        ax.add_patch(Rectangle((r.col_offset, 0), r.columns, lanes,
                               facecolor=REGION_COLORS["P"], edgecolor="white", hatch="///",
                               alpha=0.75, lw=0.8))
        ax.text(r.col_offset + r.columns / 2, lanes / 2,
                f"{r.name}{r.stage} ({r.dtype},\n2 per column)\nover {r.alias_of}{r.stage}\n"
                f"cols {r.col_offset}-{r.col_end - 1}",
                ha="center", va="center", fontsize=7, color="white", weight="bold")
    if tm.total_cols < cap:
        ax.text((tm.total_cols + cap) / 2, lanes / 2, f"unused\n{cap - tm.total_cols} cols",
                ha="center", va="center", fontsize=8, color="#777777")
    ax.axvline(tm.alloc_cols, color="#d62728", ls="--", lw=1.2)
    ax.text(tm.alloc_cols, -2, f"tcgen05.alloc {tm.alloc_cols} ", color="#d62728", fontsize=8,
            ha="right", va="bottom")
    ax.set_xlim(0, cap)
    ax.set_ylim(lanes, -14)
    ax.set_xticks(range(0, cap + 1, 64))
    ax.set_yticks([0, 32, 64, 96, 128])
    ax.set_xlabel("TMEM column (32-bit)")
    ax.set_ylabel("lane = query row")
    t = plan.tiles
    ax.set_title(f"TMEM on {plan.hardware.name}: head_dim {t.head_dim}, n_block {t.n_block}, "
                 f"q_stage {t.q_stage}: {tm.total_cols}/{cap} columns", fontsize=10)
    if own:
        fig.tight_layout()
    return fig


def draw_tmem_budget(spec, n_blocks=(64, 128),
                     head_dims=((64, 64), (96, 96), (128, 128), (192, 128), (192, 192),
                                (256, 256)), q_stage=2):
    """Columns S + O need per (head_dim, head_dim_v), against the 512-column budget (P costs
    nothing; O's columns are head_dim_v's)."""
    from fa4lab.plan.sm100 import tmem_columns

    fig, ax = subplots(figsize=(8, 3))
    width = 0.8 / len(n_blocks)
    for k, nb in enumerate(n_blocks):
        need = [tmem_columns(q_stage, nb, dv) for _, dv in head_dims]
        xs = [i + k * width for i in range(len(head_dims))]
        bars = ax.bar(xs, need, width, label=f"n_block {nb}")
        for b, v in zip(bars, need):
            b.set_color("#d62728" if v > 512 else b.get_facecolor())
            ax.text(b.get_x() + b.get_width() / 2, v + 8, str(v), ha="center", fontsize=7)
    ax.axhline(512, color="black", ls="--", lw=1)
    ax.text(-0.45, 522, "512 columns per SM", fontsize=8, ha="left")
    ax.set_xticks([i + width * (len(n_blocks) - 1) / 2 for i in range(len(head_dims))],
                  [f"{d}" if d == dv else f"{d}/{dv}" for d, dv in head_dims])
    ax.set_xlabel("head_dim (/ head_dim_v when it differs)")
    ax.set_ylabel(f"TMEM columns (q_stage {q_stage})")
    ax.set_title(f"S + O for {q_stage} Q stage(s), P inside S: red does not fit", fontsize=10)
    ax.set_ylim(0, 900)
    ax.legend(fontsize=8, frameon=False, loc="upper center")
    fig.tight_layout()
    return fig


# ---- roles ----
def draw_roles(plan):
    """One column per warp, colored by role, height = registers per thread (setmaxnreg)."""
    fig, ax = subplots(figsize=(9, 3.2))
    warp_role = {w: r for r in plan.roles for w in r.warps}
    for w in sorted(warp_role):
        r = warp_role[w]
        ax.bar(w, r.registers, color=_role_color(r.name), edgecolor="black", lw=0.5)
    for r in plan.roles:
        mid = sum(r.warps) / len(r.warps)
        ax.text(mid, r.registers + 6, f"{r.name}\n{r.registers}", ha="center", fontsize=7)
    n = len(warp_role)
    ax.set_xticks(range(n))
    ax.set_xlabel("warp")
    ax.set_ylabel("registers / thread")
    ax.set_ylim(0, 290)
    for g in range(1, n // 4):
        ax.axvline(4 * g - 0.5, color="#999999", lw=0.8, ls=":")
    hw = plan.hardware
    ax.set_title(f"{plan.arch} roles: {plan.threads_per_cta} threads, {plan.registers_used}/"
                 f"{hw.registers_per_sm} registers (dotted lines: warpgroups)", fontsize=10)
    fig.tight_layout()
    return fig


def role_table_html(plan) -> str:
    rows = "".join(
        f"<tr><td style='color:{_role_color(r.name)}'><b>{html.escape(r.name)}</b></td>"
        f"<td>{','.join(map(str, r.warps))}</td><td>{r.registers}</td>"
        f"<td style='text-align:left'>{html.escape(r.does)}</td></tr>" for r in plan.roles)
    return ("<table><tr><th>role</th><th>warps</th><th>setmaxnreg</th><th>does</th></tr>"
            f"{rows}</table>")


# ---- barrier graph ----
def _node_positions(plan) -> dict[str, tuple[float, float]]:
    names = [r.name for r in plan.roles if not r.name.startswith("empty")]
    fixed = {"load": (0.0, 0.5), "mma": (1.3, 0.5), "softmax0": (2.6, 1.0),
             "softmax1": (2.6, 0.0), "correction": (3.9, 0.5), "epilogue": (5.2, 0.5),
             "consumer0": (1.6, 0.95), "consumer1": (1.6, 0.05)}
    pos = {}
    for i, n in enumerate(names):
        pos[n] = fixed.get(n, (i * 1.2, 0.5))
    return pos


def draw_barrier_graph(plan, highlight: str | None = None):
    """Roles as nodes, barriers as arrows producer -> consumer (one per role pair). Left: the
    data pipeline (and sm90's named-barrier ping-pong, dashed); right: the softmax ->
    correction statistics mailbox. `highlight` draws that barrier in red (a removed edge)."""
    bars = plan.barriers.barriers
    mailbox = [b for b in bars if b.group == "mailbox"]
    main = [b for b in bars if b.group != "mailbox"]
    ncols = 2 if mailbox else 1
    fig, axes = subplots(1, ncols, figsize=(12 if mailbox else 8, 4.2),
                             gridspec_kw={"width_ratios": [3, 1.4]} if mailbox else None)
    axes = list(axes) if mailbox else [axes]
    pos = _node_positions(plan)
    _draw_graph(axes[0], plan, main, pos, highlight,
                f"{plan.arch} barrier graph: {plan.barriers.mbarrier_count} mbarriers")
    if mailbox:
        sub = {n: p for n, p in pos.items() if n.startswith("softmax") or n == "correction"}
        sub = {n: ((0.0, p[1]) if n.startswith("softmax") else (1.4, 0.5))
               for n, p in sub.items()}
        _draw_graph(axes[1], plan, mailbox, sub, highlight,
                    "statistics mailbox (SMEM 'stats')")
    fig.tight_layout()
    return fig


def _draw_graph(ax, plan, barriers, pos, highlight, title):
    for name, (x, y) in pos.items():
        ax.text(x, y, name, ha="center", va="center", fontsize=9, color="white", weight="bold",
                bbox=dict(boxstyle="round,pad=0.4", fc=_role_color(name), ec="black", lw=0.6),
                zorder=3)
    pairs: dict[tuple[str, str], list] = {}
    for b in barriers:
        for stage_i, p in enumerate(b.producers):
            for stage_j, c in enumerate(b.consumers):
                if b.per_role_stage and len(b.producers) > 1 and len(b.consumers) > 1 \
                        and stage_i != stage_j:
                    continue
                if p in pos and c in pos:
                    pairs.setdefault((p, c), []).append(b)
    for (p, c), bs in pairs.items():
        (x0, y0), (x1, y1) = pos[p], pos[c]
        # One arrow per role pair carrying every barrier's name; a highlighted (removed)
        # barrier gets its own red dashed arrow.
        groups = [[b for b in bs if b.name != highlight]] + [[b] for b in bs
                                                             if b.name == highlight]
        for k, group in enumerate(g for g in groups if g):
            red = group[0].name == highlight
            named = all(b.kind == "named" for b in group)
            rad = (0.5 if named else 0.12) + 0.16 * k
            ax.add_patch(FancyArrowPatch(
                (x0, y0), (x1, y1), connectionstyle=f"arc3,rad={rad}", arrowstyle="-|>",
                mutation_scale=12, lw=2.2 if red else 1.1, shrinkA=18, shrinkB=18,
                color="#d62728" if red else ("#8c564b" if named else "#555555"),
                ls="--" if (named or red) else "-", zorder=2))
            # The midpoint of matplotlib's arc3 curve: half the control-point offset.
            lx = (x0 + x1) / 2 + 0.5 * rad * (y1 - y0)
            ly = (y0 + y1) / 2 - 0.5 * rad * (x1 - x0)
            label = "\n".join(b.name + (f" x{b.stages}" if b.stages > 1 else "") for b in group)
            ax.text(lx, ly, label, fontsize=7, ha="center", va="center",
                    color="#d62728" if red else "black",
                    bbox=dict(fc="white", ec="none", alpha=0.8, pad=0.5), zorder=4)
    xs = [p[0] for p in pos.values()]
    ys = [p[1] for p in pos.values()]
    ax.set_xlim(min(xs) - 0.6, max(xs) + 0.6)
    ax.set_ylim(min(ys) - 0.35, max(ys) + 0.35)
    ax.set_axis_off()
    ax.set_title(title, fontsize=10)


# ---- timeline ----
LANE_ORDER = ["load", "tma", "mma", "tensor", "softmax0", "softmax1", "consumer0", "consumer1",
              "correction", "epilogue", "tma_store"]
KIND_STYLE = {"work": 0.62, "mma": 0.62, "copy": 0.62, "wait": 0.22}


def draw_timeline(sim, ax=None, max_cycles: float | None = None, title: str | None = None):
    """Gantt chart by role and engine; MMAs red, waits thin and grey, hazards as red lines."""
    own = ax is None
    if own:
        fig, ax = subplots(figsize=(11, 0.42 * max(4, len(sim.lanes())) + 1.2))
    else:
        fig = ax.figure
    lanes = sorted(sim.lanes(), key=lambda n: LANE_ORDER.index(n) if n in LANE_ORDER else 99)
    for s in sim.spans:
        y = lanes.index(s.lane)
        color = {"wait": "#dddddd", "mma": ROLE_COLORS["tensor"]}.get(s.kind,
                                                                       _role_color(s.lane))
        ax.barh(y, s.end - s.start, left=s.start, height=KIND_STYLE[s.kind], color=color,
                edgecolor="white" if s.kind != "wait" else "none", lw=0.3)
    for h in sim.hazards:
        ax.axvline(h.time, color="#d62728", lw=0.8, alpha=0.6)
    # What the colours mean: one entry per kind of span drawn, and the hazards.
    kinds = {s.kind for s in sim.spans}
    work_lane = next((s.lane for s in sim.spans if s.kind in ("work", "copy")), None)
    handles = []
    if "mma" in kinds:
        handles.append(Patch(color=ROLE_COLORS["tensor"], label="MMA (tensor cores)"))
    if work_lane is not None:
        handles.append(Patch(color=_role_color(work_lane),
                             label="work or copy (the lane's role colour)"))
    if "wait" in kinds:
        handles.append(Patch(color="#dddddd", label="waiting on a barrier (thin, grey)"))
    if sim.hazards:
        handles.append(Line2D([], [], color="#d62728", label=f"{len(sim.hazards)} hazard(s)"))
    if handles:
        ax.legend(handles=handles, loc="lower right", fontsize=7, framealpha=0.85)
    ax.set_yticks(range(len(lanes)), lanes, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max_cycles or max(sim.cycles, 1))
    ax.set_xlabel("cycles (simulated)")
    status = "DEADLOCK" if sim.deadlock else (f"{len(sim.hazards)} hazard(s)" if sim.hazards
                                              else "no deadlock, no hazard")
    ax.set_title(title or f"{sim.arch}: {sim.n_tiles} tile(s) x {sim.n_blocks} K/V blocks, "
                          f"{sim.cycles:.0f} cycles; {status}", fontsize=10)
    if own:
        fig.tight_layout()
    return fig


def draw_phase_bits(sim, names=("kv_full", "kv_empty"), max_cycles: float | None = None):
    """The phase bit of each stage of the named barriers over simulated time: it flips at every
    completed phase; a waiter for its k-th use of a stage waits for parity k % 2 to complete."""
    rows = [(k, v) for n in names for k, v in sim.phase_times.items() if k.startswith(n + "[")]
    fig, ax = subplots(figsize=(11, 0.5 * max(3, len(rows)) + 1))
    end = max_cycles or sim.cycles
    for y, (_, times) in enumerate(rows):
        xs, bits, bit, t0 = [], [], 0, 0.0
        for t in times + [end]:
            xs += [t0, t]
            bits += [bit, bit]
            bit, t0 = 1 - bit, t
        # The y axis is inverted (first row on top): bit 1 is drawn up.
        ax.plot(xs, [y + 0.3 - 0.6 * b for b in bits], color="#1f77b4", lw=1.2)
        for k, t in enumerate(times):
            ax.text(t, y + 0.47, str(k), fontsize=6, ha="center", color="#555555")
    ax.set_yticks(range(len(rows)), [k for k, _ in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, end)
    ax.set_xlabel("cycles (simulated); each step = one completed phase (its index above)")
    ax.set_title("mbarrier phase bits: low while a phase of parity 0 is pending, high for parity 1",
                 fontsize=10)
    fig.tight_layout()
    return fig


def sim_summary_html(sim) -> str:
    lines = [html.escape(sim.summary().splitlines()[0])]
    if sim.deadlock:
        lines += ["<b style='color:#b00020'>deadlock</b>: "
                  + html.escape("; ".join(sim.deadlock[:4]))]
    for h in sim.hazards[:4]:
        lines.append(f"<span style='color:#b00020'>hazard</span>: {html.escape(str(h))}")
    if sim.ok:
        busy = ", ".join(f"{k} {v:.0%}" for k, v in sim.busy().items())
        lines.append(f"<b>no deadlock, no hazard</b>; busy: {html.escape(busy)}")
    return "<br>".join(lines)


# ---- widgets (notebooks 03 and 04) ----
def _spec(head_dim: int = 128, causal: bool = False):
    from fa4lab.spec import AttentionSpec

    return AttentionSpec(1, 4096, 4096, 16, 16, head_dim, causal=causal)


def _tmem_view(head_dim, n_block, q_stage):
    from fa4lab.plan import plan_forward

    plan = plan_forward(_spec(head_dim), "sm100", n_block=n_block, q_stage=q_stage)
    tm = plan.tmem
    n_s = sum(r.name == "S" for r in tm.regions)
    text = (f"S {n_s}x{n_block} + O {q_stage}x{head_dim} = {tm.total_cols} of "
            f"{tm.capacity_cols} columns (alloc {tm.alloc_cols}); each P reuses its S's upper "
            f"{n_block // 2} columns; SMEM {plan.smem.total_bytes} of "
            f"{plan.smem.limit_bytes} bytes")
    return View(draw_tmem(plan), text)


def tmem_widget(*, head_dim=128, n_block=128, q_stage=2) -> LiveFigure:
    """head_dim, n_block and q_stage for the sm100 TMEM map; a plan that does not fit shows its
    PlanError in red."""
    import ipywidgets as w

    style = {"description_width": "initial"}
    controls = {
        "head_dim": w.Dropdown(options=list(equal_head_dims()), value=head_dim,
                               description="head_dim",
                               style=style),
        "n_block": w.Dropdown(options=[32, 64, 96, 128, 160, 192, 256], value=n_block,
                              description="n_block", style=style),
        "q_stage": w.Dropdown(options=[1, 2], value=q_stage, description="q_stage", style=style),
    }
    return LiveFigure(controls, _tmem_view, title="TMEM map (sm100)")


def _timeline_view(arch, head_dim, kv_stage, n_blocks, l2_bytes_per_cycle, tma_latency,
                   rescale_fraction):
    from fa4lab.plan import plan_forward
    from fa4lab.plan.calibration import costs_for
    from fa4lab.plan.simulate import simulate

    plan = plan_forward(_spec(head_dim), arch, kv_stage=kv_stage)
    costs = costs_for(plan.hardware).with_(l2_bytes_per_cycle=float(l2_bytes_per_cycle),
                                tma_latency=int(tma_latency),
                                rescale_fraction=float(rescale_fraction))
    sim = simulate(plan, n_blocks, 2, costs)
    return View(draw_timeline(sim), sim_summary_html(sim))


def timeline_widget(*, arch="sm100", head_dim=128, kv_stage=3, n_blocks=6,
                    l2_bytes_per_cycle=64, tma_latency=700, rescale_fraction=0.125) -> LiveFigure:
    """The simulated timeline (Gantt by role): stages and the cost model's assumptions."""
    import ipywidgets as w

    style = {"description_width": "initial"}
    controls = {
        "arch": w.Dropdown(options=list(ARCHS), value=arch, description="arch", style=style),
        "head_dim": w.Dropdown(options=list(equal_head_dims()), value=head_dim,
                               description="head_dim",
                               style=style),
        "kv_stage": w.Dropdown(options=[2, 3, 4], value=kv_stage, description="kv_stage",
                               style=style),
        "n_blocks": w.IntSlider(n_blocks, min=1, max=12, description="K/V blocks per tile",
                                style=style),
        "l2_bytes_per_cycle": w.Dropdown(options=[16, 32, 64, 128, 256],
                                         value=l2_bytes_per_cycle,
                                         description="L2 bytes/cycle/SM", style=style),
        "tma_latency": w.IntSlider(tma_latency, min=0, max=2000, step=100,
                                   description="TMA latency (cycles)", style=style),
        "rescale_fraction": w.FloatSlider(rescale_fraction, min=0.0, max=1.0, step=0.125,
                                          description="rescale fraction", style=style),
    }
    return LiveFigure(controls, _timeline_view, title="Simulated timeline by role")


NO_MUTATION = "(none)"


def _mutation_view(arch, drop, mutation):
    from fa4lab.plan import plan_forward
    from fa4lab.plan.simulate import simulate

    plan = plan_forward(_spec(128), arch)
    names = [b.name for b in plan.barriers.barriers]
    if drop != NO_MUTATION and drop not in names:
        raise ValueError(f"{arch} has no barrier {drop!r}; its barriers: {', '.join(names)}")
    sim = simulate(plan, 4, 2, drop=None if drop == NO_MUTATION else drop, mutation=mutation)
    g = draw_barrier_graph(plan, highlight=None if drop == NO_MUTATION else drop)
    t = draw_timeline(sim)
    return View(_stack(g, t), sim_summary_html(sim))


def _stack(*figs):
    """Stack figures vertically into one image (each keeps its own layout)."""
    import io

    import matplotlib.image as mpimg

    images = []
    for f in figs:
        buf = io.BytesIO()
        f.savefig(buf, format="png", dpi=80, bbox_inches="tight")
        close(f)
        buf.seek(0)
        images.append(mpimg.imread(buf))
    width = max(im.shape[1] for im in images)
    height = sum(im.shape[0] for im in images)
    fig = Figure(figsize=(width / 80, height / 80), dpi=80)
    y = 1.0
    for im in images:
        h = im.shape[0] / height
        ax = fig.add_axes([0, y - h, im.shape[1] / width, h])
        ax.imshow(im)
        ax.set_axis_off()
        y -= h
    return fig


def mutation_widget(*, arch="sm100", drop=NO_MUTATION, mutation="drop") -> LiveFigure:
    """Remove one barrier edge and watch the hazard (or deadlock) appear."""
    import ipywidgets as w

    from fa4lab.plan import plan_forward

    names = sorted({b.name for a in ARCHS
                    for b in plan_forward(_spec(128), a).barriers.barriers})
    style = {"description_width": "initial"}
    controls = {
        "arch": w.Dropdown(options=list(ARCHS), value=arch, description="arch", style=style),
        "drop": w.Dropdown(options=[NO_MUTATION] + names, value=drop,
                           description="remove barrier", style=style),
        "mutation": w.Dropdown(options=[("waits and arrivals", "drop"),
                                        ("arrivals only", "drop_arrive")], value=mutation,
                               description="remove", style=style),
    }
    return LiveFigure(controls, _mutation_view, title="Mutation check: remove one edge")
