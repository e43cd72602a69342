"""The ladder of notebook 05 (fa4lab.kernels.ladder): each step compiles for sm_100a on a CPU and
its binary holds what the step issues; the excerpts are read from the source, captioned from the
plan, and fail loudly when an anchor disappears; on a B200 steps 1-2 match the float64 reference.

Compiles (marker `compile`): steps 1-2 at two configurations each (trimmed: one head_dim 128
bf16, one head_dim 64 fp16; step 2's with GQA 4), step 3 at head_dim 128 (q_stage 1) and 256.
Step 4 is the default sm100 kernel, compiled and audited by tests/test_compile_sm100.py.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from fa4lab.kernels import ladder
from fa4lab.kernels.ladder import excerpts
from fa4lab.spec import AttentionSpec


def _excerpt_file_lines(e: excerpts.Excerpt) -> list[str]:
    path, span = e.where.split(" ")[0].rsplit(":", 1)
    lo, hi = map(int, span.split("-"))
    root = Path(excerpts.__file__).resolve().parents[3]
    return (root / path).read_text().splitlines()[lo - 1:hi]


# ---------------------------------------------------------------- pure Python
def test_steps_and_their_plans():
    assert [s.number for s in ladder.STEPS] == [1, 2, 3, 4]
    assert ladder.step_plan(3).tiles.q_stage == 1
    assert ladder.step_plan(4).tiles.q_stage == 2
    assert ladder.step_plan(1) == ladder.step_plan(4)
    with pytest.raises(ValueError, match="steps 1-4"):
        ladder.step_plan(5)


def test_step2_refuses_what_it_does_not_compute():
    pytest.importorskip("cutlass")
    from fa4lab.kernels.ladder.step2_scores import ScoreSoftmaxSm100
    from fa4lab.plan import plan_forward

    plan = plan_forward(AttentionSpec(1, 300, 700, 4, 4, 128, causal=True), arch="sm100")
    with pytest.raises(ValueError, match="non-causal.*step 4"):
        ScoreSoftmaxSm100(plan)


def test_barrier_excerpt_is_the_source_captioned_from_the_plan():
    pytest.importorskip("cutlass")
    from fa4lab.kernels.fwd_sm100 import FlashForwardSm100 as K

    plan = ladder.step_plan(4)
    for obj, site in ((K.mma, "commit s_full"), (K.softmax_step, "arrive p_ready"),
                      (K.correction, "wait o_final")):
        e = excerpts.barrier_excerpt(plan, obj, site)
        b = plan.barriers.barrier(site.split()[1])
        assert f"({b.producer} -> {b.consumer})" in e.caption and b.guards in e.caption
        assert any(f'"{site}' in ln for ln in e.lines)
        got = [ln.strip() for ln in _excerpt_file_lines(e)]
        assert got == [ln.strip() for ln in e.lines], e.where


def test_tmem_caption_reads_the_plan():
    plan = ladder.step_plan(4)
    caption = excerpts.tmem_caption(plan, "O")
    for r in plan.tmem.regions:
        if r.name == "O":
            assert f"O_{r.stage} columns [{r.col_offset}, {r.col_end})" in caption
    with pytest.raises(excerpts.ExcerptMissing, match="no TMEM region 'X'"):
        excerpts.tmem_caption(plan, "X")


def test_a_missing_anchor_fails_loudly():
    with pytest.raises(excerpts.ExcerptMissing, match=r"step_plan: anchor 'no such line'"):
        excerpts.lines_at(ladder.step_plan, "no such line", "caption")
    with pytest.raises(excerpts.ExcerptMissing, match="occurrence 9"):
        excerpts.lines_at(ladder.step_plan, "q_stage", "caption", occurrence=9)
    e = excerpts.between(ladder.step_plan, "spec = ladder_spec()", "return plan_forward",
                         "caption")
    assert e.lines[0].startswith("spec =") and e.lines[-1].startswith("return plan_forward")


# ---------------------------------------------------------------- compiled on the CPU
SMALL = [(1, AttentionSpec(1, 128, 128, 1, 1, 128, return_lse=True)),
         (1, AttentionSpec(1, 128, 128, 1, 1, 64, dtype="fp16", return_lse=True)),
         (2, AttentionSpec(1, 300, 700, 8, 2, 128, return_lse=True)),
         (2, AttentionSpec(1, 300, 700, 4, 4, 64, dtype="fp16", return_lse=True))]


def _small_id(case):
    n, s = case
    return f"step{n}-hd{s.head_dim}-{s.dtype}-gqa{s.qhead_per_kvhead}"


@pytest.mark.slow
@pytest.mark.compile
@pytest.mark.parametrize("case", SMALL, ids=_small_id)
def test_small_steps_compile_and_hold_what_they_issue(case, tmp_path_factory):
    n, spec = case
    cf = ladder.compile_step(n, spec, keep_dir=tmp_path_factory.mktemp("ladder"))
    result = ladder.audit_step(n, cf)
    assert result.ok, "\n".join(f"{r.name}: expected {r.expected}, found {r.found}"
                                for r in result.failures())
    plan = cf.plan
    assert result.row("tcgen05.mma (PTX)").found == plan.tiles.head_dim // 16
    assert result.row("TMEM columns (tcgen05.alloc)").found == [plan.tmem.region("S", 0).columns]
    assert result.row("spill instructions (STL/LDL)").found == 0


@pytest.mark.slow
@pytest.mark.compile
def test_step_audit_can_fail(tmp_path_factory):
    """Step 1's binary audited with step 2's expectations: the extra commit and mbarriers of
    step 2 are missing, and the audit says so with numbers."""
    keep = tmp_path_factory.mktemp("ladder")
    one, two = (ladder.compile_step(*SMALL[i], keep_dir=keep) for i in (0, 2))
    result = ladder.audit_step(1, dataclasses.replace(one, kernel=two.kernel))
    bad = {r.name: (r.expected, r.found) for r in result.failures()}
    assert bad["tcgen05.commit (PTX)"] == (2, 1)
    assert bad["mbarrier.init (PTX)"] == (two.kernel.expected["mbarrier.init"], 2)


@pytest.mark.slow
@pytest.mark.compile
def test_ladder_table_adds_what_each_step_says(tmp_path_factory):
    keep = tmp_path_factory.mktemp("ladder")
    measured = {n: ladder.measure(ladder.compile_step(n, spec, keep_dir=keep))
                for n, spec in (SMALL[0], (2, AttentionSpec(1, 300, 700, 1, 1, 128,
                                                            return_lse=True)))}
    one, two = measured[1], measured[2]
    assert two["mbarrier.init"] > one["mbarrier.init"]      # the K ring, s_full / p_ready
    assert two["tcgen05.commit"] == one["tcgen05.commit"] + 1   # kv_empty
    assert one["MUFU.EX2"] == 0 < two["MUFU.EX2"]           # the softmax
    table = ladder.ladder_table(measured)
    assert table.count("\n") == 3 and "| 2. S only |" in table


@pytest.mark.slow
@pytest.mark.compile
@pytest.mark.parametrize("head_dim", [128, 256])
def test_step3_one_q_tile_two_s_buffers(head_dim, tmp_path_factory):
    spec = ladder.ladder_spec(head_dim)
    cf = ladder.compile_step(3, spec, keep_dir=tmp_path_factory.mktemp("ladder"))
    assert cf.plan.tiles.q_stage == 1
    result = ladder.audit_step(3, cf)
    assert result.ok, [(r.name, r.expected, r.found) for r in result.failures()]


# ---------------------------------------------------------------- on a B200
@pytest.mark.sm100
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_step1_scores_match_float64(dtype, gen):
    import torch

    tdtype = torch.bfloat16 if dtype == "bf16" else torch.float16
    for sq, sk, d in ((1, 1, 128), (128, 128, 128), (77, 128, 64), (128, 5, 128)):
        q = torch.randn(sq, d, generator=gen).to("cuda", tdtype)
        k = torch.randn(sk, d, generator=gen).to("cuda", tdtype)
        s = ladder.score_tile(q, k)
        ref = q.double() @ k.double().T
        err = (s.double() - ref).abs().max().item()
        assert err <= 1e-4 * math.sqrt(d), f"({sq}, {sk}, {d}) {dtype}: max |S - ref| = {err}"


@pytest.mark.sm100
def test_step2_lse_matches_float64(gen):
    import torch

    from fa4lab.reference import attention_reference

    for b, sq, sk, hq, hkv, d, spread in ((1, 1, 1, 1, 1, 128, 1.0),
                                          (2, 17, 1000, 8, 2, 128, 1.0),
                                          (1, 300, 129, 4, 4, 64, 30.0)):   # extreme logits
        q = (spread * torch.randn(b, sq, hq, d, generator=gen)).to("cuda", torch.bfloat16)
        k = torch.randn(b, sk, hkv, d, generator=gen).to("cuda", torch.bfloat16)
        v = torch.zeros_like(k)
        lse = ladder.lse_only(q, k)
        _, ref = attention_reference(q, k, v, return_lse=True)
        err = (lse.double() - ref.double()).abs().max().item()
        assert torch.isfinite(lse).all() and err <= 1e-3, \
            f"(b={b}, {sq}x{sk}, heads {hq}/{hkv}, d={d}, spread {spread}): max |LSE err| {err}"


@pytest.mark.sm100
def test_bad_inputs_are_refused_before_launch():
    import torch

    q = torch.randn(129, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"seqlen_q in \[1, 128\]"):
        ladder.score_tile(q, q[:4])
    with pytest.raises(ValueError, match="bf16 or fp16 CUDA"):
        ladder.score_tile(q.float(), q.float())
