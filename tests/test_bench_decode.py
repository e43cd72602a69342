"""`fa4lab bench --decode` on a CPU: the HBM floor's arithmetic, the GQA shapes, the check before
timing with GQA providers (right, wrong head mapping, wrong batch, raising, missing), the
record and the table, provider resolution with `fa4lab-unpacked`, and the command (no GPU, and
the GPU path with the device faked and the runs on CPU tensors)."""

from __future__ import annotations

import pytest
from bench_checks import needs_no_gpu, no_upstream_fa4, parse_bench, run_bench

from fa4lab import bench
from fa4lab.bench import ERROR, FAILED, MISSING, OK, DecodeResult, GqaShape, Provider
from fa4lab.bench import cli as bench_cli
from fa4lab.bench import decode as bench_decode


# ---- the shapes and the floor ----------------------------------------------------------------
def test_default_shapes():
    decode, prefill = bench.gqa_shapes()
    assert (decode.name, decode.batch, decode.seqlen_q, decode.seqlen_k, decode.heads_q,
            decode.heads_kv, decode.head_dim, decode.causal, decode.dtype) == (
        "decode", 32, 1, 8192, 32, 8, 128, False, "bf16")
    assert (prefill.name, prefill.batch, prefill.seqlen_q, prefill.seqlen_k, prefill.heads_q,
            prefill.heads_kv, prefill.head_dim, prefill.causal) == (
        "prefill", 1, 8192, 8192, 32, 8, 128, True)
    assert decode.spec.qhead_per_kvhead == 4
    # FLOPs as the sweep counts them: 4 * B * Hq * Sq * Sk * D, halved for causal
    assert decode.flops == 4 * 32 * 32 * 1 * 8192 * 128
    assert prefill.flops == 4 * 1 * 32 * 8192 * 8192 * 128 / 2
    assert decode.label() == "decode b32 sq1 sk8192 h32/8 hd128 full"
    (only,) = bench.gqa_shapes(batch=4, seqlen_k=1024, heads_q=16, heads_kv=2, head_dim=64,
                               prefill_seqlen=0)
    assert (only.batch, only.seqlen_k, only.heads_q, only.heads_kv, only.head_dim) == (
        4, 1024, 16, 2, 64)


def test_hbm_bytes_of_the_default_decode_shape():
    # computed here from the definition: K and V once, q and out once, 2 bytes per bf16
    batch, seqlen_q, seqlen_k, heads_q, heads_kv, d = 32, 1, 8192, 32, 8, 128
    k_bytes = batch * seqlen_k * heads_kv * d * 2
    assert k_bytes == 512 * 2**20                      # the cache: 512 MiB for K, as many for V
    q_bytes = batch * seqlen_q * heads_q * d * 2
    expect = 2 * k_bytes + 2 * q_bytes
    assert expect == 1_074_266_112
    decode, prefill = bench.gqa_shapes()
    assert decode.hbm_bytes == expect == bench.hbm_bytes(decode.spec)
    assert prefill.hbm_bytes == 2 * 8192 * 8 * 128 * 2 + 2 * 8192 * 32 * 128 * 2
    # at 4000 GB/s the floor is bytes / bandwidth
    assert bench.floor_us(decode.hbm_bytes, 4000.0) == pytest.approx(expect / 4e12 * 1e6)
    assert bench.floor_us(decode.hbm_bytes, 4000.0) == pytest.approx(268.5665, abs=1e-3)
    assert bench.floor_us(decode.hbm_bytes, None) is None
    assert bench.floor_us(decode.hbm_bytes, 0.0) is None
    # fp16 is 2 bytes too; head_dim counts twice (q/K and out/V)
    (fp16,) = bench.gqa_shapes(head_dim=64, dtype="fp16", prefill_seqlen=0)
    assert fp16.hbm_bytes == expect // 2


@pytest.mark.parametrize("kw,match", [
    ({"heads_q": 32, "heads_kv": 5}, "not a multiple of --heads-kv 5"),
    ({"head_dim": 100}, r"--head-dim 100 is not supported"),
    ({"batch": 0}, "--batch must be >= 1"),
    ({"seqlen_k": 0}, "--seqlen-k must be >= 1"),
    ({"prefill_seqlen": -1}, "--prefill-seqlen must be >= 0"),
])
def test_bad_shapes_are_clear_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        bench.gqa_shapes(**kw)


def test_copy_bandwidth_counts_read_and_write():
    bw = bench.copy_bandwidth(1 << 20, device="cpu", rep_ms=2)
    assert bw.nbytes == 1 << 20 and bw.ms > 0
    assert bw.gbps == pytest.approx(2 * bw.nbytes / (bw.ms * 1e-3) / 1e9)
    with pytest.raises(ValueError, match="nbytes"):
        bench.copy_bandwidth(0, device="cpu")


# ---- the check before timing, with GQA ---------------------------------------------------------
SMALL = GqaShape("decode", batch=3, seqlen_q=2, seqlen_k=96, heads_q=8, heads_kv=2,
                 head_dim=64)


def _gqa_providers():
    import torch

    math_gqa = bench.sdpa_runner("MATH")

    def tiled_heads(q, k, v, causal, softmax_scale):
        # K/V head h % heads_kv instead of h // group: the classic GQA mapping bug
        r = q.shape[2] // k.shape[2]
        k2, v2 = (t.repeat(1, 1, r, 1) for t in (k, v))
        return math_gqa(q, k2, v2, causal, softmax_scale)

    def last_batch_wrong(q, k, v, causal, softmax_scale):
        out = math_gqa(q, k, v, causal, softmax_scale).clone()
        out[-1] = torch.flip(out[-1], dims=[-1])
        return out

    def raises(q, k, v, causal, softmax_scale):
        raise RuntimeError("kernel launch failed")

    return [Provider("sdpa-math", math_gqa),
            Provider("sdpa-bhsd", bench.sdpa_runner("MATH", layout="bhsd"),
                     prepare=bench.to_bhsd),
            Provider("tiled", tiled_heads), Provider("last-batch", last_batch_wrong),
            Provider("raises", raises), Provider("fa4", None, "flash-attn-4 is not installed")]


@pytest.mark.parametrize("shape", [SMALL, GqaShape("prefill", 1, 64, 64, 6, 2, 64, True)])
def test_check_then_time_gqa_on_cpu(shape):
    res = {r.provider: r for r in bench.measure_gqa_shape(shape, _gqa_providers(),
                                                          hbm_gbps=100.0, device="cpu",
                                                          rep_ms=2)}
    good = res["sdpa-math"]
    assert good.status == OK and good.max_err <= good.tol
    assert good.us > 0 and good.tflops > 0
    assert good.hbm_bytes == shape.hbm_bytes
    assert good.floor_us == pytest.approx(shape.hbm_bytes / 100e9 * 1e6)
    assert good.x_floor == pytest.approx(good.us / good.floor_us)
    assert good.gbps == pytest.approx(shape.hbm_bytes / (good.us * 1e-6) / 1e9)
    assert good.tflops == pytest.approx(shape.flops / (good.us * 1e-6) / 1e12)
    assert res["sdpa-bhsd"].status == OK
    assert res["tiled"].status == FAILED and res["tiled"].us is None
    if shape.batch > 1:   # only the last batch element is wrong: the check covers it
        assert res["last-batch"].status == FAILED
    assert res["raises"].status == ERROR and "kernel launch failed" in res["raises"].note
    assert res["fa4"].status == MISSING and res["fa4"].floor_us is not None
    # without a bandwidth there is no floor, and the rest is still measured
    (r,) = bench.measure_gqa_shape(shape, _gqa_providers()[:1], device="cpu", rep_ms=1)
    assert r.status == OK and r.floor_us is None and r.x_floor is None and r.us > 0


def test_sdpa_refuses_a_causal_mask_it_would_align_top_left():
    shape = GqaShape("decode", 1, 4, 32, 4, 2, 64, causal=True)
    (r,) = bench.measure_gqa_shape(shape, _gqa_providers()[:1], device="cpu", rep_ms=1)
    assert r.status == ERROR and "top-left" in r.note


# ---- providers ---------------------------------------------------------------------------------
def test_resolves_the_unpacked_fa4lab_provider(monkeypatch):
    from fa4lab import api

    calls = []

    def fake_attention(q, k, v, **kw):
        calls.append(kw)
        return q

    monkeypatch.setattr(api, "attention", fake_attention)
    provs = bench.resolve_providers([bench.UNPACKED])
    assert [p.name for p in provs] == ["fa4lab", "fa4lab-unpacked"]
    assert not any(p.missing for p in provs)
    q = object()
    for p in provs:
        p.runner(q, q, q, True, 0.5)
        p.runner(q, q, q, True, 0.5)    # the calls after the first take the same arguments
    # the default passes no pack_gqa (attention's own choice); unpacked passes False
    assert calls[0] == calls[1] == {"causal": True, "softmax_scale": 0.5}
    assert calls[2] == calls[3] == {"causal": True, "softmax_scale": 0.5, "pack_gqa": False}
    with pytest.raises(ValueError, match="fa4lab-unpacked"):
        bench.resolve_providers(["xformers"])


def test_real_fa4lab_providers_on_cpu_tensors_are_never_timed(monkeypatch):
    no_upstream_fa4(monkeypatch)
    provs = bench.resolve_providers([bench.UNPACKED, "fa4"])
    res = {r.provider: r for r in bench.measure_gqa_shape(SMALL, provs, device="cpu",
                                                          rep_ms=1)}
    # on CPU tensors fa4lab.attention is the float64 reference: an error, not a time
    for name in ("fa4lab", "fa4lab-unpacked"):
        assert res[name].status == ERROR and "SlowReferenceWarning" in res[name].note
    assert res["fa4"].status == MISSING and "pip install flash-attn-4" in res["fa4"].note


def test_plan_of_decode():
    shapes, names = bench.plan_of_decode(parse_bench(["--decode"]))
    assert [s.name for s in shapes] == ["decode", "prefill"]
    assert shapes[0].head_dim == 128          # the sweep's three default head dims mean 128
    assert names == ["fa4lab", "fa4lab-unpacked", "sdpa-flash", "sdpa-cudnn", "fa4"]
    shapes, names = bench.plan_of_decode(parse_bench(["--decode", "--peers", "fa4",
                                                      "--head-dim", "64", "--prefill-seqlen",
                                                      "0"]))
    assert [(s.name, s.head_dim) for s in shapes] == [("decode", 64)]
    assert names == ["fa4lab", "fa4lab-unpacked", "fa4"]
    with pytest.raises(ValueError, match="one --head-dim"):
        bench.plan_of_decode(parse_bench(["--decode", "--head-dim", "64", "128"]))


# ---- record and table --------------------------------------------------------------------------
def _synthetic() -> list[DecodeResult]:
    decode, prefill = bench.gqa_shapes()
    gbps = 4000.0
    floor = bench.floor_us(decode.hbm_bytes, gbps)
    out = []
    for provider, us in (("fa4lab", 300.0), ("fa4lab-unpacked", 600.0), ("sdpa-flash", 450.0)):
        out.append(bench.decode._result(provider, decode, gbps, status=OK, us=us,
                                        x_floor=us / floor,
                                        gbps=decode.hbm_bytes / (us * 1e-6) / 1e9,
                                        tflops=decode.flops / (us * 1e-6) / 1e12,
                                        max_err=1e-3, tol=4e-3, first_call_s=2.5))
    out.append(bench.decode._result("sdpa-cudnn", decode, gbps, status=ERROR,
                                    note="RuntimeError: No available kernel"))
    out.append(bench.decode._result("fa4", decode, gbps, status=MISSING,
                                    note="flash-attn-4 is not installed"))
    for provider, us in (("fa4lab", 1000.0), ("fa4lab-unpacked", 1100.0)):
        out.append(bench.decode._result(provider, prefill, gbps, status=OK, us=us,
                                        x_floor=us / bench.floor_us(prefill.hbm_bytes, gbps),
                                        gbps=prefill.hbm_bytes / (us * 1e-6) / 1e9,
                                        tflops=prefill.flops / (us * 1e-6) / 1e12))
    out.append(bench.decode._result("fa4", prefill, gbps, status=FAILED, max_err=0.5,
                                    tol=0.01, note="max error 5.0e-01 > tolerance"))
    return out


def _record(results=None):
    shapes = bench.gqa_shapes()
    copy = bench.CopyBandwidth(1 << 30, 0.5368709, 4000.0)
    config = bench.decode_config(shapes, list(bench.DECODE_PROVIDERS), copy=copy)
    return bench.make_decode_record(results or _synthetic(), hbm_gbps=4000.0,
                                    gpu_name="Test GPU", arch="sm90",
                                    command="fa4lab bench --decode", config=config)


def test_decode_record_round_trip(tmp_path):
    rec = _record()
    for key in ("schema", "kind", "commit", "gpu", "date", "versions", "command", "config",
                "hbm_gbps", "results"):
        assert key in rec
    assert rec["kind"] == "decode" and "gemm_tflops" not in rec and rec["hbm_gbps"] == 4000.0
    assert rec["config"]["hbm_copy"] == {"bytes": 1 << 30, "ms": 0.5368709, "gbps": 4000.0}
    assert [s["name"] for s in rec["config"]["shapes"]] == ["decode", "prefill"]
    assert rec["config"]["shapes"][0]["hbm_bytes"] == 1_074_266_112
    assert rec["config"]["providers"]["fa4lab-unpacked"] == "fa4lab.attention, pack_gqa=False"
    first = rec["results"][0]
    for key in ("provider", "shape", "batch", "seqlen_q", "seqlen_k", "heads_q", "heads_kv",
                "head_dim", "causal", "dtype", "status", "us", "x_floor", "floor_us",
                "hbm_bytes", "gbps", "tflops", "max_err", "tol", "first_call_s", "note"):
        assert key in first
    name = bench.default_record_path(rec).name
    assert name.endswith("_test-gpu_" + (rec["commit"] or "nocommit")[:7] + "_"
                         + rec["time_utc"].replace(":", "") + "_decode.json")
    path = bench.save_record(rec, tmp_path / name)
    back = bench.load_record(path)
    assert bench.decode_results_of(back) == _synthetic()
    with pytest.raises(ValueError, match="decode_results_of"):
        bench.results_of(back)
    with pytest.raises(ValueError, match="decode_results_of"):
        bench.host_results_of(back)
    with pytest.raises(ValueError, match="results_of"):
        bench.decode_results_of(bench.make_record([], gemm=None, gpu_name="g", arch=None,
                                                  command="fa4lab bench", config={}))
    # the throughput readers never see it; asked for, it is there
    assert bench.load_records(tmp_path) == []
    assert [r["kind"] for r in bench.load_records(tmp_path, kinds=("decode",))] == ["decode"]
    assert bench.latest_record(bench.load_records(tmp_path, kinds=None),
                               provider="fa4lab") is not None
    summary = bench.recorded_decode_summary(tmp_path)
    assert f"latest recorded GQA decode: {name}" in summary and "| fa4lab |" in summary


def test_bad_decode_record_names_the_problem():
    rec = _record()
    rec["results"][0]["us"] = None
    with pytest.raises(ValueError, match="no positive us"):
        bench.validate_record(rec)
    rec = _record()
    del rec["hbm_gbps"]
    with pytest.raises(ValueError, match=r"lacks \['hbm_gbps'\]"):
        bench.validate_record(rec)
    rec = _record()
    del rec["results"][0]["seqlen_k"]
    with pytest.raises(ValueError, match="lacks"):
        bench.validate_record(rec)


def test_decode_table():
    text = bench.format_decode_table(_synthetic(), hbm_gbps=4000.0)
    lines = text.splitlines()
    assert lines[0] == "| shape | provider | us | x HBM floor | GB/s | TFLOP/s | fa4lab/this |"
    row = next(x for x in lines if "| decode b32" in x and "| fa4lab |" in x)
    # 300 us against a 268.6 us floor; 1.074 GB in 300 us = 3581 GB/s; 4.29 GFLOP = 14.3 TFLOP/s
    assert row == "| decode b32 sq1 sk8192 h32/8 hd128 full | fa4lab | 300.0 | 1.12 | 3581 | " \
                  "14.3 | 1.00 |"
    unpacked = next(x for x in lines if "| decode b32" in x and "| fa4lab-unpacked |" in x)
    assert unpacked.endswith("| 600.0 | 2.23 | 1790 | 7.2 | 2.00 |")
    assert "| sdpa-cudnn | error | - | - | - | - |" in text
    assert "| fa4 | missing |" in text and "| fa4 | failed |" in text
    prefill = next(x for x in lines if "| prefill b1" in x and "| fa4lab |" in x)
    assert "| 1000.0 |" in prefill and "| 550 |" in prefill      # 549.8 TFLOP in 1 ms
    assert "at 4000 GB/s" in text and "decode 1.074 GB = 268.6 us" in text
    assert "prefill 0.168 GB = 41.9 us" in text
    assert "- sdpa-cudnn decode: error: RuntimeError: No available kernel" in text
    assert "flash-attn-4 is not installed" in text
    no_bw = bench.format_decode_table([r for r in _synthetic() if r.shape == "decode"])
    assert "at 4000 GB/s" not in no_bw and "decode 1.074 GB = 268.6 us" in no_bw


# ---- the command -------------------------------------------------------------------------------
@needs_no_gpu
def test_decode_on_cpu_says_it_needs_a_gpu_and_exits_0(tmp_path, capsys):
    assert run_bench(["--decode", "--records", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "no CUDA GPU visible" in out
    assert "decode b32 sq1 sk8192 h32/8 hd128 full  1.074 GB to move" in out
    assert "prefill b1 sq8192 sk8192 h32/8 hd128 causal" in out
    assert "fa4lab-unpacked" in out and "pack_gqa=False" in out
    assert "sdpa-cudnn" in out and "fa4 " in out
    assert "1 GiB device-to-device copy_" in out
    assert "no recorded decode results" in out
    assert run_bench(["--decode", "--batch", "4", "--seqlen-k", "1024", "--prefill-seqlen",
                      "0", "--records", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "decode b4 sq1 sk1024 h32/8 hd128 full" in out and "prefill" not in out


@pytest.mark.parametrize("argv,message", [
    (["--decode", "--heads-kv", "5"], "not a multiple of --heads-kv 5"),
    (["--decode", "--head-dim", "64", "128"], "one --head-dim"),
    (["--decode", "--quick"], "--quick do not apply to --decode"),
    (["--decode", "--host-overhead"], "--host-overhead and --decode are separate modes"),
    (["--decode", "--plot", "x.png"], "--plot do not apply"),
    (["--batch", "4"], "--batch apply to --decode only"),
    (["--host-overhead", "--seqlen-k", "4"], "--seqlen-k apply to --decode only"),
])
def test_bad_decode_arguments_exit_2(argv, message, capsys):
    assert run_bench(argv) == 2
    assert message in capsys.readouterr().err


def test_decode_command_with_the_gpu_faked(monkeypatch, tmp_path, capsys):
    """The GPU path of `--decode` (bandwidth, providers, table, record) with the device faked
    and the runs on CPU tensors: the flow is tested here, not the speed."""
    from fa4lab import environment

    no_upstream_fa4(monkeypatch)
    monkeypatch.setattr(environment, "gpu", lambda: environment.GpuInfo("Fake H200", (9, 0)))
    monkeypatch.setattr(bench_decode, "copy_bandwidth",
                        lambda **kw: bench.CopyBandwidth(1 << 30, 0.5, 4294.967296))
    real_run = bench.run_decode
    monkeypatch.setattr(bench_cli, "run_decode",
                        lambda shapes, providers, **kw: real_run(
                            shapes, providers, **{**kw, "device": "cpu", "progress": False}))
    out_json = tmp_path / "decode.json"
    argv = ["--decode", "--batch", "2", "--seqlen-k", "64", "--heads-q", "4", "--heads-kv",
            "2", "--head-dim", "64", "--prefill-seqlen", "32", "--rep-ms", "1",
            "--json", str(out_json)]
    assert run_bench(argv) == 0
    text = capsys.readouterr().out
    assert "fa4lab bench --decode on Fake H200" in text and "record saved" in text
    assert "memory bandwidth (device-to-device copy_ of 1 GiB, read + write): 4295 GB/s" in text
    assert "| decode b2 sq1 sk64 h4/2 hd64 full | sdpa-flash |" in text
    rec = bench.load_record(out_json)
    assert rec["kind"] == "decode" and rec["gpu"] == "Fake H200" and rec["arch"] == "sm90"
    assert rec["hbm_gbps"] == pytest.approx(4294.967296)
    assert rec["command"].startswith("fa4lab bench --head-dim 64 --json ")
    assert "--decode --batch 2 --seqlen-k 64" in rec["command"]
    res = bench.decode_results_of(rec)
    assert {(r.shape, r.provider) for r in res} == {
        (s, p) for s in ("decode", "prefill") for p in bench.DECODE_PROVIDERS}
    for r in res:
        assert r.status == OK or r.note
        assert r.floor_us == pytest.approx(r.hbm_bytes / 4294.967296e9 * 1e6)
    status = {(r.shape, r.provider): r for r in res}
    for shape in ("decode", "prefill"):
        flash = status[(shape, "sdpa-flash")]          # torch's CPU flash takes GQA
        assert flash.status == OK and flash.max_err <= flash.tol
        assert flash.x_floor == pytest.approx(flash.us / flash.floor_us)
        for ours in ("fa4lab", "fa4lab-unpacked"):     # never the float64 fallback
            assert status[(shape, ours)].status == ERROR
            assert "SlowReferenceWarning" in status[(shape, ours)].note
        assert status[(shape, "fa4")].status == MISSING
    assert run_bench(argv + ["--strict"]) == 1        # fa4lab raised: --strict says so
    capsys.readouterr()
    # on a GPU without a fa4lab kernel the peers are still measured
    assert run_bench(argv[:-2] + ["--no-save", "--arch", "sm100", "--peers", "sdpa-flash"]) == 0
    captured = capsys.readouterr()
    assert "not --arch sm100" in captured.err
    assert "| fa4lab-unpacked | missing |" in captured.out
