"""Plan figures and widgets: they draw every supported plan, and an over-budget widget choice
shows the PlanError instead of a figure."""

from __future__ import annotations

import functools

import matplotlib.pyplot as plt
import pytest

from fa4lab.errors import PlanError
from fa4lab.plan import plan_forward
from fa4lab.plan.simulate import simulate
from fa4lab.spec import AttentionSpec
from fa4lab.viz import plan as vp


def spec(hd=128):
    return AttentionSpec(1, 2048, 2048, 8, 8, hd)


@functools.cache
def timeline(arch, hd):
    """(simulate(plan, 3, 2), its draw_timeline figure): simulated and drawn once for the
    tests that read it (test_figures_draw, test_the_timeline_says_what_its_colours_mean)."""
    sim = simulate(plan_forward(spec(hd), arch), 3, 2)
    return sim, vp.draw_timeline(sim)


@pytest.mark.parametrize("arch,hd", [("sm100", 64), ("sm100", 128), ("sm90", 128),
                                     ("sm90", 256)])
def test_figures_draw(arch, hd):
    p = plan_forward(spec(hd), arch)
    figs = [vp.draw_roles(p), vp.draw_barrier_graph(p, highlight=p.barriers.barriers[0].name),
            timeline(arch, hd)[1]]
    if arch == "sm100":
        figs.append(vp.draw_tmem(p))
    else:
        with pytest.raises(PlanError, match="no tensor memory"):
            vp.draw_tmem(p)
    for f in figs:
        assert f.axes
        plt.close(f)
    assert "softmax" in vp.role_table_html(p) or "consumer" in vp.role_table_html(p)


def test_tmem_map_labels_every_region():
    fig = vp.draw_tmem(plan_forward(spec(128), "sm100"))
    texts = " ".join(t.get_text() for t in fig.axes[0].texts)
    for name in ("S0", "S1", "P0", "P1", "O0", "O1"):
        assert name in texts
    plt.close(fig)


def test_tmem_widget_changes_and_shows_errors():
    live = vp.tmem_widget()
    assert "head_dim" in live.controls["head_dim"].description
    assert "n_block" in live.controls["n_block"].description
    first = live.image.value
    live.controls["n_block"].value = 64
    assert live.image.value and live.image.value != first
    live.controls["head_dim"].value = 256
    assert "fa4lab-error" in live.text.value and "TMEM" in live.text.value
    assert live.image.layout.display == "none"


def test_timeline_and_mutation_widgets():
    live = vp.timeline_widget(n_blocks=3)
    assert "no deadlock" in live.text.value
    live.controls["arch"].value = "sm90"
    assert "sm90" in live.text.value
    mut = vp.mutation_widget()
    assert "no deadlock" in mut.text.value
    mut.controls["drop"].value = "p_ready"
    assert "hazard" in mut.text.value
    mut.controls["drop"].value = "mma_turn0"   # an sm90 barrier on the sm100 plan
    assert "fa4lab-error" in mut.text.value


def test_phase_bits_flip_once_per_completion():
    sim = simulate(plan_forward(spec(128), "sm100"), 4, 2)
    fig = vp.draw_phase_bits(sim, ["kv_full"])
    lines = fig.axes[0].lines
    assert len(lines) == 3                                  # one per K/V ring stage
    for line, key in zip(lines, ["kv_full[0]", "kv_full[1]", "kv_full[2]"]):
        ys = line.get_ydata()
        flips = sum(1 for a, b in zip(ys, ys[1:]) if a != b)
        assert flips == len(sim.phase_times[key]) == sim.completions[key]
    plt.close(fig)


def test_the_figures_leave_the_backend_to_the_notebook():
    """fa4lab.viz builds Figures without pyplot and never sets a backend (a library that did
    would switch a notebook's inline backend); a fresh process shows it."""
    import os
    import subprocess
    import sys

    code = (
        "import sys, matplotlib\n"
        "from fa4lab.viz import plan, softmax, tiles, bench, figure_png\n"
        "from fa4lab.plan import plan_forward\n"
        "from fa4lab.spec import AttentionSpec\n"
        "png = figure_png(plan.draw_roles(plan_forward(AttentionSpec(1, 256, 256, 1, 1, 64),"
        " 'sm90')))\n"
        "assert png[:4] == b'\\x89PNG', png[:8]\n"
        "assert 'matplotlib.pyplot' not in sys.modules, 'fa4lab imported pyplot'\n"
        "assert dict.__getitem__(matplotlib.rcParams, 'backend') is "
        "matplotlib.rcsetup._auto_backend_sentinel, 'fa4lab chose a backend'\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


@pytest.mark.parametrize("arch", ["sm100", "sm90"])
def test_the_timeline_says_what_its_colours_mean(arch):
    """Notebook 04's timeline: a legend entry for each kind of bar it draws (the grey ones are
    waits on a barrier)."""
    sim, fig = timeline(arch, 128)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    kinds = {s.kind for s in sim.spans}
    assert ("wait" in kinds) == any("waiting on a barrier" in x for x in labels)
    assert ("mma" in kinds) == any(x.startswith("MMA") for x in labels)
    assert any("work or copy" in x for x in labels)
