"""A tiny `fa4lab bench` end to end on a GPU: one shape, the SDPA peers and fa4lab (when its
kernel for this GPU is importable), checked against the reference and timed."""

from __future__ import annotations

import importlib.util

import pytest

from fa4lab import bench
from fa4lab.bench import OK
from fa4lab.cli import main as fa4lab_main


@pytest.mark.gpu
def test_tiny_bench_end_to_end(tmp_path, capsys):
    out_json, out_png = tmp_path / "tiny.json", tmp_path / "tiny.png"
    rc = fa4lab_main(["bench", "--head-dim", "128", "--seqlen", "1024", "--causal", "true",
                      "--total-tokens", "2048", "--peers", "sdpa-flash,sdpa-cudnn",
                      "--rep-ms", "20", "--warmup-ms", "5", "--json", str(out_json),
                      "--plot", str(out_png)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "| 128 | yes | 1024 |" in text
    rec = bench.load_record(out_json)
    assert rec["gpu"] and rec["versions"]["torch"] and rec["gemm_tflops"] > 0
    res = {r.provider: r for r in bench.results_of(rec)}
    assert set(res) == {"fa4lab", "sdpa-flash", "sdpa-cudnn"}
    flash = res["sdpa-flash"]
    assert flash.status == OK and flash.tflops > 0 and flash.max_err <= flash.tol
    assert res["sdpa-cudnn"].status in (OK, "error", "missing")   # cuDNN may lack it
    if importlib.util.find_spec("fa4lab.api") is not None and rec["arch"] in ("sm90", "sm100"):
        ours = res["fa4lab"]
        assert ours.status == OK, f"fa4lab: {ours.status}: {ours.note}"
        assert ours.max_err <= ours.tol
    assert out_png.stat().st_size > 0


@pytest.mark.sm90
@pytest.mark.parametrize("n_block", [None, 64])
def test_measure_plan_compiles_checks_and_times_these_tiles(n_block):
    from fa4lab.plan import plan_forward

    shape = bench.shape_for(128, 1024, True, total_tokens=2048)
    overrides = {} if n_block is None else {"n_block": n_block}
    plan = plan_forward(shape.spec, "sm90", **overrides)
    m = bench.measure_plan(plan, peers=["sdpa-flash"], warmup_ms=5, rep_ms=20)
    assert m.error == ""
    assert m.compile_s and m.compile_s > 0
    ours = {r.provider: r for r in m.results}["fa4lab"]
    assert ours.status == OK, ours.note
    assert ours.max_err <= ours.tol


@pytest.mark.gpu
def test_tiny_decode_end_to_end(tmp_path, capsys):
    """`fa4lab bench --decode` at a small size: every provider that runs here passes its check
    before timing, and the record has the bandwidth, the floors and the per-result fields."""
    out_json = tmp_path / "decode.json"
    rc = fa4lab_main(["bench", "--decode", "--batch", "4", "--seqlen-k", "2048",
                      "--prefill-seqlen", "1024", "--rep-ms", "20", "--warmup-ms", "5",
                      "--json", str(out_json)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "| decode b4 sq1 sk2048 h32/8 hd128 full |" in text and "x HBM floor" in text
    rec = bench.load_record(out_json)
    assert rec["kind"] == "decode" and rec["gpu"] and rec["versions"]["torch"]
    assert rec["hbm_gbps"] > 100          # any GPU copies faster than 100 GB/s
    assert rec["config"]["hbm_copy"]["bytes"] >= 2**30
    res = {(r.shape, r.provider): r for r in bench.decode_results_of(rec)}
    assert set(res) == {(s, p) for s in ("decode", "prefill") for p in bench.DECODE_PROVIDERS}
    kernel_here = (importlib.util.find_spec("fa4lab.api") is not None
                   and rec["arch"] in ("sm90", "sm100"))
    for (shape, provider), r in res.items():
        where = f"{provider} {shape}: {r.status}: {r.note}"
        assert r.status != "failed", where                   # nothing that ran was wrong
        assert r.hbm_bytes > 0 and r.floor_us > 0, where
        if provider == "sdpa-flash" or (kernel_here and provider.startswith("fa4lab")):
            assert r.status == OK, where
        if provider == "fa4":
            assert r.status in (OK, "missing"), where       # flash-attn-4 may be absent
        if r.status == OK:
            assert r.max_err <= r.tol, where
            assert r.us > 0 and r.gbps > 0 and r.tflops > 0, where
            assert r.x_floor == pytest.approx(r.us / r.floor_us), where
