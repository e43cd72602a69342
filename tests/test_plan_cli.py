"""`fa4lab plan`: answers for head_dim 64/128 (causal or not, GQA 1/4), explains 256 on sm100,
JSON output stable and round-trips to Plan."""

from __future__ import annotations

import argparse
import json

import pytest

from fa4lab.plan import Plan, plan_forward
from fa4lab.plan.report import EXIT_NO_PLAN, add_cli


def run_cli(capsys, *argv) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="fa4lab")
    add_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", *argv])
    rc = args.func(args)
    return rc, capsys.readouterr().out


@pytest.mark.parametrize("arch", ["sm100", "sm90"])
@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("causal,gqa", [(False, 1), (True, 4)])
def test_answers_supported_specs(capsys, arch, hd, causal, gqa):
    argv = ["--arch", arch, "--head-dim", str(hd), "--gqa", str(gqa), "--seqlen", "2048"]
    rc, out = run_cli(capsys, *(argv + (["--causal"] if causal else [])))
    assert rc == 0
    for section in ("## Conclusion", "## Evidence and assumptions", "## Contract",
                    "## Simulated timeline", "## Minimal validation", "## Risks and fallbacks"):
        assert section in out
    assert "no deadlock, no hazard" in out and "NOT CAUGHT" not in out
    assert f"GQA {gqa}" in out


def test_head_dim_256_on_sm100_explains_fallback(capsys):
    rc, out = run_cli(capsys, "--head-dim", "256")
    assert rc == EXIT_NO_PLAN
    assert "TMEM over budget" in out and "768" in out
    assert "--arch sm90" in out and "--q-stage 1" in out
    rc, out = run_cli(capsys, "--head-dim", "256", "--format", "json")
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
