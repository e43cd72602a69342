"""Split-KV (`fa4lab.splitkv`): the combine of per-split partials against the float64 reference
of the whole key range, the split ranges, and the num_splits rule's properties.

Hypothesis grids are trimmed (<= 2 batches, <= 9 queries, <= 40 keys, <= 9 splits, <= 40
examples) to run in seconds on a 2-core CPU; they hold empty splits (more splits than blocks, a
window that hides whole splits), fully masked rows (causal with seqlen_q > seqlen_k), GQA and
logits of 1e4.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fa4lab.errors import InputError, InputTypeError
from fa4lab.reference import attention_reference
from fa4lab.splitkv import (
    MIN_BLOCKS_PER_SPLIT,
    choose_num_splits,
    combine,
    partial_attention_reference,
    split_blocks,
    wave_efficiency,
)
from fa4lab.tiling import ceil_div

SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@st.composite
def problems(draw):
    hkv = draw(st.integers(1, 2))
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 9)), draw(st.integers(1, 40)),
             hkv * draw(st.integers(1, 3)), hkv, draw(st.sampled_from([4, 8])),
             draw(st.sampled_from([3, 8])))
    causal = draw(st.booleans())
    opts = dict(causal=causal, window_size=(draw(st.sampled_from([None, 0, 6])),
                                            None if causal else draw(st.sampled_from([None,
                                                                                      2]))),
                softcap=draw(st.sampled_from([0.0, 8.0])))
    return (shape, opts, draw(st.sampled_from([1.0, 1e4])), draw(st.integers(1, 9)),
            draw(st.sampled_from([1, 4, 16])), draw(st.integers(0, 2**32 - 1)))


def _inputs(shape, logit, seed):
    b, sq, sk, hq, hkv, d, dv = shape
    g = torch.Generator().manual_seed(seed)
    s = math.sqrt(logit)
    return (torch.randn(b, sq, hq, d, generator=g, dtype=torch.float64) * s,
            torch.randn(b, sk, hkv, d, generator=g, dtype=torch.float64) * s,
            torch.randn(b, sk, hkv, dv, generator=g, dtype=torch.float64))


def _check(out, lse, ref, ref_lse, tol):
    """combine's (out, lse (b, sq, h)) against the reference's (out, lse (b, h, sq))."""
    lse = lse.transpose(1, 2)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    empty = torch.isneginf(ref_lse).transpose(1, 2)
    assert (out[empty] == 0).all(), "a row no split saw must be exactly 0"
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], atol=tol,
                               rtol=tol)


@SETTINGS
@given(problems())
def test_combine_of_partials_is_the_whole_reference(problem):
    shape, opts, logit, num_splits, n_block, seed = problem
    q, k, v = _inputs(shape, logit, seed)
    out_p, lse_p = partial_attention_reference(q, k, v, num_splits=num_splits,
                                               n_block_size=n_block, **opts)
    assert out_p.shape[0] == lse_p.shape[0] == num_splits
    ref, ref_lse = attention_reference(q, k, v, return_lse=True, **opts)
    _check(*combine(out_p, lse_p), ref, ref_lse, tol=1e-9)
    # float32 / bfloat16 partials: float32 math, out back in the partials' dtype. A float32
    # LSE of magnitude L is known to ~L * 2**-24, and the merge weights exp(lse - max) carry
    # that as a relative error (the kernels' float32 LSE has the same limit).
    lse_ulps = 4 * 2.0**-24 * lse_p[torch.isfinite(lse_p)].abs().max().item() \
        if torch.isfinite(lse_p).any() else 0.0
    out32, lse32 = combine(out_p.float(), lse_p.float())
    assert out32.dtype == lse32.dtype == torch.float32
    _check(out32, lse32, ref, ref_lse, tol=1e-5 + 8 * lse_ulps)
    out16, lse16 = combine(out_p.bfloat16(), lse_p.float())
    assert out16.dtype == torch.bfloat16 and lse16.dtype == torch.float32
    _check(out16, lse16, ref, ref_lse, tol=2e-2 + 8 * lse_ulps)


@SETTINGS
@given(problems())
def test_a_sink_enters_once_in_the_combine(problem):
    shape, opts, logit, num_splits, n_block, seed = problem
    q, k, v = _inputs(shape, logit, seed)
    sink = torch.randn(shape[3], generator=torch.Generator().manual_seed(seed)) * 4
    sink[-1] = -math.inf
    out_p, lse_p = partial_attention_reference(q, k, v, num_splits=num_splits,
                                               n_block_size=n_block, **opts)
    ref, ref_lse = attention_reference(q, k, v, return_lse=True, learnable_sink=sink, **opts)
    _check(*combine(out_p, lse_p, learnable_sink=sink), ref, ref_lse, tol=1e-9)


def test_empty_splits_weigh_nothing(rng):
    q, k, v = (torch.from_numpy(rng.standard_normal(s)) for s in ((1, 4, 2, 8), (1, 3, 2, 8),
                                                                  (1, 3, 2, 8)))
    out_p, lse_p = partial_attention_reference(q, k, v, num_splits=6, n_block_size=1)
    assert torch.isneginf(lse_p[3:]).all() and (out_p[3:] == 0).all(), "splits 3.. are empty"
    ref, ref_lse = attention_reference(q, k, v, return_lse=True)
    _check(*combine(out_p, lse_p), ref, ref_lse, tol=1e-12)
    nothing = combine(torch.zeros(3, 2, 5, 4), torch.full((3, 2, 5), -math.inf))
    assert (nothing[0] == 0).all() and torch.isneginf(nothing[1]).all()


@pytest.mark.parametrize("num_splits", [1, 2])
def test_a_row_no_split_saw_is_zero_whatever_its_partial_holds(num_splits):
    """One split is merged like several (the fold starts from the empty state): a row whose
    every LSE is -inf gives out 0, even where its partials hold leftover numbers."""
    g = torch.Generator().manual_seed(17 + num_splits)
    out_p = torch.randn(num_splits, 2, 3, 4, 8, generator=g)
    lse_p = torch.randn(num_splits, 2, 3, 4, generator=g)
    lse_p[:, 1, 2, :] = -math.inf
    out, lse = combine(out_p, lse_p)
    assert (out[1, 2] == 0).all() and torch.isneginf(lse[1, 2]).all()
    seen = torch.ones(2, 3, 4, dtype=torch.bool)
    seen[1, 2] = False
    if num_splits == 1:
        assert torch.equal(out[seen], out_p[0][seen]) and torch.equal(lse[seen], lse_p[0][seen])


def test_combine_refuses_mismatched_partials():
    with pytest.raises(InputError, match="same leading shape"):
        combine(torch.zeros(2, 3, 4, 8), torch.zeros(2, 4, 3))
    with pytest.raises(InputTypeError, match="floating point"):
        combine(torch.zeros(2, 3, 8), torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(InputError, match=r"learnable_sink must be a torch tensor \(heads_q,\)"):
        combine(torch.zeros(2, 3, 4, 8), torch.zeros(2, 3, 4), learnable_sink=torch.zeros(3))


@given(st.integers(0, 300), st.integers(1, 40))
def test_split_blocks_are_balanced_and_cover_the_range(n_blocks, num_splits):
    ranges = split_blocks(n_blocks, num_splits)
    assert len(ranges) == num_splits and ranges[0][0] == 0 and ranges[-1][1] == n_blocks
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), "gaps or overlaps"
    sizes = [hi - lo for lo, hi in ranges]
    assert min(sizes) >= 0 and max(sizes) - min(sizes) <= 1
    assert max(sizes) == ceil_div(n_blocks, num_splits)
    assert (0 in sizes) == (num_splits > n_blocks)


@given(st.integers(1, 64), st.integers(1, 16), st.integers(1, 512), st.integers(1, 2**17),
       st.sampled_from([64, 128, 176]), st.sampled_from([78, 132, 148]),
       st.sampled_from([64, 128]), st.integers(1, 128))
def test_choose_num_splits_splits_only_what_cannot_fill_the_gpu(batch, heads_kv, rows,
                                                                seqlen_k, n_block, num_sms,
                                                                m_block, max_splits):
    s = choose_num_splits(batch, heads_kv, rows, seqlen_k, n_block, num_sms, m_block=m_block,
                          max_splits=max_splits)
    ctas = batch * heads_kv * ceil_div(rows, m_block)
    n_blocks = ceil_div(seqlen_k, n_block)
    assert 1 <= s <= max(1, min(max_splits, num_sms))
    if ctas >= 0.8 * num_sms:
        assert s == 1, "a grid that fills the GPU is not split"
    if s > 1:
        sizes = [hi - lo for lo, hi in split_blocks(n_blocks, s)]
        assert min(sizes) >= MIN_BLOCKS_PER_SPLIT, "a split too short to pay for itself"
        assert wave_efficiency(ctas, s, num_sms) > wave_efficiency(ctas, 1, num_sms)


def test_decode_on_an_h200_is_split():
    """One decode step of a 64k-token sequence, 8 KV heads (GQA 4 packed), 132 SMs: 8 CTAs
    would leave 124 SMs idle while each walks 512 key blocks."""
    s = choose_num_splits(1, 8, 4, 65536, 128, 132)
    assert s > 8
    waves = math.ceil(8 * s / 132)
    assert waves * ceil_div(512, s) < 512 / 4, "the longest CTA is not 4x shorter"
    assert choose_num_splits(64, 8, 4, 65536, 128, 132) == 1
    assert choose_num_splits(1, 8, 4, 3 * 128, 128, 132) == 1, "3 blocks: too short to split"
