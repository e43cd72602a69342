"""`fa4lab plan`: answers for head_dim 64/128 (causal or not, GQA 1/4), explains 256 on sm100,
JSON output stable and round-trips to Plan."""

from __future__ import annotations

import argparse
import json

import pytest
from matrix import FULL_MATRIX, matrix

from fa4lab.plan import Plan, plan_forward
from fa4lab.plan_cli import EXIT_NO_PLAN, add_cli

_REPORTS: dict = {}


@pytest.fixture
def one_report_per_plan(monkeypatch):
    """`fa4lab plan` builds the report of a plan (simulations: 0.5-1 s each) once for this
    module's tests that print one plan twice (JSON and Markdown, or several --page-size): each
    call gets its own copy. Not for test_json_is_stable_and_round_trips, which builds it twice on
    purpose."""
    import copy

    from fa4lab import plan_cli

    real = plan_cli.build_report

    def once(plan, costs=None, recorded=None):
        key = (plan, costs, json.dumps(recorded, sort_keys=True))
        if key not in _REPORTS:
            _REPORTS[key] = real(plan, costs, recorded)
        return copy.deepcopy(_REPORTS[key])

    monkeypatch.setattr(plan_cli, "build_report", once)


def run_cli(capsys, *argv) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="fa4lab")
    add_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", *argv])
    rc = args.func(args)
    return rc, capsys.readouterr().out


# arch x head_dim x (causal, GQA) sampled pairwise (tests/matrix.py): each report builds and
# simulates its plan (1-2 s on a 2-core machine): 4 of the 8; FA4LAB_FULL_MATRIX=1 runs all.
@pytest.mark.parametrize("arch,hd,causal_gqa", matrix(
    [("sm100", "sm90"), (64, 128), ((False, 1), (True, 4))]))
def test_answers_supported_specs(capsys, arch, hd, causal_gqa):
    causal, gqa = causal_gqa
    argv = ["--arch", arch, "--head-dim", str(hd), "--gqa", str(gqa), "--seqlen", "2048"]
    rc, out = run_cli(capsys, *(argv + (["--causal"] if causal else [])))
    assert rc == 0
    for section in ("## Conclusion", "## Evidence and assumptions", "## Contract",
                    "## Simulated timeline", "## Minimal validation", "## Risks and fallbacks"):
        assert section in out
    assert "no deadlock, no hazard" in out and "NOT CAUGHT" not in out
    assert f"GQA {gqa}" in out


def test_head_dim_256_on_sm100_plans_one_q_tile(capsys):
    rc, out = run_cli(capsys, "--head-dim", "256", "--seqlen", "1024")
    assert rc == 0 and "q_stage" in out and "no deadlock, no hazard" in out
    rc, out = run_cli(capsys, "--head-dim", "256", "--q-stage", "2")
    assert rc == EXIT_NO_PLAN
    assert "TMEM over budget" in out and "768" in out and "q_stage=1 fits" in out
    rc, out = run_cli(capsys, "--head-dim", "256", "--q-stage", "2", "--format", "json")
    assert rc == EXIT_NO_PLAN and "TMEM" in json.loads(out)["error"]


def test_head_dim_256_on_sm90_plans(capsys):
    rc, out = run_cli(capsys, "--head-dim", "256", "--arch", "sm90", "--seqlen", "1024")
    assert rc == 0 and "n_block" in out


def test_json_is_stable_and_round_trips(capsys):
    argv = ["--head-dim", "128", "--causal", "--gqa", "4", "--lse", "--seqlen", "1024",
            "--format", "json"]
    rc1, out1 = run_cli(capsys, *argv)
    rc2, out2 = run_cli(capsys, *argv)
    assert rc1 == rc2 == 0 and out1 == out2
    data = json.loads(out1)
    assert json.dumps(data, sort_keys=True, indent=2) == out1.strip()
    plan = Plan.from_dict(data)
    assert plan == plan_forward(plan.spec, "sm100")
    assert plan.spec.causal and plan.spec.return_lse and plan.spec.gqa_ratio == 4
    assert data["report"]["simulation"]["hazards"] == []


def test_bad_arguments_are_explained(capsys):
    rc = run_cli(capsys, "--heads", "6", "--gqa", "4")[0]
    assert rc == EXIT_NO_PLAN
    rc, out = run_cli(capsys, "--n-block", "72")
    assert rc == EXIT_NO_PLAN and "multiple of 16" in out


# ---- windows, softcap, sinks ----
def run_cli_err(capsys, *argv) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="fa4lab")
    add_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", *argv])
    rc = args.func(args)
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


# Each window on one arch, the archs taking turns (4 of the 8 pairs: the report's tile counts
# are one rule over whichever blocks the plan has, and each report takes 2-3 s on a 2-core
# machine); FA4LAB_FULL_MATRIX=1 runs every window on both.
WINDOWS = [
    (["--causal", "--window", "700", "none"], (700, None)),
    (["--window", "300", "0"], (300, None)),         # right = 0 is causal
    (["--window", "none", "200", "--seqlen-k", "3000"], (None, 200)),
    (["--window", "250", "100", "--gqa", "4"], (250, 100)),
]
WINDOW_CASES = ([(arch, *w) for arch in ("sm100", "sm90") for w in WINDOWS] if FULL_MATRIX
                else [(("sm100", "sm90")[i % 2], *w) for i, w in enumerate(WINDOWS)])


@pytest.mark.parametrize("arch,argv,window", WINDOW_CASES)
def test_window_softcap_sink_plan(capsys, one_report_per_plan, arch, argv, window):
    """The report's tile counts are classify_tiles' on the plan's CTA x K/V block grid; the
    Markdown names the window, the softcap and the sink."""
    from fa4lab import tiling

    base = ["--arch", arch, "--head-dim", "128", "--seqlen", "2048", "--softcap", "30",
            "--sink", *argv]
    rc, out = run_cli(capsys, *base, "--format", "json")
    assert rc == 0
    data = json.loads(out)
    plan = Plan.from_dict(data)
    s, t = plan.spec, plan.tiles
    assert s.window_size == window and s.softcap == 30.0 and s.learnable_sink
    assert plan == plan_forward(s, arch)
    got = data["report"]["tiles"]
    kw = dict(seqlen_q=s.seqlen_q, seqlen_k=s.seqlen_k, m_block_size=t.cta_m,
              n_block_size=t.n_block, causal=s.causal, window_size=s.window_size)
    tc = tiling.classify_tiles(**kw)
    assert {k: got[k] for k in tc.counts} == tc.counts and got["tiles"] == tc.num_tiles
    left = [tiling.n_block_left_masked_range(m, **kw) for m in range(tc.shape[0])]
    assert got["left_edge_masked"] == sum(e - b for b, e in left)
    assert got["skipped_fraction"] == pytest.approx(tc.skipped_fraction, abs=1e-4)
    assert data["report"]["mask"]["effective_window"] == list(s.effective_window)
    rc, md = run_cli(capsys, *base)
    assert rc == 0
    left_side, right_side = ("none" if x is None else str(x) for x in s.effective_window)
    assert f"window ({left_side}, {right_side})" in md
    assert "softcap 30" in md and "learnable sink" in md.lower()
    assert "### Tile kinds" in md and f"| {tc.counts['SKIP']} | {tc.num_tiles} |" in md
    assert "without the mask" in md and "no deadlock, no hazard" in md


def test_windowed_plan_predicts_less_time(capsys):
    argv = ["--head-dim", "128", "--seqlen", "4096", "--format", "json"]
    dense = json.loads(run_cli(capsys, *argv)[1])["report"]
    local = json.loads(run_cli(capsys, *argv, "--window", "512", "512")[1])["report"]
    assert local["mask"]["dense_seconds"] == pytest.approx(dense["prediction"]["seconds"])
    assert local["prediction"]["seconds"] < dense["prediction"]["seconds"]
    assert dense["mask"]["dense_seconds"] is None and dense["tiles"]["SKIP"] == 0


@pytest.mark.parametrize("argv,window,softcap", [
    (["--window", "1.5", "none"], ("1.5", None), 0.0),
    (["--window", "left", "2"], ("left", 2), 0.0),
    (["--softcap", "-3"], (None, None), -3.0),
    (["--softcap", "inf"], (None, None), float("inf")),
    (["--softcap", "big"], (None, None), "big"),
])
def test_bad_window_or_softcap_exits_2_with_the_spec_message(capsys, argv, window, softcap):
    from fa4lab.spec import check_softcap, check_window_size

    with pytest.raises((TypeError, ValueError)) as err:
        check_window_size(window)
        check_softcap(softcap)
    rc, out, errout = run_cli_err(capsys, *argv)
    assert rc == EXIT_NO_PLAN and out == ""
    assert str(err.value) in errout and "Traceback" not in errout


def test_causal_with_a_right_side_exits_2(capsys):
    from fa4lab.spec import normalize_mask

    with pytest.raises(ValueError) as err:
        normalize_mask(True, (4, 2))
    rc, _, errout = run_cli_err(capsys, "--causal", "--window", "4", "2")
    assert rc == EXIT_NO_PLAN and str(err.value) in errout


def test_python_m_fa4lab_plan_takes_the_mask_flags():
    """The same flags through `python -m fa4lab plan`: a plan, and a bad value's message
    without a traceback."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "fa4lab", "plan", "--seqlen", "1024", "--causal"]
    ok = subprocess.run(cmd + ["--window", "256", "0", "--softcap", "20", "--sink"],
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert "window (256, 0)" in ok.stdout and "softcap 20" in ok.stdout
    bad = subprocess.run(cmd + ["--window", "4", "-2"], capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == EXIT_NO_PLAN
    assert "disagree" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("page_size", [16, 100, 256])
def test_page_size_shows_how_pages_meet_the_blocks(capsys, one_report_per_plan, page_size):
    """Note [paged blocks in the plan]: the blocks' pieces come from key_block_pages, in order;
    every key of the sequence is read once, from the slot that holds it."""
    from fa4lab.varlen_tiles import key_block_pages

    rc, out = run_cli(capsys, "--arch", "sm90", "--seqlen", "1000", "--page-size",
                      str(page_size), "--format", "json")
    assert rc == 0
    sec = json.loads(out)["report"]["paged"]
    n = sec["n_block"]
    blocks = key_block_pages(1000, page_size, n)
    keys = [s * page_size + t for b in blocks for s, _, a, z in b for t in range(a, z)]
    assert keys == list(range(1000))
    assert sec["blocks"] == len(blocks) == -(-1000 // n)
    assert sec["max_pieces_per_block"] == max(len(b) for b in blocks)
    want = {16: f"gathers {n // 16} pages", 256: "whole K/V block", 100: "straddle"}[page_size]
    assert want in sec["path"]
    rc, md = run_cli(capsys, "--arch", "sm90", "--seqlen", "1000", "--page-size", str(page_size))
    assert rc == 0 and f"## Paged K/V (pages of {page_size} tokens)" in md


def test_page_size_must_be_positive(capsys, one_report_per_plan):
    parser = argparse.ArgumentParser(prog="fa4lab")
    add_cli(parser.add_subparsers(dest="command"))
    # the report is built before the page size is read: the page-size tests' plan
    args = parser.parse_args(["plan", "--arch", "sm90", "--seqlen", "1000", "--page-size", "0"])
    assert args.func(args) == EXIT_NO_PLAN
    assert "--page-size: page_size must be a positive int, got 0" in capsys.readouterr().err
