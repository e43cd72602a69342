"""The sm90 kernel on a Hopper GPU against the float64 reference (marker `sm90`).

FA4's acceptance rule: the kernel's max error against the float64 reference is at most twice
PyTorch's own same-dtype attention error (F.scaled_dot_product_attention on the same 16-bit
inputs, GQA through enable_gqa, causal through an explicit bottom-right bool mask) plus
ATOL = 1e-3. The atol is a floor for cases where SDPA happens to be exact (seqlen_k = 1, or
one-hot rows at extreme logits): it is below half a bf16 ulp at magnitude 0.5 (2**-9 ~ 2e-3),
so it absorbs fp32 summation-order noise but not one output rounded the wrong way.
Rows that see no key must give exactly 0 and LSE -inf; nothing may be NaN; LSE must match the
reference to 1e-3 + 1e-5 * |lse| (fp32 accumulation of 16-bit products); and two runs on the
same inputs must agree bit for bit.

Grid (trimmed to run in a few minutes; each (head_dim, dtype, causal, GQA) is one compile):
* bf16: every (head_dim, head_dim_v) pair of `fa4lab.limits.KERNEL_HEAD_DIMS["sm90"]` (64, 96,
  128, 256 and (192, 128)) x causal {no, yes} x GQA ratio {1, 2, 8}, each with the
  seqlen pairs (1, 1), (17, 1000), (1000, 17) and (1000, 4097) -- tails on both sides, the
  single-key and single-query rows, seqlen_q != seqlen_k both ways (causal with
  seqlen_q > seqlen_k has fully masked rows); (4097, 4097) only at head_dim 128;
* fp16: head_dim {64, 128, 256} x causal, GQA 2, the same seqlen pairs;
* logits of magnitude 1e4 (q scaled), both dtypes; a custom softmax_scale; new scales that
  must not recompile; softcap (its own yardstick: PyTorch eager in bf16, as SDPA cannot cap);
  return_lse=False;
  q/k/v slices of a packed qkv tensor (non-compact strides); compile-once caching;
* pack-GQA (`pack_gqa=True`): head_dim {64, 128} x causal x GQA ratio {2, 8}, and the pairs
  added later (96, (192, 128)) at GQA 8 (trimmed), seqlen pairs
  (1, 1000), (17, 1000), (1000, 17), (1000, 4097), held to the same rule (its summation order
  may differ from the unpacked kernel's, so the two are not compared bit for bit).
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
from fa4lab.plan.sm90 import SM90_TUNING, persistent_able  # noqa: E402

pytestmark = pytest.mark.sm90


def _check(q, k, v, pack_gqa=False, **checks):
    """The unpacked kernel unless pack_gqa=True (the default, None, would pack GQA ratios that
    divide the Q tile: `fa4lab.limits.pack_gqa_default`)."""
    from fa4lab.kernels.launch import attention_sm90

    check_kernel(attention_sm90, q, k, v, pack_gqa=pack_gqa, **checks)


def _check_packed(q, k, v, **checks):
    _check(q, k, v, pack_gqa=True, **checks)


def _dims_id(dims):
    d, dv = dims
    return f"hd{d}" if d == dv else f"hd{d}x{dv}"


@pytest.mark.parametrize("gqa", [1, 2, 8])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dims", KERNEL_HEAD_DIMS["sm90"], ids=_dims_id)
def test_bf16_matrix(dims, causal, gqa):
    head_dim, head_dim_v = dims
    heads_q = 8
    pairs = SEQLENS + ([(4097, 4097)] if head_dim == 128 else [])
    for i, (sq, sk) in enumerate(pairs):
        batch = 2 if sq * sk < 10**6 else 1
        q, k, v = _inputs(batch, sq, sk, heads_q, heads_q // gqa, head_dim, torch.bfloat16,
                          seed=1000 * head_dim + head_dim_v + 10 * gqa + i, dv=head_dim_v)
        _check(q, k, v, causal=causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_fp16(head_dim, causal):
    for i, (sq, sk) in enumerate(SEQLENS):
        q, k, v = _inputs(2, sq, sk, 4, 2, head_dim, torch.float16, seed=77 + i)
        _check(q, k, v, causal=causal)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True])
def test_extreme_logits(dtype, causal):
    """q scaled so the scaled logits reach ~1e4: the max subtraction must keep exp2 finite;
    atol one output ulp (see Note [extreme logits] in fa4lab.acceptance)."""
    q, k, v = _inputs(1, 300, 555, 4, 4, 128, DTYPES[dtype], seed=5, q_scale=1e4)
    _check(q, k, v, causal=causal, atol=output_ulp_atol(v, dtype))


def test_softmax_scale_and_no_lse():
    from fa4lab.kernels.launch import attention_sm90
    from fa4lab.reference import attention_reference

    q, k, v = _inputs(2, 129, 383, 4, 1, 64, torch.bfloat16, seed=9)
    _check(q, k, v, causal=True, softmax_scale=0.3)
    out = attention_sm90(q, k, v, causal=False)
    assert isinstance(out, torch.Tensor)
    ref = attention_reference(q, k, v)
    pt = sdpa_same_dtype(q, k, v)
    assert (out.double() - ref).abs().max() <= 2 * (pt.double() - ref).abs().max() + ATOL


def test_packed_qkv_strides():
    """q, k, v as views into one (b, s, 3, h, d) tensor: strides the kernel reads at runtime."""
    qkv = torch.randn(2, 333, 3, 4, 128, device="cuda").to(torch.bfloat16)
    q, k, v = qkv.unbind(dim=2)
    assert not q.is_contiguous()
    _check(q, k, v, causal=True)


def test_compiles_once_per_configuration():
    from fa4lab.kernels import launch
    from fa4lab.kernels.launch import attention_sm90

    q, k, v = _inputs(1, 100, 100, 2, 2, 64, torch.bfloat16, seed=1)
    attention_sm90(q, k, v, causal=True)
    before = launch.stats()["misses"]
    for b, sq, sk, h in [(3, 17, 900, 2), (1, 2000, 64, 6), (2, 1, 1, 4)]:
        q, k, v = _inputs(b, sq, sk, h, h, 64, torch.bfloat16, seed=2)
        attention_sm90(q, k, v, causal=True)
    assert launch.stats()["misses"] == before, "a new batch/seqlen/head count recompiled"
    q, k, v = _inputs(1, 100, 100, 2, 2, 64, torch.bfloat16, seed=1)
    attention_sm90(q, k, v, causal=False)
    assert launch.stats()["misses"] == before + 1


def test_a_new_softmax_scale_does_not_recompile():
    """The scale is a runtime argument (Note [runtime scale]): three scales, one compile, each
    result held to the acceptance rule against the reference at its own scale."""
    from fa4lab.kernels import launch

    q, k, v = _inputs(2, 200, 333, 4, 2, 128, torch.bfloat16, seed=21)
    _check(q, k, v, causal=True, softmax_scale=0.05)
    before = launch.stats()["misses"]
    for scale in (0.3, 128 ** -0.5, 1.7):
        _check(q, k, v, causal=True, softmax_scale=scale)
    assert launch.stats()["misses"] == before, "a new softmax_scale compiled a new kernel"


def test_fa4lab_attention_dispatches_to_sm90():
    import fa4lab
    from fa4lab.kernels import launch

    q, k, v = _inputs(1, 64, 64, 2, 2, 128, torch.bfloat16, seed=3)
    before = launch.stats()["misses"]
    out = fa4lab.attention(q, k, v, causal=True)
    out2 = fa4lab.attention(q, k, v, causal=True)
    assert launch.stats()["misses"] <= before + 1
    assert torch.equal(out, out2) and out.is_cuda


_PACK_CONFIGS = [((d, d), c, g) for d in (64, 128) for c in (False, True) for g in (2, 8)] + [
    (dims, c, 8) for dims in ((96, 96), (192, 128)) for c in (False, True)]


@pytest.mark.parametrize("dims,causal,gqa", _PACK_CONFIGS, ids=[
    f"{_dims_id(dims)}-{'causal' if c else 'full'}-gqa{g}" for dims, c, g in _PACK_CONFIGS])
def test_pack_gqa(dims, causal, gqa):
    """One CTA per (KV head, packed row tile); 16 query heads so several KV heads exist."""
    head_dim, head_dim_v = dims
    heads_q = 16
    for i, (sq, sk) in enumerate([(1, 1000), (17, 1000), (1000, 17), (1000, 4097)]):
        batch = 2 if sq * sk < 10**6 else 1
        q, k, v = _inputs(batch, sq, sk, heads_q, heads_q // gqa, head_dim, torch.bfloat16,
                          seed=3000 + 100 * head_dim + head_dim_v + 10 * gqa + i,
                          dv=head_dim_v)
        _check_packed(q, k, v, causal=causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_softcap(head_dim, causal):
    """Gemma-2 capping (Note [softcap]): tails both ways, fully masked rows (causal, sq > sk),
    GQA packed and not, a strong cap and a loose one, logits far past the cap; the cap's value
    and the scale are runtime arguments, so all of it is one compile per flag set."""
    from fa4lab.kernels import launch

    for i, (sq, sk) in enumerate([(17, 1000), (1000, 17), (333, 777)]):
        q, k, v = _inputs(2, sq, sk, 4, 2, head_dim, torch.bfloat16, seed=300 + i)
        _check(q, k, v, causal=causal, softcap=30.0)
        if i == 0:
            before = launch.stats()["misses"]
        _check(q, k, v, causal=causal, softcap=2.0, softmax_scale=0.2)
        _check(q, k, v, causal=causal, softcap=30.0, pack_gqa=True)
    q, k, v = _inputs(1, 200, 300, 4, 2, head_dim, torch.bfloat16, seed=399, q_scale=100.0)
    _check(q, k, v, causal=causal, softcap=10.0)
    assert launch.stats()["misses"] == before + 1, "a new cap or scale value recompiled"


def test_pack_gqa_is_chosen_by_default():
    """pack_gqa=None packs a GQA ratio that divides the 64-row Q tile when that takes fewer
    tiles (decode: the same kernel as pack_gqa=True, bit for bit), and not a ratio that does
    not divide it, nor a long prompt (the unpacked kernel)."""
    import fa4lab
    from fa4lab.kernels.launch import attention_sm90

    q, k, v = _inputs(2, 1, 700, 8, 2, 128, torch.bfloat16, seed=12)
    # num_splits=1: these shapes would split (fa4lab.splitkv), which attention_sm90 does not ask.
    assert torch.equal(fa4lab.attention(q, k, v, num_splits=1),
                       attention_sm90(q, k, v, pack_gqa=True))
    q, k, v = _inputs(2, 5, 700, 6, 2, 128, torch.bfloat16, seed=13)
    assert torch.equal(fa4lab.attention(q, k, v, num_splits=1),
                       attention_sm90(q, k, v, pack_gqa=False))
    _check(q, k, v, causal=True, pack_gqa=None)
    q, k, v = _inputs(1, 640, 700, 8, 2, 128, torch.bfloat16, seed=14)
    assert torch.equal(fa4lab.attention(q, k, v, num_splits=1),
                       attention_sm90(q, k, v, pack_gqa=False))


def test_pack_gqa_through_fa4lab_attention():
    import fa4lab
    from fa4lab.kernels import launch
    from fa4lab.kernels.launch import attention_sm90

    q, k, v = _inputs(2, 33, 513, 8, 2, 128, torch.bfloat16, seed=11)
    out = fa4lab.attention(q, k, v, causal=True, pack_gqa=True, num_splits=1)
    before = launch.stats()["misses"]
    assert torch.equal(out, attention_sm90(q, k, v, causal=True, pack_gqa=True))
    assert launch.stats()["misses"] == before, "the packed kernel was not cached"
    _check_packed(q, k, v, causal=True, softmax_scale=0.2)


# Note [sm90 persistent CTAs] in fa4lab.plan.sm90: every plan that can be persistent, forced so,
# over shapes with many tiles per CTA (b4 x 32 heads x 16 m-blocks = 2048 tiles on 132 SMs) and
# the seqlen pairs above (tails, single rows, fully masked rows); pack-GQA, window + sink,
# softcap and a mask_mod once each. A tile's arithmetic is the same in both kernels, so the
# persistent kernel must also equal the one-CTA-per-tile kernel bit for bit.
_PERSISTENT_DIMS = [dims for dims in KERNEL_HEAD_DIMS["sm90"]
                    if persistent_able(SM90_TUNING[dims])]   # not O in Q's bytes


def _same_as_one_tile(q, k, v, **kw):
    from fa4lab.kernels.launch import attention_sm90

    a = attention_sm90(q, k, v, return_lse=True, persistent=True, **kw)
    b = attention_sm90(q, k, v, return_lse=True, persistent=False, **kw)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), \
        "the persistent kernel differs from the one-CTA-per-tile kernel"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dims", _PERSISTENT_DIMS, ids=_dims_id)
def test_persistent_ctas(dims, causal):
    head_dim, head_dim_v = dims
    cases = [(4, 2000, 2000, 32, 8)] + [(2, sq, sk, 8, 2) for sq, sk in SEQLENS]
    for i, (b, sq, sk, hq, hkv) in enumerate(cases):
        q, k, v = _inputs(b, sq, sk, hq, hkv, head_dim, torch.bfloat16,
                          seed=3000 + head_dim + 7 * i, dv=head_dim_v)
        _check(q, k, v, causal=causal, persistent=True)
        _same_as_one_tile(q, k, v, causal=causal, pack_gqa=False)


def test_persistent_ctas_with_options():
    from fa4lab import mods

    q, k, v = _inputs(2, 1500, 1700, 16, 4, 128, torch.bfloat16, seed=4242)
    _check(q, k, v, causal=True, pack_gqa=True, persistent=True)
    _same_as_one_tile(q, k, v, causal=True, pack_gqa=True)
    sink = torch.linspace(-2.0, 3.0, 16, device="cuda")
    _check(q, k, v, causal=False, window_size=(300, 40), learnable_sink=sink, persistent=True)
    _same_as_one_tile(q, k, v, causal=False, window_size=(300, 40), learnable_sink=sink)
    _check(q, k, v, causal=True, softcap=30.0, persistent=True)
    doc = torch.arange(1500, device="cuda", dtype=torch.int32) * 3 // 1500
    mod, aux = mods.document_mask(doc)
    _same_as_one_tile(q[:, :1500], k[:, :1500], v[:, :1500], causal=False, mask_mod=mod,
                      aux_tensors=aux)
