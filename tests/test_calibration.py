"""The calibrated cost model (fa4lab.plan.calibration; the record read by
fa4lab.bench.calibration): the stored constants against the record they were fitted to, the
stored tables, the refit, the B200 comparison, and the neighbour-plan rank correlation
(fa4lab.bench.neighbours) on synthetic records."""

from __future__ import annotations

import random

import pytest

from fa4lab.bench import calibration as bcal
from fa4lab.bench import records
from fa4lab.bench.neighbours import (
    MIN_NEIGHBOURS,
    make_neighbours_record,
    neighbour_overrides,
    rank_correlation,
    spearman,
)
from fa4lab.bench.records import NeighbourResult
from fa4lab.hardware import B200, H200, PUBLISHED_FA4_B200_FORWARD
from fa4lab.plan import calibration as cal
from fa4lab.plan import plan_forward
from fa4lab.plan.costs import DEFAULT_COSTS


# ---- the stored constants and tables ----
def test_the_planner_predicts_with_the_calibrated_model_by_default():
    from fa4lab.plan.throughput import predict

    p = bcal.h200_points()[0]
    plan = plan_forward(p.spec, "sm90")
    assert cal.costs_for(H200) is cal.costs_for("sm90") is cal.H200_COSTS
    assert cal.costs_for(B200) is cal.B200_COSTS
    assert predict(plan).tflops == predict(plan, cal.H200_COSTS).tflops
    assert predict(plan).tflops != predict(plan, DEFAULT_COSTS).tflops


def test_h200_points_are_the_record_as_it_is():
    """Each point is the record's row of the kernel the plan ships for the shape: persistent
    CTAs where the sm90 plan is persistent (non-causal, hd64-128), else one CTA per tile."""
    rec = bcal.h200_record()
    assert rec["commit"] == "5db14f9" and rec["date"] == "2026-12-01"
    pts = bcal.h200_points(rec)
    got = {p.key: p.tflops for p in pts}
    rows = {(r.provider, r.key): r.tflops for r in records.results_of(rec)
            if r.status == records.OK and r.seqlen >= cal.MIN_SEQLEN}
    want = {}
    for (provider, key), tflops in rows.items():
        if provider == cal.PROVIDER:
            d, causal, _ = key
            persistent = not causal and d != 256   # Note [sm90 persistent CTAs]
            want[key] = rows[(cal.PERSISTENT_PROVIDER, key)] if persistent else tflops
    assert got == want and len(got) == 24
    assert all(p.label == "MEASURED" for p in pts)


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_stored_constants_reproduce_the_stored_table(arch):
    """benchmarks/calibration/*.json state each point's prediction and error; the stored
    constants, run through today's model, give the same (and the table's constants are them)."""
    stored = cal.load_table(arch)
    now = bcal.table(arch)
    assert stored["constants"] == pytest.approx(now["constants"])
    assert len(stored["points"]) == len(now["points"])
    for a, b in zip(stored["points"], now["points"], strict=True):
        assert (a["head_dim"], a["causal"], a["seqlen"]) == (b["head_dim"], b["causal"],
                                                              b["seqlen"])
        assert a["figure_tflops"] == b["figure_tflops"]
        assert a["predicted_tflops"] == pytest.approx(b["predicted_tflops"], abs=0.2), a
        assert a["error"] == pytest.approx(b["error"], abs=5e-4), a
    assert stored["max_abs_error"] == pytest.approx(now["max_abs_error"], abs=5e-4)


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_every_point_within_its_tolerance(arch):
    tab = bcal.table(arch)
    tol = cal.TOLERANCE[arch]
    bad = [r for r in tab["points"] if abs(r["error"]) > tol]
    assert not bad, f"{arch}: outside {tol:.0%}: {bad}"
    assert tab["misses"] == []


def test_fitted_constants_inside_their_bounds():
    bounds = bcal.fit_bounds()
    for name, (lo, hi) in bounds.items():
        assert lo <= getattr(cal.H200_COSTS, name) <= hi, name
    # mma_efficiency never below what the record's own GEMM sustained.
    assert bounds["mma_efficiency"][0] == cal.measured_mma_efficiency(bcal.h200_record())


def test_b200_keeps_the_h200_fit():
    """Note [calibration]: the published figures fit no free constant; the B200 keeps the
    H200's except its own softmax counts (the defaults: hand counts)."""
    for name in bcal.fit_bounds():
        want = DEFAULT_COSTS if name in cal.B200_OWN else cal.H200_COSTS
        assert getattr(cal.B200_COSTS, name) == getattr(want, name), name


def test_b200_points_are_published_and_labelled():
    pts = cal.b200_points()
    assert len(pts) == len(PUBLISHED_FA4_B200_FORWARD) >= 1
    tab = bcal.table("sm100")
    assert tab["figures"] == "PUBLISHED"
    assert all(r["label"] == "PUBLISHED" and "arXiv 2603.05451" in r["source"]
               for r in tab["points"])


def test_misses_name_the_assumption():
    rows = [{"head_dim": 128, "causal": True, "seqlen": 8192, "error": 0.2,
             "within_tolerance": False},
            {"head_dim": 64, "causal": False, "seqlen": 8192, "error": -0.01,
             "within_tolerance": True}]
    (miss,) = cal.b200_misses(rows)
    assert "over-predicts by 20%" in miss and "mma_efficiency" in miss


@pytest.mark.slow
def test_refit_lands_on_the_stored_constants():
    """`fit_h200` from the uncalibrated defaults finds the stored constants (each within a
    tenth of its allowed range) and errors no worse than the stored ones."""
    refit = bcal.fit_h200()
    for name, (lo, hi) in bcal.fit_bounds().items():
        assert getattr(refit, name) == pytest.approx(getattr(cal.H200_COSTS, name),
                                                      abs=(hi - lo) / 10), name
    assert bcal.table("sm90", refit)["max_abs_error"] <= cal.TOLERANCE["sm90"]


def test_fit_recovers_a_known_model():
    """A model's own predictions as the 'measurements': the fit, started elsewhere, moves back
    to within the fit's resolution of the constants that made them."""
    truth = cal.H200_COSTS.with_(barrier_latency=90, sm90_softmax_stall=0.3)
    pts = [p for p in bcal.h200_points() if p.head_dim == 128 and p.seqlen in (2048, 8192)]
    made = cal.predictions(pts, "sm90", truth)
    fake = [cal.Point(p.head_dim, p.causal, p.seqlen, p.batch, p.heads, t, "MEASURED", "model")
            for p, t in zip(pts, made, strict=True)]
    bounds = {k: bcal.fit_bounds()[k] for k in ("barrier_latency", "sm90_softmax_stall")}
    got = cal.fit(fake, "sm90", truth.with_(barrier_latency=30, sm90_softmax_stall=0.6),
                  bounds=bounds, rounds=3)
    errs = cal.errors(fake, cal.predictions(fake, "sm90", got))
    assert max(abs(e) for e in errs) < 0.01


def test_calibration_plot_draws_the_stored_tables():
    from fa4lab.viz.calibration import plot_calibration

    for arch in ("sm90", "sm100"):
        fig = plot_calibration(cal.load_table(arch))
        ax, ax_err = fig.axes[:2]
        assert "predicted" in ax.get_ylabel()
        assert len(ax_err.patches) >= len(cal.load_table(arch)["points"])


# ---- neighbouring plans and the rank correlation ----
def _spec(causal=False):
    return cal.Point(128, causal, 8192, 2, 16, 0.0, "MEASURED", "").spec


def test_at_least_eight_neighbours_plan_and_the_shipped_plan_comes_first():
    spec = _spec()
    ovs = neighbour_overrides(spec, "sm90")
    t = plan_forward(spec, "sm90").tiles
    assert ovs[0] == {"n_block": t.n_block, "kv_stage": t.kv_stage, "q_stage": t.q_stage}
    assert len(ovs) >= MIN_NEIGHBOURS + 1
    assert len({tuple(o.values()) for o in ovs}) == len(ovs)
    for ov in ovs:
        assert plan_forward(spec, "sm90", **ov).tiles.n_block == ov["n_block"]


def _ranks_slow(xs):
    return [sum(y < x for y in xs) + (sum(y == x for y in xs) + 1) / 2 for x in xs]


def test_spearman_against_its_definition():
    rng = random.Random(15)
    print("seed 15")
    for n in (3, 5, 12):
        xs = [rng.choice([1.0, 2.0, 3.0, rng.random()]) for _ in range(n)]
        ys = [rng.random() for _ in range(n)]
        if len(set(xs)) == 1:
            continue
        rx, ry = _ranks_slow(xs), _ranks_slow(ys)
        mx, my = sum(rx) / n, sum(ry) / n
        want = (sum((a - mx) * (b - my) for a, b in zip(rx, ry)) /
                (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5)
        assert spearman(xs, ys) == pytest.approx(want)
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="constant"):
        spearman([1, 1, 1], [1, 2, 3])
    with pytest.raises(ValueError, match=">= 3"):
        spearman([1, 2], [1, 2])


def _record(spec, ovs, tflops, status=None):
    rows = [NeighbourResult(**ov, default=i == 0, head_dim=spec.head_dim, seqlen=spec.seqlen_q,
                            causal=spec.causal, batch=spec.batch, heads=spec.heads_q,
                            status=(status or {}).get(i, records.OK),
                            ms=None if (status or {}).get(i) else 1.0,
                            tflops=None if (status or {}).get(i) else t)
            for i, (ov, t) in enumerate(zip(ovs, tflops, strict=True))]
    return make_neighbours_record(rows, gpu_name="synthetic", arch="sm90", command="test",
                                  config={"synthetic": True})


def test_rank_correlation_of_a_synthetic_record(tmp_path):
    """A record whose 'measurements' are the model's predictions ranks at rho = 1; reversed,
    at -1; a failed plan is left out of both lists. The record saves and loads."""
    from fa4lab.bench.neighbours import predicted_tflops

    spec = _spec(causal=True)
    ovs = neighbour_overrides(spec, "sm90")[:MIN_NEIGHBOURS + 1]
    pred = predicted_tflops(spec, ovs, "sm90")
    rec = _record(spec, ovs, pred)
    path = records.save_record(rec, tmp_path / "n.json")
    loaded = records.load_record(path)
    assert loaded["kind"] == records.NEIGHBOURS
    rc = rank_correlation(loaded)
    assert rc.rho == pytest.approx(1.0) and rc.best_measured == rc.best_predicted
    worst_first = rank_correlation(_record(spec, ovs, [-t for t in pred]) | {}, None)
    assert worst_first.rho == pytest.approx(-1.0)
    rec = _record(spec, ovs, pred, status={2: records.FAILED})
    rc = rank_correlation(rec)
    assert len(rc.plans) == len(ovs) - 1 and ovs[2] not in rc.plans
    with pytest.raises(ValueError, match="neighbour_results_of"):
        records.results_of(rec)


def test_neighbours_mode_on_a_cpu_prints_the_plans(capsys):
    from fa4lab.cli import main

    assert main(["bench", "--neighbours", "--head-dim", "128", "--seqlen", "8192",
                 "--causal", "false", "--no-save"]) == 0
    out = capsys.readouterr().out
    assert "nothing measured" in out and out.count("n_block") >= MIN_NEIGHBOURS + 1
    assert main(["bench", "--neighbours", "--no-save"]) == 2
