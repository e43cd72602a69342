"""The float64 reference against a direct torch softmax and a brute-force loop (windows,
softcap, sinks), the causal rule, lse, kinds, errors."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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


# ------------------------------------------------------------ window_size, softcap, sinks


def _brute_reference(q, k, v, *, causal=False, scale=None, window=(None, None), softcap=0.0,
                     sink=None):
    """The contract one (batch, head, query) at a time, independent of the reference: an
    explicit visibility test per key, explicit tanh, and the sink as one more column of the
    softmax whose value is zero. Returns (out, lse) float64 numpy."""
    batch, sq, hq, d = q.shape
    sk, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    scale = 1 / math.sqrt(d) if scale is None else scale
    left, right = window
    right = 0 if causal else right
    offset = sk - sq
    out = np.zeros((batch, sq, hq, dv))
    lse = np.full((batch, hq, sq), -np.inf)
    for b, h, i in itertools.product(range(batch), range(hq), range(sq)):
        g = h // (hq // hkv)
        logits, values = [], []
        for j in range(sk):
            if left is not None and j < i + offset - left:
                continue
            if right is not None and j > i + offset + right:
                continue
            s = scale * float(np.dot(q[b, i, h], k[b, j, g]))
            if softcap:
                s = softcap * math.tanh(s / softcap)
            logits.append(s)
            values.append(v[b, j, g])
        if sink is not None:
            logits.append(float(sink[h]))
            values.append(np.zeros(dv))
        if not logits or max(logits) == -math.inf:
            continue                                   # sees nothing: out 0, lse -inf
        top = max(logits)
        w = np.exp(np.array(logits) - top)
        out[b, i, h] = (w[:, None] * np.array(values)).sum(axis=0) / w.sum()
        lse[b, h, i] = top + math.log(w.sum())
    return out, lse


def _assert_matches(got, want, atol=1e-9):
    (out, lse), (ref_out, ref_lse) = got, want
    np.testing.assert_allclose(out, ref_out, rtol=1e-9, atol=atol)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12, atol=atol)


_SIDE = st.one_of(st.none(), st.integers(0, 10))


@settings(max_examples=150, deadline=None)
@given(batch=st.integers(1, 2), sq=st.integers(1, 9), sk=st.integers(1, 9),
       hkv=st.integers(1, 2), group=st.sampled_from([1, 3]), d=st.sampled_from([1, 8]),
       causal=st.booleans(), left=_SIDE, right=_SIDE,
       softcap=st.sampled_from([0.0, 0.5, 5.0, 50.0]),
       sink=st.sampled_from([None, "normal", "extreme"]),
       magnitude=st.sampled_from([1.0, 30.0]), seed=st.integers(0, 2**32 - 1))
def test_options_match_brute_force(batch, sq, sk, hkv, group, d, causal, left, right, softcap,
                                   sink, magnitude, seed):
    # random windows, caps and sinks on fresh inputs; magnitude 30 gives logits in the
    # hundreds (extreme for exp), "extreme" sinks dominate or vanish
    if causal and right:
        right = None
    rng = np.random.default_rng(seed)
    q, k, v = _inputs(rng, b=batch, sq=sq, sk=sk, hq=hkv * group, hkv=hkv, d=d, dv=3)
    q, k = q * magnitude, k * magnitude
    sinks = {None: None, "normal": rng.standard_normal(hkv * group) * 3,
             "extreme": rng.choice([-300.0, 300.0, -np.inf], size=hkv * group)}[sink]
    got = attention_reference(q, k, v, causal=causal, window_size=(left, right),
                              softcap=softcap, learnable_sink=sinks, return_lse=True)
    want = _brute_reference(q, k, v, causal=causal, window=(left, right), softcap=softcap,
                            sink=sinks)
    _assert_matches(got, want)
    assert not np.isnan(got[0]).any() and not np.isnan(got[1]).any()


def test_defaults_leave_the_reference_unchanged(rng):
    q, k, v = _inputs(rng, sq=9, sk=5)
    for causal in (False, True):
        plain = attention_reference(q, k, v, causal=causal, return_lse=True)
        explicit = attention_reference(q, k, v, causal=causal, return_lse=True,
                                       window_size=(None, None), softcap=0.0,
                                       learnable_sink=None)
        # a window that hides nothing is no window at all
        wide = attention_reference(q, k, v, causal=causal, return_lse=True,
                                   window_size=(9 + 5, None if causal else 9 + 5))
        for other in (explicit, wide):
            np.testing.assert_array_equal(plain[0], other[0])
            np.testing.assert_array_equal(plain[1], other[1])


def test_causal_window_is_right_zero(rng):
    q, k, v = _inputs(rng, sq=8, sk=13)
    a = attention_reference(q, k, v, causal=True, window_size=(3, None), return_lse=True)
    b = attention_reference(q, k, v, window_size=(3, 0), return_lse=True)
    c = attention_reference(q, k, v, causal=True, window_size=(3, 0), return_lse=True)
    for x in (b, c):
        np.testing.assert_array_equal(a[0], x[0])
        np.testing.assert_array_equal(a[1], x[1])


def test_visible_mask_with_windows():
    m = visible_mask(4, 6, False, window_size=(1, 0))
    want = np.array([[j in (i + 2 - 1, i + 2) for j in range(6)] for i in range(4)])
    np.testing.assert_array_equal(m, want)
    np.testing.assert_array_equal(visible_mask(4, 6, True, window_size=(1, None)), want)
    np.testing.assert_array_equal(visible_mask(5, 5, False, window_size=(0, 0)),
                                  np.eye(5, dtype=bool))
    # window (None, 2): two keys past the diagonal; seqlen_q > seqlen_k hides the first rows
    assert visible_mask(7, 3, False, window_size=(None, 2))[:2].sum() == 0
    with pytest.raises(ValueError, match="causal=True with window_size"):
        visible_mask(4, 4, True, window_size=(None, 1))


def test_window_rows_that_see_nothing(rng):
    # (0, 0) with 9 queries and 4 keys: query i sees only key i - 5, so rows 0..4 see nothing
    q, k, v = _inputs(rng, sq=9, sk=4, hq=4, hkv=2)
    out, lse = attention_reference(q, k, v, window_size=(0, 0), return_lse=True)
    assert (out[:, :5] == 0).all() and np.isneginf(lse[:, :, :5]).all()
    kv = kv_head_index(4, 2)
    np.testing.assert_allclose(out[:, 5:], v[:, :, kv], rtol=1e-15)   # one key: weight 1
    np.testing.assert_allclose(
        lse[:, :, 5:], np.einsum("bqhd,bqhd->bhq", q[:, 5:], k[:, :, kv]) / math.sqrt(8),
        rtol=1e-12)
    # with a sink those rows give lse = sink and still out 0; seen rows shrink by the sink
    sink = np.array([-1.0, 0.0, 2.0, 40.0])
    out_s, lse_s = attention_reference(q, k, v, window_size=(0, 0), learnable_sink=sink,
                                       return_lse=True)
    assert (out_s[:, :5] == 0).all()
    np.testing.assert_array_equal(lse_s[:, :, :5], np.broadcast_to(sink[None, :, None],
                                                                   (2, 4, 5)))
    np.testing.assert_allclose(np.logaddexp(lse[:, :, 5:], sink[None, :, None]),
                               lse_s[:, :, 5:], rtol=1e-12)
    weight = np.exp(lse[:, :, 5:] - lse_s[:, :, 5:]).transpose(0, 2, 1)[..., None]
    np.testing.assert_allclose(out_s[:, 5:], weight * out[:, 5:], rtol=1e-12, atol=1e-300)


def test_sink_probabilities_sum_to_one(rng):
    """exp(s - lse) over the visible keys plus exp(sink - lse) is one on every row."""
    q, k, v = _inputs(rng, sq=6, sk=10, hq=2, hkv=2)
    sink = rng.standard_normal(2) * 4
    _, lse = attention_reference(q, k, v, window_size=(2, 1), softcap=3.0, learnable_sink=sink,
                                 return_lse=True)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(8)
    s = np.where(visible_mask(6, 10, False, window_size=(2, 1)), 3.0 * np.tanh(s / 3.0), -np.inf)
    total = np.exp(s - lse[..., None]).sum(-1) + np.exp(sink[None, :, None] - lse)
    np.testing.assert_allclose(total, 1.0, rtol=1e-12)


def test_minus_inf_sink_is_no_sink(rng):
    q, k, v = _inputs(rng, sq=9, sk=4)
    plain = attention_reference(q, k, v, causal=True, return_lse=True)
    none = attention_reference(q, k, v, causal=True, return_lse=True,
                               learnable_sink=np.full(4, -np.inf))
    np.testing.assert_allclose(none[0], plain[0], rtol=1e-15)
    np.testing.assert_array_equal(np.isneginf(none[1]), np.isneginf(plain[1]))
    np.testing.assert_allclose(none[1], plain[1], rtol=1e-15)


def test_softcap_bounds_the_scores(rng):
    q, k, v = _inputs(rng, d=8)
    q, k = q * 50, k * 50                    # raw logits in the thousands
    cap = 2.0
    _, lse = attention_reference(q, k, v, softcap=cap, return_lse=True)
    # every capped score lies in (-cap, cap): lse within log(seqlen_k) +- cap
    assert np.all(np.abs(lse - math.log(11)) < cap + 1e-12)
    # a cap far above every score changes nothing measurable
    q, k, v = _inputs(rng)
    np.testing.assert_allclose(attention_reference(q, k, v, softcap=1e7),
                               attention_reference(q, k, v), rtol=1e-9, atol=1e-12)


def test_options_through_the_chunked_path(rng, monkeypatch):
    q, k, v = _inputs(rng, sq=13, sk=17, hq=6, hkv=3)
    kw = dict(window_size=(4, 2), softcap=1.5, learnable_sink=rng.standard_normal(6),
              return_lse=True)
    whole = attention_reference(q, k, v, **kw)
    _assert_matches(whole, _brute_reference(q, k, v, window=(4, 2), softcap=1.5,
                                            sink=kw["learnable_sink"]), atol=1e-12)
    for budget in (17 * 13 * 2, 17 * 5, 1):
        monkeypatch.setattr(reference, "_SCORE_BUDGET", budget)
        part = attention_reference(q, k, v, **kw)
        np.testing.assert_allclose(part[0], whole[0], rtol=1e-13, atol=1e-14)
        np.testing.assert_allclose(part[1], whole[1], rtol=1e-13)


def test_torch_sink_and_inputs(rng):
    q, k, v = _inputs(rng, sq=5, sk=7)
    sink = rng.standard_normal(4)
    want = attention_reference(q, k, v, causal=True, window_size=(2, None), learnable_sink=sink,
                               return_lse=True)
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    got = attention_reference(tq, tk, tv, causal=True, window_size=(2, None),
                              learnable_sink=torch.from_numpy(sink).float(), return_lse=True)
    assert got[0].dtype == torch.float64
    np.testing.assert_allclose(got[0].numpy(), want[0], atol=1e-6)   # sink rounded to fp32
    np.testing.assert_allclose(got[1].numpy(), want[1], atol=1e-6)


@pytest.mark.parametrize("kwargs,err,words", [
    (dict(window_size=(-1, 3), causal=True), ValueError, r"causal=True with window_size=\(-1, 3\)"),
    (dict(window_size=(2, 3), causal=True), ValueError, r"causal=True with window_size=\(2, 3\)"),
    (dict(window_size=[1]), TypeError, "window_size must be a pair"),
    (dict(softcap=-2.0), ValueError, "softcap must be 0.0 .off. or a positive"),
    (dict(softcap=float("inf")), ValueError, "softcap"),
    (dict(learnable_sink=np.zeros(3)), ValueError,
     r"learnable_sink has shape \(3,\): expected \(heads_q,\) = \(4,\)"),
    (dict(learnable_sink=np.zeros(4, dtype=np.int32)), TypeError, "learnable_sink has dtype int32"),
    (dict(learnable_sink=np.array([0.0, np.nan, 0.0, 0.0])), ValueError,
     "learnable_sink contains NaN or \\+inf"),
    (dict(learnable_sink=np.array([0.0, np.inf, 0.0, 0.0])), ValueError, "learnable_sink"),
    (dict(learnable_sink=torch.zeros(4)), TypeError, "learnable_sink must be a numpy array"),
    (dict(learnable_sink=[0.0] * 4), TypeError, "learnable_sink must be a numpy array"),
])
def test_bad_options_are_named(rng, kwargs, err, words):
    with pytest.raises(err, match=words):
        attention_reference(*_inputs(rng), **kwargs)


def test_torch_sink_on_another_device_is_named(rng):
    q, k, v = (torch.from_numpy(x) for x in _inputs(rng))
    with pytest.raises(ValueError, match="learnable_sink is on meta but q is on cpu"):
        attention_reference(q, k, v, learnable_sink=torch.zeros(4, device="meta"))
    with pytest.raises(TypeError, match="learnable_sink must be a torch tensor like q"):
        attention_reference(q, k, v, learnable_sink=np.zeros(4))
