"""`plan_backward` and `fa4lab plan --backward`: the B200 backward's plan fits TMEM, SMEM and the
register file, reads its numbers from `fa4lab.backward_budget`, and its protocol table runs in
the simulator without deadlock or hazard, each barrier's removal caught (or named as implied or
unobservable); the CLI prints the five outputs."""

from __future__ import annotations

import argparse
import json
import math

import pytest

import fa4lab.backward_budget as budget
from fa4lab.errors import PlanError
from fa4lab.hardware import B200
from fa4lab.limits import KERNEL_HEAD_DIMS
from fa4lab.plan.backward import BACKWARD_HEAD_DIMS, plan_backward
from fa4lab.plan.report_backward import IMPLIED
from fa4lab.plan.simulate import mutation_check, simulate, unobservable
from fa4lab.plan_cli import EXIT_NO_PLAN, add_cli
from fa4lab.spec import AttentionSpec


def spec(hd: int, hdv: int | None = None, **kw) -> AttentionSpec:
    return AttentionSpec(1, 1024, 1024, 8, 8, hd, head_dim_v=hdv, **kw)


@pytest.fixture(scope="module")
def plans():
    return {d: plan_backward(spec(d, dv)) for d, dv in BACKWARD_HEAD_DIMS}


@pytest.mark.parametrize("pair", KERNEL_HEAD_DIMS["sm100"])
def test_tmem_fits_or_refuses_at_every_forward_head_dim(pair):
    try:
        plan = plan_backward(spec(*pair))
    except PlanError as err:
        assert pair not in BACKWARD_HEAD_DIMS
        assert "2-CTA" in str(err) and "TMEM" in str(err) or "dQ" in str(err), err
        return
    assert plan.tmem.total_cols <= B200.tmem_columns
    assert plan.tmem.alloc_cols <= B200.tmem_columns
    # the only undeclared overlap: dS and dQ, both over dP, reused in issue order (Note [the
    # backward's TMEM] in fa4lab.backward_budget)
    assert [(a.name, b.name) for a, b in plan.tmem.overlaps()] == [("dS", "dQ")]


def test_tmem_and_tiles_are_backward_budgets(plans):
    for (d, dv), plan in zip(BACKWARD_HEAD_DIMS, plans.values()):
        tm = budget.backward_tmem(d, dv)
        assert plan.tmem == tm
        assert (plan.tiles.n_block, plan.tiles.m_block) == (tm.lanes, tm.region("S", 0).columns)
    assert [p.tmem.total_cols for p in plans.values()] == [384, 448, 512]


def test_the_plan_reads_backward_budget_not_a_copy(monkeypatch):
    real = budget.backward_tmem
    monkeypatch.setattr(budget, "backward_tmem", lambda d, dv=None, **kw: real(64, **kw))
    assert plan_backward(spec(128)).tmem.total_cols == 384


def test_step_bytes_and_flops_are_backward_budgets(plans):
    for (d, dv), plan in zip(BACKWARD_HEAD_DIMS, plans.values()):
        t, sm = plan.tiles, plan.smem
        b = budget.step_bytes(d, dv, block_m=t.m_block, block_n=t.n_block)
        assert sm.region("q").bytes_per_stage == b["q"]
        assert sm.region("do").bytes_per_stage == b["dout"]
        assert sm.region("lse").bytes_per_stage + sm.region("dpsum").bytes_per_stage == b["lse_d"]
        assert t.dq_chunks * sm.region("dq_acc").bytes_per_stage == b["dq_partial"]
        flops = budget.step_flops(d, dv, block_m=t.m_block, block_n=t.n_block)
        assert {m.name: m.flops for m in plan.mmas} == flops


def test_smem_and_registers_fit(plans):
    for plan in plans.values():
        assert plan.smem.total_bytes <= plan.smem.limit_bytes == B200.smem_per_cta
        assert plan.registers_used <= B200.registers_per_sm
        assert plan.threads_per_cta == 512
    # upstream FA4's 1-CTA shared storage at head_dim 128 (flash_bwd_sm100.py, `__call__`)
    assert plans[128].smem.total_bytes == 232448
    masked = plan_backward(spec(128, causal=True))
    assert masked.role("compute").registers == 144 and masked.registers_used <= 65536


def test_every_barrier_has_producers_and_waiters(plans):
    proto = plans[128].protocol
    sites = [s for path in proto.paths() for s in proto.sites(path, plans[128].tiles.q_stage)]
    for b in proto.barriers.barriers:
        kinds = {s.kind for s in sites if s.barrier == b.name}
        assert kinds & {"wait", "sync"}, b.name
        assert kinds & {"arrive", "commit", "expect_tx", "named_arrive", "sync"}, b.name


@pytest.mark.parametrize("hd", [64, 128])
def test_the_protocol_runs_without_deadlock_or_hazard(plans, hd):
    for n in (1, 2, 3, 8):
        for masked in {0, n // 2, n}:
            r = simulate(plans[hd], n, 1, masked_blocks=masked)
            assert r.ok, r.summary()
            assert r.leftover == {}, r.leftover      # every phase begun was completed
            assert math.isfinite(r.cycles) and r.cycles > 0


def test_the_tensor_pipe_runs_a_query_block_ahead(plans):
    r = simulate(plans[128], 3, 1)
    order = [s.label for s in r.spans if s.lane == "tensor"]
    assert order == ["S^T=K Q0", "dP^T=V dO0", "dV+=P^T dO0",
                     "S^T=K Q1", "dK+=dS^T Q0", "dQ0=dS K", "dP^T=V dO1", "dV+=P^T dO1",
                     "S^T=K Q2", "dK+=dS^T Q1", "dQ1=dS K", "dP^T=V dO2", "dV+=P^T dO2",
                     "dK+=dS^T Q2", "dQ2=dS K"]


def test_each_barrier_is_caught_implied_or_unobservable(plans):
    plan = plans[128]
    found = mutation_check(plan)
    missed = {k for k, v in found.items() if not v}
    assert missed == set(IMPLIED) | set(unobservable(plan)), found
    assert set(unobservable(plan)) == {"dkv_empty", "tile_read"}


def test_refusals_name_the_reason():
    with pytest.raises(PlanError, match="2-CTA"):
        plan_backward(spec(192, 128))
    with pytest.raises(PlanError, match="768"):
        plan_backward(spec(256))
    with pytest.raises(PlanError, match="no sm90 backward plan"):
        plan_backward(spec(128), "sm90")


def run_cli(capsys, *argv) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="fa4lab")
    add_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", "--backward", *argv])
    rc = args.func(args)
    return rc, capsys.readouterr().out


SECTIONS = ("## Conclusion", "## Evidence and assumptions", "## Contract",
            "### Simulated timeline (MODELLED)", "## Validation and one falsifiable experiment",
            "## Risks and fallback")


def test_cli_prints_the_five_outputs(capsys):
    rc, out = run_cli(capsys, "--head-dim", "128", "--causal", "--seqlen", "2048")
    assert rc == 0
    at = [out.index(s) for s in SECTIONS]
    assert at == sorted(at)
    assert "no deadlock, no hazard" in out and "NOT CAUGHT" not in out
    assert "Falsifiable experiment" in out and "causal" in out
    for line in out.splitlines():   # no throughput figure without its label
        if "TFLOP/s" in line:
            assert "MODELLED" in line or "PUBLISHED" in line, line


def test_cli_refuses_what_it_cannot_plan(capsys):
    rc, out = run_cli(capsys, "--head-dim", "256")
    assert rc == EXIT_NO_PLAN and "PlanError" in out
    rc, _ = run_cli(capsys, "--n-block", "64")
    assert rc == EXIT_NO_PLAN


def test_cli_json_has_the_plan_and_the_report(capsys):
    rc, out = run_cli(capsys, "--head-dim", "64", "--seqlen", "1024", "--format", "json")
    d = json.loads(out)
    assert rc == 0 and d["direction"] == "backward"
    assert d["tmem"]["total_cols"] == 384 and d["report"]["simulation"]["deadlock"] == []


def test_the_notebook_views(plans):
    from matplotlib.figure import Figure

    from fa4lab.plan.report_backward import (
        build_backward_report,
        render_backward_markdown,
        report_section,
    )
    from fa4lab.viz.backward import draw_backward_timeline, protocol_markdown

    plan = plans[64]
    table = protocol_markdown(plan)
    assert all(f"`{b.name}`" in table for b in plan.barriers.barriers)
    assert table.count("\n") == 1 + len(plan.protocol.programs)
    md = render_backward_markdown(plan, build_backward_report(plan))
    head = report_section(md, "Conclusion")
    assert head.startswith("## Conclusion") and "## Evidence" not in head
    assert report_section(md, "One CTA or a pair").count("\n| ") == 1 + len(plan.mmas)
    with pytest.raises(KeyError):
        report_section(md, "no such section")
    assert isinstance(draw_backward_timeline(simulate(plan, 2, 1)), Figure)
