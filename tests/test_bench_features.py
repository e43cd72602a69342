"""`fa4lab bench --features` on a CPU: the plan of a run (rows, skipped peers and why), the
FLOP count against a brute-force count of the reference's mask, the check with a feature's
options (the PyTorch peers pass, a peer that drops the option fails), the run's time limits,
the record, the table, the command line (no GPU, and the GPU path with the device faked and the
runs on CPU tensors); and on a GPU, a tiny `--features` run end to end."""

from __future__ import annotations

import dataclasses
import importlib.util
import time
import warnings

import numpy as np
import pytest
from bench_checks import needs_no_gpu, no_upstream_fa4, parse_bench, run_bench

from fa4lab import bench
from fa4lab.bench import (
    ERROR,
    FAILED,
    MISSING,
    OK,
    SKIPPED,
    Feature,
    FeatureResult,
    Provider,
    features_cli,
)
from fa4lab.bench import features as bf
from fa4lab.bench import providers as bench_providers
from fa4lab.reference import visible_mask

# Small versions of every kind of feature (the mode's own sizes are for seqlen 8192).
SMALL = (Feature("none", "full"), Feature("causal", "causal", causal=True),
         Feature("window", "window", window_size=(40, 0)),
         Feature("window-both", "window both", window_size=(24, 9)),
         Feature("softcap", "softcap", softcap=5.0),
         Feature("sink", "sink", causal=True, sink=True),
         Feature("alibi", "alibi", causal=True, mod="alibi"),
         Feature("relative-bias", "relative bias", mod="relative_bias", mod_size=16),
         Feature("document", "documents", causal=True, mod="document_mask", mod_size=3),
         Feature("prefix-lm", "prefix", mod="prefix_lm", mod_size=50))


def _small_cases(features=SMALL, seqlen=192):
    # batch 2, heads 3: the check covers heads 0..1 of batch 0; the FLOPs count every one
    return bf.feature_cases(features, head_dim=64, seqlen=seqlen, total_tokens=2 * seqlen,
                            hidden=192)


# ---- the plan of a run -------------------------------------------------------------------------
def test_the_mode_covers_every_option_at_the_sweeps_hd128_s8192_shape():
    cases = bf.feature_cases(bf.OPTION_FEATURES)
    sweep = bench.shape_for(128, 8192, False)
    assert all((c.batch, c.seqlen, c.heads, c.head_dim, c.dtype) ==
               (sweep.batch, sweep.seqlen, sweep.heads, sweep.head_dim, "bf16") for c in cases)
    specs = {c.feature.name: c.spec for c in cases}
    assert specs["none"].has_mask is False and specs["causal"].causal
    assert specs["window-1024-0"].effective_window == (1024, 0)
    assert specs["window-512-512"].effective_window == (512, 512)
    assert specs["softcap"].softcap == 30.0 and not specs["softcap"].causal
    assert specs["softcap-causal"].softcap == 30.0 and specs["softcap-causal"].causal
    assert specs["sink-causal"].learnable_sink and specs["sink-causal"].causal
    mods = {c.feature.mod: c.feature for c in cases if c.feature.mod}
    assert set(mods) == {"alibi", "relative_bias", "document_mask", "prefix_lm"}
    assert mods["document_mask"].mod_size == 4 and mods["prefix_lm"].mod_size == 1024
    assert not specs["prefix-lm"].causal   # the mod holds the causal part after the prefix


def test_the_model_features_are_the_issues_table():
    cases = {c.feature.name: c for c in bf.feature_cases(bf.MODEL_FEATURES)}
    want = {  # (batch, seqlen, heads_q, heads_kv, head_dim, head_dim_v), causal, window,
        #        softcap, sink
        "gpt-oss-sink-window": ((4, 4096, 64, 8, 64, 64), (128, 0), 0.0, True),
        "gpt-oss-sink": ((4, 4096, 64, 8, 64, 64), (None, 0), 0.0, True),
        "mla-prefill": ((4, 4096, 16, 16, 192, 128), (None, 0), 0.0, False),
        "mistral-window": ((1, 16384, 32, 8, 128, 128), (4096, 0), 0.0, False),
        "gqa16-hd64": ((8, 2048, 32, 2, 64, 64), (None, 0), 0.0, False),
        "gemma2-softcap": ((2, 8192, 16, 8, 256, 256), (4096, 0), 50.0, False),
    }
    assert list(cases) == list(want)
    for name, (shape, window, softcap, sink) in want.items():
        spec = cases[name].spec
        assert (spec.batch, spec.seqlen_q, spec.heads_q, spec.heads_kv, spec.head_dim,
                spec.head_dim_v) == shape, name
        assert spec.seqlen_k == spec.seqlen_q and spec.causal and spec.dtype == "bf16"
        assert spec.effective_window == window, name
        assert (spec.softcap, spec.learnable_sink) == (softcap, sink), name
    assert cases["gqa16-hd64"].spec.heads_q // cases["gqa16-hd64"].spec.heads_kv == 16
    assert bf.features_named(["models"]) == list(bf.MODEL_FEATURES)
    assert bf.features_named(["options", "mla-prefill"]) == [*bf.OPTION_FEATURES,
                                                              bf.MODEL_FEATURES[2]]
    # FA4 runs every model feature (none is a mod); SDPA cannot softcap
    rows = {(r.feature, r.provider): r.skip
            for r in bf.plan_features(bf.MODEL_FEATURES, bf.FEATURE_PEERS)}
    assert not any(rows[(f.name, "fa4")] for f in bf.MODEL_FEATURES)
    assert rows[("gemma2-softcap", "sdpa")] and not rows[("mistral-window", "sdpa")]


def _small_models():
    """The model features at small sizes (their options, GQA and head dims kept)."""
    shapes = {"gpt-oss-sink-window": bf.FeatureShape(1, 160, 8, 2, 64, 64),
              "gqa16-hd64": bf.FeatureShape(1, 96, 32, 2, 64, 64),
              "mla-prefill": bf.FeatureShape(1, 96, 4, 4, 192, 128),
              "gemma2-softcap": bf.FeatureShape(1, 96, 4, 2, 64, 64)}
    small = [dataclasses.replace(f, shape=shapes[f.name],
                                 window_size=(40, 0) if f.window_size[0] else f.window_size)
             for f in bf.MODEL_FEATURES if f.name in shapes]
    return bf.feature_cases(small)


def test_fa4lab_and_fa4_get_the_same_call_on_every_model_feature(monkeypatch):
    """The headline row is fa4lab's default call: `attention` with the feature's options and
    nothing else; upstream FA4 gets the same options (its bf16 sink: the same numbers) and the
    same q, k, v (GQA heads, head dims)."""
    import torch

    from fa4lab import api

    ours, theirs = [], []
    monkeypatch.setattr(api, "attention", lambda q, k, v, **kw: ours.append((q, k, v, kw)) or q)
    monkeypatch.setattr(bench_providers, "fa4_function",
                        lambda: lambda q, k, v, **kw: theirs.append((q, k, v, kw)) or q)
    for case in bf.feature_cases(bf.MODEL_FEATURES):
        ours.clear()
        theirs.clear()
        call = bf.feature_call(case, "cpu")
        q, k, v = (torch.empty(0),) * 3
        for name in ("fa4lab", "fa4"):
            bf.feature_provider(name, call).runner(q, k, v, case.spec.causal, 0.125)
        ((*_, mine),), ((*_, fa4),) = ours, theirs
        assert set(mine) == set(fa4), case.feature.name
        for key in mine:
            if key == "learnable_sink":
                assert fa4[key].dtype == torch.bfloat16
                assert torch.equal(fa4[key].float(), mine[key])
            else:
                assert mine[key] == fa4[key], (case.feature.name, key)
        assert mine["causal"] is True and mine["softmax_scale"] == 0.125
        assert not {"pack_gqa", "num_splits"} & set(mine)       # nothing tuned: the default
        spec = case.spec
        assert ("window_size" in mine) == (spec.window_size != (None, None))
        assert mine.get("softcap", 0.0) == spec.softcap
        assert ("learnable_sink" in mine) == spec.learnable_sink


@pytest.mark.slow
def test_the_pytorch_peers_pass_the_check_on_the_model_features():
    """GQA, a second head dim, sink + window, softcap + window: SDPA and Flex (eager) compute
    what the reference does, so the check before timing holds them to fa4lab's semantics."""
    for case in _small_models():
        by = {r.provider: r for r in bf.measure_feature(case, ["sdpa", "flex"], device="cpu",
                                                         rep_ms=1, flex_compile=False)}
        assert (by["fa4lab"].heads_kv, by["fa4lab"].head_dim_v) == (case.spec.heads_kv,
                                                                     case.spec.head_dim_v)
        for name in ("sdpa", "flex"):
            r = by[name]
            if name == "sdpa" and case.spec.softcap:
                assert r.status == SKIPPED
                continue
            assert r.status == OK, f"{name} {case.feature.name}: {r.note}"
            assert r.max_err <= r.tol


def test_the_headline_row_is_fa4labs_default_call_first_in_each_feature():
    """Note [the headline row]: whatever order the rows come in, each feature's first row in
    the table is fa4lab, its call column "default"; ratios are over it."""
    rows = []
    for case in bf.feature_cases([bf.OPTION_FEATURES[1], bf.MODEL_FEATURES[0]]):
        for provider, us in (("flex", 300.0), ("fa4", 150.0), ("fa4lab", 100.0)):
            rows.append(bf._row(case, provider, 1e12, status=OK, us=us,
                                tflops=1e12 / (us * 1e-6) / 1e12))
    text = bench.format_features_table(rows)
    for name, shape in (("causal", "b2 s8192 h16/16 hd128"),
                        ("gpt-oss-sink-window", "b4 s4096 h64/8 hd64")):
        cells = [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines()
                 if line.startswith(f"| {name} | b")]
        assert [c[3:5] for c in cells] == [["fa4lab", "default"], ["fa4", "same options"],
                                           ["flex", "torch.compile"]]
        assert {c[1] for c in cells} == {shape} and {c[2] for c in cells} == {"bf16"}
        assert [c[-1] for c in cells] == ["1.00", "1.50", "3.00"]
    assert "default call" in bf.FEATURE_LABELS["fa4lab"]
    mla = bf.feature_cases([bf.MODEL_FEATURES[2]])[0]
    assert bf._row(mla, "fa4lab", None).shape_label() == "b4 s4096 h16/16 hd(192, 128)"


def test_plan_rows_and_which_peers_skip_why():
    rows = bf.plan_features(bf.ALL_FEATURES, bf.FEATURE_PEERS)
    assert len(rows) == len(bf.ALL_FEATURES) * 4
    by = {(r.feature, r.provider): r.skip for r in rows}
    for f in bf.ALL_FEATURES:
        assert by[(f.name, "fa4lab")] == "" and by[(f.name, "flex")] == ""
        # upstream FA4 takes the options it has; fa4lab's mods are not ported to it
        assert bool(by[(f.name, "fa4")]) == f.is_mod
        # SDPA cannot softcap; everything else it gets as a materialized mask or bias
        assert bool(by[(f.name, "sdpa")]) == bool(f.softcap)
    assert "CuTe-DSL" in by[("alibi", "fa4")] and "tanh" in by[("softcap", "sdpa")]
    only = bf.plan_features(bf.features_named(["alibi"]), ["flex"])
    assert [(r.provider, r.skip) for r in only] == [("fa4lab", ""), ("flex", "")]
    with pytest.raises(ValueError, match="unknown.*sdpa-flash"):
        bf.plan_features(bf.ALL_FEATURES, ["sdpa-flash"])
    with pytest.raises(ValueError, match="unknown.*'nope'"):
        bf.features_named(["nope"])


def test_the_calls_options():
    import torch

    cases = {c.feature.name: c for c in _small_cases()}
    sink = bf.feature_call(cases["sink"], "cpu")
    opts, fa4_opts = sink.options(), sink.options(sink_dtype=torch.bfloat16)
    assert opts["learnable_sink"].dtype == torch.float32 and opts["learnable_sink"].shape == (3,)
    # upstream FA4 takes a bf16 sink: the same numbers, exactly
    assert fa4_opts["learnable_sink"].dtype == torch.bfloat16
    assert torch.equal(fa4_opts["learnable_sink"].float(), opts["learnable_sink"])
    assert bf.feature_call(cases["window-both"], "cpu").options() == {"window_size": (24, 9)}
    assert bf.feature_call(cases["window"], "cpu").options() == {"window_size": (40, None)}
    assert set(bf.feature_call(cases["alibi"], "cpu").options()) == {"score_mod", "aux_tensors"}
    assert set(bf.feature_call(cases["prefix-lm"], "cpu").options()) == {"mask_mod"}
    again = bf.feature_call(cases["relative-bias"], "cpu")     # seeded: the same every run
    assert torch.equal(again.aux[0], bf.feature_call(cases["relative-bias"], "cpu").aux[0])
    with pytest.raises(ValueError, match="needs seqlen > 50"):
        _small_cases(seqlen=48)


# ---- FLOPs -------------------------------------------------------------------------------------
def _brute_force_pairs(case) -> int:
    """Visible pairs over batch and heads, from the reference's mask and the mods written out
    by hand (Note [visible FLOPs])."""
    f, s = case.feature, case.seqlen
    mask = visible_mask(s, s, f.causal, window_size=f.window_size)
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    if f.mod == "document_mask":
        doc = np.arange(s) * f.mod_size // s
        mask = mask & (doc[i] == doc[j])
    if f.mod == "prefix_lm":
        mask = mask & ((j < f.mod_size) | (j <= i))
    return int(mask.sum()) * case.batch * case.heads


@pytest.mark.parametrize("seqlen", [192, 320])
def test_flops_count_only_the_visible_pairs(seqlen, rng):
    left, right = (int(x) for x in rng.integers(0, seqlen, size=2))
    features = SMALL + (Feature("random-window", "w", window_size=(left, right)),
                        Feature("causal-window", "cw", causal=True, window_size=(right, None)))
    for case in _small_cases(features, seqlen):
        pairs = _brute_force_pairs(case)
        assert bf.visible_pairs(case) == pairs, case.feature
        spec = case.spec
        assert bf.feature_flops(case) == 2 * (spec.head_dim + spec.head_dim_v) * pairs
    # without a mask every pair counts: AttentionSpec.flops of the plain shape
    plain = _small_cases((SMALL[0],), seqlen)[0]
    assert bf.feature_flops(plain) == plain.spec.flops()


# ---- the check with a feature's options --------------------------------------------------------
@pytest.mark.slow
def test_the_pytorch_peers_pass_the_check_on_every_feature():
    # FlexAttention eager here (torch.compile of Flex is for the GPU); the runs are timed too
    for case in _small_cases():
        res = bf.measure_feature(case, ["sdpa", "flex"], device="cpu", rep_ms=1,
                                 flex_compile=False)
        by = {r.provider: r for r in res}
        for name in ("sdpa", "flex"):
            r = by[name]
            if name == "sdpa" and case.feature.softcap:
                assert r.status == SKIPPED and "tanh" in r.note
                continue
            assert r.status == OK, f"{name} {case.feature.name}: {r.note}"
            assert r.max_err <= r.tol and r.us > 0
            assert r.tflops == pytest.approx(r.flops / (r.us * 1e-6) / 1e12)
        # on CPU tensors fa4lab.attention is the float64 fallback (or lacks the option):
        # an error, never a time
        assert by["fa4lab"].status == ERROR and by["fa4lab"].us is None


def _dropping(option: str, case):
    """A provider that computes the case with `option` left out of the call."""
    call = bf.feature_call(case, "cpu")
    fewer = dataclasses.replace(call, spec=case.spec.with_(
        **{"window_size": (None, None), "causal": False} if option == "window" else
        {"softcap": 0.0} if option == "softcap" else {}))
    if option == "sink":
        fewer.sink = None
    if option == "mod":
        fewer.score_mod = fewer.mask_mod = None
    return bench.pytorch_peers.pytorch_provider("flex", fewer, flex_compile=False)


@pytest.mark.parametrize("name,option", [("window-both", "window"), ("softcap", "softcap"),
                                         ("sink", "sink"), ("alibi", "mod"),
                                         ("relative-bias", "mod"), ("document", "mod"),
                                         ("prefix-lm", "mod")])
def test_a_peer_that_drops_the_option_fails_the_check(name, option):
    (case,) = _small_cases([f for f in SMALL if f.name == name])
    call = bf.feature_call(case, "cpu")
    check = lambda q, k, v: bench.reference_slice(q, k, v, case, options=call.options())
    (m,) = bench.check_then_time(case, [_dropping(option, case)], check=check, device="cpu",
                                 rep_ms=1)
    assert m.status == FAILED and m.ms is None and "tolerance" in m.note


def test_reference_slice_refuses_unknown_options_and_mods_beyond_batch_0():
    (case,) = _small_cases([SMALL[6]])
    q, k, v = bench.make_inputs(case, "cpu")
    with pytest.raises(ValueError, match="unknown option"):
        bench.reference_slice(q, k, v, case, options={"window": (1, 1)})
    opts = bf.feature_call(case, "cpu").options()
    with pytest.raises(ValueError, match="batch 0 alone"):
        bench.reference_slice(q, k, v, case, batches=(0, -1), options=opts)


# ---- the run's time limits ---------------------------------------------------------------------
def test_a_spent_budget_skips_the_rows_left():
    (case,) = _small_cases([SMALL[1]])
    guard = bench.RunGuard(budget_s=0.0)
    res = bf.measure_feature(case, ["sdpa"], device="cpu", rep_ms=1, guard=guard)
    assert {r.status for r in res} == {SKIPPED}
    assert all("time budget" in r.note for r in res)


def test_the_watchdog_reports_a_stuck_step_and_ends_the_run():
    seen, codes = [], []
    guard = bench.RunGuard(step_s=0.2, poll_s=0.02, on_timeout=lambda *a: seen.append(a),
                           exit=codes.append)
    with guard.step("fast step"):
        pass
    time.sleep(0.3)
    assert seen == [] and codes == []              # a finished step is never reported
    with guard.step("flex on alibi"):
        time.sleep(0.6)
    assert codes == [bench.TIMEOUT_EXIT]
    (label, seconds), = seen
    assert label == "flex on alibi" and seconds >= 0.2


# ---- record and table --------------------------------------------------------------------------
def _synthetic() -> list[FeatureResult]:
    out = []
    for case in bf.feature_cases(bf.features_named(["causal", "softcap", "alibi"])):
        flops = bf.feature_flops(case)
        for provider, us in (("fa4lab", 800.0), ("fa4", 1000.0), ("sdpa", 1600.0),
                             ("flex", 1200.0)):
            skip = bf.why_not(provider, case.feature)
            if skip:
                r = bf._row(case, provider, flops, status=SKIPPED, note=skip)
            else:
                r = bf._row(case, provider, flops, status=OK, us=us,
                            tflops=flops / (us * 1e-6) / 1e12, max_err=1e-3, tol=4e-3,
                            first_call_s=2.0)
            out.append(r)
    out[-1] = dataclasses.replace(out[-1], status=FAILED, us=None, tflops=None,
                                  note="max error 5e-01 > tolerance")
    return out


def _record(results=None):
    cases = bf.feature_cases(bf.features_named(["causal", "softcap", "alibi"]))
    config = bf.features_config(cases, list(bf.FEATURE_PEERS))
    return bf.make_features_record(results or _synthetic(), gpu_name="Test GPU", arch="sm90",
                                   command="fa4lab bench --features", config=config)


def test_features_record_round_trip(tmp_path):
    rec = _record()
    assert rec["kind"] == "features" and "gemm_tflops" not in rec
    assert rec["config"]["shape"] == {"batch": 2, "seqlen": 8192, "heads": 16, "head_dim": 128,
                                      "dtype": "bf16"}
    assert rec["config"]["skipped"]["alibi/fa4"] == bf.why_not("fa4", bf.ALL_FEATURES[7])
    assert rec["config"]["features"]["softcap"]["softcap"] == 30.0
    name = bench.default_record_path(rec).name
    assert name.endswith("_test-gpu_" + (rec["commit"] or "nocommit")[:7] + "_"
                         + rec["time_utc"].replace(":", "") + "_features.json")
    path = bench.save_record(rec, tmp_path / name)
    back = bench.load_record(path)
    assert bench.feature_results_of(back) == _synthetic()
    for reader in (bench.results_of, bench.decode_results_of, bench.host_results_of):
        with pytest.raises(ValueError, match="feature_results_of"):
            reader(back)
    with pytest.raises(ValueError, match="read it with results_of"):
        bench.feature_results_of(bench.make_record([], gemm=None, gpu_name="g", arch=None,
                                                   command="fa4lab bench", config={}))
    assert bench.load_records(tmp_path) == []          # not a throughput record
    assert [r["kind"] for r in bench.load_records(tmp_path, kinds=("features",))] == ["features"]
    summary = features_cli.recorded_features_summary(tmp_path)
    assert f"latest recorded features: {name}" in summary
    assert "| alibi | b2 s8192 h16/16 hd128 | bf16 | flex | torch.compile |" in summary
    bad = _record()
    bad["results"][0]["us"] = None
    with pytest.raises(ValueError, match="no positive us"):
        bench.validate_record(bad)


def test_features_table_ratios_come_from_the_times():
    results = _synthetic()
    text = bench.format_features_table(results)
    assert text.splitlines()[0] == ("| feature | shape | dtype | provider | call | us | "
                                    "TFLOP/s | fa4lab/this |")
    by = {(r.feature, r.provider): r for r in results}
    causal = by[("causal", "fa4lab")]
    at = "b2 s8192 h16/16 hd128 | bf16"
    assert f"| causal | {at} | fa4lab | default | 800.0 | {causal.tflops:.0f} | 1.00 |" in text
    assert (f"| causal | {at} | sdpa | masks materialized | 1600.0 | "
            f"{by[('causal', 'sdpa')].tflops:.0f} | 2.00 |") in text
    assert f"| softcap | {at} | sdpa | masks materialized | skipped | - | - |" in text
    # fa4lab / FA4 and fa4lab / the faster PyTorch peer (Flex at 1200 us beats SDPA at 1600)
    assert "| causal | " + f"{causal.tflops:.0f} | 1.25 | 1.50 (flex) |" in text
    # alibi: FA4 skipped; Flex failed, so the best PyTorch peer is SDPA
    assert f"| alibi | {by[('alibi', 'fa4lab')].tflops:.0f} | - | 2.00 (sdpa) |" in text
    assert "- flex alibi: failed: max error 5e-01 > tolerance" in text
    ratios = {r.feature: r for r in bench.feature_ratios(results)}
    assert ratios["softcap"].best_pytorch == "flex" and ratios["softcap"].over_fa4 == 1.25


def test_the_features_figure():
    from fa4lab.viz.bench import plot_features

    fig = plot_features(_record())
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["causal", "softcap", "alibi"]
    labels = ax.get_legend_handles_labels()[1]
    assert len(labels) == 4 and labels[0] == bf.FEATURE_LABELS["fa4lab"]
    assert {t.get_text() for t in ax.texts} == {"skipped", "failed"}
    with pytest.raises(ValueError, match="no results"):
        plot_features([])


def test_recorded_decode_records_still_load():
    # the records already in benchmarks/ (every kind) read with the folded loop's readers
    records = bench.load_records(kinds=None)
    decode = [r for r in records if r["kind"] == "decode"]
    assert decode, "benchmarks/ holds a decode record"
    for rec in decode:
        assert all(r.status in bench.STATUSES for r in bench.decode_results_of(rec))


# ---- the command -------------------------------------------------------------------------------
def test_plan_of_features_from_the_command_line():
    cases, names = bench.plan_of_features(parse_bench(["--features"]))
    assert [c.feature.name for c in cases] == list(bf.FEATURE_NAMES)
    assert {(c.head_dim, c.seqlen) for c in cases if c.feature.shape is None} == {(128, 8192)}
    assert names == ["fa4lab", "fa4", "sdpa", "flex"]
    cases, _ = bench.plan_of_features(parse_bench(["--features", "--feature", "models",
                                                   "--seqlen", "2048"]))
    assert [c.feature.name for c in cases] == [f.name for f in bf.MODEL_FEATURES]
    assert [c.seqlen for c in cases] == [4096, 4096, 4096, 16384, 2048, 8192]   # their own
    cases, names = bench.plan_of_features(parse_bench(
        ["--features", "--feature", "document", "alibi", "--peers", "flex", "--seqlen", "2048",
         "--total-tokens", "4096"]))
    assert [c.feature.name for c in cases] == ["alibi", "document"]
    assert {(c.seqlen, c.batch) for c in cases} == {(2048, 2)} and names == ["fa4lab", "flex"]


@pytest.mark.parametrize("argv,message", [
    (["--features", "--feature", "nope"], "unknown ['nope']"),
    (["--features", "--peers", "sdpa-flash"], "unknown ['sdpa-flash'] for --features"),
    (["--features", "--head-dim", "64", "128"], "one --head-dim"),
    (["--features", "--seqlen", "1024", "--total-tokens", "1024"], "needs seqlen > 1024"),
    (["--features", "--time-budget", "0"], "--time-budget must be > 0"),
    (["--features", "--causal", "true"], "--causal do not apply to --features"),
    (["--features", "--batch", "4"], "--batch do not apply to --features"),
    (["--features", "--decode"], "--decode and --features are separate modes"),
    (["--feature", "alibi"], "--feature apply to --features only"),
    (["--decode", "--step-timeout", "5"], "--step-timeout apply to --features only"),
])
def test_bad_features_arguments_exit_2(argv, message, capsys):
    assert run_bench(argv) == 2
    assert message in capsys.readouterr().err


@needs_no_gpu
def test_features_on_cpu_say_what_they_would_run(tmp_path, capsys):
    assert run_bench(["--features", "--feature", "window-512-512", "prefix-lm",
                      "--records", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "no CUDA GPU visible" in out
    assert "2 features x 4 providers at hd128 s8192 (batch 2, heads 16, bf16)" in out
    for case in bf.feature_cases(bf.features_named(["window-512-512", "prefix-lm"])):
        assert f"{bf.feature_flops(case) / 1e12:6.3f} TFLOP (visible pairs)" in out
    assert "skipped" in out and "fa4 prefix-lm" in out
    assert "no recorded features results" in out


@pytest.mark.slow
def test_features_command_with_the_gpu_faked(monkeypatch, tmp_path, capsys):
    """The GPU path of `--features` (providers, check, table, record, plot) with the device
    faked and the runs on CPU tensors (FlexAttention eager): the flow, not the speed."""
    from fa4lab import environment

    no_upstream_fa4(monkeypatch)
    monkeypatch.setattr(environment, "gpu", lambda: environment.GpuInfo("Fake H200", (9, 0)))
    real_run = bf.run_features
    monkeypatch.setattr(features_cli, "run_features", lambda cases, names, **kw: real_run(
        cases, names, **{**kw, "device": "cpu", "progress": False, "flex_compile": False}))
    out_json, out_png = tmp_path / "features.json", tmp_path / "features.png"
    argv = ["--features", "--feature", "window-512-512", "sink-causal", "--head-dim", "64",
            "--seqlen", "1536", "--total-tokens", "1536", "--hidden", "128", "--rep-ms", "1",
            "--json", str(out_json), "--plot", str(out_png)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert run_bench(argv) == 0
    text = capsys.readouterr().out
    assert "fa4lab bench --features on Fake H200" in text and "record saved" in text
    assert "| window-512-512 | b1 s1536 h2/2 hd64 | bf16 | sdpa |" in text
    assert out_png.stat().st_size > 0
    rec = bench.load_record(out_json)
    assert rec["kind"] == "features" and rec["arch"] == "sm90"
    assert rec["config"]["time_limits"] == {"budget_s": bf.BUDGET_S,
                                            "step_timeout_s": bf.STEP_TIMEOUT_S}
    res = {(r.feature, r.provider): r for r in bench.feature_results_of(rec)}
    assert set(res) == {(f, p) for f in ("window-512-512", "sink-causal")
                        for p in bf.FEATURE_PROVIDERS}
    for f in ("window-512-512", "sink-causal"):
        for p in ("sdpa", "flex"):
            assert res[(f, p)].status == OK and res[(f, p)].max_err <= res[(f, p)].tol
        assert res[(f, "fa4")].status == MISSING
        assert res[(f, "fa4lab")].status == ERROR       # never the float64 fallback, timed
    assert rec["config"]["features"]["sink-causal"]["flops"] == res[("sink-causal", "flex")].flops


# ---- on a GPU ----------------------------------------------------------------------------------
@pytest.mark.gpu
def test_tiny_features_end_to_end(tmp_path, capsys):
    """`fa4lab bench --features` at a small shape: every fa4lab row passed its check before it
    was timed, nothing that ran was wrong, and the record and the plot are written."""
    out_json, out_png = tmp_path / "features.json", tmp_path / "features.png"
    rc = run_bench(["--features", "--feature", "options", "--seqlen", "2048",
                    "--total-tokens", "2048", "--hidden", "256", "--rep-ms", "20",
                    "--warmup-ms", "5", "--json", str(out_json), "--plot", str(out_png)])
    assert rc == 0
    assert "| feature | fa4lab TFLOP/s | fa4lab/FA4 | fa4lab/best PyTorch |" in \
        capsys.readouterr().out
    rec = bench.load_record(out_json)
    res = bench.feature_results_of(rec)
    assert {(r.feature, r.provider) for r in res} == {
        (f.name, p) for f in bf.OPTION_FEATURES for p in bf.FEATURE_PROVIDERS}
    kernel_here = (importlib.util.find_spec("fa4lab.api") is not None
                   and rec["arch"] in ("sm90", "sm100"))
    for r in res:
        where = f"{r.provider} {r.feature}: {r.status}: {r.note}"
        assert r.status != FAILED, where
        if r.provider == "fa4lab" and kernel_here:
            assert r.status == OK and r.max_err <= r.tol, where
        if r.provider in ("sdpa", "flex"):
            assert r.status in (OK, SKIPPED), where
        if r.provider == "fa4":
            assert r.status in (OK, SKIPPED, MISSING), where
        if r.status == OK:
            assert r.us > 0 and r.tflops > 0 and r.max_err <= r.tol, where
    assert out_png.stat().st_size > 0


@pytest.mark.gpu
def test_model_features_beside_fa4_on_a_gpu():
    """Each model feature at its own shape, fa4lab's default call beside upstream FA4: nothing
    that runs is wrong; a row that does not run says why."""
    for case in bf.feature_cases(bf.MODEL_FEATURES):
        for r in bf.measure_feature(case, ["fa4"], rep_ms=20, warmup_ms=5):
            where = f"{r.provider} {r.feature}: {r.status}: {r.note}"
            assert r.status != FAILED, where
            assert r.status == OK or r.note, where
            if r.status == OK:
                assert r.us > 0 and r.max_err <= r.tol, where


def test_providers_of_a_case_are_thin_calls(monkeypatch):
    from fa4lab import api

    calls = []
    monkeypatch.setattr(api, "attention", lambda q, k, v, **kw: calls.append(kw) or q)
    (case,) = _small_cases([SMALL[3]])
    call = bf.feature_call(case, "cpu")
    p = bf.feature_provider("fa4lab", call)
    assert isinstance(p, Provider) and p.prepare is None
    p.runner("q", "k", "v", False, 0.5)
    assert calls == [{"causal": False, "softmax_scale": 0.5, "window_size": (24, 9)}]
