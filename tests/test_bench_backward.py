"""`fa4lab bench --backward` on a CPU: the cases and their FLOPs (2.5 x the forward's count),
the gradient check before timing (a right provider is timed, a wrong one failed and not timed,
one that raises is an error, a missing one says why), the record and its validation, the
table, the command line (no GPU; bad arguments; the GPU path with the device faked and the runs
on CPU tensors)."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
from bench_checks import needs_no_gpu, no_upstream_fa4, run_bench

from fa4lab import bench
from fa4lab.bench import ERROR, FAILED, MISSING, OK, Result, backward_cli
from fa4lab.bench import backward as bb
from fa4lab.bench import providers as bench_providers
from fa4lab.bench.records import BACKWARD, backward_results_of


# hd64, seqlen 128: batch 1, heads 2 (the checked heads), a few ms per backward on a CPU.
def _tiny(causal=(False, True)):
    return bb.backward_cases([64], [128], causal, total_tokens=128, hidden=128)


# ---- the cases and their FLOPs -----------------------------------------------------------------
def test_the_cases_are_the_backwards_anchor():
    cases = bb.backward_cases()
    assert len(cases) == 2 * 3 * 2
    assert {(c.head_dim, c.seqlen, c.causal) for c in cases} == {
        (d, s, c) for d in (64, 128) for s in (2048, 8192, 16384) for c in (False, True)}
    for c in cases:
        assert c.batch * c.seqlen == 16384 and c.heads * c.head_dim == 2048 and c.dtype == "bf16"


@pytest.mark.parametrize("causal", [False, True])
def test_backward_flops_are_two_and_a_half_forwards(causal):
    (shape,) = bb.backward_cases([128], [8192], [causal])
    b, h, s, d = shape.batch, shape.heads, shape.seqlen, shape.head_dim
    forward = 4 * b * h * s * s * d / (2 if causal else 1)
    assert shape.flops == forward                 # the forward bench's count
    assert bb.backward_flops(shape) == 2.5 * forward
    assert "2.5 x the forward's FLOPs" in bb.FLOPS_RULE


# ---- the check before timing -------------------------------------------------------------------
def _sdpa_math():
    return bb.autograd_setup(bench_providers.sdpa_runner("MATH", layout="bhsd"),
                             bench_providers.to_bhsd)


def _moved_dk(setup):
    def wrong(*args):
        call, to_bshd = setup(*args)
        return (lambda: (lambda g: (g[0], g[1] * 1.5, g[2]))(call())), to_bshd
    return wrong


def _raises(*args):
    raise RuntimeError("no kernel for this")


def test_each_provider_is_checked_then_timed_or_reported():
    (shape,) = _tiny([True])
    providers = [bb.BackwardProvider("right", _sdpa_math()),
                 bb.BackwardProvider("wrong", _moved_dk(_sdpa_math())),
                 bb.BackwardProvider("raises", _raises),
                 bb.BackwardProvider("absent", None, "not installed")]
    seen = []
    res = {r.provider: r for r in bb.measure_case(shape, providers, device="cpu", rep_ms=1,
                                                  on_result=seen.append)}
    assert [r.provider for r in seen] == ["right", "wrong", "raises", "absent"]
    right, wrong = res["right"], res["wrong"]
    assert right.status == OK and right.ms > 0 and right.max_err <= right.tol
    assert right.tflops == pytest.approx(bb.backward_flops(shape) / (right.ms * 1e-3) / 1e12)
    assert wrong.status == FAILED and wrong.ms is None and wrong.tflops is None
    assert "dk: max error" in wrong.note and wrong.max_err > wrong.tol
    assert res["raises"].status == ERROR and "no kernel for this" in res["raises"].note
    assert res["absent"].status == MISSING and res["absent"].note == "not installed"


def test_the_gradient_check_reads_the_slice_of_the_full_gradients():
    """dq, dk, dv of the full problem, checked on batch 0 and heads 0..1 only: a wrong head
    beyond the slice is not seen, a NaN inside it is."""
    import torch

    shape = bb.backward_cases([64], [64], [False], total_tokens=128, hidden=256)[0]
    assert (shape.batch, shape.heads) == (2, 4)
    q, k, v, dout = bb.backward_inputs(shape, "cpu")
    check = bb.gradient_reference(q, k, v, dout, shape)
    from fa4lab.reference_backward import attention_backward_reference

    exact = [g.to(torch.bfloat16) for g in attention_backward_reference(q, k, v, dout)[:3]]
    assert bb.check_gradients(exact, check)[0]
    exact[1][:, :, 3] = 7.0                          # head 3: outside the slice
    exact[1][1] = 7.0                                # batch 1: outside the slice
    assert bb.check_gradients(exact, check)[0]
    exact[2][0, 5, 1, 0] = float("nan")
    passed, _, _, note = bb.check_gradients(exact, check)
    assert not passed and "dv has NaN/inf" in note


# ---- record and table --------------------------------------------------------------------------
def _rows(shape):
    return [Result.for_shape("fa4lab", shape, status=OK, ms=2.0, tflops=100.0, max_err=1e-3,
                             tol=4e-3, first_call_s=3.0),
            Result.for_shape("fa4lab-kernel", shape, status=OK, ms=1.0, tflops=200.0),
            Result.for_shape("fa4", shape, status=OK, ms=0.5, tflops=400.0),
            Result.for_shape("sdpa-cudnn", shape, status=MISSING, note="this torch build has "
                                                                      "no cuDNN")]


def test_the_record_validates_and_reads_back(tmp_path):
    shapes = _tiny()
    results = [r for s in shapes for r in _rows(s)]
    config = bb.backward_config(shapes, list(bb.BACKWARD_PROVIDERS), wall_s=1.0)
    rec = bb.make_backward_record(results, gpu_name="Fake H100", arch="sm90",
                                  command="fa4lab bench --backward", config=config)
    assert rec["kind"] == BACKWARD and "gemm_tflops" not in rec
    assert "2.5 x the forward's FLOPs" in rec["notes"]
    assert rec["config"]["cases"][shapes[0].label()]["flops"] == bb.backward_flops(shapes[0])
    assert set(rec["config"]["providers"]) == set(bb.BACKWARD_PROVIDERS)
    path = bench.default_record_path(rec)
    assert path.name.endswith("_backward.json")
    bench.save_record(rec, tmp_path / path.name)
    assert [r["kind"] for r in bench.load_records(tmp_path, kinds=(BACKWARD,))] == [BACKWARD]
    assert bench.load_records(tmp_path) == []        # not a forward throughput record
    loaded = bench.load_record(tmp_path / path.name)
    assert backward_results_of(loaded) == results
    with pytest.raises(ValueError, match="backward_results_of"):
        bench.results_of(loaded)
    broken = dict(rec, results=[dataclasses.asdict(dataclasses.replace(results[0], tflops=None))])
    with pytest.raises(ValueError, match="no positive tflops"):
        bench.validate_record(broken)


def test_the_table_gives_fa4labs_ratios_and_the_kernels():
    text = bb.format_backward_table([r for s in _tiny() for r in _rows(s)])
    assert "| head_dim | causal | seqlen | fa4lab | sdpa-cudnn | fa4 | fa4lab-kernel |" in text
    assert "fa4lab/fa4 0.25" in text and "fa4lab/fa4lab-kernel 0.50" in text
    assert "fa4lab-kernel/fa4 0.50" in text
    assert "sdpa-cudnn" in text and "no cuDNN" in text


# ---- the command -------------------------------------------------------------------------------
@needs_no_gpu
def test_backward_on_cpu_says_what_it_would_run(tmp_path, capsys):
    _ = tmp_path
    assert run_bench(["--backward", "--records", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "no CUDA GPU visible" in out
    assert "12 cases x 5 providers, the backward only (bf16" in out
    for shape in bb.backward_cases():
        assert f"  {shape.label()}  {bb.backward_flops(shape) / 1e12:.2f} TFLOP" in out
    assert "fa4lab-kernel" in out and "sdpa-cudnn" in out
    assert "no recorded backward results" in out


@pytest.mark.parametrize("argv, message", [
    (["--backward", "--plot", "x.png"], "--plot do not apply to --backward"),
    (["--backward", "--peers", "flex"], "unknown ['flex'] for --backward"),
    (["--backward", "--features"], "are separate modes"),
    (["--backward", "--seqlen", "3000"], "does not divide --total-tokens"),
    (["--backward", "--step-timeout", "0"], "--step-timeout must be > 0"),
])
def test_bad_arguments_exit_2(argv, message, capsys):
    assert run_bench(argv) == 2
    assert message in capsys.readouterr().err


def test_quick_and_peers_choose_the_cases_and_providers():
    import argparse

    parser = argparse.ArgumentParser()
    bench.add_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "--backward", "--quick", "--peers", "fa4,fa4lab-kernel",
                              "--causal", "true"])
    cases, names = backward_cli.plan_of_backward(args)
    assert [(c.head_dim, c.seqlen, c.causal) for c in cases] == [(128, 2048, True),
                                                                  (128, 8192, True)]
    assert names == ["fa4lab", "fa4lab-kernel", "fa4"]


def test_backward_command_with_the_gpu_faked(monkeypatch, tmp_path, capsys):
    """The GPU path of `--backward` (providers, check, time, table, record) with the device
    faked and the runs on CPU tensors: the flow, not the speed."""
    from fa4lab import environment

    no_upstream_fa4(monkeypatch)
    monkeypatch.setattr(environment, "gpu", lambda: environment.GpuInfo("Fake H100", (9, 0)))
    real_run = bb.run_backward
    monkeypatch.setattr(backward_cli, "run_backward", lambda cases, providers, **kw: real_run(
        cases, providers, **{**kw, "device": "cpu", "progress": False}))
    out_json = tmp_path / "backward.json"
    argv = ["--backward", "--head-dim", "64", "--seqlen", "128", "--total-tokens", "128",
            "--hidden", "128", "--rep-ms", "1", "--json", str(out_json)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert run_bench(argv) == 0
    text = capsys.readouterr().out
    assert "fa4lab bench --backward on Fake H100" in text and "record saved" in text
    assert "| head_dim | causal | seqlen |" in text and "TFLOP/s: the backward as 2.5 x" in text
    rec = bench.load_record(out_json)
    assert rec["kind"] == BACKWARD and rec["arch"] == "sm90" and rec["gpu"] == "Fake H100"
    assert rec["command"].startswith("fa4lab bench --head-dim 64 --seqlen 128 ")
    assert rec["config"]["time_limits"]["step_timeout_s"] == bench.features.STEP_TIMEOUT_S
    res = {(r.causal, r.provider): r for r in backward_results_of(rec)}
    assert set(res) == {(c, p) for c in (False, True) for p in bb.BACKWARD_PROVIDERS}
    for causal in (False, True):
        flash = res[(causal, "sdpa-flash")]
        assert flash.status == OK and flash.max_err <= flash.tol and flash.tflops > 0
        assert res[(causal, "fa4")].status == MISSING
        assert "flash-attn-4 is not installed" in res[(causal, "fa4")].note
        assert res[(causal, "sdpa-cudnn")].status in (OK, MISSING)
        # on CPU tensors fa4lab is the float64 fallback and no kernel runs: never timed
        for p in ("fa4lab", "fa4lab-kernel"):
            assert res[(causal, p)].status == ERROR and res[(causal, p)].ms is None
        assert "SlowReferenceWarning" in res[(causal, "fa4lab")].note
