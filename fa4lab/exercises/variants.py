"""Notebook 05's exercise, a softmax-step variant written as a score_mod, and the tiers its
check and notebook 06's (`fa4lab.exercises.masks`) share.

A student's mod (`fa4lab.mods`) is graded the way the library is tested, tier by tier
(`fa4lab.environment.tiers`):

  tier 0 (CPU)  float64: the mod through `fa4lab.reference` against the spec's own option (here
                softcap=...) or brute force over the element mask; then `blockwise_attention`,
                the kernels' walk over key blocks (`fa4lab.blockwalk` on the plan's tiles:
                `fa4lab.tiling`'s block ranges and masked runs, a mask_mod's block table,
                `fa4lab.online_softmax` with FA4's conditional rescale), against the
                reference. That walk is a model of the kernel's order of work, not the kernel.
  tier 1 (CPU)  the mod compiled into the kernel for its arch with fake tensors and audited
                (`fa4lab.kernels.audit`: no spills, every protocol row holds). One compile per
                mod, keyed as the launch cache keys it (`fa4lab.mods.mod_key`) and kept for the
                process: a notebook re-running its test cell does not compile again. What this
                machine cannot do is not the student's fault (Note [whose failure]).
  tier 2 (GPU)  notebook 06 only: `fa4lab.attention` on a Hopper GPU (`fa4lab.exercises.masks`).

Exercise 05: `softcap_score_mod(softcap)` returns score_mod(score, b, h, q_idx, kv_idx) that
caps each score as the spec's softcap does (Gemma 2's tanh softcapping), built from
`fa4lab.mods` helpers so that one body runs in the reference and in the sm100 kernel.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

from fa4lab import mods as M
from fa4lab.blockwalk import walk
from fa4lab.exercises._core import (
    ExerciseFailed,
    GradingError,
    call_student,
    fresh_rng,
    raised_at,
)
from fa4lab.reference import attention_reference
from fa4lab.spec import AttentionSpec, resolve_scale

__all__ = ["check_softcap_score_mod", "blockwise_attention", "compile_and_audit",
           "first_output_mismatch", "graded_call"]

_RTOL, _ATOL = 1e-10, 1e-10      # float64 against float64: only summation order differs
CAPS = (30.0, 5.0, 0.5)          # a cap like Gemma 2's, a tight one, one below most scores
# The configuration each arch's mod is compiled in: tails on both sides of the tiles, GQA 4:1,
# causal, LSE (the audited mods configurations of tests/test_compile_sm100.py and
# tests/test_sm90_compile.py).
COMPILE_SPEC = AttentionSpec(2, 300, 700, 8, 2, 128, causal=True, return_lse=True)


# ---- tier 0: the kernels' block walk --------------------------------------------------------

def blockwise_attention(q, k, v, *, arch: str, causal: bool = False, km=None, aux: tuple = ()):
    """(out, lse), float64 numpy: `fa4lab.blockwalk.walk`, the kernels' walk over key blocks,
    on the tiles of `arch`'s kernel that the mod is compiled into (the plan of COMPILE_SPEC's
    head_dim at this shape, no pack-GQA: a lesson's small head_dim need not be one the kernels
    build). q (batch, seqlen_q, heads_q, d), k, v numpy float64; km a `fa4lab.mods.KernelMods`
    or None; softmax_scale 1/sqrt(d)."""
    from fa4lab.plan import plan_forward

    batch, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    shape = dict(batch=batch, seqlen_q=sq, seqlen_k=sk, heads_q=hq, heads_kv=hkv, causal=causal)
    tiles = plan_forward(COMPILE_SPEC.with_(**shape), arch=arch, pack_gqa=False).tiles
    spec = AttentionSpec(**shape, head_dim=d, head_dim_v=v.shape[-1])
    out, lse, _ = walk(q, k, v, spec, tiles, km, aux)
    return out, lse


def first_output_mismatch(got, want, rtol: float = _RTOL, atol: float = _ATOL):
    """(batch, row, head) of the first row where out (batch, seqlen_q, heads, d) or lse (batch,
    heads, seqlen_q) differ, with a one-line description; None when they agree."""
    (out, lse), (ref, ref_lse) = ([np.asarray(x, dtype=np.float64) for x in pair]
                                  for pair in (got, want))
    bad_o = ~np.isclose(out, ref, rtol=rtol, atol=atol).all(axis=-1)          # (b, sq, h)
    same_l = np.isclose(lse, ref_lse, rtol=rtol, atol=atol) | (lse == ref_lse)
    bad = bad_o | ~same_l.transpose(0, 2, 1)
    if not bad.any():
        return None
    b, i, h = (int(x) for x in np.argwhere(bad)[0])
    col = int(np.argmax(~np.isclose(out[b, i, h], ref[b, i, h], rtol=rtol, atol=atol)))
    return (b, i, h), (f"batch {b}, query row {i}, head {h}: lse {lse[b, h, i]:.10g} (expected "
                       f"{ref_lse[b, h, i]:.10g}), out[..., {col}] {out[b, i, h, col]:.10g} "
                       f"(expected {ref[b, i, h, col]:.10g})")


# ---- tier 1: compile into the kernel and audit ----------------------------------------------

# Note [whose failure]
# A build or an audit can fail for reasons that are not the student's: the CuTe DSL or the CUDA
# binary tools missing or broken on a laptop, a bug in fa4lab. So the check blames the mod only
# for what the mod causes:
#   - the DSL cannot trace the mod (`fa4lab.mods.ModCompileError`): the student's, with the line
#     of their function that raised when it is one (`raised_at`);
#   - any other build failure, or audit rows that fail: the kernel is built and audited the same
#     way WITHOUT the mod (the baseline: the same configuration, with the library's own version
#     of the variant where it has one, e.g. softcap=). What fails there too is not the student's:
#     that part is not graded, and the summary says so, why, and what to do;
#   - the CUDA binary tools missing (cuobjdump, nvdisasm) or failing: the audit is not graded,
#     the summary says so (a pass, never silent: the grader's report shows the summary).

_compiled: dict = {}
_baselines: dict = {}
_FIX = ("run `fa4lab doctor` to see what this machine lacks (`make install` installs the CuTe "
        "DSL and the CUDA binary tools); the instructor's grader builds it again")


def compile_and_audit(km, arch: str, what: str, baseline: AttentionSpec | None = None) -> str:
    """Compile `km` (a `fa4lab.mods.KernelMods`) into the kernel for `arch` ("sm100a" /
    "sm90a") on this machine and audit the binary; raises ExerciseFailed naming what the mod
    broke. `baseline` is the configuration built without the mod when the mod's build or audit
    fails (COMPILE_SPEC when None): what fails there too is not graded (Note [whose failure]).
    Returns a one-line summary, saying what was not graded and why (no CuTe DSL,
    FA4LAB_FORBID_COMPILE=1 as `make test-fast` sets, no CUDA binary tools, a kernel that does
    not build here). Cached per (arch, mod) for the process."""
    from fa4lab import environment

    if not environment.has_cute_dsl():
        return f"compile for {arch} skipped: nvidia-cutlass-dsl is not installed here"
    if os.environ.get("FA4LAB_FORBID_COMPILE") == "1":
        return f"compile for {arch} skipped: FA4LAB_FORBID_COMPILE=1 switches compiles off here"
    key = (arch, km.key)
    if key not in _compiled:
        _compiled[key] = _compile_and_audit(km, arch, what, baseline or COMPILE_SPEC)
    result = _compiled[key]
    if isinstance(result, ExerciseFailed):
        raise result
    return result


def _build(spec: AttentionSpec, arch: str, km):
    import tempfile

    from fa4lab.kernels.compile import compile_forward

    return compile_forward(spec, arch=arch, mods=km,
                           keep_dir=tempfile.mkdtemp(prefix="fa4lab-exercise-"))


def _baseline(spec: AttentionSpec, arch: str):
    """(compiled, audit or the audit's exception) of `spec` without a mod, or the build's
    exception; kept for the process."""
    from fa4lab.kernels import audit as audit_mod

    key = (arch, spec)
    if key not in _baselines:
        try:
            cf = _build(spec, arch, None)
        except Exception as err:        # whatever breaks the build: reported, not raised
            _baselines[key] = err
        else:
            try:
                _baselines[key] = (cf, audit_mod.audit_compiled(cf))
            except (FileNotFoundError, RuntimeError) as err:
                _baselines[key] = (cf, err)
    return _baselines[key]


def _trace_failure(err: M.ModCompileError, km, what: str, arch: str) -> ExerciseFailed:
    """The DSL could not trace the mod: where in the student's function, when it raised."""
    cause = err.__cause__
    fn = km.score_mod or km.mask_mod
    at = raised_at(cause, fn) if cause is not None else ""
    said = (f"your function raised {type(cause).__name__}{at} when the kernel traced it: "
            f"{M.one_line(cause)}" if at else M.one_line(err))
    return ExerciseFailed(
        f"{what} does not compile into the {arch} kernel: {said}\n  hint: in the kernel "
        f"your function is traced with the DSL's Float32 / Int32 scalars: use fa4lab.mods.tanh "
        f"/ where / minimum / maximum / abs (not torch.* or math.*, no tensor methods, no `if` "
        f"on a value)")


def _compile_and_audit(km, arch: str, what: str, baseline: AttentionSpec):
    from fa4lab.kernels import audit as audit_mod

    try:
        cf = _build(COMPILE_SPEC, arch, km)
    except M.ModCompileError as err:
        return _trace_failure(err, km, what, arch)
    except Exception as err:
        base = _baseline(baseline, arch)
        if isinstance(base, Exception):
            return (f"compile for {arch} NOT GRADED: the kernel does not build here without "
                    f"your mod either: {type(base).__name__}: {M.one_line(base)[:300]}; this is "
                    f"not your code: {_FIX}")
        return ExerciseFailed(
            f"{what}: the {arch} kernel builds here without your mod but not with it: "
            f"{type(err).__name__}: {M.one_line(err)[:300]}\n  hint: write the mod as one "
            f"expression of its arguments with fa4lab.mods helpers (Note [one body, two "
            f"worlds] in fa4lab.mods)")
    built = f"compiled for {arch} in {cf.seconds:.0f} s"
    try:
        audit = audit_mod.audit_compiled(cf)
    except (FileNotFoundError, RuntimeError) as err:   # fa4lab.kernels.binary: tool missing/failed
        return (f"{built}; the audit of the binary NOT GRADED: the CUDA binary tools do not run "
                f"here ({M.one_line(err)[:300]}): {_FIX}")
    bad = audit.failures()
    if not bad:
        return f"{built}, audit clean ({len(audit.rows)} rows, 0 spills)"
    base = _baseline(baseline, arch)
    base_bad = ({r.name for r in base[1].failures()} if isinstance(base, tuple)
                and not isinstance(base[1], Exception) else set())
    mine = [r for r in bad if r.name not in base_bad]
    if not mine:
        rows = ", ".join(r.name for r in bad)
        return (f"{built}; the audit of the binary NOT GRADED: the kernel without your mod "
                f"fails the same row(s) here ({rows}): this is not your code: {_FIX}")
    rows = "; ".join(f"{r.name}: expected {r.expected}, found {r.found}" for r in mine)
    spill = any("spill" in r.name or "stack" in r.name for r in mine)
    hint = ("the mod keeps values live across the softmax loop, or reads memory per score; "
            "compute from score and the indices only, with fewer temporaries" if spill else
            "the mod changed the kernel's protocol or resources: write it as a plain "
            "expression of its arguments")
    return ExerciseFailed(f"{what} compiles for {arch} but the audit of the binary fails "
                          f"({len(mine)} row(s) that pass without your mod): {rows}\n  hint: "
                          f"{hint}")


# ---- shared: calling a student's mod --------------------------------------------------------

def mod_of(factory: Callable, name: str, arg, what: str) -> Callable:
    """factory(arg), which must be a function; turns the stub and crashes into a failure."""
    mod = call_student(factory, name, arg)
    if not callable(mod):
        raise ExerciseFailed(f"{name}({arg!r}) returned {type(mod).__name__} {mod!r}; return "
                             f"the inner function itself, {what} (`return inner`, not "
                             f"`return inner(...)`)")
    return mod


def _raised_hint(text: str) -> str:
    """The hint for an exception a mod raised, from its message."""
    if "ambiguous" in text:
        return ("`and` / `or` / `not` and `if` ask a tensor for one truth value: combine "
                "conditions with & | ~ and choose values with fa4lab.mods.where")
    if "scalar" in text or "must be real" in text or "one element" in text:
        return ("math.* and numpy functions take one number: use fa4lab.mods's tanh / where / "
                "minimum / maximum / abs, which work on torch, numpy and kernel values alike")
    return "see Note [one body, two worlds] in fa4lab.mods for what a mod may use"


def try_mod(mod: Callable, args: tuple, what: str, where: str):
    """mod(*args), any exception turned into a failure with the hint that fits it."""
    try:
        return mod(*args)
    except Exception as err:
        text = M.one_line(err)
        raise ExerciseFailed(f"your function {what} raised {type(err).__name__}"
                             f"{raised_at(err, mod)}: {text}\n  on {where}\n  hint: "
                             f"{_raised_hint(text)}") from err


def graded_call(mod: Callable, what: str, where: str, fn: Callable, *args, **kwargs):
    """fn(*args, **kwargs), a library function the check runs the student's `mod` through (the
    reference, the block walk). An exception raised in a line of the student's code is their
    failure (`raised_at`); any other is fa4lab's, a GradingError saying so (Note [whose
    failure])."""
    try:
        return fn(*args, **kwargs)
    except (ExerciseFailed, GradingError):
        raise
    except Exception as err:
        text, at = M.one_line(err), raised_at(err, mod)
        if at:
            raise ExerciseFailed(f"your function {what} raised {type(err).__name__}{at}: "
                                 f"{text}\n  on {where}\n  hint: {_raised_hint(text)}") from err
        raise GradingError(f"fa4lab failed while grading {what} on {where}: "
                           f"{type(err).__name__}: {text}\n  no line of your code is in the "
                           f"error, so it is not your answer but fa4lab or this install: run "
                           f"`fa4lab doctor`; if it persists, report it with this message (the "
                           f"seed replays it)") from err


def numpy_world(mod: Callable, args: tuple, what: str) -> None:
    """A mod built from fa4lab.mods helpers also runs on numpy arrays (the helpers dispatch);
    one that calls torch directly does not, and will not compile: say so early."""
    try:
        mod(*args)
    except Exception as err:
        raise ExerciseFailed(
            f"{what} works on torch tensors only ({type(err).__name__}: {M.one_line(err)} on "
            f"numpy arrays): it calls a torch function or tensor method, which the kernel "
            f"cannot trace\n  hint: use fa4lab.mods.tanh / where / minimum / maximum / abs; "
            f"they dispatch on their arguments (torch in the reference, DSL scalars in the "
            f"kernel)") from err


# ---- exercise 05: tanh softcapping as a score_mod -------------------------------------------

def _check_score_kind(mod, cap, seed) -> None:
    """The result's kind, dtype and shape on float64 scores, each with its own message."""
    import torch

    what = f"softcap_score_mod({cap:g})"
    score = torch.linspace(-50.0, 50.0, 6, dtype=torch.float64).view(2, 3)
    b, h = torch.zeros((1, 1), dtype=torch.int64), torch.zeros((1, 1), dtype=torch.int64)
    qi, ki = torch.arange(2)[:, None], torch.arange(3)[None, :]
    where = "float64 scores of shape (2, 3), int64 indices"
    got = try_mod(mod, (score, b, h, qi, ki), what, where)
    if not isinstance(got, torch.Tensor):
        raise ExerciseFailed(f"{what} returned {type(got).__name__} on {where}, not a tensor\n"
                             f"  hint: compute the result from `score` with fa4lab.mods "
                             f"helpers (math.tanh or float() turn a tensor into one number)")
    if not got.is_floating_point():
        raise ExerciseFailed(f"{what} returned dtype {got.dtype} on {where}: a score must stay "
                             f"floating point\n  hint: no integer division (//), rounding or "
                             f"comparisons in the result: softcap * tanh(score / softcap) is "
                             f"real-valued")
    if got.dtype != score.dtype:
        raise ExerciseFailed(f"{what} returned dtype {got.dtype} for {score.dtype} scores: it "
                             f"casts (a tensor method the kernel cannot trace, and a loss of "
                             f"precision in the float64 reference)\n  hint: return the "
                             f"expression itself; the kernel chooses the dtype")
    if torch.broadcast_shapes(got.shape, score.shape) != score.shape:
        raise ExerciseFailed(f"{what} returned shape {tuple(got.shape)} for scores of shape "
                             f"{tuple(score.shape)}: return one value per score")
    numpy_world(mod, (score.numpy(), 0, 0, qi.numpy(), ki.numpy()), what)
    try:
        M.check_mods(mod, None, None, "cpu")
    except (TypeError, ValueError) as err:
        raise ExerciseFailed(f"{what}: {M.one_line(err)} (seed {seed})") from err


def _score_grid(rng, rows: int = 48, cols: int = 40):
    """(q, k, v, scores): one key per batch element, so the reference's lse IS the transformed
    score of (row i, column = batch j); scores from 1e-3 to ~3e4 in size, both signs."""
    d = 4
    a = rng.choice([-1.0, 1.0], rows) * 10 ** rng.uniform(-3, 2.5, rows)
    c = rng.choice([-1.0, 1.0], cols) * 10 ** rng.uniform(-1, 2, cols)
    q = np.zeros((cols, rows, 1, d))
    q[..., 0, 0] = a[None, :]
    k = np.zeros((cols, 1, 1, d))
    k[:, 0, 0, 0] = c / resolve_scale(None, d)
    return q, k, np.ones((cols, 1, 1, 1)), np.outer(a, c)


def _softcap_hint(s, got, want, cap: float, i: int, j: int) -> str:
    """What the wrong scores look like, judged on the whole grid (s, got, want: (rows, cols))."""
    def near(x, y):
        return bool(np.allclose(x, y, rtol=1e-9, atol=1e-12))

    if np.isnan(got).any():
        return "NaN: a division by zero or inf / inf; divide the score by softcap, not by itself"
    if near(got, -want):
        return "a sign error: the cap keeps the score's sign (tanh is odd, softcap > 0)"
    if near(got, s):
        return "the scores came back unchanged: return softcap * tanh(score / softcap)"
    if near(got, cap * np.tanh(s)):
        return ("tanh(score) saturates at |score| ~ 3 whatever the cap: divide inside, "
                "tanh(score / softcap)")
    if near(got, np.tanh(s / cap)):
        return "tanh is in [-1, 1]: multiply by softcap to map it back to [-softcap, softcap]"
    if near(got, s / cap) or near(got, cap * s):
        return "the tanh is missing"
    if np.array_equal(got, np.round(got)):
        return ("every result is a whole number: // or rounding crept in; a capped score is "
                "real-valued")
    top = np.unravel_index(np.argmax(np.abs(s)), s.shape)
    if not near(abs(got[top]), cap):
        return (f"the largest score, {s[top]:.6g}, must saturate at +-{cap:g} and gives "
                f"{got[top]:.6g}: use the softcap argument of softcap_score_mod inside the "
                f"inner function, not a constant")
    return "each score s becomes softcap * tanh(s / softcap) (fa4lab.spec, softcap)"


def _problems(rng):
    """(name, q, k, v, causal): adversarial attention problems, float64 numpy, fresh values."""
    def rand(b, sq, sk, hq, hkv, d, mag=1.0):
        return (rng.standard_normal((b, sq, hq, d)) * mag, rng.standard_normal((b, sk, hkv, d))
                * mag, rng.standard_normal((b, sk, hkv, d)))

    return [
        ("random logits, GQA (4 query heads on 2 KV heads), tails", *rand(2, 9, 13, 4, 2, 8),
         False),
        ("extreme logits (|score| up to ~1e3: the cap saturates)", *rand(1, 7, 20, 2, 1, 8, 12.0),
         False),
        ("causal with seqlen_q > seqlen_k: the first rows see no key", *rand(1, 13, 5, 2, 1, 8,
                                                                            3.0), True),
        ("seqlen_q = seqlen_k = 1", *rand(1, 1, 1, 1, 1, 8), False),
        ("decoding: one query over 300 keys (three key blocks, a tail)", *rand(1, 1, 300, 2, 1,
                                                                               8, 3.0), True),
        ("two CTA tiles and a key tail, causal", *rand(1, 300, 260, 2, 1, 8, 3.0), True),
    ]


def check_softcap_score_mod(softcap_score_mod: Callable, *, seed: int | None = None,
                            compile: bool = True) -> str:
    """Grade `softcap_score_mod(softcap) -> score_mod(score, b, h, q_idx, kv_idx)`, the spec's
    softcap (`AttentionSpec.softcap`: each scaled score s becomes softcap * tanh(s / softcap))
    written as a `fa4lab.mods` score_mod.

    (a) float64, for softcap in CAPS: the result's kind and dtype; every score of a grid from
    1e-3 to ~3e4 through `attention_reference(score_mod=...)` against `attention_reference(
    softcap=...)` (row and column of the first mismatch, with a hint); whole attention problems
    (GQA, causal, empty rows, tails, seqlen 1); (b) compiled into the sm100 kernel for sm_100a
    on this CPU and audited (`compile=False` skips it); (c) the kernels' block walk
    (`blockwise_attention`, sm100 tiles) against the reference. Raises ExerciseFailed on the
    first failure; returns a summary.
    """
    rng, seed = fresh_rng(seed)
    q, k, v, s = _score_grid(rng)
    scores = 0
    for cap in CAPS:
        what = f"softcap_score_mod({cap:g})"
        mod = mod_of(softcap_score_mod, "softcap_score_mod", cap,
                     "score_mod(score, b, h, q_idx, kv_idx)")
        _check_score_kind(mod, cap, seed)
        _, want = attention_reference(q, k, v, softcap=cap, return_lse=True)
        _, got = graded_call(mod, what, f"the score grid, fa4lab.reference (seed {seed})",
                             attention_reference, q, k, v, score_mod=mod, return_lse=True)
        got, want = got[:, 0, :].T, want[:, 0, :].T                 # (rows, cols) of scores
        bad = ~np.isclose(got, want, rtol=1e-12, atol=1e-12)
        scores += got.size
        if bad.any():
            i, j = np.unravel_index(np.argmax(np.where(bad, np.abs(got - want), -1.0)),
                                    got.shape)
            raise ExerciseFailed(
                f"{what}: score row {i}, column {j}: s = {s[i, j]:.6g} became {got[i, j]:.10g}, "
                f"expected {want[i, j]:.10g} (fa4lab.reference with softcap={cap:g}; the "
                f"largest of {int(bad.sum())} wrong scores out of {got.size}; seed {seed})\n  "
                f"hint: {_softcap_hint(s, got, want, cap, i, j)}")
    cap = float(rng.choice(CAPS))
    mod = mod_of(softcap_score_mod, "softcap_score_mod", cap, "a score_mod")
    km = M.kernel_mods(mod, None, ())
    problems = _problems(rng)
    for name, q, k, v, causal in problems:
        want = attention_reference(q, k, v, causal=causal, softcap=cap, return_lse=True)
        what, where = f"softcap_score_mod({cap:g})", f"{name} (seed {seed})"
        got = graded_call(mod, what, f"{where}, fa4lab.reference", attention_reference, q, k,
                          v, causal=causal, score_mod=mod, return_lse=True)
        bad = first_output_mismatch(got, want)
        if bad:
            raise ExerciseFailed(
                f"softcap_score_mod({cap:g}) in whole attention ({name}; seed {seed}): "
                f"{bad[1]}\n  hint: each score alone was right, so the mod must depend on "
                f"b, h, q_idx or kv_idx: softcapping depends on the score only")
        walked = graded_call(mod, what, f"{where}, the sm100 block walk", blockwise_attention,
                             q, k, v, arch="sm100", causal=causal, km=km)
        sim = first_output_mismatch(walked, want)
        if sim:
            raise ExerciseFailed(
                f"softcap_score_mod({cap:g}) in the sm100 kernel's block walk ({name}; seed "
                f"{seed}): {sim[1]}\n  hint: the walk hands the mod one key block at a time "
                f"(kv_idx of that block only): the result must not depend on how many scores "
                f"it is given")
    tier1 = (compile_and_audit(km, "sm100a", f"softcap_score_mod({cap:g})",
                               COMPILE_SPEC.with_(softcap=cap)) if compile else
             "compile skipped (compile=False)")
    return (f"softcap_score_mod: {scores} scores match fa4lab.reference's softcap for softcap "
            f"in {CAPS}, {len(problems)} attention problems match in float64 and in the "
            f"sm100 block walk; {tier1} (seed {seed})")
