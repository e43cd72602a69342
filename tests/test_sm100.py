"""The sm100 kernel on a B200-class GPU against the float64 reference (marker `sm100`).

Everywhere else these tests skip with the reason (tests/conftest.py); the CPU side of the kernel
(compile for sm_100a, binary audit) is tests/test_compile_sm100.py.

FA4's acceptance rule: the kernel's max error against the float64 reference is at most twice
PyTorch's own same-dtype attention error (F.scaled_dot_product_attention on the same 16-bit
inputs, GQA through enable_gqa, causal through an explicit bottom-right bool mask) plus
ATOL = 1e-3 (a floor for the cases where SDPA is exact, e.g. seqlen_k = 1; below half a bf16 ulp
at 0.5). Rows that see no key must be exactly 0 with LSE -inf; nothing may be NaN; LSE within
1e-3 + 1e-5 |lse| of the reference; two runs bit-identical.

Grid (trimmed: each (head_dim, dtype, causal, GQA) is one compile): every (head_dim,
head_dim_v) pair of `fa4lab.limits.KERNEL_HEAD_DIMS["sm100"]` x causal x GQA {1, 4} in bf16
with seqlen pairs (1, 1), (17, 1000), (1000, 17), (1000, 4097)
-- tails on both sides, one key, one query, causal with seqlen_q > seqlen_k (fully masked rows
and whole CTAs that see nothing); fp16 at both head dims; logits of magnitude 1e4 (the
conditional rescale and the exp2 polynomial at their extremes); a custom softmax_scale and
return_lse=False; persistent CTAs that run several tiles each, some of them empty.

pack-GQA (`pack_gqa=True`, Note [sm100 pack-GQA kernel]): head_dim {64, 128} x causal x GQA
ratio {2, 8} on the same seqlen pairs, judged by the same rule; and the same through
fa4lab.attention, cached. Its CPU side (plan, block ranges, TMA views, compile + audit) is
tests/test_pack_gqa_sm100.py.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kernel_checks import (  # noqa: E402
    ATOL,
    DTYPES,
    SEQLENS,
    check_kernel,
    output_ulp_atol,
)
from kernel_checks import make_inputs as _inputs  # noqa: E402

from fa4lab.api import sdpa_same_dtype  # noqa: E402
from fa4lab.limits import KERNEL_HEAD_DIMS  # noqa: E402

pytestmark = pytest.mark.sm100


def _check(q, k, v, pack_gqa=False, **checks):
    """The unpacked kernel unless pack_gqa=True (the default, None, would pack GQA ratios that
    divide the Q tile: `fa4lab.limits.pack_gqa_default`)."""
    from fa4lab.kernels.launch import attention_sm100

    check_kernel(attention_sm100, q, k, v, pack_gqa=pack_gqa, **checks)


def _check_packed(q, k, v, **checks):
    _check(q, k, v, pack_gqa=True, **checks)


@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dims", KERNEL_HEAD_DIMS["sm100"],
                         ids=lambda p: f"hd{p[0]}" + (f"x{p[1]}" if p[1] != p[0] else ""))
def test_bf16_matrix(dims, causal, gqa):
    for i, (sq, sk) in enumerate(SEQLENS):
        q, k, v = _inputs(2, sq, sk, 8, 8 // gqa, dims[0], torch.bfloat16, seed=i, dv=dims[1])
        _check(q, k, v, causal=causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fp16(head_dim, causal):
    for i, (sq, sk) in enumerate(SEQLENS):
        q, k, v = _inputs(1, sq, sk, 4, 2, head_dim, torch.float16, seed=10 + i)
        _check(q, k, v, causal=causal)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True])
def test_extreme_logits(dtype, causal):
    """Scores of magnitude ~1e4: one-hot rows, maxima that jump by far more than the threshold."""
    q, k, v = _inputs(1, 300, 700, 4, 4, 128, DTYPES[dtype], seed=7, q_scale=1e3)
    # atol one output ulp: see Note [extreme logits] in fa4lab.acceptance
    _check(q, k, v, causal=causal, atol=output_ulp_atol(v, dtype))


def test_fully_masked_rows_and_empty_ctas():
    """causal, seqlen_q >> seqlen_k: the first 3000 rows (whole CTAs) see no key at all."""
    q, k, v = _inputs(1, 3100, 100, 2, 1, 64, torch.bfloat16, seed=3)
    _check(q, k, v, causal=True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_persistent_ctas_run_many_tiles_each(head_dim, causal):
    """Note [persistent CTAs] in fa4lab.plan.sm100: 4 x 16 heads x 8 row tiles = 512 work tiles
    on at most 148 CTAs, so every CTA runs 3-4 in turn, its phases running on; causal with
    seqlen_q > seqlen_k puts tiles that see no key (no K/V block) between the others (in LPT
    order, the longest first)."""
    from fa4lab.plan import plan_forward
    from fa4lab.spec import AttentionSpec

    spec = AttentionSpec(4, 2000, 1500, 16, 4, head_dim, causal=causal)
    assert plan_forward(spec, "sm100").protocol.persistent
    q, k, v = _inputs(4, 2000, 1500, 16, 4, head_dim, torch.bfloat16, seed=21)
    _check(q, k, v, causal=causal)


def test_softmax_scale_and_no_lse():
    from fa4lab.kernels.launch import attention_sm100
    from fa4lab.reference import attention_reference

    q, k, v = _inputs(1, 257, 513, 4, 2, 64, torch.bfloat16, seed=5)
    out = attention_sm100(q, k, v, softmax_scale=0.3)
    assert isinstance(out, torch.Tensor)
    ref = attention_reference(q, k, v, softmax_scale=0.3)
    pt = sdpa_same_dtype(q, k, v, softmax_scale=0.3)
    assert (out.double() - ref).abs().max() <= 2 * (pt.double() - ref).abs().max() + ATOL


@pytest.mark.parametrize("gqa", [2, 8])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_pack_gqa(head_dim, causal, gqa):
    """One CTA per (KV head, packed row tile); 16 query heads so several KV heads exist."""
    heads_q = 16
    for i, (sq, sk) in enumerate(SEQLENS):
        batch = 2 if sq * sk < 10**6 else 1
        q, k, v = _inputs(batch, sq, sk, heads_q, heads_q // gqa, head_dim, torch.bfloat16,
                          seed=4000 + 100 * head_dim + 10 * gqa + i)
        _check_packed(q, k, v, causal=causal)


def test_pack_gqa_is_chosen_by_default():
    """pack_gqa=None packs a GQA ratio that divides the 128-row Q tile when that takes fewer
    tiles (decode: the same kernel as pack_gqa=True, bit for bit), and not a ratio that does
    not divide it, nor a long prompt (the unpacked kernel)."""
    import fa4lab
    from fa4lab.kernels.launch import attention_sm100

    q, k, v = _inputs(2, 1, 700, 8, 2, 128, torch.bfloat16, seed=12)
    assert torch.equal(fa4lab.attention(q, k, v), attention_sm100(q, k, v, pack_gqa=True))
    q, k, v = _inputs(2, 5, 700, 6, 2, 128, torch.bfloat16, seed=13)
    assert torch.equal(fa4lab.attention(q, k, v), attention_sm100(q, k, v, pack_gqa=False))
    _check(q, k, v, causal=True, pack_gqa=None)
    q, k, v = _inputs(1, 1280, 700, 8, 2, 128, torch.bfloat16, seed=14)
    assert torch.equal(fa4lab.attention(q, k, v), attention_sm100(q, k, v, pack_gqa=False))


def test_pack_gqa_through_fa4lab_attention():
    import fa4lab
    from fa4lab.kernels import launch
    from fa4lab.kernels.launch import attention_sm100

    q, k, v = _inputs(2, 33, 513, 8, 2, 128, torch.bfloat16, seed=12)
    out = fa4lab.attention(q, k, v, causal=True, pack_gqa=True)
    before = launch.stats()["misses"]
    assert torch.equal(out, attention_sm100(q, k, v, causal=True, pack_gqa=True))
    assert launch.stats()["misses"] == before, "the packed kernel was not cached"
    _check_packed(q, k, v, causal=True, softmax_scale=0.2)


@pytest.mark.parametrize("causal,window", [(False, (100, None)), (False, (None, 50)),
                                           (False, (30, 70)), (True, (200, 0)), (True, (5, 0))])
def test_windows_and_sinks(causal, window):
    """Sliding windows (the walk each role shares: tests/kernel_walk.py) and learnable sinks,
    packed and not; (1000, 17) leaves rows with no key, whose LSE is then the sink."""
    import math

    for i, (sq, sk) in enumerate([(1, 1000), (17, 1000), (1000, 17), (300, 777)]):
        q, k, v = _inputs(2, sq, sk, 8, 2, 128, torch.bfloat16, seed=900 + i)
        sink = torch.tensor([0.5, -2.0, 30.0, -30.0, -math.inf, 1e3, 3.0, -1e3], device="cuda")
        _check(q, k, v, causal=causal, window_size=window)
        _check(q, k, v, causal=causal, window_size=window, learnable_sink=sink)
        _check_packed(q, k, v, causal=causal, window_size=window, learnable_sink=sink)
