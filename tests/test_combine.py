"""The split-KV combine kernel (`fa4lab.kernels.combine`).

Tier 1 (marker `compile`): the kernel compiles for sm_90a and sm_100a with fake tensors, with no
spills, 16-byte loads of the partial outputs and the merge's exp2 on MUFU. Tier 0: its plan's
numbers and the input checks that run before any launch. Tier 2 (marker `gpu`, an sm90 or sm100
GPU): combine_cuda against the float64 reference and the torch combine on partials from
`partial_attention_reference` (empty splits, rows no key reaches, logits of 1e4, GQA, tails) and
on synthetic partials whose LSEs differ by up to 1e4, for num_splits 1, 2, 7, 16 (and 128),
head_dim_v 64 / 96 / 128 / 256, bf16 / fp16 / fp32 out, with and without a learnable sink.

Grids are trimmed: a (head_dim_v, out dtype, lse, sink) is one compile, every num_splits and
shape of it a runtime value.
"""

from __future__ import annotations

import math

import pytest
import torch

from fa4lab.environment import gpu
from fa4lab.errors import InputError, InputTypeError, PlanError
from fa4lab.reference import attention_reference
from fa4lab.splitkv import MAX_SPLITS, combine, partial_attention_reference


# ---- tier 0: the plan and the checks before launch ---------------------------------------------
@pytest.mark.parametrize("head_dim_v", [8, 64, 96, 128, 256, 512])
def test_plan_covers_its_tile_with_the_cta(head_dim_v):
    from fa4lab.kernels.combine import (
        COMBINE_MIN_ROWS,
        COMBINE_SMEM_LIMIT,
        COMBINE_THREADS,
        COMBINE_VEC,
        CombinePlan,
    )

    p = CombinePlan(head_dim_v, "bf16")
    assert p.threads_per_row * COMBINE_VEC == head_dim_v, "a row's threads cover its columns"
    assert p.rows_per_pass * p.threads_per_row <= COMBINE_THREADS
    assert (p.rows_per_pass + 1) * p.threads_per_row > COMBINE_THREADS, "a whole row is idle"
    assert p.tile_rows % p.rows_per_pass == 0 and p.tile_rows >= COMBINE_MIN_ROWS
    assert p.tile_rows - p.rows_per_pass < COMBINE_MIN_ROWS, "a pass more than needed"
    assert p.weight_stride > p.num_splits_max and p.smem_bytes <= COMBINE_SMEM_LIMIT


@pytest.mark.parametrize("kwargs, match", [
    (dict(head_dim_v=66, dtype="bf16"), "multiple of 4"),
    (dict(head_dim_v=516, dtype="bf16"), "up to 512"),
    (dict(head_dim_v=4, dtype="bf16"), "bytes of shared memory"),
    (dict(head_dim_v=128, dtype="fp8"), "writes out as one of"),
    (dict(head_dim_v=128, dtype="bf16", num_splits_max=MAX_SPLITS + 1), "MAX_SPLITS"),
    (dict(head_dim_v=128, dtype="bf16", num_splits_max=0), "num_splits_max"),
])
def test_plan_refuses_what_the_kernel_cannot_build(kwargs, match):
    from fa4lab.kernels.combine import CombinePlan

    with pytest.raises(PlanError, match=match):
        CombinePlan(**kwargs)


def test_combine_cuda_refuses_before_launch():
    from fa4lab.kernels.combine import combine_cuda

    out_p, lse_p = torch.zeros(2, 1, 3, 4, 64), torch.zeros(2, 1, 3, 4)
    with pytest.raises(InputError, match="runs on a CUDA GPU"):
        combine_cuda(out_p, lse_p)
    with pytest.raises(InputTypeError, match="reads float32 partials"):
        combine_cuda(out_p.double(), lse_p)
    with pytest.raises(InputTypeError, match="must be a torch tensor"):
        combine_cuda(out_p.numpy(), lse_p)


def test_combine_out_dtype_on_the_torch_path(rng):
    q, k, v = (torch.from_numpy(rng.standard_normal(s)) for s in ((2, 3, 4, 8), (2, 9, 2, 8),
                                                                  (2, 9, 2, 16)))
    out_p, lse_p = partial_attention_reference(q, k, v, num_splits=3, n_block_size=4)
    ref, ref_lse = attention_reference(q, k, v, return_lse=True)
    out, lse = combine(out_p.float(), lse_p.float(), out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.transpose(1, 2).double(), ref_lse, atol=1e-5, rtol=1e-5)
    with pytest.raises(InputTypeError, match="out_dtype must be a floating torch dtype"):
        combine(out_p, lse_p, out_dtype=torch.int32)


# ---- tier 1: compile on the CPU -----------------------------------------------------------------
# (head_dim_v, out dtype, return_lse, learnable_sink): every head_dim_v the forward kernels
# build (fa4lab.limits.KERNEL_HEAD_DIMS), each out dtype, each switch on and off somewhere.
COMPILED = [(64, "bf16", True, False), (96, "fp16", False, True), (128, "bf16", True, True),
            (256, "fp32", True, False)]


@pytest.mark.compile
@pytest.mark.parametrize("arch", ["sm90a", "sm100a"])
@pytest.mark.parametrize("head_dim_v, dtype, return_lse, sink", COMPILED)
def test_combine_compiles_without_spills(arch, head_dim_v, dtype, return_lse, sink, tmp_path):
    from fa4lab.kernels import binary
    from fa4lab.kernels.combine import compile_combine

    cc = compile_combine(head_dim_v=head_dim_v, dtype=dtype, arch=arch, return_lse=return_lse,
                         learnable_sink=sink, keep_dir=tmp_path)
    assert f".target sm_{arch.removeprefix('sm')}" in cc.ptx_path.read_text()
    res = binary.resource_usage(cc.cubin_path)
    assert res["local"] == 0 and res["stack"] == 0, f"{cc.plan.name(arch)} spills: {res}"
    ops = binary.sass_opcodes(binary.sass(cc.cubin_path))
    assert binary.count_prefix(ops, "STL") == binary.count_prefix(ops, "LDL") == 0
    # Note [combine in two passes]: each thread reads its 4 columns of a split in one load.
    assert binary.count_prefix(ops, "LDG", "128") > 0, "the partial outputs' loads are scalar"
    assert binary.count_prefix(ops, "MUFU.EX2") > 0, "the weights' exp2 is not on MUFU"


# ---- tier 2: on the GPU -------------------------------------------------------------------------
def _need_kernel_gpu():
    g = gpu()
    if g is None or g.arch not in ("sm90", "sm100"):
        pytest.skip(f"the combine kernel is built for sm_90a / sm_100a; here: "
                    f"{g.name if g else 'no GPU'}")


def _lse_ulps(lse_p) -> float:
    """4 float32 ulps of the largest finite partial LSE: the weights exp(lse - max) carry a
    float32 LSE's rounding as a relative error (tests/test_splitkv.py says why)."""
    finite = lse_p[torch.isfinite(lse_p)]
    return 4 * 2.0**-24 * finite.abs().max().item() if finite.numel() else 0.0


def _tolerances(lse_p, vmax) -> tuple[float, float]:
    """(out, lse) tolerances of float32 partials against the float64 reference of the whole
    problem, beyond out's own rounding: what the partial LSEs' float32 rounding allows."""
    ulps = _lse_ulps(lse_p)
    return 1e-5 + 8 * ulps * vmax, 1e-5 + 2 * ulps


def _check(out, lse, ref, ref_lse, out_dtype, out_atol, lse_atol):
    """out (b, sq, h, dv) and lse (b, h, sq) against the float64 (ref, ref_lse (b, h, sq)): rows
    no key reaches give exactly 0 and -inf; elsewhere out is within twice the rounding of the
    reference to out_dtype plus out_atol, lse within lse_atol."""
    assert out.dtype == out_dtype and not torch.isnan(out).any()
    out, ref = out.double().cpu(), ref.double().cpu()
    rounding = (ref.to(out_dtype).double() - ref).abs().max().item()
    torch.testing.assert_close(out, ref, rtol=0, atol=2 * rounding + out_atol)
    empty = torch.isneginf(ref_lse.cpu()).transpose(1, 2)     # (b, sq, h)
    assert (out[empty] == 0).all(), "a row no split saw must be exactly 0"
    if lse is None:
        return
    lse, ref_lse = lse.double().cpu(), ref_lse.double().cpu()
    assert not torch.isnan(lse).any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "-inf where no key is seen"
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], rtol=0, atol=lse_atol)


# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, n_block, causal, logit): tails (seqlen_k not a
# multiple of n_block), GQA, more splits than key blocks (empty splits), causal with seqlen_q >
# seqlen_k (the top rows see no key), logits of 1e4 (partial LSEs far apart), one query row.
PROBLEMS = [(2, 3, 37, 4, 2, 4, False, 1.0), (1, 5, 3, 2, 2, 1, True, 1.0),
            (2, 1, 29, 6, 3, 3, False, 1e4), (1, 4, 50, 3, 1, 8, True, 1e4)]


def _problem(problem, head_dim_v, num_splits, seed):
    b, sq, sk, hq, hkv, n_block, causal, logit = problem
    g = torch.Generator().manual_seed(seed)
    s = math.sqrt(logit)
    q = torch.randn(b, sq, hq, 16, generator=g, dtype=torch.float64) * s
    k = torch.randn(b, sk, hkv, 16, generator=g, dtype=torch.float64) * s
    v = torch.randn(b, sk, hkv, head_dim_v, generator=g, dtype=torch.float64)
    out_p, lse_p = partial_attention_reference(q, k, v, num_splits=num_splits,
                                               n_block_size=n_block, causal=causal)
    return (q, k, v), causal, out_p.float().cuda(), lse_p.float().cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 2, 7, 16])
@pytest.mark.parametrize("head_dim_v", [64, 128, 256])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_combine_cuda_is_the_reference(num_splits, head_dim_v, out_dtype, rng):
    _need_kernel_gpu()
    from fa4lab.kernels.combine import combine_cuda

    seed = int(rng.integers(2**31))
    for i, problem in enumerate(PROBLEMS):
        (q, k, v), causal, out_p, lse_p = _problem(problem, head_dim_v, num_splits, seed + i)
        where = f"problem {problem}, seed {seed + i}"
        ref, ref_lse = attention_reference(q, k, v, causal=causal, return_lse=True)
        out_atol, lse_atol = _tolerances(lse_p, v.abs().max().item())
        out, lse = combine_cuda(out_p, lse_p, out_dtype=out_dtype, return_lse=True)
        assert lse.dtype == torch.float32, where
        assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]), "lse is (batch, heads, seqlen)"
        _check(out, lse, ref, ref_lse, out_dtype, out_atol, lse_atol)
        # The torch combine of the same float32 partials (on the CPU: on the GPU it would
        # dispatch to the kernel) agrees to one rounding of out_dtype.
        t_out, t_lse = combine(out_p.cpu(), lse_p.cpu(), out_dtype=out_dtype)
        torch.testing.assert_close(out.cpu().double(), t_out.double(),
                                   rtol=torch.finfo(out_dtype).eps, atol=out_atol, msg=where)
        torch.testing.assert_close(lse.cpu().transpose(1, 2), t_lse, rtol=0, atol=lse_atol,
                                   msg=where)
        out_nolse, none = combine_cuda(out_p, lse_p, out_dtype=out_dtype, return_lse=False)
        assert none is None and torch.equal(out_nolse, out), where


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 2, 7, 16, MAX_SPLITS])
@pytest.mark.parametrize("head_dim_v, out_dtype", [(64, torch.float16), (96, torch.bfloat16),
                                                   (128, torch.float32), (256, torch.bfloat16)])
def test_combine_cuda_far_apart_and_empty_splits(num_splits, head_dim_v, out_dtype, rng):
    """Synthetic partials: LSEs spread over +-1e4, a third of the splits empty (LSE -inf, and
    out 1e30 where the split kernel might have left anything: Note [combine in two passes]),
    and whole rows with every split empty; against the torch combine in float64 of the same
    partials (the merge rule itself, `merge_out_lse` folded)."""
    _need_kernel_gpu()
    from fa4lab.kernels.combine import combine_cuda

    g = torch.Generator().manual_seed(int(rng.integers(2**31)))
    b, sq, h = 3, 5, 7                     # 35 rows per batch: tiles with a tail
    out_p = torch.randn(num_splits, b, sq, h, head_dim_v, generator=g)
    lse_p = torch.randn(num_splits, b, sq, h, generator=g) * 1e4
    lse_p[:, :, :, 0] = torch.randn(num_splits, b, sq, generator=g)   # close together too
    empty = torch.rand(num_splits, b, sq, h, generator=g) < 1 / 3
    empty[:, 1, 2, :] = True               # rows no split saw
    empty[:, 0, :, 3] = True
    vmax = out_p.abs().max().item()
    lse_p[empty] = -math.inf
    ref, ref_lse = combine(out_p.double(), lse_p.double())           # lse (b, sq, h)
    out_p[empty] = 1e30
    out, lse = combine_cuda(out_p.cuda(), lse_p.cuda(), out_dtype=out_dtype)
    # The same float32 LSEs on both sides: only the kernel's float32 merge differs (exp2 and
    # lg2 approximations, a relative 1e-5 at most on the weights).
    _check(out, lse, ref, ref_lse.transpose(1, 2), out_dtype, 1e-5 + 4e-5 * vmax,
           1e-5 + 2 * _lse_ulps(lse_p))
    assert (out[1, 2] == 0).all() and torch.isneginf(lse[1, :, 2]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 7])
def test_combine_cuda_with_a_learnable_sink(num_splits, rng):
    """A sink per head (one -inf: no sink there, one far above the logits) joins once, in the
    combine (Note [sinks in the combine]); rows no key reaches get out 0 and lse sink[h]."""
    _need_kernel_gpu()
    from fa4lab.kernels.combine import combine_cuda

    seed = int(rng.integers(2**31))
    for i, problem in enumerate(PROBLEMS):
        (q, k, v), causal, out_p, lse_p = _problem(problem, 128, num_splits, seed + i)
        sink = torch.randn(q.shape[2], generator=torch.Generator().manual_seed(seed + i),
                           dtype=torch.float64) * 4
        sink[0], sink[-1] = -math.inf, 30.0
        sink = sink.float().double()          # the kernel reads float32 logits
        ref, ref_lse = attention_reference(q, k, v, causal=causal, return_lse=True,
                                           learnable_sink=sink)
        out, lse = combine_cuda(out_p, lse_p, out_dtype=torch.bfloat16,
                                learnable_sink=sink.float().cuda())
        _check(out, lse, ref, ref_lse, torch.bfloat16,
               *_tolerances(lse_p, v.abs().max().item()))


@pytest.mark.gpu
def test_the_launch_combine_runs_the_kernel_on_the_gpu(rng):
    """fa4lab.kernels.combine.combine (the split-KV launch's merge) on CUDA float32 partials is
    combine_cuda (lse as (b, sq, h), out in out_partial's dtype by default); float64 partials
    stay on the torch path (fa4lab.splitkv.combine's)."""
    _need_kernel_gpu()
    from fa4lab.kernels.combine import combine as launch_combine
    from fa4lab.kernels.combine import combine_cuda

    (q, k, v), causal, out_p, lse_p = _problem(PROBLEMS[1], 64, 7, int(rng.integers(2**31)))
    out, lse = launch_combine(out_p, lse_p)
    assert out.is_cuda and out.dtype == torch.float32 and lse.shape == lse_p.shape[1:]
    k_out, k_lse = combine_cuda(out_p, lse_p, out_dtype=torch.float32)
    assert torch.equal(out, k_out) and torch.equal(lse, k_lse.transpose(1, 2))
    ref, ref_lse = attention_reference(q, k, v, causal=causal, return_lse=True)
    tolerances = _tolerances(lse_p, v.abs().max().item())
    _check(out, lse.transpose(1, 2), ref, ref_lse, torch.float32, *tolerances)
    wide_out, wide_lse = launch_combine(out_p.double(), lse_p.double())     # float64: torch
    assert wide_out.dtype == wide_lse.dtype == torch.float64 and wide_out.is_cuda
    assert torch.equal(wide_out, combine(out_p.double(), lse_p.double())[0])
    _check(wide_out, wide_lse.transpose(1, 2), ref, ref_lse, torch.float64, *tolerances)
    strided = torch.empty(out_p.shape[:-1] + (80,), device="cuda")[..., :64]
    strided.copy_(out_p)
    assert torch.equal(launch_combine(strided, lse_p)[0], out), \
        "a strided view is copied, not refused"


@pytest.mark.gpu
def test_combine_cuda_refuses_bad_layouts():
    _need_kernel_gpu()
    from fa4lab.kernels.combine import combine_cuda

    out_p = torch.zeros(2, 1, 3, 4, 64, device="cuda")
    lse_p = torch.zeros(2, 1, 3, 4, device="cuda")
    with pytest.raises(InputError, match=r"pass out_partial.contiguous\(\)"):
        combine_cuda(out_p.transpose(3, 4).contiguous().transpose(3, 4), lse_p)
    with pytest.raises(InputError, match="combine_cuda needs out_partial"):
        combine_cuda(out_p, lse_p[:, :, :2])
    with pytest.raises(InputError, match="num_splits_max=1"):
        combine_cuda(out_p, lse_p, num_splits_max=1)
    with pytest.raises(InputError, match=r"learnable_sink must be a torch tensor \(heads,\)"):
        combine_cuda(out_p, lse_p, learnable_sink=torch.zeros(3, device="cuda"))
    with pytest.raises(InputError, match="multiple of 4"):
        combine_cuda(torch.zeros(2, 1, 3, 4, 66, device="cuda"), lse_p)
