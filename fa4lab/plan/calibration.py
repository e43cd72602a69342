"""The cost model calibrated per chip: the fitted `CostModel` of each hardware, the fit that
produced it, and the table that compares its predictions with measured and published figures.

    from fa4lab.plan.calibration import costs_for
    costs_for(H200)            # what `fa4lab.plan.throughput.predict` uses by default

    python -m fa4lab.bench.calibration            # refit, print the tables (about a minute)
    python -m fa4lab.bench.calibration --write    # the stored constants' tables and plots,
                                                 # into benchmarks/calibration/

H200 (sm90): the ASSUMED constants of `fa4lab.plan.costs.CostModel` fitted to the fa4lab
points (seqlen >= MIN_SEQLEN) of one recorded standard sweep (`H200_RECORD`). B200 (sm100):
nothing measured here; the model keeps the H200's fitted constants and is compared with the
FA4 paper's PUBLISHED figures (`fa4lab.hardware.PUBLISHED_FA4_B200_FORWARD`). See Note
[calibration].
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from fa4lab.hardware import H200, PUBLISHED_FA4_B200_FORWARD, Hardware, hardware_for
from fa4lab.paths import CALIBRATION_DIR

# The stored fit lives beside the model (`fa4lab.plan.costs`); importable from here too.
from fa4lab.plan.costs import (  # noqa: F401
    B200_COSTS,
    B200_OWN,
    CALIBRATED,
    DEFAULT_COSTS,
    H200_COSTS,
    CostModel,
    b200_costs,
    costs_for,
)

# Note [calibration]
# What is fitted, to what, and why the B200 is not fitted.
# - The H200 fit moves the constants the datasheets do not give (FIT_BOUNDS), each inside the
#   range written there, by a pattern search (`fit`) on the squared log errors of the 24
#   fa4lab points at seqlen >= MIN_SEQLEN of one recorded sweep, with a penalty on any point
#   past 80% of the tolerance. seqlen 1024 is left out: a call lasts ~0.1 ms there, and launch
#   jitter and host time, which no per-tile cost models, weigh.
# - The ranges, and why: mma_efficiency (the tensor pipe's sustained share of the datasheet
#   rate: the clock under a sustained load) from the record's own dense GEMM (8192^3, 0.77)
#   up to 0.9, since that GEMM also loses its wave tail and epilogue. sm90_softmax_stall
#   [0, 1]: the share of a consumer's softmax during which the other consumers' wgmmas stall
#   (register-file ports and warp-scheduler issue slots are shared). barrier_latency [20, 200]
#   cycles: on sm90 the ping-pong hand-off, the named-barrier wake-up plus the next wgmma's
#   start. tma_latency [400, 1200] cycles (an L2 hit to a few HBM round trips). cta_start_cycles
#   [0, 3000] (~1.6 us: launch, barrier init, setmaxnreg, exit). fma_ops_per_score [3.5, 10]
#   and fma_ops_per_masked_score [2, 12]: read as issue slots per score, not only FMAs (an SM
#   issues 128 thread-instructions per cycle, the FMA pipe's rate), from the hand count of
#   the FMA-pipe work up to every non-MUFU instruction, the row reductions' shuffles over the
#   wgmma accumulator layout (a row spread over four threads) and the mask's index arithmetic
#   included. rescale_fraction [0, 0.5].
# - The B200 model is the H200 fit except where the chips differ (B200_OWN): the softmax's
#   instruction counts stay the hand counts of Note [packed exp2 cost] (tcgen05.ld gives each
#   thread a whole row, so the row max and sum need no shuffles, and the exp2 work is priced
#   from the kernel's own packed form), and sm90_softmax_stall is Hopper's (the sm100 softmax
#   reads S from TMEM, not from the registers the MMA reads). mma_efficiency is ASSUMED equal
#   to the H200's (no B200 GEMM measured here; both run at their datasheet boost clock under a
#   power limit). Nothing is fitted to the published figures: they are a handful of points, and
#   free constants would match any model; a miss then names the assumption that is off
#   (`b200_misses`).
# - Where the fit sits (the tables' "at_bounds"): tma_latency at the top of its range (1200
#   cycles). Fitted to the record of 4583e2d (one CTA per tile everywhere, GEMM 0.81 of peak)
#   it was fma_ops_per_masked_score at its top instead (12): a causal diagonal block costs the
#   kernel more than its mask's instructions, and the model has no other term for it
#   (candidates: the early blocks' rescales, the L2 locality of the LPT order). With the
#   persistent non-causal points of 5db14f9 (a second tile's loads under the first's
#   epilogue) and a slower machine (GEMM 0.77), the fit puts that cost in the loads' latency;
#   the dense points' under-prediction (2-4%) remains. The B200 point moved from +3.5% to
#   -9.6% with it: mma_efficiency comes from the H200 record's GEMM, lower on this machine.
# - A persistent plan (the sm100 default at head dims 64-128, as upstream's kernel behind the
#   published figures is) is timed as its table runs: a tile's fixed cost is what a second
#   tile adds in the same CTA, its loads under the first tile's epilogue
#   (`fa4lab.plan.throughput.block_cycles`, Note [tile time]); a plan of one CTA per tile pays
#   its CTA start (cta_start_cycles) per tile.

H200_RECORD = "2026-12-01_nvidia-h200_5db14f9_042927.json"
PROVIDER = "fa4lab"
# The same kernel with persistent CTAs (Note [sm90 persistent CTAs]): the record measured both
# beside each other, and a point takes the row of the kernel the plan now ships for its shape.
PERSISTENT_PROVIDER = "fa4lab-persistent"
MIN_SEQLEN = 2048
TOLERANCE = {"sm90": 0.05, "sm100": 0.10}
# The fitted constants and their ranges (Note [calibration]); mma_efficiency's range starts at
# the record's own GEMM (`fit_bounds`).
MMA_EFFICIENCY_MAX = 0.9
FIT_BOUNDS = {
    "sm90_softmax_stall": (0.0, 1.0),
    "barrier_latency": (20, 200),
    "tma_latency": (400, 1200),
    "cta_start_cycles": (0.0, 3000.0),
    "fma_ops_per_score": (3.5, 10.0),
    "fma_ops_per_masked_score": (2.0, 12.0),
    "rescale_fraction": (0.0, 0.5),
}
_INTEGER = ("barrier_latency", "tma_latency")

@dataclass(frozen=True)
class Point:
    """One shape with a figure to compare: MEASURED (a record) or PUBLISHED (a paper)."""

    head_dim: int
    causal: bool
    seqlen: int
    batch: int
    heads: int
    tflops: float
    label: str          # "MEASURED" | "PUBLISHED"
    source: str

    @property
    def spec(self):
        from fa4lab.spec import AttentionSpec
        return AttentionSpec(self.batch, self.seqlen, self.seqlen, self.heads, self.heads,
                             self.head_dim, causal=self.causal)

    @property
    def key(self) -> tuple[int, bool, int]:
        return (self.head_dim, self.causal, self.seqlen)


def b200_points() -> list[Point]:
    """The FA4 paper's forward figures that could be found, labelled PUBLISHED."""
    return [Point(p["head_dim"], p["causal"], p["seqlen"], p["batch"], p["heads"], p["tflops"],
                  "PUBLISHED", p["source"]) for p in PUBLISHED_FA4_B200_FORWARD]


def measured_mma_efficiency(record: dict, hw: Hardware = H200) -> float:
    """The record's dense GEMM over the datasheet peak, to 3 decimals (Note [calibration])."""
    return round(record["gemm_tflops"] / hw.peak_mma_tflops, 3)


def fit_bounds(record: dict) -> dict[str, tuple]:
    """FIT_BOUNDS and mma_efficiency's range: from the H200 record's GEMM (`H200_RECORD`, read
    by `fa4lab.bench.calibration.h200_record`) to MMA_EFFICIENCY_MAX."""
    return {"mma_efficiency": (measured_mma_efficiency(record), MMA_EFFICIENCY_MAX),
            **FIT_BOUNDS}


# ---- prediction and fit ----
def _plans(points: list[Point], arch: str) -> dict:
    from fa4lab.plan import plan_forward
    return {p.key: plan_forward(p.spec, arch) for p in points}


def predictions(points: list[Point], arch: str, costs: CostModel, plans=None,
                _fast: bool = False) -> list[float]:
    """Predicted TFLOP/s of each point: one tile-time fit per (head_dim, causal) plan, then
    each shape's schedule (`fa4lab.plan.throughput.predict_with`)."""
    from fa4lab.plan.throughput import BlockCycles, block_cycles, predict_with
    plans = plans or _plans(points, arch)
    cycles: dict = {}
    out = []
    for p in points:
        plan = plans[p.key]
        group = (p.head_dim, p.causal)
        if group not in cycles:
            cycles[group] = block_cycles(plan, costs)
        b = cycles[group]
        if _fast:   # the schedule in units of one unmasked block, memoised (see `fit`)
            unit = BlockCycles(round(b.fixed / b.unmasked, 3), 1.0, round(b.masked / b.unmasked,
                                                                          3))
            key = (arch, p, unit)
            if key not in _UNIT_TFLOPS:
                _UNIT_TFLOPS[key] = predict_with(plan, unit, p.spec).tflops
            out.append(_UNIT_TFLOPS[key] / b.unmasked)
        else:
            out.append(predict_with(plan, b, p.spec).tflops)
    return out


# `fit` evaluates hundreds of cost models; a shape's schedule depends only on the tile's fixed
# and masked costs in units of one unmasked block, so it is computed once per (shape, those
# two ratios to 1e-3): the fit's predictions then differ from `predict`'s by under 0.1%.
_UNIT_TFLOPS: dict = {}


def errors(points: list[Point], predicted: list[float]) -> list[float]:
    """Relative error of each prediction: predicted / figure - 1."""
    return [q / p.tflops - 1.0 for p, q in zip(points, predicted, strict=True)]


def _loss(errs: list[float], tol: float) -> float:
    logs = [math.log1p(e) for e in errs]
    over = sum(max(abs(x) - 0.8 * tol, 0.0) ** 2 for x in logs)
    return sum(x * x for x in logs) / len(logs) + 100.0 * over


def fit(points: list[Point], arch: str = "sm90", start: CostModel | None = None,
        bounds: dict | None = None, rounds: int = 4) -> CostModel:
    """Pattern search inside `bounds`: from `start`, try each constant one and two steps up
    and down (a step starts at a quarter of its range), keep what lowers the loss, halve the
    steps when nothing does; `rounds` halvings. Deterministic; about a minute on a 2-core CPU
    (each trial simulates 18 work tiles and schedules 24 shapes)."""
    start = start or costs_for(arch)
    bounds = bounds or fit_bounds()
    plans = _plans(points, arch)
    tol = TOLERANCE[arch]

    def loss(c):
        return _loss(errors(points, predictions(points, arch, c, plans, _fast=True)), tol)

    def clip(name, v):
        lo, hi = bounds[name]
        v = min(max(v, lo), hi)
        return int(round(v)) if name in _INTEGER else round(v, 4)

    best, best_loss = start, loss(start)
    step = {k: (hi - lo) / 4 for k, (lo, hi) in bounds.items()}
    for _ in range(rounds):
        moved = True
        while moved:
            moved = False
            for name in bounds:   # a line search: two steps either way (crosses flat stretches)
                cur = getattr(best, name)
                for k in (-2, -1, 1, 2):
                    v = clip(name, cur + k * step[name])
                    if v == getattr(best, name):
                        continue
                    trial = best.with_(**{name: v})
                    trial_loss = loss(trial)
                    if trial_loss < best_loss - 1e-9:
                        best, best_loss, moved = trial, trial_loss, True
        step = {k: v / 2 for k, v in step.items()}
    return best


def fit_h200(record: dict, points: list[Point]) -> CostModel:
    """Refit the H200 model to `points` (the record's, `fa4lab.bench.calibration.h200_points`)
    from the middle of every range (`fit`); mma_efficiency no lower than the record's own GEMM
    sustained (`measured_mma_efficiency`)."""
    bounds = fit_bounds(record)
    start = DEFAULT_COSTS.with_(**{k: (lo + hi) // 2 if k in _INTEGER else (lo + hi) / 2
                                   for k, (lo, hi) in bounds.items()})
    return fit(points, "sm90", start, bounds)


# ---- the table ----
def table(arch: str, bounds: dict[str, tuple], points: list[Point] | None = None,
          costs: CostModel | None = None) -> dict:
    """Per point: shape, the figure (label, source), the prediction and its error; plus the
    model's constants, their `fit_bounds` and provenance. What benchmarks/calibration/*.json
    hold. `points`: the H200 record's on sm90 (`fa4lab.bench.calibration.h200_points`), the
    published ones by default on sm100."""
    hw = hardware_for(arch)
    costs = costs or costs_for(arch)
    if points is None:
        if hw.arch == "sm90":
            raise ValueError("the sm90 table needs the H200 record's points: "
                             "fa4lab.bench.calibration.table reads them")
        points = b200_points()
    pred = predictions(points, hw.arch, costs)
    errs = errors(points, pred)
    tol = TOLERANCE[hw.arch]
    rows = [{**{k: v for k, v in asdict(p).items() if k != "tflops"},
             "figure_tflops": round(p.tflops, 1), "predicted_tflops": round(q, 1),
             "error": round(e, 4), "within_tolerance": abs(e) <= tol}
            for p, q, e in zip(points, pred, errs, strict=True)]
    return {
        "hardware": hw.name, "arch": hw.arch, "tolerance": tol,
        "figures": "MEASURED" if hw.arch == "sm90" else "PUBLISHED",
        "provenance": _provenance(hw.arch),
        "constants": {k: getattr(costs, k) for k in sorted(bounds)},
        "bounds": {k: list(v) for k, v in bounds.items()},
        "at_bounds": [k for k, (lo, hi) in bounds.items()
                      if hw.arch == "sm90" and getattr(costs, k) in (lo, hi)],
        "max_abs_error": round(max(abs(e) for e in errs), 4),
        "points": rows,
        "misses": b200_misses(rows) if hw.arch == "sm100" else [],
    }


def _provenance(arch: str) -> str:
    if arch == "sm90":
        return (f"fitted by fa4lab.plan.calibration.fit_h200 to the points at seqlen >= "
                f"{MIN_SEQLEN} of benchmarks/{H200_RECORD} (the '{PROVIDER}' rows, the "
                f"'{PERSISTENT_PROVIDER}' ones where the plan is persistent), mma_efficiency no "
                f"lower than that record's dense GEMM / datasheet peak")
    return (f"the H200 fit's constants but {', '.join(B200_OWN)} (not fitted to the published "
            f"figures; Note [calibration] in fa4lab.plan.calibration)")


def calibration_note(arch: str) -> str:
    """One line for `fa4lab plan`: where the chip's constants come from and how far the stored
    table (benchmarks/calibration/*.json) found the model off."""
    arch = hardware_for(arch).arch
    try:
        tab = load_table(arch)
    except (OSError, ValueError):
        return f"{_provenance(arch)} (no stored table: `python -m fa4lab.bench.calibration " \
               f"--write`)"
    return (f"{_provenance(arch)}; max |error| {tab['max_abs_error']:.1%} over "
            f"{len(tab['points'])} {tab['figures']} point(s), tolerance {tab['tolerance']:.0%} "
            f"(benchmarks/calibration/{CALIBRATION_FILES[arch]}.json)")


def b200_misses(rows: list[dict]) -> list[str]:
    """Why a B200 point misses its tolerance: which assumption would move it, and how."""
    out = []
    for r in rows:
        if r["within_tolerance"]:
            continue
        way = "over" if r["error"] > 0 else "under"
        out.append(
            f"hd{r['head_dim']} {'causal' if r['causal'] else 'non-causal'} {r['seqlen']}: "
            f"{way}-predicts by {abs(r['error']):.0%}; the B200 mma_efficiency is ASSUMED "
            f"equal to the H200's measured one (no B200 GEMM here)")
    return out


def render(tab: dict) -> str:
    """The table as text: one line per point."""
    lines = [f"{tab['hardware']} ({tab['figures']} vs predicted, tolerance "
             f"{tab['tolerance']:.0%}): max |error| {tab['max_abs_error']:.1%}",
             f"  provenance: {tab['provenance']}",
             "  constants: " + ", ".join(f"{k}={v}" for k, v in tab["constants"].items())]
    for r in tab["points"]:
        mark = "" if r["within_tolerance"] else "  <-- outside"
        lines.append(f"  hd{r['head_dim']:<4}{'causal' if r['causal'] else 'dense ':<7}"
                     f"{r['seqlen']:>6}  {r['label']} {r['figure_tflops']:7.1f}  predicted "
                     f"{r['predicted_tflops']:7.1f}  {r['error']:+.1%}{mark}")
    lines += [f"  miss: {m}" for m in tab["misses"]]
    return "\n".join(lines)


# In a folder of their own: `fa4lab.bench.records.load_records` reads every benchmarks/*.json
# as a bench record.
CALIBRATION_FILES = {"sm90": "h200_measured", "sm100": "b200_published"}


def load_table(arch: str, directory: Path | None = None) -> dict:
    """A stored calibration table (benchmarks/calibration/*.json)."""
    directory = directory or CALIBRATION_DIR
    return json.loads((directory / f"{CALIBRATION_FILES[hardware_for(arch).arch]}.json")
                      .read_text())
