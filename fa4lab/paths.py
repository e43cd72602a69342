"""Where the project keeps its recorded data: benchmarks/ beside the package.

    BENCHMARKS_DIR      benchmark records (`fa4lab.bench.records`), one JSON file a run
    CALIBRATION_DIR     the cost model's calibration tables (`fa4lab.plan.calibration`)

A module of its own so that the plan layer can read its stored tables without importing the
bench.
"""

from __future__ import annotations

from pathlib import Path

BENCHMARKS_DIR = Path(__file__).resolve().parents[1] / "benchmarks"
CALIBRATION_DIR = BENCHMARKS_DIR / "calibration"
