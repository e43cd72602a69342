"""The sm100 kernel compiles for sm_100a on a CPU (fake tensors) and passes the binary audit.

Tier 1: no GPU needed, nvidia-cutlass-dsl and pip's CUDA binary tools required.

The grid is head_dim {64, 128} x causal x GQA {1, 4} x LSE x {bf16, fp16}: 32 compiles of
5-25 s each on a 2-core machine, most of them repeating what another already showed. `make test`
compiles a pairwise sample of it (tests/matrix.py: 6 configs that hold every level of every
factor beside every level of every other one, among them the two head_dim 128 configs that
compare LSE on and off); FA4LAB_FULL_MATRIX=1 compiles and audits all 32. Every other
(head_dim, head_dim_v) pair the kernel builds (`fa4lab.limits.KERNEL_HEAD_DIMS["sm100"]`)
compiles once, causal with GQA 4 and LSE (trimmed: one config per extra pair); head_dim 256 is
the one-Q-tile plan (Note [S ping-pong] in fa4lab.plan.sm100).
"""

from __future__ import annotations

import dataclasses

import pytest
from matrix import matrix, repeats

pytest.importorskip("cutlass")

from fa4lab.kernels import audit as audit_mod  # noqa: E402
from fa4lab.limits import KERNEL_HEAD_DIMS  # noqa: E402
from fa4lab.plan import plan_forward  # noqa: E402
from fa4lab.spec import AttentionSpec  # noqa: E402

# A config's head dim is an int (head_dim_v == head_dim) or a (head_dim, head_dim_v) pair.
GRID_DIMS = (64, 128)
GRID = [GRID_DIMS, (False, True), (1, 4), (False, True), ("bf16", "fp16")]
EXTRA_DIMS = [(d if d == dv else (d, dv), True, 4, True, "bf16")
              for d, dv in KERNEL_HEAD_DIMS["sm100"] if not (d == dv and d in GRID_DIMS)]
# Two head_dim 128 configs, LSE on and off, always in the sample: test_lse_off_passes_none and
# test_audit_catches_a_plan_that_does_not_match read their compiles.
WITH_LSE, WITHOUT_LSE = (128, True, 1, True, "bf16"), (128, False, 4, False, "bf16")
MATRIX = matrix(GRID, must=[WITH_LSE, WITHOUT_LSE]) + EXTRA_DIMS
# The options beyond the matrix, each on two configurations: softcap (a cap value; its value is
# a runtime argument, so one compile serves every cap); a sliding window (causal with a left
# side; both sides) and a learnable sink (their values are runtime arguments too); split-KV
# (its split count is a runtime argument); variable-length batches (packed q/k/v, the tile
# table, O stored row by row).
OPTIONS = [(128, True, 4, True, "bf16", (("softcap", 30.0),)),
           (64, False, 1, False, "fp16", (("softcap", 5.0),)),
           (128, True, 4, True, "bf16", (("window_size", (100, 0)),)),
           (64, False, 1, False, "fp16", (("window_size", (37, 12)), ("learnable_sink", True))),
           # A paged K/V cache (Note [paged key blocks]): one TMA box per key block (pages of
           # 128, 256) and a gather of 2 to 128 pages per block (64 down to 1: the load warp's
           # run-time loop over the pieces, 32 at a time, no spills; at head_dim 256 one piece
           # per iteration, `paged.gather_unroll`). Pages of 32, and of 16 at head_dim 64,
           # repeat the gathers of 16 and 64: `repeats`, compiled under FA4LAB_FULL_MATRIX=1.
           (128, True, 4, True, "bf16", (("page_size", 128),)),
           (64, False, 1, False, "fp16", (("page_size", 256),)),
           (128, False, 4, True, "bf16", (("page_size", 64), ("window_size", (300, None)))),
           *repeats([(128, True, 1, False, "fp16", (("page_size", 32),))]),
           (128, True, 4, True, "bf16", (("page_size", 16),)),
           *repeats([(64, False, 4, False, "bf16", (("page_size", 16),))]),
           (128, True, 4, True, "bf16", (("page_size", 1),)),
           (256, True, 1, False, "bf16", (("page_size", 4),)),
           # split-KV (fa4lab.kernels.device.split): float32 partials from the correction warps
           (128, False, 8, False, "bf16", (("split_kv", True),)),
           (64, True, 1, True, "fp16", (("window_size", (100, 0)), ("split_kv", True))),
           # varlen (Note [sm100 varlen]): persistent and causal; a window; one Q tile
           (128, True, 4, True, "bf16", (("varlen", True),)),
           (64, False, 1, False, "fp16", (("varlen", True), ("window_size", (37, 12)))),
           (256, True, 1, True, "bf16", (("varlen", True), ("learnable_sink", True)))]

_compiled = {}


def _spec(head_dim, causal, gqa, lse, dtype, options=()):
    dims = head_dim if isinstance(head_dim, tuple) else (head_dim, head_dim)
    return AttentionSpec(2, 300, 700, 8, 8 // gqa, *dims, dtype=dtype, causal=causal,
                         return_lse=lse, **dict(options))


def _compile(config, tmp_path_factory):
    from fa4lab.kernels import compile_forward

    if config not in _compiled:
        keep = tmp_path_factory.mktemp("sm100")
        _compiled[config] = compile_forward(_spec(*config), arch="sm100a", keep_dir=keep)
    return _compiled[config]


def _config_id(c):
    hd = "x".join(map(str, c[0])) if isinstance(c[0], tuple) else c[0]
    return "hd{}-{}-gqa{}-{}-{}".format(hd, "causal" if c[1] else "full", c[2],
                                        "lse" if c[3] else "nolse", c[4]) + "".join(
        f"-{name}{value}" for name, value in (c[5] if len(c) > 5 else ()))


@pytest.mark.slow
@pytest.mark.compile
@pytest.mark.parametrize("config", MATRIX + OPTIONS, ids=_config_id)
def test_compiles_and_passes_audit(config, tmp_path_factory):
    cf = _compile(config, tmp_path_factory)
    assert cf.ptx_path.stat().st_size > 0 and cf.cubin_path.stat().st_size > 0
    result = audit_mod.audit_compiled(cf)
    failures = "\n".join(f"{r.name}: expected {r.expected}, found {r.found}"
                         for r in result.failures())
    assert result.ok, f"audit failed for {config}:\n{failures}"
    assert result.row("spill instructions (STL/LDL)").found == 0
    assert result.row("dynamic SMEM bytes").found == cf.plan.smem.total_bytes
    assert result.row("tcgen05.mma (PTX)").found > 0


@pytest.mark.slow
@pytest.mark.compile
def test_one_q_tile_plan_compiles_and_passes_audit(tmp_path_factory):
    """The S ping-pong (Note [S ping-pong]) at head_dim 128, where two Q tiles would fit too:
    q_stage 1 is a plan override, and its kernel audits like every other (head_dim 256, which
    needs it, is in the matrix)."""
    from fa4lab.kernels import compile_forward

    plan = plan_forward(_spec(128, True, 4, True, "bf16"), arch="sm100", q_stage=1)
    assert plan.tiles.q_stage == 1 and plan.barriers.barrier("kv_full").ring == "kv_ahead"
    cf = compile_forward(plan, arch="sm100a", keep_dir=tmp_path_factory.mktemp("sm100q1"))
    result = audit_mod.audit_compiled(cf)
    failures = "\n".join(f"{r.name}: expected {r.expected}, found {r.found}"
                         for r in result.failures())
    assert result.ok, failures
    assert result.row("spill instructions (STL/LDL)").found == 0


# The decode shape's split kernels: contiguous K/V, and a paged cache (Note [paged key blocks])
# read as a gather of 2 and 8 pages per key block (causal: LPT order, the MMA warp's tightest
# registers) and as one TMA box per block.
SPLIT_DECODE = [(None, False), (64, True), (16, True), (128, False)]


@pytest.mark.slow
@pytest.mark.compile
@pytest.mark.parametrize("page_size,causal", SPLIT_DECODE, ids=[
    f"{'page' + str(p) if p else 'contiguous'}-{'causal' if c else 'full'}"
    for p, c in SPLIT_DECODE])
def test_split_kv_pack_gqa_compiles_and_passes_audit(page_size, causal, tmp_path_factory):
    """The decode shape's kernel: split-KV with pack-GQA 8 (persistent), the same audit; the
    correction warps store the float32 partials in 16-byte vectors and the epilogue warp
    issues no TMA store."""
    from fa4lab.kernels import compile_forward

    spec = _spec(128, causal, 8, False, "bf16", (("split_kv", True), ("page_size", page_size)))
    cf = compile_forward(plan_forward(spec, arch="sm100", pack_gqa=True), arch="sm100a",
                         keep_dir=tmp_path_factory.mktemp("sm100split"))
    result = audit_mod.audit_compiled(cf)
    failures = "\n".join(f"{r.name}: expected {r.expected}, found {r.found}"
                         for r in result.failures())
    assert result.ok, failures
    assert result.row("spill instructions (STL/LDL)").found == 0
    assert "st.global.v4" in cf.ptx and "cp.async.bulk.tensor.4d.global.shared" not in cf.ptx


@pytest.mark.slow
@pytest.mark.compile
def test_audit_catches_a_plan_that_does_not_match(tmp_path_factory):
    """Audit the same binary against a different plan: the mismatches must show, with numbers."""
    cf = _compile(WITH_LSE, tmp_path_factory)
    other = plan_forward(cf.plan.spec, arch="sm100", kv_stage=2)
    result = audit_mod.audit_compiled(dataclasses.replace(cf, plan=other))
    smem = result.row("dynamic SMEM bytes")
    assert not smem.ok and smem.expected == other.smem.total_bytes and smem.found == cf.smem_bytes
    assert not result.ok


@pytest.mark.slow
@pytest.mark.compile
def test_lse_off_passes_none(tmp_path_factory):
    """return_lse=False compiles with mLSE=None: no global store of LSE in the PTX."""
    with_lse = _compile(WITH_LSE, tmp_path_factory).ptx
    without = _compile(WITHOUT_LSE, tmp_path_factory).ptx
    assert with_lse.count("st.global.b32") >= 2 > without.count("st.global.b32")
    assert "lg2.approx" in with_lse and "lg2.approx" not in without


def test_unsupported_head_dim_is_a_clear_error():
    from fa4lab.kernels.fwd_sm100 import FlashForwardSm100

    plan = plan_forward(AttentionSpec(1, 128, 128, 1, 1, 128), arch="sm100")
    bad = dataclasses.replace(plan, spec=AttentionSpec(1, 128, 128, 1, 1, 80))
    with pytest.raises(ValueError, match=r"\(80, 80\) is not built by the sm100 kernel"):
        FlashForwardSm100(bad)


def test_compile_forward_rejects_unknown_arch():
    from fa4lab.kernels import compile_forward

    with pytest.raises(ValueError, match="sm100a"):
        compile_forward(AttentionSpec(1, 128, 128, 1, 1, 128), arch="sm80")


def test_kernels_package_imports_no_dsl():
    import subprocess
    import sys

    code = "import sys, fa4lab.kernels; assert 'cutlass' not in sys.modules, 'imported cutlass'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.slow
@pytest.mark.compile
@pytest.mark.parametrize("which", ["score_mod", "mask_mod"])
def test_mods_compile_and_pass_audit(which, tmp_path):
    """A score_mod (ALiBi, reading an aux tensor) and a mask_mod (prefix LM with per-batch
    lengths from an aux tensor) compiled in (fa4lab.kernels.device.mods): the same audit, no
    spills (the mask_mod's known 4, outside the steady-state loop, bounded below). Not in the
    audited set because they spill in the softmax warps' 192 registers at
    head_dim 128: a document mask (one aux read per score: 24 bytes) and a score_mod after a
    softcap (40 bytes); both compile, and the sm90 kernel audits both without spills."""
    import torch

    from fa4lab import mods
    from fa4lab.kernels import compile_forward

    if which == "score_mod":
        mod, aux = mods.alibi(torch.ones(8))
        km, options = mods.kernel_mods(mod, None, aux), ()
    else:
        mod, aux = mods.prefix_lm(torch.zeros(2, dtype=torch.int32))
        km, options = mods.kernel_mods(None, mod, aux), ()
    cf = compile_forward(_spec(128, True, 4, True, "bf16", options), arch="sm100a",
                         keep_dir=tmp_path, mods=km)
    result = audit_mod.audit_compiled(cf)
    # Known defect (mask_mod only): with the block table (fa4lab.mods_blocks) the softmax warps
    # spill a row's key limit, 4 spill instructions and an 8-byte stack frame, none of them in
    # the steady-state loop. Bounded here so that any growth fails; 0 is the goal.
    known = ({"spill instructions (STL/LDL)": 4, "stack frame bytes": 8}
             if which == "mask_mod" else {})
    failures = [f"{r.name}: expected {r.expected}, found {r.found}" for r in result.failures()
                if not (r.name in known and r.found <= known[r.name])]
    assert not failures, failures
    assert result.row("spills in the steady-state loop").found == 0
    assert result.row("spill instructions (STL/LDL)").found <= known.get(
        "spill instructions (STL/LDL)", 0)
