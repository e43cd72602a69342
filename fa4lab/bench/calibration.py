"""The cost model's calibration over the benchmark records: the bench reads the H200 record and
hands its points to `fa4lab.plan.calibration` (which reads no record itself), and writes the
stored tables and their plots.

    python -m fa4lab.bench.calibration            # refit, print the tables (about a minute)
    python -m fa4lab.bench.calibration --write    # the stored constants' tables and plots,
                                                  # into benchmarks/calibration/
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fa4lab.bench.records import BENCHMARKS_DIR, OK, load_record, results_of
from fa4lab.paths import CALIBRATION_DIR
from fa4lab.plan import calibration as cal
from fa4lab.plan.calibration import (
    CALIBRATION_FILES,
    H200_COSTS,
    H200_RECORD,
    MIN_SEQLEN,
    PERSISTENT_PROVIDER,
    PROVIDER,
    Point,
    b200_costs,
    render,
)
from fa4lab.plan.costs import CostModel


def h200_record(path: str | Path | None = None) -> dict:
    """The record the H200 model was fitted to (`fa4lab.plan.calibration.H200_RECORD`)."""
    return load_record(Path(path) if path else BENCHMARKS_DIR / H200_RECORD)


def h200_points(record: dict | None = None, min_seqlen: int = MIN_SEQLEN) -> list[Point]:
    """The record's results at seqlen >= min_seqlen of the kernel the plan ships for each
    shape (`PERSISTENT_PROVIDER`'s row where the sm90 plan is persistent and the record has
    it, else `PROVIDER`'s), labelled MEASURED."""
    from fa4lab.bench.sweep import BenchShape
    from fa4lab.plan import plan_forward

    rec = record or h200_record()
    src = f"{Path(rec.get('path', H200_RECORD)).name} ({rec['gpu']}, {rec['date']})"
    rows = {(r.provider, r.head_dim, r.causal, r.seqlen): r for r in results_of(rec)
            if r.status == OK and r.seqlen >= min_seqlen}
    out = []
    for (provider, d, causal, s), r in rows.items():
        if provider != PROVIDER:
            continue
        spec = BenchShape(d, s, causal, r.batch, r.heads, r.dtype).spec
        if plan_forward(spec, "sm90").protocol.persistent:
            r = rows.get((PERSISTENT_PROVIDER, d, causal, s), r)
        out.append(Point(d, causal, s, r.batch, r.heads, r.tflops, "MEASURED", src))
    return out


def fit_bounds(record: dict | None = None) -> dict[str, tuple]:
    """`fa4lab.plan.calibration.fit_bounds` of the H200 record."""
    return cal.fit_bounds(record or h200_record())


def fit_h200(record: dict | None = None) -> CostModel:
    """`fa4lab.plan.calibration.fit_h200` on the H200 record's points."""
    rec = record or h200_record()
    return cal.fit_h200(rec, h200_points(rec))


def table(arch: str, costs: CostModel | None = None, points: list[Point] | None = None) -> dict:
    """`fa4lab.plan.calibration.table` with the H200 record's bounds and, on sm90, its points."""
    rec = h200_record()
    if points is None and arch == "sm90":
        points = h200_points(rec)
    return cal.table(arch, cal.fit_bounds(rec), points, costs)


def write(directory: Path | None = None) -> list[Path]:
    """Write benchmarks/calibration/h200_measured.json/.png and b200_published.json/.png."""
    from fa4lab.viz.calibration import plot_calibration

    directory = directory or CALIBRATION_DIR
    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for arch, name in CALIBRATION_FILES.items():
        tab = table(arch)
        path = directory / f"{name}.json"
        path.write_text(json.dumps(tab, indent=1) + "\n")
        fig = plot_calibration(tab)
        fig.savefig(directory / f"{name}.png", dpi=110, bbox_inches="tight")
        out += [path, directory / f"{name}.png"]
    return out


def main(argv: list[str] | None = None) -> int:
    """Refit the H200 model and print its table beside the stored constants (about a minute);
    with --write, write the stored constants' tables and plots to benchmarks/calibration/
    instead (no refit)."""
    argv = sys.argv[1:] if argv is None else argv
    if "--write" in argv:
        for arch in CALIBRATION_FILES:
            print(render(table(arch)))
        for p in write():
            print("wrote", p)
        return 0
    refit = fit_h200()
    names = sorted(fit_bounds())
    print("H200 refit:  " + ", ".join(f"{k}={getattr(refit, k)}" for k in names))
    print("H200 stored: " + ", ".join(f"{k}={getattr(H200_COSTS, k)}" for k in names))
    print(render(table("sm90", refit)))
    print(render(table("sm100", b200_costs(refit))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
