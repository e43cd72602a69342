"""The backward's budget model (fa4lab.backward_budget): the bytes of each way to accumulate dQ,
the TMEM map of the sm100 backward, and the figure of lesson 10."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pytest

from fa4lab.backward_budget import (
    SCHEMES,
    backward_tmem,
    dq_costs,
    machine_balance,
    saved_bytes,
    step_bytes,
    step_flops,
    tmem_table_markdown,
)
from fa4lab.errors import PlanError
from fa4lab.hardware import B200, H200
from fa4lab.viz.backward import plot_dq_schemes

KIB = 1024


def test_what_the_forward_keeps_grows_linearly_and_p_quadratically():
    small, large = saved_bytes(1024), saved_bytes(4096)
    assert small == {"P": 2 * 1024 ** 2, "O": 1024 * 128 * 2, "LSE": 1024 * 4}
    assert large["P"] == 16 * small["P"] and large["O"] == 4 * small["O"]
    assert saved_bytes(8, 64, dtype="fp32") == {"P": 256, "O": 2048, "LSE": 32}


def test_one_step_at_head_dim_128_moves_what_the_lesson_says():
    b = step_bytes(128)
    assert b == {"q": 32 * KIB, "dout": 32 * KIB, "lse_d": 1 * KIB, "dq_partial": 64 * KIB,
                 "kv_reread": 64 * KIB}
    assert step_bytes(64)["dq_partial"] == 32 * KIB
    assert step_bytes(192, 128)["kv_reread"] == 128 * (192 + 128) * 2
    f = step_flops(128)
    assert set(f) == {"S", "dP", "dV", "dQ", "dK"} and sum(f.values()) == 5 * 2 * 128 ** 3


def test_costs_of_the_three_schemes():
    seqlen = 8192
    c = dq_costs(seqlen)
    assert tuple(c) == SCHEMES
    steps = 64 * 64
    assert all(x.steps == steps and x.base_steps == 64 for x in c.values())
    finish = seqlen * 128 * (4 + 4 + 2)
    assert c["atomic"].dq_bytes == steps * 64 * KIB + finish
    assert c["deterministic"].dq_bytes == c["atomic"].dq_bytes + steps * 8
    assert c["separate pass"].dq_bytes == (steps * 64 * KIB + seqlen * 256 * 2 + seqlen * 8
                                          + seqlen * 128 * 2)
    assert c["atomic"].pass_bytes == steps * 65 * KIB + 2 * seqlen * 256 * 2
    assert c["atomic"].relative_time == 1.0
    assert c["separate pass"].mma_ratio == pytest.approx(7 / 5)
    assert c["deterministic"].path_ratio == pytest.approx((64 + 64 - 1) / 64)
    assert c["deterministic"].mma_ratio == 1.0


def test_deterministic_path_grows_with_the_number_of_key_blocks():
    ratios = [dq_costs(s)["deterministic"].relative_time for s in (256, 1024, 8192, 65536)]
    assert ratios == sorted(ratios) and ratios[0] == pytest.approx(1.5) and ratios[-1] < 2


def test_machine_balance_reads_the_hardware_table():
    assert machine_balance() == pytest.approx(B200.peak_mma_tflops * 1e12 / B200.hbm_bytes_per_s)
    assert 250 < machine_balance() < 300 and machine_balance(H200) != machine_balance()


@pytest.mark.parametrize("head_dim,total", [(64, 384), (96, 448), (128, 512)])
def test_backward_tmem_fits_to_head_dim_128(head_dim, total):
    plan = backward_tmem(head_dim)
    assert plan.total_cols == total and plan.alloc_cols == 512
    assert (plan.lanes, plan.capacity_cols) == (B200.tmem_lanes, B200.tmem_columns)
    # the declared aliases: P over S, dS and dQ over dP; dQ over dS is the one reuse that
    # rests on the MMA thread's issue order (Note [the backward's TMEM])
    assert [(a.name, b.name) for a, b in plan.overlaps()] == [("dS", "dQ")]
    assert plan.region("dQ", 0).col_offset == plan.region("dP", 0).col_offset
    assert plan.region("dK", 0).col_end == total


@pytest.mark.parametrize("dims,need", [((256,), 768), ((192, 128), 576)])
def test_backward_tmem_refuses_what_does_not_fit(dims, need):
    with pytest.raises(PlanError, match=f"needs {need}"):
        backward_tmem(*dims)


def test_dq_must_fit_over_dp():
    """A head dim whose accumulators fit but whose dQ is wider than dP's 128 columns."""
    with pytest.raises(PlanError, match="does not fit over dP"):
        backward_tmem(160, 32)


def test_tmem_table_names_every_region_and_the_totals():
    table = tmem_table_markdown()
    for name in ("S", "P", "dV", "dP", "dS", "dK", "dQ"):
        assert f"| {name} |" in table
    assert "**384** (alloc 512)" in table and "**512** (alloc 512)" in table
    assert "| dQ | dQ = dS K (one step) | 128 queries | 192-255 (over dP) | 256-383 (over dP) |" \
        in table


def test_the_figure_says_it_is_a_model_and_stays_out_of_pyplot():
    before = plt.get_fignums()
    fig = plot_dq_schemes([1024, 4096, 16384], at_seqlen=4096)
    assert plt.get_fignums() == before
    left, right = fig.axes
    assert "MODEL" in left.get_title() and "MODEL" in right.get_title()
    labels = [t.get_text() for t in right.get_legend().get_texts()]
    assert labels == list(SCHEMES)
    det = [line for line in right.get_lines() if line.get_label() == "deterministic"][0]
    assert list(det.get_ydata()) == [dq_costs(s)["deterministic"].relative_time
                                     for s in (1024, 4096, 16384)]
    # the bars: one key block's walk at 4096 (32 steps), in MiB
    assert {t.get_text() for t in left.texts} == {f"{32 * (65 + 64) * KIB / 2 ** 20:.2f} MiB"}
