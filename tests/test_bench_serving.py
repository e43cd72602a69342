"""`fa4lab bench --serving` on a CPU: the cases and their seeded lengths, the floor and FLOP
arithmetic (worked out here from the definitions), the paged inputs, the check before timing
over every sequence (right providers, a wrong page, a wrong last sequence, a provider that
raises because an argument is not merged yet, a missing one), the record, the table with its
bars, and the command (no GPU, bad arguments, and the GPU path with the device faked and the
runs on CPU tensors)."""

from __future__ import annotations

import pytest
from bench_checks import needs_no_gpu, no_upstream_fa4, recording_varlen, run_bench

from fa4lab.bench import ERROR, FAILED, MISSING, OK, Provider, serving_cli
from fa4lab.bench import decode as bench_decode
from fa4lab.bench import providers as bench_providers
from fa4lab.bench import serving as sv
from fa4lab.bench.records import (
    decode_results_of,
    default_record_path,
    load_record,
    load_records,
    save_record,
    serving_results_of,
    validate_record,
)

# Small cases for the CPU: a causal varlen batch with a 1-token sequence, a paged batch whose
# lengths end inside a page, on a page boundary and past one, a dense split-KV batch of two.
VARLEN_SMALL = sv.ServingCase(sv.VARLEN, (1, 40, 17), (1, 40, 17), 4, 2, 64, causal=True)
PAGED_SMALL = sv.ServingCase(sv.PAGED, (1, 1, 1), (5, 33, 16), 4, 2, 64, page_size=16)
SPLIT_SMALL = sv.ServingCase(sv.SPLITKV, (1, 1), (64, 64), 8, 2, 64)
CHUNK_SMALL = sv.ServingCase(sv.PAGED_PREFILL, (3, 1, 40), (35, 1, 60), 4, 2, 64, causal=True,
                             page_size=16)
SMALL = [VARLEN_SMALL, PAGED_SMALL, SPLIT_SMALL, CHUNK_SMALL]


# ---- the cases ---------------------------------------------------------------------------------
def test_default_cases_are_the_issues():
    cases = sv.serving_cases()
    varlen, p128, p16, *split, c128, c16 = cases
    assert (varlen.scenario, varlen.batch, varlen.heads_q, varlen.heads_kv, varlen.head_dim,
            varlen.causal, varlen.dtype) == (sv.VARLEN, 24, 32, 8, 128, True, "bf16")
    assert varlen.seqlens_q == varlen.seqlens_k
    assert all(200 <= n <= 6000 for n in varlen.seqlens_k) and len(set(varlen.seqlens_k)) > 16
    for case, size in ((p16, 16), (p128, 128)):
        assert (case.scenario, case.batch, case.page_size, case.heads_q, case.heads_kv,
                case.causal) == (sv.PAGED, 32, size, 32, 8, False)
        assert case.seqlens_q == (1,) * 32
        assert all(1024 <= n <= 16384 for n in case.seqlens_k)
    assert p16.seqlens_k == p128.seqlens_k            # one batch, two page sizes
    assert [(c.batch, c.seqlens_k[0], c.heads_q, c.heads_kv) for c in split] == [
        (b, 131072, 64, 8) for b in (1, 2, 4)]
    for case, size in ((c16, 16), (c128, 128)):
        assert (case.scenario, case.batch, case.page_size, case.heads_q, case.heads_kv,
                case.causal) == (sv.PAGED_PREFILL, 16, size, 32, 8, True)
        assert all(128 <= n <= 2048 for n in case.seqlens_q)
        assert all(1024 + q <= k <= 16384 + q for q, k in zip(case.seqlens_q, case.seqlens_k))
        assert len(set(case.seqlens_q)) > 8
    assert (c16.seqlens_q, c16.seqlens_k) == (c128.seqlens_q, c128.seqlens_k)
    assert [c.name for c in cases] == ["varlen-prefill", "paged-decode p128",
                                       "paged-decode p16", "splitkv-decode b1",
                                       "splitkv-decode b2", "splitkv-decode b4",
                                       "paged-prefill p128", "paged-prefill p16"]
    # seeded: the same lengths every time, others with another seed
    assert sv.serving_cases() == cases
    assert sv.serving_cases(seed=1)[0].seqlens_k != varlen.seqlens_k
    quick = sv.serving_cases(quick=True)
    assert len(quick) < len(cases)
    assert sum(c.hbm_bytes for c in quick) < sum(c.hbm_bytes for c in cases) / 4
    assert quick[0].label() == (f"varlen-prefill b8 sq{min(quick[0].seqlens_q)}.."
                                f"{max(quick[0].seqlens_q)} sk{min(quick[0].seqlens_k)}.."
                                f"{max(quick[0].seqlens_k)} h32/8 hd128 causal")


@pytest.mark.parametrize("kw,match", [
    ({"scenario": "prefill"}, "not one of"),
    ({"seqlens_q": (1, 1)}, "one length per sequence"),
    ({"page_size": None}, "page_size is given for paged-decode"),
])
def test_bad_cases_are_clear_errors(kw, match):
    base = dict(scenario=sv.PAGED, seqlens_q=(1, 1, 1), seqlens_k=(5, 33, 16), heads_q=4,
                heads_kv=2, head_dim=64, page_size=16)
    with pytest.raises(ValueError, match=match):
        sv.ServingCase(**{**base, **kw})
    with pytest.raises(ValueError, match="same seqlen_k"):
        sv.ServingCase(sv.SPLITKV, (1, 1), (64, 32), 8, 2, 64)
    with pytest.raises(ValueError, match="lo <= hi"):
        sv.random_lengths(4, 10, 5, 0)


def test_floor_and_flops_by_hand():
    # paged: the keys each sequence attends to (5 + 33 + 16) x 2 KV heads x (64 + 64), q and out
    # 3 rows x 4 heads x (64 + 64), 2 bytes each: a page's unused tail is not counted
    expect = 2 * ((5 + 33 + 16) * 2 * 128 + 3 * 4 * 128)
    assert expect == 30720
    assert PAGED_SMALL.hbm_bytes == expect
    assert sv.floor_us(PAGED_SMALL.hbm_bytes, 100.0) == pytest.approx(expect / 100e9 * 1e6)
    # a decode row sees all its keys: 2 x (64 + 64) FLOPs per (query, key) pair and head
    assert PAGED_SMALL.flops == 2 * 128 * 4 * (5 + 33 + 16)
    # causal varlen: sequence of n tokens has n (n + 1) / 2 visible pairs
    pairs = 1 * 2 // 2 + 40 * 41 // 2 + 17 * 18 // 2
    assert VARLEN_SMALL.flops == 2 * 128 * 4 * pairs
    assert VARLEN_SMALL.hbm_bytes == 2 * (58 * 2 * 128 + 58 * 4 * 128)
    # split-KV is dense: batch 2 x 64 keys x 2 heads x 128, 2 rows x 8 heads x 128
    assert SPLIT_SMALL.hbm_bytes == 2 * (2 * 64 * 2 * 128 + 2 * 8 * 128)
    assert SPLIT_SMALL.flops == 2 * 128 * 8 * 2 * 64 == SPLIT_SMALL.spec.flops()


def test_paged_inputs_scatter_every_page_once():
    import torch

    case = sv.ServingCase(sv.PAGED, (1,) * 6, (5, 33, 16, 64, 1, 70), 4, 2, 64, page_size=16)
    args = sv.VarlenArgs()
    q, k, v = sv.serving_inputs(case, "cpu", args)
    pages = [(n + 15) // 16 for n in case.seqlens_k]
    assert tuple(q.shape) == (6, 4, 64) and q.dtype == torch.bfloat16
    assert tuple(k.shape) == tuple(v.shape) == (sum(pages), 16, 2, 64)
    assert args.cu_seqlens_q.tolist() == list(range(7)) and args.cu_seqlens_k is None
    assert args.seqused_k.tolist() == list(case.seqlens_k)
    assert (args.max_seqlen_q, args.max_seqlen_k) == (1, 70)
    assert args.page_table.dtype == torch.int32 and tuple(args.page_table.shape) == (6, 5)
    used = [p for b, n in enumerate(pages) for p in args.page_table[b, :n].tolist()]
    assert sorted(used) == list(range(sum(pages)))      # every page once, none shared
    assert used != sorted(used)                          # and not in order
    again = sv.VarlenArgs()
    sv.serving_inputs(case, "cpu", again)               # seeded: the same table
    assert torch.equal(again.page_table, args.page_table)


# ---- the check before timing -------------------------------------------------------------------
def _reference_runner(args, *, swap_pages_of_last=False, flip_last_row=False):
    import torch

    from fa4lab.reference import attention_varlen_reference

    def run(q, k, v, causal, softmax_scale):
        table = args.page_table
        if swap_pages_of_last:
            table = table.clone()
            table[-1, :2] = table[-1, :2].flip(0)
        out = attention_varlen_reference(q, k, v, args.cu_seqlens_q, args.cu_seqlens_k,
                                         seqused_k=args.seqused_k, page_table=table,
                                         causal=causal, softmax_scale=softmax_scale)
        out = out.to(q.dtype)
        if flip_last_row:
            out[-1] = torch.flip(out[-1], dims=[-1])
        return out[None]

    return run


def _fakes(case, args, how):
    """A right provider, two wrong ones, one that raises, the real ones (on CPU tensors)."""
    def raises(q, k, v, causal, softmax_scale):
        raise TypeError("attention_varlen() got an unexpected keyword argument 'page_table'")

    fakes = [Provider("reference", _reference_runner(args)),
             Provider("last-row", _reference_runner(args, flip_last_row=True)),
             Provider("raises", raises)]
    if case.page_size is not None:
        fakes.append(Provider("wrong-page", _reference_runner(args, swap_pages_of_last=True)))
    if case.scenario == sv.PAGED:
        padded = sv.sdpa_padded_provider(args, how)          # torch's CPU SDPA runs it
        fakes.append(Provider("padded-on-cpu", padded.runner, prepare=padded.prepare))
    return fakes + sv.serving_providers(case, args, how)


@pytest.mark.parametrize("case", [VARLEN_SMALL, PAGED_SMALL, CHUNK_SMALL],
                         ids=lambda c: c.scenario)
def test_check_then_time_every_sequence_on_cpu(monkeypatch, case):
    no_upstream_fa4(monkeypatch)
    res = {r.provider: r for r in sv.measure_case(case, _fakes, hbm_gbps=100.0, device="cpu",
                                                  rep_ms=1)}
    good = res["reference"]
    assert good.status == OK and good.max_err <= good.tol and good.us > 0
    assert good.floor_us == pytest.approx(case.hbm_bytes / 100e9 * 1e6)
    assert good.x_floor == pytest.approx(good.us / good.floor_us)
    assert good.gbps == pytest.approx(case.hbm_bytes / (good.us * 1e-6) / 1e9)
    assert good.tflops == pytest.approx(case.flops / (good.us * 1e-6) / 1e12)
    assert (good.total_q, good.total_k, good.max_seqlen_k, good.page_size) == (
        sum(case.seqlens_q), sum(case.seqlens_k), max(case.seqlens_k), case.page_size)
    # only the last sequence is wrong: the check covers every sequence
    assert res["last-row"].status == FAILED and res["last-row"].us is None
    assert res["raises"].status == ERROR and "unexpected keyword argument" in res["raises"].note
    if case.page_size is not None:
        assert res["wrong-page"].status == FAILED
    if case.scenario == sv.PAGED:
        padded = res["padded-on-cpu"]
        assert padded.status == OK and padded.max_err <= padded.tol
    # the real providers: fa4lab never times its float64 fallback, FA4 is not installed here
    assert res["fa4lab"].status == ERROR and "SlowReferenceWarning" in res["fa4lab"].note
    assert res["fa4"].status == MISSING and "pip install flash-attn-4" in res["fa4"].note


def test_split_kv_headline_is_the_default_call(monkeypatch):
    """fa4lab's split-KV headline row calls `attention` with no num_splits at all (Note [the
    headline row]); the num_splits=1 row passes 1, and when that raises its row is an error,
    not a crash. The SDPA math backend is the right provider."""
    no_upstream_fa4(monkeypatch)
    from fa4lab import api

    seen = []

    def fake_attention(q, k, v, *, causal=False, softmax_scale=None, **kw):
        seen.append(kw)
        if kw.get("num_splits") == 1:
            raise TypeError("attention() got an unexpected keyword argument 'num_splits'")
        return sdpa(q, k, v, causal, softmax_scale)

    sdpa = bench_providers.sdpa_runner("MATH")
    monkeypatch.setattr(api, "attention", fake_attention)

    def providers(case, args, how):
        return [Provider("sdpa-math", sdpa)] + sv.serving_providers(case, args, how)

    res = {r.provider: r for r in sv.measure_case(SPLIT_SMALL, providers, device="cpu",
                                                  rep_ms=1)}
    assert res["sdpa-math"].status == OK and res["sdpa-math"].x_floor is None
    assert res["fa4lab"].status == OK                     # the default call: no num_splits
    assert res[sv.NOSPLIT].status == ERROR and "num_splits" in res[sv.NOSPLIT].note
    assert {} in seen and {"num_splits": 1} in seen
    assert all(kw in ({}, {"num_splits": 1}) for kw in seen)
    for name in ("fa4", sv.FA4_NOSPLIT):
        assert res[name].status == MISSING


@pytest.mark.parametrize("case", [VARLEN_SMALL, PAGED_SMALL, CHUNK_SMALL],
                         ids=lambda c: c.scenario)
def test_the_headline_row_is_the_default_call(monkeypatch, case):
    """Note [the headline row]: fa4lab's first row of a varlen / paged case calls
    attention_varlen with NO check_indices argument (whatever its default is); the secondary
    rows pass check_indices=True and False; the table puts the default first, labelled so."""
    no_upstream_fa4(monkeypatch)
    seen = recording_varlen(monkeypatch)
    providers = sv.SCENARIO_PROVIDERS[case.scenario]
    assert providers[:3] == (sv.OURS, sv.CHECKED, sv.UNCHECKED)
    results = []
    for name in providers[:3]:
        seen.clear()

        def only(c, args, how, name=name):
            return [p for p in sv.serving_providers(c, args, how) if p.name == name]

        (r,) = sv.measure_case(case, only, hbm_gbps=1.0, device="cpu", rep_ms=1)
        assert r.status == OK, r.note
        assert seen and all(kw == sv.VARIANT_KWARGS[name] for kw in seen), (name, seen)
        results.append(r)
    assert sv.VARIANT_KWARGS[sv.OURS] == {}                # not even check_indices="device"
    assert sv.VARIANT_KWARGS[sv.CHECKED] == {"check_indices": True}
    assert sv.VARIANT_KWARGS[sv.UNCHECKED] == {"check_indices": False}
    # the table: the default call first whatever order the rows come in, labelled "default"
    text = serving_cli.format_serving_table(results[::-1], hbm_gbps=1.0,
                                            shapes={case.name: case.shape_label()})
    rows = [line for line in text.splitlines() if line.startswith(f"| {case.name} |")]
    cells = [[c.strip() for c in row.split("|")[1:-1]] for row in rows]
    assert [c[3:5] for c in cells] == [["fa4lab", "default"],
                                       [sv.CHECKED, "check_indices=True"],
                                       [sv.UNCHECKED, "check_indices=False"]]
    assert {c[1] for c in cells} == {case.shape_label()} and {c[2] for c in cells} == {"bf16"}
    assert cells[0][-1] == "1.00"                          # every ratio is over the default


def test_every_scenario_leads_with_the_default_call():
    labels = sv.serving_labels()
    default = sv.default_check_indices()                   # read from the signature
    assert default == "'device'"                           # what fa4lab.api says today
    for scenario in (sv.VARLEN, sv.PAGED, sv.PAGED_PREFILL):
        ours = labels[f"{scenario}/fa4lab"]
        assert "the default call: no check_indices argument" in ours
        assert f"check_indices={default}" in ours and "{default}" not in ours
        assert "check_indices=True" in labels[f"{scenario}/{sv.CHECKED}"]
        assert "check_indices=False" in labels[f"{scenario}/{sv.UNCHECKED}"]
    assert "(the default)" not in " ".join(labels.values())
    for scenario, providers in sv.SCENARIO_PROVIDERS.items():
        assert providers[0] == sv.OURS, scenario
        assert sv.CALLS[providers[0]] == "default"
        assert "default call" in sv.SERVING_LABELS[f"{scenario}/{sv.OURS}"]
        variants = [p for p in providers if p.startswith(sv.OURS + "-")]
        assert variants and all(sv.VARIANT_KWARGS[p] for p in variants)   # each changes one


# ---- record and table --------------------------------------------------------------------------
def _synthetic():
    gbps = 1.0               # a small bandwidth for the small cases: floors of tens of us
    rows = []

    def ok(provider, case, us, **kw):
        floor = sv.floor_us(case.hbm_bytes, gbps)
        rows.append(sv._result(provider, case, gbps, status=OK, us=us, x_floor=us / floor,
                               gbps=case.hbm_bytes / (us * 1e-6) / 1e9,
                               tflops=case.flops / (us * 1e-6) / 1e12, max_err=1e-3,
                               tol=4e-3, first_call_s=1.5, **kw))

    ok("fa4lab", VARLEN_SMALL, 100.0)
    ok("fa4", VARLEN_SMALL, 96.0)                      # fa4lab at 0.96x FA4: met
    ok(sv.SDPA_NESTED, VARLEN_SMALL, 300.0, note="K/V heads repeated to 4")
    ok("fa4lab", PAGED_SMALL, 40.0)                    # floor 30.72 us: 1.30x, MISSED
    ok("fa4", PAGED_SMALL, 50.0)
    rows.append(sv._result(sv.SDPA_PADDED, PAGED_SMALL, gbps, status=ERROR,
                           note="RuntimeError: No available kernel"))
    rows.append(sv._result("fa4lab", SPLIT_SMALL, gbps, status=ERROR,
                           note="TypeError: unexpected keyword argument 'num_splits'"))
    return rows


def _record():
    copy = sv.CopyBandwidth(1 << 30, 2147.483648, 1.0)
    config = sv.serving_config(SMALL, copy=copy, wall_s=12.34)
    return sv.make_serving_record(_synthetic(), hbm_gbps=1.0, gpu_name="Test GPU",
                                  arch="sm90", command="fa4lab bench --serving", config=config)


def test_serving_record_round_trip(tmp_path):
    rec = _record()
    assert rec["kind"] == "serving" and rec["hbm_gbps"] == 1.0 and "gemm_tflops" not in rec
    cases = rec["config"]["cases"]
    assert [c["name"] for c in cases] == ["varlen-prefill", "paged-decode p16",
                                          "splitkv-decode b2", "paged-prefill p16"]
    assert cases[1]["seqlens_k"] == [5, 33, 16] and cases[1]["page_size"] == 16
    assert cases[1]["hbm_bytes"] == 30720
    assert cases[1]["floor_us"] == pytest.approx(30.72)
    assert rec["config"]["wall_s"] == 12.3 and rec["config"]["bars"] == sv.BARS
    assert set(rec["config"]["providers"]) == {
        f"{s}/{p}" for s in sv.SCENARIOS for p in sv.SCENARIO_PROVIDERS[s]}
    name = default_record_path(rec).name
    assert name.endswith("_" + rec["time_utc"].replace(":", "") + "_serving.json")
    back = load_record(save_record(rec, tmp_path / name))
    assert serving_results_of(back) == _synthetic()
    with pytest.raises(ValueError, match="serving_results_of"):
        decode_results_of(back)
    assert load_records(tmp_path) == []
    assert [r["kind"] for r in load_records(tmp_path, kinds=("serving",))] == ["serving"]
    assert serving_cli.recorded_calls(rec) == {}           # a record with the headline rule
    legacy = {"config": {"providers": {
        "paged-decode/fa4lab": "attention_varlen(..., check_indices=False)",
        "varlen-prefill/fa4lab": "attention_varlen(...)",
        "varlen-prefill/fa4lab-checked": "the same with check_indices=True (the default)"}}}
    assert serving_cli.recorded_calls(legacy) == {
        "paged-decode/fa4lab": "check_indices=False (recorded)",
        "varlen-prefill/fa4lab": "as recorded",
        "varlen-prefill/fa4lab-checked": "check_indices=True"}
    summary = serving_cli.recorded_serving_summary(tmp_path)
    assert f"latest recorded serving calls: {name}" in summary and "| fa4lab |" in summary
    bad = _record()
    bad["results"][0]["us"] = None
    with pytest.raises(ValueError, match="no positive us"):
        validate_record(bad)
    del bad["hbm_gbps"]
    with pytest.raises(ValueError, match=r"lacks \['hbm_gbps'\]"):
        validate_record(bad)


def test_serving_table_and_bars():
    text = serving_cli.format_serving_table(_synthetic(), hbm_gbps=1.0)
    lines = text.splitlines()
    assert lines[0] == ("| case | shape | dtype | provider | call | us | x HBM floor | GB/s | "
                        "TFLOP/s | fa4lab/this |")
    # no lengths given: the shape from the row's own fields
    paged = "| paged-decode p16 | b3 q3 k54 h4/2 hd64 full | bf16 |"
    # 30720 bytes at 1 GB/s = 30.72 us; 40 us is 1.30x; 30720 B / 40 us = 0.768 GB/s
    assert f"{paged} fa4lab | default | 40.0 | 1.30 | 1 | 0.0 | 1.00 |" in lines
    assert f"{paged} fa4 | same args | 50.0 | 1.63 | 1 | 0.0 | 1.25 |" in lines
    assert "| sdpa-nested | nested jagged | 300.0 |" in text and "| 3.00 |" in text
    assert f"{paged} sdpa-padded | padded + mask | error | - | - | - | - |" in lines
    assert ("- varlen-prefill: fa4lab (default call) at 0.96x the speed of fa4 (bar >= 0.95x: "
            "met)") in lines
    assert ("- paged-decode p16: fa4lab (default call) at 1.25x the speed of fa4 (bar >= "
            "0.95x: met); 1.30x the HBM floor (bar <= 1.15x: MISSED); fa4 1.63x the HBM "
            "floor") in lines
    # split-KV: fa4lab raised, so nothing is judged; with a time, its speed is shown unjudged
    assert ("- splitkv-decode b2: fa4lab (default call) x fa4-nosplit: not judged (fa4lab or "
            "fa4-nosplit not ok)") in lines
    split = [sv._result(p, SPLIT_SMALL, None, status=OK, us=us)
             for p, us in (("fa4lab", 20.0), (sv.FA4_NOSPLIT, 70.0))]
    assert ("- splitkv-decode b2: fa4lab (default call) at 3.50x the speed of fa4-nosplit (no "
            "bar)" in serving_cli.format_serving_table(split))
    assert "paged-decode p16 0.000 GB = 30.7 us" in text and "at 1 GB/s" in text
    assert "- sdpa-nested varlen-prefill: K/V heads repeated to 4" in lines
    assert "- fa4lab splitkv-decode b2: error: TypeError: unexpected keyword" in text
    # with the cases' lengths (the command, and a record's config): their shape
    shaped = serving_cli.format_serving_table(_synthetic(), hbm_gbps=1.0,
                                              shapes=serving_cli.recorded_shapes(_record()))
    assert "| paged-decode p16 | b3 sq1 sk5..33 h4/2 hd64 full | bf16 | fa4lab |" in shaped
    only_fa4 = [r for r in _synthetic() if r.provider == "fa4"]
    assert "not judged" in serving_cli.format_serving_table(only_fa4)


# ---- the command -------------------------------------------------------------------------------
@needs_no_gpu
def test_serving_on_cpu_says_it_needs_a_gpu_and_exits_0(tmp_path, capsys):
    assert run_bench(["--serving", "--records", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "no CUDA GPU visible" in out and "8 serving cases" in out
    assert "paged-prefill p16 b16 sq" in out and "paged-prefill p128 b16 sq" in out
    assert "paged-decode p128 b32 sq1" in out and "splitkv-decode b4 sq1 sk131072" in out
    assert "splitkv-decode/fa4-nosplit" in out and "gather is NOT timed" in out
    assert "no recorded serving results" in out
    assert run_bench(["--serving", "--quick", "--records", str(tmp_path)]) == 0
    assert "6 serving cases" in capsys.readouterr().out
    assert run_bench(["--serving", "--scenario", "paged-prefill", "splitkv-decode",
                      "--records", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "5 serving cases" in out and "varlen-prefill b24" not in out
    assert run_bench(["--scenario", "paged-prefill"]) == 2
    assert "--scenario applies to --serving only" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--serving", "--decode"], "--decode and --serving are separate modes"),
    (["--serving", "--batch", "4"], "--batch do not apply to --serving"),
    (["--serving", "--head-dim", "64"], "--head-dim do not apply to --serving"),
    (["--serving", "--step-timeout", "0"], "--step-timeout must be > 0"),
])
def test_bad_serving_arguments_exit_2(argv, message, capsys):
    assert run_bench(argv) == 2
    assert message in capsys.readouterr().err


def test_serving_command_with_the_gpu_faked(monkeypatch, tmp_path, capsys):
    """The GPU path (bandwidth, providers, table, bars, record) with the device faked, the
    small cases and the runs on CPU tensors: the flow is tested here, not the speed."""
    from fa4lab import environment

    no_upstream_fa4(monkeypatch)
    monkeypatch.setattr(environment, "gpu", lambda: environment.GpuInfo("Fake H200", (9, 0)))
    monkeypatch.setattr(bench_decode, "copy_bandwidth",
                        lambda **kw: sv.CopyBandwidth(1 << 30, 0.5, 4294.967296))
    monkeypatch.setattr(serving_cli, "serving_cases", lambda **kw: SMALL)
    real_run = sv.run_serving
    monkeypatch.setattr(serving_cli, "run_serving",
                        lambda cases, providers, **kw: real_run(
                            cases, providers, **{**kw, "device": "cpu", "progress": False}))
    out_json = tmp_path / "serving.json"
    assert run_bench(["--serving", "--rep-ms", "1", "--out", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "fa4lab bench --serving on Fake H200" in text and "record saved" in text
    assert "4295 GB/s" in text and "bars:" in text
    rec = load_record(out_json)
    assert rec["kind"] == "serving" and rec["arch"] == "sm90"
    assert rec["command"].startswith("fa4lab bench --json ") and "--serving" in rec["command"]
    res = serving_results_of(rec)
    assert {(r.case, r.provider) for r in res} == {
        (c.name, p) for c in SMALL for p in sv.SCENARIO_PROVIDERS[c.scenario]}
    for r in res:
        assert r.status == OK or r.note
        assert r.floor_us == pytest.approx(r.hbm_bytes / 4294.967296e9 * 1e6)
    by = {(r.case, r.provider): r for r in res}
    assert by[("paged-decode p16", sv.SDPA_PADDED)].status == OK
    assert by[("splitkv-decode b2", "sdpa-flash")].status == OK     # torch's CPU flash
    for case in ("varlen-prefill", "paged-decode p16", "splitkv-decode b2"):
        assert by[(case, "fa4lab")].status == ERROR          # never the float64 fallback
    assert run_bench(["--serving", "--rep-ms", "1", "--no-save", "--strict"]) == 1


# ---- on a GPU ----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    sv.ServingCase(sv.VARLEN, (1, 300, 129), (1, 300, 129), 32, 8, causal=True),
    sv.ServingCase(sv.PAGED, (1,) * 4, (5, 300, 128, 1000), 32, 4, page_size=16),
    sv.ServingCase(sv.PAGED, (1,) * 4, (5, 300, 128, 1000), 32, 4, page_size=128),
    sv.ServingCase(sv.SPLITKV, (1, 1), (4096, 4096), 64, 8),
    sv.ServingCase(sv.PAGED_PREFILL, (1, 300, 129), (700, 300, 1500), 32, 8, causal=True,
                   page_size=16),
], ids=lambda c: c.name)
def test_real_providers_on_a_gpu(case):
    """Every real provider of a small case on the GPU: each row is ok or says why; the PyTorch
    forms run and pass the check (the fallbacks included), and so does fa4lab where its varlen
    path runs (`attention_varlen` on CUDA tensors; split-KV only once `num_splits` is in)."""
    res = {r.provider: r for r in sv.measure_case(case, rep_ms=5, warmup_ms=2,
                                                  hbm_gbps=4000.0)}
    assert set(res) == set(sv.SCENARIO_PROVIDERS[case.scenario])
    for r in res.values():
        assert r.status == OK or r.note, r
        assert r.status != FAILED, f"{r.provider}: {r.note}"
        if r.status == OK:
            assert r.max_err <= r.tol and r.us > 0 and r.x_floor > 0
    torch_forms = {sv.VARLEN: [sv.SDPA_NESTED], sv.PAGED: [sv.SDPA_PADDED],
                   sv.SPLITKV: ["sdpa-flash"], sv.PAGED_PREFILL: []}[case.scenario]
    for name in torch_forms:
        assert res[name].status == OK, f"{name}: {res[name].note}"
    if case.scenario != sv.SPLITKV:
        assert res["fa4lab"].status == OK, res["fa4lab"].note
