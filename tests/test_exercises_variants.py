"""The checks of notebooks 05 and 06 (`fa4lab.exercises.variants`, `fa4lab.exercises.masks`):
the instructor's answers pass, each typical wrong answer fails with its own message, and the
kernels' block walk they grade with agrees with the float64 reference and really trusts the
block table. The compile tier: `compile` tests (one kernel each, 20-40 s on a 2-core CPU); the
GPU tier: `sm90`.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fa4lab import environment, mods
from fa4lab.exercises import (
    ExerciseFailed,
    check_chunked_local_mask,
    check_softcap_score_mod,
    masks,
    variants,
)
from fa4lab.exercises._core import GradingError
from fa4lab.kernels.binary import Audit, AuditRow
from fa4lab.reference import attention_reference


def softcap_solution(softcap):
    def softcap_score(score, b, h, q_idx, kv_idx):
        return softcap * mods.tanh(score / softcap)
    return softcap_score


def chunked_solution(chunk_size):
    def chunked_local(b, h, q_idx, kv_idx):
        return q_idx // chunk_size == kv_idx // chunk_size
    return chunked_local


def _failure(check, fn) -> str:
    with pytest.raises(ExerciseFailed) as err:
        check(fn, compile=False)
    return str(err.value)


def _stub(_):
    raise NotImplementedError()


# ---- exercise 05 ------------------------------------------------------------------------------

def test_softcap_solution_passes_the_cpu_tiers():
    summary = check_softcap_score_mod(softcap_solution, compile=False)
    assert "match" in summary and "sm100 block walk" in summary and "seed" in summary


def _capped(expr):
    """A wrong softcap_score_mod from `expr(softcap, score)`."""
    return lambda softcap: (lambda s, b, h, qi, ki: expr(softcap, s))


SOFTCAP_MISTAKES = {
    "sign": (_capped(lambda c, s: -c * mods.tanh(s / c)), "a sign error"),
    "no division inside tanh": (_capped(lambda c, s: c * mods.tanh(s)), "divide inside"),
    "no multiply by the cap": (_capped(lambda c, s: mods.tanh(s / c)), "multiply by softcap"),
    "a constant cap": (_capped(lambda c, s: 30.0 * mods.tanh(s / 30.0)), "not a constant"),
    "unchanged": (_capped(lambda c, s: s), "unchanged"),
    "floor division": (_capped(lambda c, s: (c * mods.tanh(s / c)) // 1), "whole number"),
    "integer dtype": (_capped(lambda c, s: (c * mods.tanh(s / c)).long()), "must stay floating"),
    "float32 cast": (_capped(lambda c, s: (c * mods.tanh(s / c)).float()), "it casts"),
    "torch function": (_capped(lambda c, s: c * torch.tanh(s / c)), "torch tensors only"),
    "math function": (_capped(lambda c, s: c * math.tanh(s / c)), "math.* and numpy"),
    "branch on a value": (_capped(lambda c, s: s if s > c else c), "truth value"),
    "depends on the indices": (lambda c: (lambda s, b, h, qi, ki: c * mods.tanh(s / c) + 1e-3 * ki),
                               "must depend on b, h, q_idx or kv_idx"),
    "returns a call, not the function": (lambda c: None, "return the inner function itself"),
    "the release's stub": (_stub, "not implemented yet: write _stub"),
}


@pytest.mark.parametrize("mistake", sorted(SOFTCAP_MISTAKES))
def test_softcap_check_names_each_mistake(mistake):
    wrong, says = SOFTCAP_MISTAKES[mistake]
    msg = _failure(check_softcap_score_mod, wrong)
    assert says in msg, msg
    if "score row" in msg:
        assert "column" in msg and "expected" in msg and "seed" in msg


def test_softcap_messages_differ_per_mistake():
    hints = {m: _failure(check_softcap_score_mod, w).split("hint:")[-1]
             for m, (w, _) in SOFTCAP_MISTAKES.items()}
    assert len(set(hints.values())) == len(hints)


# ---- exercise 06 ------------------------------------------------------------------------------

def test_chunked_solution_passes_the_cpu_tiers():
    summary = check_chunked_local_mask(chunked_solution, compile=False, random_shapes=5)
    assert "match" in summary and "block tables" in summary and "seed" in summary
    g = environment.gpu()
    if g is None or g.arch != "sm90":
        assert "GPU check skipped (" in summary


def _masked(expr):
    return lambda c: (lambda b, h, qi, ki: expr(c, qi, ki))


MASK_MISTAKES = {
    "causal inside the mod": (_masked(lambda c, i, j: (i // c == j // c) & (j <= i)),
                              "leave causality to causal=True"),
    "modulo": (_masked(lambda c, i, j: i % c == j % c), "% gives"),
    "sliding window": (_masked(lambda c, i, j: mods.abs(i - j) < c), "sliding window"),
    "off by one": (_masked(lambda c, i, j: (i + 1) // c == j // c), "off by one"),
    "integer dtype": (_masked(lambda c, i, j: i // c - j // c), "returns bool"),
    "`and`": (_masked(lambda c, i, j: (i // c == j // c) and (j >= 0)), "combine conditions"),
    "torch function": (_masked(lambda c, i, j: torch.eq(i // c, j // c)), "torch tensors only"),
    "a Python bool": (_masked(lambda c, i, j: True), "not a tensor"),
    "the release's stub": (_stub, "not implemented yet: write _stub"),
}


@pytest.mark.parametrize("mistake", sorted(MASK_MISTAKES))
def test_chunked_check_names_each_mistake(mistake):
    wrong, says = MASK_MISTAKES[mistake]
    msg = _failure(check_chunked_local_mask, wrong)
    assert says in msg, msg
    if "sees key" in msg or "see key" in msg:
        assert "query" in msg and "chunk" in msg and "seed" in msg


def test_chunked_check_blames_the_mod_for_what_it_raises_in_the_reference():
    """A mod that passes the element and table checks but raises on a problem's (batch, head)
    fails with its own line, also when fa4lab wraps the error (ModCompileError); before, the
    check crashed with fa4lab's error."""
    def factory(c):
        def breaks_on_the_last_head(b, h, q_idx, kv_idx):
            if np.any((np.asarray(b) == 1) & (np.asarray(h) == 3)):   # only GQA 4:2's grid
                return q_idx.no_such_method()
            return q_idx // c == kv_idx // c
        return breaks_on_the_last_head

    with pytest.raises(ExerciseFailed) as err:
        check_chunked_local_mask(factory, compile=False, random_shapes=2)
    msg = str(err.value)
    assert msg.startswith("your function chunked_local_mask(") and "fa4lab.reference" in msg, msg
    assert "at line" in msg and "of breaks_on_the_last_head (`if np.any(" in msg, msg


def test_table_check_names_the_tile_and_block(monkeypatch):
    """A block table that hides a block some row sees fails, naming the tile and the block."""
    import fa4lab.mods_blocks as mb

    real = mb.block_table

    def hides_block_0(*args, **kwargs):
        table = real(*args, **kwargs).clone()
        table[:, 0] = torch.clamp(table[:, 0], min=1)
        return table

    monkeypatch.setattr(mb, "block_table", hides_block_0)
    km = mods.kernel_mods(None, chunked_solution(16), ())
    with pytest.raises(ExerciseFailed, match=r"m_block 0 .*key block 0"):
        masks._check_table(km, 300, 300, 16, seed=0)


# ---- the kernels' block walk --------------------------------------------------------------------

def _problem(rng, b=2, sq=300, sk=260, hq=4, hkv=2, d=16, mag=3.0):
    return (rng.standard_normal((b, sq, hq, d)) * mag, rng.standard_normal((b, sk, hkv, d)) * mag,
            rng.standard_normal((b, sk, hkv, d)))


@pytest.mark.parametrize("arch", ["sm100", "sm90"])
@pytest.mark.parametrize("causal", [False, True])
def test_block_walk_matches_the_reference(rng, arch, causal):
    q, k, v = _problem(rng)
    slopes = torch.from_numpy(rng.uniform(0.01, 1.0, 4)).float()
    alibi, aux = mods.alibi(slopes)
    docs = torch.from_numpy(np.sort(rng.integers(0, 4, 300))).int()
    documents, doc_aux = mods.document_mask(docs, aux_index=1)
    for score_mod, mask_mod, aux_tensors in ((None, None, None), (alibi, None, aux),
                                             (None, documents, (slopes,) + doc_aux),
                                             (alibi, documents, aux + doc_aux)):
        km, a = mods.check_mods(score_mod, mask_mod, aux_tensors, "cpu")
        a = tuple(t.double() if t.is_floating_point() else t for t in a)
        got = variants.blockwise_attention(q, k, v, arch=arch, causal=causal, km=km or None,
                                           aux=a)
        want = attention_reference(q, k, v, causal=causal, score_mod=score_mod,
                                   mask_mod=mask_mod, aux_tensors=aux_tensors, return_lse=True)
        assert variants.first_output_mismatch(got, want) is None, (score_mod, mask_mod)


def test_block_walk_trusts_the_tables_unmasked_run(rng, monkeypatch):
    """The walk skips the mask_mod in the run the table says every row sees whole, as the
    kernels do: a table that claims too much changes the answer (so the table is tested)."""
    import fa4lab.mods_blocks as mb

    q, k, v = _problem(rng, b=1, sq=256, sk=256, hq=2, hkv=1)
    km = mods.kernel_mods(None, chunked_solution(100), ())
    want = attention_reference(q, k, v, causal=True, mask_mod=km.mask_mod, return_lse=True)
    assert variants.first_output_mismatch(
        variants.blockwise_attention(q, k, v, arch="sm90", causal=True, km=km), want) is None
    real = mb.block_table

    def claims_every_block_whole(*args, **kwargs):
        table = real(*args, **kwargs).clone()
        table[:, 2], table[:, 3] = table[:, 0], table[:, 1]
        return table

    monkeypatch.setattr(mb, "block_table", claims_every_block_whole)
    bad = variants.first_output_mismatch(
        variants.blockwise_attention(q, k, v, arch="sm90", causal=True, km=km), want)
    assert bad is not None and "query row" in bad[1]


def test_forbidden_compiles_are_skipped_with_the_reason(monkeypatch):
    monkeypatch.setenv("FA4LAB_FORBID_COMPILE", "1")
    km = mods.kernel_mods(None, chunked_solution(64), ())
    text = variants.compile_and_audit(km, "sm90a", "chunked_local_mask(64)")
    assert "skipped" in text and ("FA4LAB_FORBID_COMPILE" in text or "not installed" in text)


# ---- whose failure: the machine's, fa4lab's or the student's (Note [whose failure]) -------------

@pytest.fixture
def fake_kernel(monkeypatch):
    """compile_forward and audit_compiled replaced by fakes the test steers: `build(mods)`
    returns or raises for a build with / without a mod, `audit(mods)` the same for its audit;
    the process caches emptied, compiles switched on."""
    import fa4lab.kernels.audit as audit_mod
    import fa4lab.kernels.compile as compile_mod

    monkeypatch.delenv("FA4LAB_FORBID_COMPILE", raising=False)
    monkeypatch.setattr(environment, "has_cute_dsl", lambda: True)
    monkeypatch.setattr(variants, "_compiled", {})
    monkeypatch.setattr(variants, "_baselines", {})
    steer = SimpleNamespace(builds=[], build=lambda mods: None, audit=lambda mods: None)

    def compile_forward(spec, arch, mods=None, keep_dir=None):
        steer.builds.append((spec, mods))
        steer.build(mods)
        return SimpleNamespace(seconds=1.0, mods=mods)

    monkeypatch.setattr(compile_mod, "compile_forward", compile_forward)
    monkeypatch.setattr(audit_mod, "audit_compiled", lambda cf: steer.audit(cf.mods))
    return steer


def _raise(err):
    raise err


def _audit(*failing):
    rows = [AuditRow(name, 0, 1 if name in failing else 0, name not in failing)
            for name in ("local memory (spills)", "registers", "barrier protocol")]
    return Audit("fake", tuple(rows))


def test_a_kernel_that_does_not_build_without_the_mod_either_is_not_graded(fake_kernel):
    """A broken toolchain fails the library's own softcap build too: the summary says the
    compile was not graded and that it is not the student's code; the rest is graded."""
    fake_kernel.build = lambda mods: _raise(RuntimeError("ptxas fatal: unsupported .version"))
    summary = check_softcap_score_mod(softcap_solution)
    assert "does not build here without your mod either" in summary, summary
    assert "ptxas fatal" in summary and "not your code" in summary and "NOT GRADED" in summary
    assert "fa4lab doctor" in summary and "sm100 block walk" in summary
    (_, first), (baseline, none) = fake_kernel.builds
    assert first is not None and none is None and baseline.softcap > 0   # the library's softcap


def test_a_build_that_fails_only_with_the_mod_is_the_mods(fake_kernel):
    fake_kernel.audit = lambda mods: _audit()
    fake_kernel.build = lambda mods: mods and _raise(RuntimeError("MLIR verification failed"))
    km = mods.kernel_mods(softcap_solution(5.0), None, ())
    with pytest.raises(ExerciseFailed, match="builds here without your mod but not with it: "
                                             "RuntimeError: MLIR verification failed"):
        variants.compile_and_audit(km, "sm100a", "softcap_score_mod(5)")


def test_missing_cuda_tools_leave_the_audit_ungraded_and_say_so(fake_kernel):
    missing = FileNotFoundError("cuobjdump not found in pip's nvidia packages")
    fake_kernel.audit = lambda mods: _raise(missing)
    summary = check_softcap_score_mod(softcap_solution)
    assert "compiled for sm100a" in summary, summary
    assert "audit of the binary NOT GRADED" in summary and "cuobjdump not found" in summary


def test_audit_rows_that_fail_without_the_mod_are_not_the_students(fake_kernel):
    km = mods.kernel_mods(softcap_solution(5.0), None, ())
    fake_kernel.audit = lambda mods: _audit("local memory (spills)")
    summary = variants.compile_and_audit(km, "sm100a", "softcap_score_mod(5)")
    assert "NOT GRADED" in summary and "fails the same row(s)" in summary, summary
    assert "local memory (spills)" in summary and "not your code" in summary

    variants._compiled.clear()
    variants._baselines.clear()
    fake_kernel.audit = lambda mods: _audit("local memory (spills)", *(["registers"] if mods
                                                                         else []))
    with pytest.raises(ExerciseFailed, match=r"1 row\(s\) that pass without your mod\): "
                                             r"registers: expected 0, found 1"):
        variants.compile_and_audit(km, "sm100a", "softcap_score_mod(5)")


def test_the_students_exception_names_its_line_and_fa4labs_says_it_is_not_theirs():
    def raises_late(score, b, h, q_idx, kv_idx):
        if len(score.shape) == 3 and score.shape[1] > 40:   # not the probes: the grid
            return score.no_such_method()
        return 5.0 * mods.tanh(score / 5.0)

    with pytest.raises(ExerciseFailed) as err:
        check_softcap_score_mod(lambda c: raises_late, compile=False)
    msg = str(err.value)
    assert msg.startswith("your function softcap_score_mod(") and "AttributeError" in msg, msg
    assert "at line" in msg and "of raises_late (`return score.no_such_method()`)" in msg, msg

    q, k = np.zeros((1, 2, 1, 4)), np.zeros((1, 3, 1, 8))     # fa4lab fails, not the mod
    with pytest.raises(GradingError, match="no line of your code is in the error"):
        variants.graded_call(raises_late, "softcap_score_mod(5)", "a problem",
                             attention_reference, q, k, k, score_mod=raises_late)


# ---- tier 1: compile and audit (CPU) -----------------------------------------------------------

@pytest.mark.slow
@pytest.mark.compile
def test_softcap_solution_compiles_for_sm100a_and_audits_clean():
    pytest.importorskip("cutlass")
    summary = check_softcap_score_mod(softcap_solution)
    assert "compiled for sm100a" in summary and "audit clean" in summary, summary


@pytest.mark.compile
def test_chunked_solution_compiles_for_sm90a_and_audits_clean(monkeypatch):
    pytest.importorskip("cutlass")
    summary = check_chunked_local_mask(chunked_solution, random_shapes=2, seed=7)
    assert "compiled for sm90a" in summary and "audit clean" in summary, summary

    def no_second_compile(*args, **kwargs):
        raise AssertionError("compiled again: the check caches per mod")

    import fa4lab.kernels.compile as compile_mod

    monkeypatch.setattr(compile_mod, "compile_forward", no_second_compile)
    assert check_chunked_local_mask(chunked_solution, random_shapes=2, seed=7) == summary


@pytest.mark.compile
def test_a_mod_the_kernel_cannot_trace_fails_at_compile():
    pytest.importorskip("cutlass")

    def clamped(score, b, h, q_idx, kv_idx):
        return score.clamp(min=-5.0)

    with pytest.raises(ExerciseFailed, match="does not compile into the sm90a kernel") as err:
        variants.compile_and_audit(mods.kernel_mods(clamped, None, ()), "sm90a", "clamped")
    assert "your function raised AttributeError at line" in str(err.value), str(err.value)
    assert "(`return score.clamp(min=-5.0)`)" in str(err.value)


# ---- tier 2: the sm90 kernel on a Hopper GPU -----------------------------------------------------

@pytest.mark.sm90
def test_chunked_solution_runs_in_the_sm90_kernel():
    summary = check_chunked_local_mask(chunked_solution, random_shapes=2)
    assert "the sm90 kernel matches the float64 reference" in summary, summary
