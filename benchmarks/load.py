"""Print every benchmark record in this folder (or the files given) as a table.

    python benchmarks/load.py                 # all records (every kind), oldest first
    python benchmarks/load.py some.json       # one record

The reading itself is `fa4lab.bench.load_records` / `load_record`, which validate the format.
"""

from __future__ import annotations

import sys
from pathlib import Path

from fa4lab.bench import (
    BACKWARD,
    DECODE,
    FEATURES,
    HOST_OVERHEAD,
    NEIGHBOURS,
    SERVING,
    TRAINING,
    backward_results_of,
    decode_results_of,
    feature_results_of,
    format_decode_table,
    format_features_table,
    format_host_table,
    format_table,
    host_results_of,
    load_record,
    load_records,
    results_of,
    serving_results_of,
)


def table_of(rec: dict) -> str:
    if rec["kind"] == HOST_OVERHEAD:
        return format_host_table(host_results_of(rec))
    if rec["kind"] == DECODE:
        return format_decode_table(decode_results_of(rec), hbm_gbps=rec["hbm_gbps"])
    if rec["kind"] == FEATURES:
        return format_features_table(feature_results_of(rec))
    if rec["kind"] == SERVING:
        from fa4lab.bench.serving_cli import format_serving_table

        return format_serving_table(serving_results_of(rec), hbm_gbps=rec["hbm_gbps"])
    if rec["kind"] == BACKWARD:
        from fa4lab.bench.backward import format_backward_table

        return format_backward_table(backward_results_of(rec))
    if rec["kind"] == TRAINING:
        from fa4lab.bench.training_cli import training_record_lines

        return "\n".join(training_record_lines(rec))
    if rec["kind"] == NEIGHBOURS:
        from fa4lab.bench.neighbours import format_neighbours_table

        return format_neighbours_table(rec)
    return format_table(results_of(rec), gemm_tflops=rec.get("gemm_tflops"))


def main(paths: list[str]) -> int:
    records = ([load_record(p) for p in paths] if paths
               else load_records(Path(__file__).parent, kinds=None))
    if not records:
        print("no records")
    for rec in records:
        print(f"## {Path(rec['path']).name}: {rec['label']}")
        print(f"{rec['kind']}, {rec['date']}, {rec['gpu']}, commit {rec['commit'] or '-'}, "
              f"command {rec['command'] or '-'}")
        print()
        print(table_of(rec))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
