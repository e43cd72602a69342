"""`fa4lab bench` on a CPU: the sweep arithmetic, the FLOP formula, records, the ratio table,
the plot, the check-before-timing path (with CPU providers) and the no-GPU command."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from bench_checks import needs_no_gpu, parse_bench, run_bench
from hypothesis import given
from hypothesis import strategies as st

from fa4lab import bench
from fa4lab.bench import ERROR, FAILED, MISSING, OK, BenchShape, Provider, Result
from fa4lab.bench import cli as bench_cli
from fa4lab.bench import providers as bench_providers


# ---- the sweep -------------------------------------------------------------------------------
def test_standard_sweep_has_every_point_with_the_same_tokens_and_hidden():
    shapes = bench.sweep()
    assert len(shapes) == 3 * 5 * 2
    assert {(s.head_dim, s.causal, s.seqlen) for s in shapes} == {
        (d, c, s) for d in (64, 128, 256) for c in (False, True)
        for s in (1024, 2048, 4096, 8192, 16384)}
    for s in shapes:
        assert s.batch * s.seqlen == 16384
        assert s.heads * s.head_dim == 2048
        assert s.dtype == "bf16"


@given(d=st.sampled_from([64, 128, 256]), log_s=st.integers(0, 14),
       log_total=st.integers(14, 17), causal=st.booleans())
def test_sweep_arithmetic(d, log_s, log_total, causal):
    total, seqlen = 2**log_total, 2**log_s
    (shape,) = bench.sweep([d], [seqlen], [causal], total_tokens=total, hidden=4096)
    assert (shape.batch, shape.heads) == (total // seqlen, 4096 // d)
    assert shape.causal is causal


def test_quick_sweep():
    args = parse_bench(["--quick"])
    shapes, names = bench.plan_of_run(args)
    assert [(s.head_dim, s.seqlen) for s in shapes] == [(128, 4096), (128, 8192)] * 2
    assert names == ["fa4lab", "sdpa-flash", "sdpa-cudnn", "fa4"]


@pytest.mark.parametrize("d", [100, 32, 0])
def test_bad_head_dim_is_a_clear_error(d):
    # the message lists what is supported: the head dims fa4lab.limits says a kernel builds
    assert set(bench.SUPPORTED_HEAD_DIMS) >= {64, 128}
    with pytest.raises(ValueError, match=rf"--head-dim {d} .*"
                                         rf"{re.escape(str(bench.SUPPORTED_HEAD_DIMS))}"):
        bench.sweep([d], [4096], [False])


def test_head_dim_must_divide_hidden():
    with pytest.raises(ValueError, match="does not divide --hidden 2112"):
        bench.sweep([256], [4096], [False], hidden=2112)


@pytest.mark.parametrize("s", [3000, 32768, 0])
def test_seqlen_must_divide_total_tokens(s):
    with pytest.raises(ValueError, match=rf"--seqlen {s} does not divide --total-tokens 16384"):
        bench.sweep([128], [s], [False])


def test_parse_causal():
    assert bench.parse_causal("both") == (False, True)
    assert bench.parse_causal("TRUE") == (True,)
    assert bench.parse_causal("false") == (False,)
    with pytest.raises(ValueError, match="both"):
        bench.parse_causal("sometimes")


# ---- FLOPs -----------------------------------------------------------------------------------
@pytest.mark.parametrize("d,s,causal", [(64, 1024, False), (128, 4096, True), (256, 16384, False)])
def test_flop_formula(d, s, causal):
    (shape,) = bench.sweep([d], [s], [causal])
    b, h = 16384 // s, 2048 // d
    expect = 4 * b * h * s * s * d / (2 if causal else 1)
    assert shape.flops == pytest.approx(expect, rel=1e-12)
    assert shape.flops == shape.spec.flops()


# ---- synthetic results -------------------------------------------------------------------------
def _synthetic() -> list[Result]:
    out = []
    for shape in bench.sweep([128], [4096, 8192], [False, True]):
        base = 500.0 + shape.seqlen / 1024 + (0 if shape.causal else 50)
        out.append(Result.for_shape("fa4lab", shape, tflops=base, ms=1.0))
        out.append(Result.for_shape("sdpa-cudnn", shape, tflops=base / 1.25, ms=1.25))
        out.append(Result.for_shape("sdpa-flash", shape, tflops=base / 2, ms=2.0))
        out.append(Result.for_shape("fa4", shape, status=MISSING,
                                    note="flash-attn-4 is not installed"))
    # one failed check and one error
    out[0] = Result.for_shape("fa4lab", bench.sweep([128], [4096], [False])[0], status=FAILED,
                              max_err=0.5, tol=0.01, note="max error 5.0e-01 > tolerance")
    out[6] = replace_status(out[6], ERROR, "RuntimeError: No available kernel")
    return out


def replace_status(r: Result, status: str, note: str) -> Result:
    return Result(r.provider, r.head_dim, r.seqlen, r.causal, r.batch, r.heads, r.dtype,
                  status=status, note=note)


def test_ratio_table_on_synthetic_results():
    rows = bench.ratio_table(_synthetic())
    assert [(r.head_dim, r.causal, r.seqlen) for r in rows] == [
        (128, False, 4096), (128, False, 8192), (128, True, 4096), (128, True, 8192)]
    first, second = rows[0], rows[1]
    # fa4lab failed its check on the first shape: no ratio there, not a ratio of 0
    assert all(v is None for v in first.ratios.values())
    assert second.ratios["sdpa-cudnn"] == pytest.approx(1.25)
    assert second.ratios["sdpa-flash"] is None          # the peer raised on this shape
    assert rows[2].ratios["sdpa-flash"] == pytest.approx(2.0)
    assert all(r.ratios["fa4"] is None for r in rows)   # missing peer
    gm = bench.geomean_ratios(rows)
    assert gm["sdpa-cudnn"] == pytest.approx(1.25)
    assert gm["sdpa-flash"] == pytest.approx(2.0)
    assert gm["fa4"] is None


def test_table_says_missing_failed_and_error():
    text = bench.format_table(_synthetic(), gemm_tflops=730.0)
    lines = [x for x in text.splitlines() if x.startswith("| 128 | no | 4096")]
    assert lines and "failed" in lines[0] and "missing" in lines[0]
    assert "| 128 | no | 8192 | 558 | 279 |" not in text   # sdpa-flash raised there
    assert "error" in text
    assert "fa4lab/sdpa-cudnn 1.25" in text
    assert "flash-attn-4 is not installed" in text
    assert "730 TFLOP/s" in text


def test_result_rejects_an_unknown_status():
    with pytest.raises(ValueError, match="status"):
        Result("fa4lab", 128, 1024, False, 16, 16, status="fast")


# ---- records ---------------------------------------------------------------------------------
def _record(results=None):
    return bench.make_record(results or _synthetic(), gemm=712.5, gpu_name="Test GPU",
                             arch="sm90", command="fa4lab bench --quick",
                             config={"total_tokens": 16384, "hidden": 2048, "dtype": "bf16"})


def test_record_round_trip(tmp_path):
    rec = _record()
    for key in ("commit", "gpu", "date", "versions", "command"):
        assert key in rec
    assert set(rec["versions"]) >= {"torch", "triton", "cutlass-dsl", "python"}
    path = bench.save_record(rec, tmp_path / "r.json")
    back = bench.load_record(path)
    assert bench.results_of(back) == _synthetic()
    assert back["gemm_tflops"] == 712.5
    assert back["gpu"] == "Test GPU"
    (tmp_path / "older.json").write_text(json.dumps({**rec, "date": "2000-01-01"}))
    # same date: a record without a time of day (a reference) sorts before a timed run
    (tmp_path / "zz-reference.json").write_text(json.dumps({**rec, "time_utc": None}))
    recs = bench.load_records(tmp_path)
    assert [Path(r["path"]).name for r in recs] == ["older.json", "zz-reference.json", "r.json"]


def test_bad_record_names_the_file(tmp_path):
    rec = _record()
    del rec["gpu"]
    (tmp_path / "broken.json").write_text(json.dumps(rec))
    with pytest.raises(ValueError, match=r"broken.json: .*lacks \['gpu'\]"):
        bench.load_records(tmp_path)
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match="broken.json is not valid JSON"):
        bench.load_records(tmp_path)


def test_ok_result_needs_tflops():
    rec = _record()
    rec["results"][1]["tflops"] = None
    with pytest.raises(ValueError, match="no positive tflops"):
        bench.validate_record(rec)


def test_recorded_benchmarks_load():
    records = bench.load_records()
    assert records, "benchmarks/ holds at least the reference measurement of the peers"
    for rec in records:
        assert rec["gpu"] and rec["date"]
        if rec["kind"] == "measured":
            # null only where the run was not made from a git checkout
            assert "commit" in rec and rec["command"].startswith("fa4lab bench")
    ref = [r for r in records if r["kind"] == "reference-peers"]
    assert ref and "H200" in ref[0]["gpu"] and ref[0]["date"] == "2026-11-29"
    res = bench.results_of(ref[0])
    # the reference record holds peers only: no fa4lab numbers were invented for it
    assert {r.provider for r in res} == {"fa4", "sdpa-cudnn", "sdpa-flash"}
    cell = {(r.provider, r.head_dim, r.causal, r.seqlen): r.tflops for r in res}
    assert cell[("fa4", 128, False, 16384)] == 677
    assert cell[("sdpa-cudnn", 256, True, 4096)] == 553
    assert ref[0]["gemm_tflops"] == 730
    assert bench.latest_record(records, gpu="H200") is not None
    assert bench.latest_record(records, gpu="B200") is None


def test_latest_record_with_provider(tmp_path):
    a = _record()
    b = {**_record([r for r in _synthetic() if r.provider != "fa4lab"]), "date": "2999-01-01"}
    assert bench.latest_record([a, b]) is b
    assert bench.latest_record([a, b], provider="fa4lab") is a


# ---- plot ------------------------------------------------------------------------------------
def test_plot_returns_a_figure_and_names_missing_providers():
    import matplotlib.figure

    from fa4lab.viz.bench import plot_sources, plot_throughput

    fig = plot_throughput(_record(), predicted={(128, False, 4096): 400.0})
    assert isinstance(fig, matplotlib.figure.Figure)
    labels = [t.get_text() for leg in fig.legends for t in leg.get_texts()]
    assert any("(missing)" in x for x in labels)
    assert any("simulated" in x for x in labels)
    assert any("GEMM" in x for x in labels)
    assert len(fig.axes) == 2          # one head_dim x two causal modes
    from fa4lab.hardware import PUBLISHED_FA4_B200

    fig2 = plot_sources(_record(), PUBLISHED_FA4_B200)
    ticks = [t.get_text() for t in fig2.axes[0].get_yticklabels()]
    assert "published" in ticks[0] and all("measured" in t for t in ticks[1:])
    with pytest.raises(ValueError, match="no results"):
        plot_throughput([])


# ---- providers and the check before timing (on the CPU) -------------------------------------
def _cpu_providers():
    good = Provider("sdpa-math", bench.sdpa_runner("MATH"))
    scaled = bench.sdpa_runner("MATH")

    def wrong_scale(q, k, v, causal, softmax_scale):
        return scaled(q, k, v, causal, softmax_scale * 1.1)

    def raises(q, k, v, causal, softmax_scale):
        raise RuntimeError("kernel launch failed")

    def nan(q, k, v, causal, softmax_scale):
        return q * float("nan")

    bhsd = Provider("sdpa-bhsd", bench.sdpa_runner("MATH", layout="bhsd"), prepare=bench.to_bhsd)
    return [good, bhsd, Provider("wrong", wrong_scale), Provider("raises", raises),
            Provider("nan", nan), Provider("fa4", None, "flash-attn-4 is not installed")]


@pytest.mark.parametrize("causal", [False, True])
def test_check_then_time_on_cpu(causal):
    shape = BenchShape(head_dim=64, seqlen=96, causal=causal, batch=2, heads=3)
    res = {r.provider: r for r in bench.measure_shape(shape, _cpu_providers(), device="cpu",
                                                      rep_ms=2)}
    assert res["sdpa-math"].status == OK and res["sdpa-math"].tflops > 0
    assert res["sdpa-math"].max_err <= res["sdpa-math"].tol
    assert res["sdpa-bhsd"].status == OK and res["sdpa-bhsd"].max_err == res["sdpa-math"].max_err
    assert res["wrong"].status == FAILED and res["wrong"].tflops is None
    assert res["wrong"].max_err > res["wrong"].tol
    assert res["raises"].status == ERROR and "kernel launch failed" in res["raises"].note
    assert res["nan"].status == FAILED and "NaN" in res["nan"].note
    assert res["fa4"].status == MISSING and "not installed" in res["fa4"].note


def test_check_catches_a_missing_mask():
    # A provider that ignores causal differs from the reference on every row but the last.
    shape = BenchShape(head_dim=64, seqlen=64, causal=True, batch=1, heads=2)
    q, k, v = bench.make_inputs(shape, "cpu")
    check = bench.reference_slice(q, k, v, shape)
    full = bench.sdpa_runner("MATH")(q, k, v, False, shape.spec.scale)
    passed, err, note = bench.check_output(full, check, shape)
    assert not passed and "tolerance" in note
    ok, err_ok, _ = bench.check_output(bench.sdpa_runner("MATH")(q, k, v, True,
                                                                   shape.spec.scale),
                                       check, shape)
    assert ok and err_ok < err


def test_wrong_output_shape_fails_the_check():
    shape = BenchShape(head_dim=64, seqlen=32, causal=False, batch=1, heads=2)
    q, k, v = bench.make_inputs(shape, "cpu")
    check = bench.reference_slice(q, k, v, shape)
    passed, err, note = bench.check_output(q[:, :16], check, shape)
    assert not passed and "output shape" in note and math.isinf(err)


def test_run_sweep_continues_after_failures():
    shapes = bench.sweep([64], [32, 64], [False], total_tokens=128, hidden=128)
    results = bench.run_sweep(shapes, _cpu_providers(), device="cpu", rep_ms=1, progress=False)
    assert len(results) == len(shapes) * 6
    assert [r.status for r in results if r.provider == "sdpa-math"] == [OK, OK]


def test_missing_peer_is_reported_not_dropped(monkeypatch):
    # Make upstream FA4 unimportable whatever this machine has installed.
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", None)
    monkeypatch.setattr(bench_providers, "package_version", lambda dist: None)
    provs = bench.resolve_providers(["fa4"])
    assert [p.name for p in provs] == ["fa4lab", "fa4"]
    assert provs[1].missing and "pip install flash-attn-4" in provs[1].why_missing
    shape = BenchShape(head_dim=64, seqlen=32, causal=False, batch=1, heads=2)
    (res,) = bench.measure_shape(shape, provs[1:], device="cpu", rep_ms=1)
    assert res.status == MISSING and res.tflops is None
    assert "missing" in bench.format_table([res])


def test_unknown_peer_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown provider"):
        bench.resolve_providers(["xformers"])
    assert run_bench(["--peers", "sdpa-flash,xformers"]) == 2


# ---- the command on a CPU ----------------------------------------------------------------------
@needs_no_gpu
def test_bench_on_cpu_exits_0_and_says_no_gpu(capsys):
    assert run_bench(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "no CUDA GPU visible" in out
    assert "hd128 full s4096 (b4 h16)" in out and "hd128 causal s8192 (b2 h16)" in out
    assert "fa4" in out and "missing" in out
    assert "latest recorded H200 results" in out and "| 128 | no | 16384 |" in out


# A fresh process importing torch (3-4 s on a 2-core machine) for what two fast tests show:
# test_bench_on_cpu_exits_0_and_says_no_gpu runs `fa4lab.cli.main(["bench", ...])`, the
# function `python -m fa4lab` calls, and test_plan_cli's
# test_python_m_fa4lab_plan_takes_the_mask_flags runs `python -m fa4lab`. `make test` runs it.
@pytest.mark.slow
@needs_no_gpu
def test_bench_through_the_console_script():
    res = subprocess.run([sys.executable, "-m", "fa4lab", "bench", "--head-dim", "64",
                          "--seqlen", "4096", "--causal", "true"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "no CUDA GPU visible" in res.stdout
    assert "hd64 causal s4096 (b4 h32)" in res.stdout


def test_bad_arguments_exit_2_with_a_message(capsys):
    assert run_bench(["--head-dim", "100"]) == 2
    err = capsys.readouterr().err
    assert "--head-dim 100" in err and str(bench.SUPPORTED_HEAD_DIMS) in err
    assert run_bench(["--seqlen", "5000"]) == 2
    assert "does not divide --total-tokens" in capsys.readouterr().err


@needs_no_gpu
def test_cpu_path_with_no_records(tmp_path, capsys):
    assert run_bench(["--quick", "--records", str(tmp_path)]) == 0
    assert "no recorded H200 results" in capsys.readouterr().out


# ---- the planner's prediction beside the records (notebook 07) ------------------------------
def test_simulated_tflops_and_the_plan_figure():
    import matplotlib.figure

    from fa4lab.hardware import H200
    from fa4lab.plan import plan_forward
    from fa4lab.plan.simulate import simulate
    from fa4lab.viz.bench import plot_plan_prediction

    shapes = bench.sweep([64, 128], [1024, 8192], [False, True])
    pred = bench.simulated_tflops(shapes, "sm90")
    assert set(pred) == {s.key for s in shapes}
    assert all(0 < t < H200.peak_mma_tflops for t in pred.values())
    # causal at a short seqlen wastes more of each diagonal tile than at a long one
    assert pred[(128, True, 1024)] < pred[(128, True, 8192)]
    shape = bench.shape_for(128, 8192, False)
    assert (shape.batch, shape.heads) == (2, 16)
    latest = bench.latest_record(bench.load_records(), gpu="H200")
    recorded = bench.recorded_tflops(latest, shape.key)
    expected = {r.provider: r.tflops for r in bench.results_of(latest)
                if (r.head_dim, r.causal, r.seqlen) == shape.key and r.tflops}
    assert recorded == expected and {"fa4", "sdpa-cudnn", "sdpa-flash"} <= set(recorded)
    assert bench.recorded_tflops(None, shape.key) == {}
    sim = simulate(plan_forward(shape.spec, "sm90"), n_blocks=4, n_tiles=1)
    fig = plot_plan_prediction(sim, pred.get(shape.key, 500.0), recorded=recorded,
                               gemm_tflops=730.0)
    assert isinstance(fig, matplotlib.figure.Figure)
    labels = [t.get_text() for t in fig.axes[1].get_yticklabels()]
    assert "simulated" in labels[0]
    assert sum("recorded" in x for x in labels) == len(recorded)


@pytest.mark.compile
def test_compile_report_gives_time_or_the_failure():
    # notebook 07's CPU tier compiles a widget's tiles through this report
    pytest.importorskip("cutlass")
    from fa4lab.kernels.compile import compile_report
    from fa4lab.plan import plan_forward

    plan = plan_forward(bench.shape_for(128, 1024, True).spec, "sm90", n_block=64)
    seconds, text = compile_report(plan)
    assert seconds and seconds > 0, text
    assert "compiled for sm90a" in text

    class NotAPlan:
        arch = "sm90"
        spec = None

    seconds, text = compile_report(NotAPlan())
    assert seconds is None and "failed" in text


def test_gpu_branch_of_the_command_end_to_end_on_cpu_tensors(monkeypatch, tmp_path, capsys):
    """The GPU path of `fa4lab bench` (providers, table, record, plot) with the device faked:
    the runs happen on CPU tensors, so the flow is tested here, not the speed."""
    import warnings

    from fa4lab import environment

    fake = environment.GpuInfo("Fake H200", (9, 0))
    monkeypatch.setattr(environment, "gpu", lambda: fake)
    monkeypatch.setattr(bench_cli, "gemm_tflops", lambda **kw: 700.0)
    real_run_sweep = bench.run_sweep
    monkeypatch.setattr(bench_cli, "run_sweep",
                        lambda shapes, providers, **kw: real_run_sweep(
                            shapes, providers, **{**kw, "device": "cpu", "progress": False}))
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        rc = run_bench(["--head-dim", "64", "--seqlen", "64", "--causal", "both",
                        "--total-tokens", "128", "--hidden", "128", "--rep-ms", "1",
                        "--json", str(out_json), "--plot", str(out_png)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "fa4lab bench on Fake H200" in text and "record saved" in text
    rec = bench.load_record(out_json)
    assert rec["gpu"] == "Fake H200" and rec["arch"] == "sm90" and rec["gemm_tflops"] == 700.0
    assert rec["command"].startswith("fa4lab bench --head-dim 64")
    res = bench.results_of(rec)
    assert {r.provider for r in res} == {"fa4lab", "sdpa-flash", "sdpa-cudnn", "fa4"}
    assert len(res) == 2 * 4
    # every provider has a status for every shape; none was dropped
    for r in res:
        assert r.status in bench.STATUSES
        assert r.status == OK or r.note
    # on CPU tensors fa4lab.attention would fall back to the float64 reference: never timed
    ours = [r for r in res if r.provider == "fa4lab"]
    assert all(r.status == ERROR and "SlowReferenceWarning" in r.note for r in ours)
    assert all(r.status == OK for r in res if r.provider == "sdpa-flash")   # torch's CPU flash
    assert out_png.stat().st_size > 0
    assert run_bench(["--head-dim", "64", "--seqlen", "64", "--total-tokens", "128",
                      "--hidden", "128", "--rep-ms", "1", "--no-save", "--no-gemm",
                      "--arch", "sm100"]) == 0
    assert "not --arch sm100" in capsys.readouterr().err


def test_progress_bar_and_the_commit_outside_git(monkeypatch, tmp_path, capsys):
    shapes = bench.sweep([64], [32], [True], total_tokens=64, hidden=128)
    results = bench.run_sweep(shapes, _cpu_providers()[:1], device="cpu", rep_ms=1)
    assert [r.status for r in results] == [OK]
    err = capsys.readouterr().err
    assert "bench" in err and "1/1" in err and "hd64 causal s32" in err
    bench.run_sweep(shapes, _cpu_providers()[:1], device="cpu", rep_ms=1, progress=False)
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("FA4LAB_COMMIT", "abc1234")
    assert bench.git_commit(tmp_path) == "abc1234"      # tmp_path is no git checkout
    repo = bench.BENCHMARKS_DIR.parent
    assert bench.git_commit(repo) == "abc1234"          # it also wins over a git checkout
    monkeypatch.delenv("FA4LAB_COMMIT")
    assert bench.git_commit(tmp_path) is None


def test_benchmarks_loader_script_prints_every_record():
    script = bench.BENCHMARKS_DIR / "load.py"
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert "2026-11-29_nvidia-h200_reference-peers.json" in res.stdout
    assert "| 128 | yes | 8192 | 315 | 539 | 602 |" in res.stdout
