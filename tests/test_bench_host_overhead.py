"""`fa4lab bench --host-overhead` on a CPU: the timing loop with fake providers (known sleeps,
a raiser, a counted synchronize), the real providers' calls on CPU tensors, and the command
with the GPU faked."""

from __future__ import annotations

import statistics
import time

import pytest
from bench_checks import needs_no_gpu, no_upstream_fa4, recording_varlen

from fa4lab import bench
from fa4lab.bench import ERROR, FAILED, MISSING, OK, host_overhead
from fa4lab.bench import cli as bench_cli
from fa4lab.cli import main as fa4lab_main

SLEEP_US = 500.0


def _sleeps():
    time.sleep(SLEEP_US / 1e6)


def _raises():
    raise RuntimeError("launch failed")


def test_measures_host_time_per_call_of_each_provider():
    res = bench.measure_host_overhead({"sleeps": _sleeps, "noop": lambda: None,
                                       "raises": _raises}, "cpu", calls=20, repeats=3, warmup=2)
    assert [r.provider for r in res] == ["sleeps", "noop", "raises"]
    sleeps, noop, raises = res
    assert sleeps.status == OK and len(sleeps.repeats_us) == 3
    # time.sleep never returns early; the upper bound leaves room for a loaded machine
    assert SLEEP_US <= sleeps.mean_us < 10 * SLEEP_US
    assert min(sleeps.repeats_us) <= sleeps.median_us <= max(sleeps.repeats_us)
    assert sleeps.mean_us == pytest.approx(statistics.fmean(sleeps.repeats_us), rel=1e-3)
    assert noop.status == OK and noop.mean_us < 100 < sleeps.mean_us
    assert raises.status == ERROR and "launch failed" in raises.note and raises.mean_us is None


def test_synchronizes_before_each_repeat_and_never_inside_one(monkeypatch):
    events = []

    def slow_sync():
        events.append("sync")
        time.sleep(0.02)

    monkeypatch.setattr(host_overhead, "sync_for", lambda device: slow_sync)
    (res,) = bench.measure_host_overhead({"p": lambda: events.append("call")}, "cuda",
                                         calls=3, repeats=2, warmup=2)
    assert events == ["call"] * 2 + (["sync"] + ["call"] * 3) * 2 + ["sync"]
    # the 20 ms synchronize is outside the timed loop
    assert res.status == OK and res.mean_us < 5000


def test_bad_counts_are_an_error():
    with pytest.raises(ValueError, match="calls"):
        bench.measure_host_overhead({"noop": lambda: None}, "cpu", calls=0)


def test_real_calls_on_cpu_are_checked_and_the_unrunnable_reported(monkeypatch):
    no_upstream_fa4(monkeypatch)
    ready, not_run = bench.host_calls("cpu")
    assert list(ready) == ["sdpa"]
    status = {r.provider: r for r in not_run}
    # on CPU tensors fa4lab.attention is the float64 reference: never timed as fa4lab
    assert status["fa4lab"].status == MISSING and "SlowReferenceWarning" in status["fa4lab"].note
    assert status["fa4"].status == MISSING and "pip install flash-attn-4" in status["fa4"].note
    (sdpa,) = bench.measure_host_overhead(ready, "cpu", calls=5, repeats=2)
    assert sdpa.status == OK and sdpa.mean_us > 0
    with pytest.raises(ValueError, match="unknown host-overhead provider"):
        bench.host_calls("cpu", ["xformers"])


def test_table_reads_against_fa4lab():
    rows = [bench.HostResult("fa4lab", OK, 150.0, 148.0, [150.0]),
            bench.HostResult("fa4", MISSING, note="flash-attn-4 is not installed"),
            bench.HostResult("sdpa", OK, 30.0, 29.5, [30.0])]
    text = bench.format_host_table(rows)
    dense = "| dense | b1 s128 h1 hd128 full | bf16 |"        # a record from before the cases
    assert f"{dense} fa4lab | default | 150.0 | 148.0 | 1.00 |" in text
    assert f"{dense} sdpa | (b, h, s, d) | 30.0 | 29.5 | 0.20 |" in text
    assert f"{dense} fa4 | same args | missing | - | - |" in text
    assert "flash-attn-4 is not installed" in text


def test_the_cases_cover_varlen_and_paged_at_batch_1_32_256():
    cases = bench.host_cases()
    assert [c.name for c in cases] == ["dense", "varlen b1", "varlen b32", "varlen b256",
                                       "paged b1", "paged b32", "paged b256"]
    varlen, paged = cases[2].serving, cases[5].serving
    assert (varlen.scenario, varlen.batch, varlen.seqlens_q[0], varlen.causal) == (
        "varlen-prefill", 32, host_overhead.HOST_TOKENS, True)
    assert (paged.scenario, paged.batch, paged.seqlens_q, paged.page_size) == (
        "paged-decode", 32, (1,) * 32, host_overhead.HOST_PAGE_SIZE)
    assert cases[5].label() == "b32 sq1 sk64 h1/1 hd128 full p16"
    # fa4lab's default call heads every case; its variants and FA4 follow
    for c in cases:
        assert c.providers[0] == "fa4lab"
    assert cases[1].providers == ("fa4lab", "fa4lab-checked", "fa4lab-unchecked",
                                  "fa4lab-metadata", "fa4")
    with pytest.raises(ValueError, match="entry"):
        host_overhead.HostCase("prefill")


@pytest.mark.parametrize("entry", ["varlen", "paged"])
def test_varlen_and_paged_calls_are_checked_then_measured(monkeypatch, entry):
    """The real calls on CPU tensors: fa4lab's would be the float64 fallback (never timed:
    missing), FA4 is not installed. With attention_varlen replaced by a stand-in (the
    reference), the default call passes NO check_indices, its variants True / False; each is
    checked against the reference over every sequence, then measured; a wrong stand-in fails
    its check and is not timed."""
    no_upstream_fa4(monkeypatch)
    case = host_overhead.HostCase(entry, 3)
    ready, not_run = bench.host_calls("cpu", case=case)
    assert ready == {}
    status = {r.provider: r for r in not_run}
    assert status["fa4lab"].status == MISSING and "SlowReferenceWarning" in status["fa4lab"].note
    assert status["fa4"].status == MISSING and status["fa4"].case == case.name

    seen = recording_varlen(monkeypatch)

    def wrong(q, k, v, args, serving_case):
        return lambda: q * 0

    makers = {**host_overhead.VARLEN_CALLS, "wrong": wrong}
    ready, not_run = bench.host_calls("cpu", (*case.providers, "wrong"), case, makers)
    assert list(ready) == ["fa4lab", "fa4lab-checked", "fa4lab-unchecked", "fa4lab-metadata"]
    assert {r.provider: r.status for r in not_run} == {"fa4": MISSING, "wrong": FAILED}
    assert seen[0] == {}                                   # the default call: no check_indices
    seen.clear()
    for call in ready.values():
        call()
    assert seen[:3] == [{}, {"check_indices": True}, {"check_indices": False}]
    assert set(seen[3]) == {"scheduler_metadata"}
    res = bench.measure_host_overhead(ready, "cpu", calls=3, repeats=2, warmup=1,
                                      case=case.name, shape=case.label())
    assert all(r.status == OK and r.mean_us > 0 and r.case == case.name for r in res)
    text = bench.format_host_table(res[::-1] + not_run)
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines()
             if line.startswith(f"| {case.name} |")]
    assert [c[3:5] for c in cells] == [["fa4lab", "default"],
                                       ["fa4lab-checked", "check_indices=True"],
                                       ["fa4lab-unchecked", "check_indices=False"],
                                       ["fa4lab-metadata", "scheduler_metadata"],
                                       ["fa4", "same args"], ["wrong", ""]]
    assert cells[0][1] == case.label() and cells[0][-1] == "1.00"


def test_measure_host_cases_in_provider_order():
    def calls_of(device, names, case):
        return ({n: (lambda: None) for n in names if n != "fa4"},
                [bench.HostResult("fa4", MISSING, note="not here", case=case.name,
                                  shape=case.label())])

    cases = bench.host_cases((1,))
    res = bench.measure_host_cases(cases, "cpu", calls=2, repeats=1, warmup=0,
                                   calls_of=calls_of)
    assert [(r.case, r.provider) for r in res] == [
        (c.name, p) for c in cases for p in c.providers]
    assert {r.shape for r in res if r.case == "paged b1"} == {cases[2].label()}


# ---- the command ---------------------------------------------------------------------------
@needs_no_gpu
def test_host_overhead_on_cpu_says_it_needs_a_gpu_and_exits_0(tmp_path, capsys):
    assert fa4lab_main(["bench", "--host-overhead", "--records", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "no CUDA GPU visible" in out and "needs a GPU" in out
    assert "(1, 128, 1, 128) bf16" in out and "5 x 500 back-to-back calls" in out
    assert "no recorded host-overhead results" in out


def test_host_overhead_bad_counts_exit_2(capsys):
    assert fa4lab_main(["bench", "--host-overhead", "--calls", "0"]) == 2
    assert "--calls (0)" in capsys.readouterr().err


def test_host_overhead_command_with_the_gpu_faked(monkeypatch, tmp_path, capsys):
    """The GPU path (calls, table, record) with the device faked and the calls on CPU tensors."""
    from fa4lab import environment

    no_upstream_fa4(monkeypatch)
    monkeypatch.setattr(environment, "gpu", lambda: environment.GpuInfo("Fake H200", (9, 0)))
    real_cases = bench.measure_host_cases
    monkeypatch.setattr(bench_cli, "measure_host_cases",
                        lambda cases, device, **kw: real_cases(cases, "cpu", **kw))
    out_json = tmp_path / "host.json"
    assert fa4lab_main(["bench", "--host-overhead", "--calls", "5", "--repeats", "2",
                        "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "fa4lab bench --host-overhead on Fake H200" in text and "record saved" in text
    assert "paged b256" in text and "check_indices=True" in text
    rec = bench.load_record(out_json)
    assert rec["kind"] == "host-overhead" and rec["gpu"] == "Fake H200"
    assert rec["config"]["calls"] == 5 and rec["config"]["repeats"] == 2
    assert list(rec["config"]["cases"]) == [c.name for c in bench.host_cases()]
    assert rec["command"].startswith("fa4lab bench --json ")
    assert rec["command"].endswith(" --host-overhead --calls 5 --repeats 2")
    res = bench.host_results_of(rec)
    assert [(r.case, r.provider) for r in res] == [
        (c.name, p) for c in bench.host_cases() for p in c.providers]
    dense = [r for r in res if r.case == "dense"]
    assert [r.status for r in dense] == [MISSING, MISSING, OK]
    # on CPU tensors fa4lab's varlen / paged calls are the float64 fallback: never timed
    assert all(r.status == MISSING for r in res if r.case != "dense")
    # what the CPU path prints from the records
    summary = bench_cli.recorded_host_summary(tmp_path)
    assert "latest recorded host overhead: host.json" in summary and "| sdpa |" in summary
