"""The float64 reference against a direct torch softmax, the causal rule, lse, kinds, errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import fa4lab.reference as reference
from fa4lab.reference import attention_reference, kv_head_index, visible_mask


def _direct_torch(q, k, v, causal, scale):
    """softmax(scale * q k^T) v written the obvious way, with GQA by repeat_interleave."""
    q, k, v = (torch.as_tensor(x, dtype=torch.float64) for x in (q, k, v))
    ratio = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(ratio, dim=2)
    v = v.repeat_interleave(ratio, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    sq, sk = s.shape[-2:]
    allowed = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        for i in range(sq):
            for j in range(sk):
                allowed[i, j] = j <= i + sk - sq
    s = s.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)   # fully masked rows -> 0
    out = torch.einsum("bhqk,bkhd->bqhd", p, v)
    return out.numpy(), lse.numpy()


def _inputs(rng, b=2, sq=7, sk=11, hq=4, hkv=2, d=8, dv=None):
    dv = d if dv is None else dv
    return (rng.standard_normal((b, sq, hq, d)), rng.standard_normal((b, sk, hkv, d)),
            rng.standard_normal((b, sk, hkv, dv)))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk,hq,hkv", [(7, 11, 4, 2), (11, 7, 4, 4), (1, 1, 3, 1),
                                          (5, 5, 6, 3), (1, 9, 2, 1), (9, 1, 2, 2)])
def test_matches_direct_torch_softmax(rng, causal, sq, sk, hq, hkv):
    q, k, v = _inputs(rng, sq=sq, sk=sk, hq=hq, hkv=hkv, dv=5)
    out, lse = attention_reference(q, k, v, causal=causal, return_lse=True)
    ref_out, ref_lse = _direct_torch(q, k, v, causal, 1 / math.sqrt(q.shape[-1]))
    assert out.dtype == np.float64 and out.shape == (2, sq, hq, 5)
    assert lse.shape == (2, hq, sq)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12, atol=1e-12)


def test_softmax_scale_is_used(rng):
    q, k, v = _inputs(rng)
    out = attention_reference(q, k, v, softmax_scale=0.3)
    np.testing.assert_allclose(out, _direct_torch(q, k, v, False, 0.3)[0], atol=1e-12)
    assert not np.allclose(out, attention_reference(q, k, v))


def test_visible_mask_rule():
    for sq, sk in [(3, 5), (5, 3), (4, 4), (1, 6), (6, 1)]:
        m = visible_mask(sq, sk, causal=True)
        want = np.array([[j <= i + sk - sq for j in range(sk)] for i in range(sq)])
        np.testing.assert_array_equal(m, want)
        assert visible_mask(sq, sk, causal=False).all()
    # bottom-right: the last query always sees every key
    assert visible_mask(3, 8, True)[-1].all()
    assert visible_mask(8, 3, True)[:5].sum() == 0


def test_fully_masked_rows_give_zero_and_neg_inf(rng):
    q, k, v = _inputs(rng, sq=9, sk=4)          # causal: first 5 queries see nothing
    out, lse = attention_reference(q, k, v, causal=True, return_lse=True)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert (out[:, :5] == 0).all()
    assert np.isneginf(lse[:, :, :5]).all() and np.isfinite(lse[:, :, 5:]).all()


def test_extreme_logits_no_nan(rng):
    q, k, v = _inputs(rng)
    q = q * 1e2
    k = k * 1e2                                     # logits ~1e4 / sqrt(8)
    out, lse = attention_reference(q, k, v, return_lse=True)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    ref_out, ref_lse = _direct_torch(q, k, v, False, 1 / math.sqrt(8))
    np.testing.assert_allclose(out, ref_out, atol=1e-10)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12)


def test_lse_is_the_log_normaliser(rng):
    """exp(scale * s - lse) are the attention weights: they sum to one over visible keys."""
    q, k, v = _inputs(rng, hq=2, hkv=2)
    _, lse = attention_reference(q, k, v, causal=True, return_lse=True)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    s = np.where(visible_mask(7, 11, True), s, -np.inf)
    np.testing.assert_allclose(np.exp(s - lse[..., None]).sum(-1), 1.0, rtol=1e-12)


def test_chunked_path_matches(rng, monkeypatch):
    q, k, v = _inputs(rng, sq=13, sk=17, hq=6, hkv=3)
    whole = attention_reference(q, k, v, causal=True, return_lse=True)
    for budget in (17 * 13 * 2, 17 * 5, 1):        # head chunks; query chunks; one row at a time
        monkeypatch.setattr(reference, "_SCORE_BUDGET", budget)
        part = attention_reference(q, k, v, causal=True, return_lse=True)
        np.testing.assert_allclose(part[0], whole[0], rtol=1e-13, atol=1e-14)
        np.testing.assert_allclose(part[1], whole[1], rtol=1e-13)


def test_kind_round_trip(rng):
    q, k, v = _inputs(rng)
    out_np, lse_np = attention_reference(q, k, v, return_lse=True)
    assert isinstance(out_np, np.ndarray) and isinstance(lse_np, np.ndarray)
    tq, tk, tv = (torch.from_numpy(x).float() for x in (q, k, v))
    out_t, lse_t = attention_reference(tq, tk, tv, return_lse=True)
    assert isinstance(out_t, torch.Tensor) and out_t.dtype == torch.float64
    assert out_t.device == tq.device and lse_t.dtype == torch.float64
    np.testing.assert_allclose(out_t.numpy(), out_np, atol=1e-5)   # inputs rounded to fp32
    bq, bk, bv = (torch.from_numpy(x).bfloat16() for x in (q, k, v))
    assert attention_reference(bq, bk, bv).dtype == torch.float64
    # float32 numpy is promoted too
    assert attention_reference(q.astype(np.float32), k.astype(np.float32),
                               v.astype(np.float32)).dtype == np.float64


def test_kv_head_index_is_grouped():
    np.testing.assert_array_equal(kv_head_index(8, 2), [0, 0, 0, 0, 1, 1, 1, 1])
    np.testing.assert_array_equal(kv_head_index(4, 1), [0, 0, 0, 0])
    np.testing.assert_array_equal(kv_head_index(3, 3), [0, 1, 2])


@pytest.mark.parametrize("make,err,words", [
    (lambda q, k, v: (q, k[..., :3], v), ValueError, "head_dim"),
    (lambda q, k, v: (q, k, v[:, :4]), ValueError, "seqlen_k"),
    (lambda q, k, v: (q[:, :, :3], k, v), ValueError, "multiple of heads_kv"),
    (lambda q, k, v: (q[0], k, v), ValueError, "4 dims"),
    (lambda q, k, v: (q.astype(np.int64), k, v), TypeError, "q has dtype int64"),
    (lambda q, k, v: (q, k.astype(np.complex128), v), TypeError, "k has dtype complex128"),
    (lambda q, k, v: (q, k, np.where(v > 1, np.nan, v)), ValueError, "v contains NaN or inf"),
    (lambda q, k, v: (q, np.where(k > 1, np.inf, k), v), ValueError, "k contains NaN or inf"),
    (lambda q, k, v: (q, torch.from_numpy(k), v), TypeError, "all be numpy arrays or all torch"),
    (lambda q, k, v: (q.tolist(), k, v), TypeError, "q must be"),
])
def test_bad_input_is_named(rng, make, err, words):
    q, k, v = _inputs(rng)
    with pytest.raises(err, match=words):
        attention_reference(*make(q, k, v))


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_scale(rng, scale):
    with pytest.raises(ValueError, match="softmax_scale"):
        attention_reference(*_inputs(rng), softmax_scale=scale)


def test_torch_int_dtype_rejected(rng):
    q, k, v = (torch.from_numpy(x) for x in _inputs(rng))
    with pytest.raises(TypeError, match="v has dtype torch.int32"):
        attention_reference(q, k, v.int())


@pytest.mark.gpu
def test_cuda_tensors_stay_on_device():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2048, 8, 128, generator=g)
    k = torch.randn(1, 2048, 2, 128, generator=g)
    v = torch.randn(1, 2048, 2, 128, generator=g)
    out_cpu, lse_cpu = attention_reference(q, k, v, causal=True, return_lse=True)
    out, lse = attention_reference(q.cuda().bfloat16(), k.cuda().bfloat16(),
                                   v.cuda().bfloat16(), causal=True, return_lse=True)
    assert out.is_cuda and out.dtype == torch.float64 and lse.is_cuda
    # the bf16 rounding of the inputs dominates the difference
    assert (out.cpu() - out_cpu).abs().max() < 5e-2
    assert (lse.cpu() - lse_cpu).abs().max() < 5e-2
