"""Bench records of both families (throughput and host overhead) side by side: round trips,
the kind filter, file names, and that reading records stays light (no torch, no planner)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fa4lab import bench
from fa4lab.bench import MISSING, OK, HostResult, Result


def _host_record():
    results = [HostResult("fa4lab", OK, 150.25, 149.5, [150.0, 149.5, 151.25]),
               HostResult("fa4", MISSING, note="flash-attn-4 is not installed"),
               HostResult("sdpa", OK, 30.0, 29.75, [30.25, 29.75, 30.0])]
    rec = bench.make_host_record(results, gpu_name="Test GPU", arch="sm90",
                                 command="fa4lab bench --host-overhead",
                                 config=bench.host_overhead.host_config(200, 3))
    return rec, results


def _throughput_record():
    (shape,) = bench.sweep([128], [4096], [False])
    return bench.make_record([Result.for_shape("sdpa-flash", shape, tflops=340.0, ms=1.6)],
                             gemm=700.0, gpu_name="Test GPU", arch="sm90",
                             command="fa4lab bench", config={})


def test_host_record_round_trip(tmp_path):
    rec, results = _host_record()
    for key in ("schema", "commit", "gpu", "date", "versions", "command", "config"):
        assert key in rec
    assert "gemm_tflops" not in rec and rec["config"]["calls"] == 200
    assert rec["config"]["shape"] == {"batch": 1, "seqlen": 128, "heads": 1, "head_dim": 128,
                                      "dtype": "bf16", "causal": False}
    name = bench.default_record_path(rec).name
    assert name.endswith("_test-gpu_" + (rec["commit"] or "nocommit")[:7] + "_"
                         + rec["time_utc"].replace(":", "") + "_host-overhead.json")
    path = bench.save_record(rec, tmp_path / name)
    back = bench.load_record(path)
    assert bench.host_results_of(back) == results
    with pytest.raises(ValueError, match="host_results_of"):
        bench.results_of(back)


def test_load_records_filters_by_kind(tmp_path):
    host, _ = _host_record()
    bench.save_record(host, tmp_path / "a_host.json")
    bench.save_record(_throughput_record(), tmp_path / "b_sweep.json")
    assert [r["kind"] for r in bench.load_records(tmp_path)] == ["measured"]
    assert [r["kind"] for r in bench.load_records(tmp_path, kinds=("host-overhead",))] == [
        "host-overhead"]
    assert len(bench.load_records(tmp_path, kinds=None)) == 2
    # the throughput readers never see a host record
    assert bench.latest_record(bench.load_records(tmp_path), provider="sdpa-flash") is not None
    with pytest.raises(ValueError, match="results_of"):
        bench.host_results_of(_throughput_record())


def test_bad_host_record_names_the_problem(tmp_path):
    rec, _ = _host_record()
    rec["results"][0]["mean_us"] = None
    with pytest.raises(ValueError, match="no positive mean_us"):
        bench.validate_record(rec)
    rec, _ = _host_record()
    del rec["config"]
    (tmp_path / "host.json").write_text(json.dumps(rec))
    with pytest.raises(ValueError, match=r"host.json: .*lacks \['config'\]"):
        bench.load_records(tmp_path, kinds=None)
    rec, _ = _host_record()
    rec["results"][1]["status"] = "slow"
    with pytest.raises(ValueError, match="status"):
        bench.validate_record(rec)


def test_reading_records_imports_neither_torch_nor_the_planner():
    # fa4lab.plan.report reads records: the bench must not import the planner back.
    code = ("import sys, fa4lab.bench.records, fa4lab.bench;"
            "print(sorted(m for m in ('torch', 'fa4lab.plan', 'cutlass') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"
    res = subprocess.run([sys.executable, "-c", "import fa4lab.plan.report"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
