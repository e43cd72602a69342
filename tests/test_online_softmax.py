"""The online-softmax state machine against the float64 reference.

Hypothesis grids are trimmed (max_examples <= 60, dims <= 6 heads, <= 40 keys) so the file runs
in seconds on a 2-core CPU; tails, seqlen 1, causal with seqlen_q > seqlen_k (fully masked rows)
and GQA all fall inside those ranges.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fa4lab.online_softmax as osm
from fa4lab.limits import EXP2_POLY3
from fa4lab.online_softmax import (
    MISTAKES,
    adversarial_inputs,
    exp2_poly3,
    finalize,
    init_state,
    merge_states,
    online_attention,
    score_block,
    update_state,
)
from fa4lab.reference import attention_reference, kv_head_index, visible_mask

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@st.composite
def problems(draw):
    hkv = draw(st.integers(1, 3))
    ratio = draw(st.integers(1, 3))
    shape = dict(
        batch=draw(st.integers(1, 2)), seqlen_q=draw(st.integers(1, 20)),
        seqlen_k=draw(st.integers(1, 40)), heads_q=hkv * ratio, heads_kv=hkv,
        head_dim=draw(st.sampled_from([1, 4, 8])), head_dim_v=draw(st.sampled_from([1, 3, 8])))
    seed = draw(st.integers(0, 2**32 - 1))
    logit_size = draw(st.sampled_from([1.0, 30.0, 1e4]))
    return shape, seed, logit_size


def _make(shape, seed, logit_size=1.0):
    rng = np.random.default_rng(seed)
    b, sq, sk = shape["batch"], shape["seqlen_q"], shape["seqlen_k"]
    q = rng.standard_normal((b, sq, shape["heads_q"], shape["head_dim"]))
    k = rng.standard_normal((b, sk, shape["heads_kv"], shape["head_dim"]))
    v = rng.standard_normal((b, sk, shape["heads_kv"], shape["head_dim_v"]))
    return q * math.sqrt(logit_size), k * math.sqrt(logit_size), v


def _assert_lse_close(lse, ref_lse, tol):
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    assert not np.isnan(lse).any()
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=tol, atol=tol)


@SETTINGS
@given(problem=problems(), block_n=st.integers(1, 48), causal=st.booleans(),
       threshold=st.sampled_from([0.0, 0.5, 8.0, 30.0]))
def test_matches_reference(problem, block_n, causal, threshold):
    shape, seed, logit_size = problem
    q, k, v = _make(shape, seed, logit_size)
    ref, ref_lse = attention_reference(q, k, v, causal=causal, return_lse=True)
    out, lse = online_attention(q, k, v, block_n=block_n, causal=causal, return_lse=True,
                                rescale_threshold=threshold)
    assert not np.isnan(out).any()
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-10)
    _assert_lse_close(lse, ref_lse, 1e-10)


@SETTINGS
@given(problem=problems(), block_n=st.integers(1, 16), causal=st.booleans(),
       data=st.data())
def test_block_order_does_not_matter(problem, block_n, causal, data):
    shape, seed, _ = problem
    q, k, v = _make(shape, seed)
    n_blocks = len(osm.kv_blocks(shape["seqlen_k"], block_n))
    order = data.draw(st.permutations(range(n_blocks)))
    a = online_attention(q, k, v, block_n=block_n, causal=causal, return_lse=True)
    b = online_attention(q, k, v, block_n=block_n, causal=causal, return_lse=True,
                         block_order=order)
    np.testing.assert_allclose(b[0], a[0], rtol=0, atol=1e-12)
    _assert_lse_close(b[1], a[1], 1e-12)


def _partial_state(q, k, v, keys, causal, scale_log2, threshold=0.0):
    """State after the keys in range `keys` only (a split-KV worker)."""
    kv_of = kv_head_index(q.shape[2], k.shape[2])
    qh = q.transpose(0, 2, 1, 3)
    kh = k[:, :, kv_of].transpose(0, 2, 1, 3)
    vh = v[:, :, kv_of].transpose(0, 2, 1, 3)
    vis = visible_mask(q.shape[1], k.shape[1], causal)
    state = init_state(qh.shape[:3], v.shape[-1], scale_log2)
    for n0 in range(keys.start, keys.stop, 5):
        n1 = min(keys.stop, n0 + 5)
        s = score_block(qh, kh[:, :, n0:n1], vis[:, n0:n1])
        state, _ = update_state(state, s, vh[:, :, n0:n1], rescale_threshold=threshold)
    return state


def _close_states(a, b, tol):
    np.testing.assert_array_equal(a.row_max, b.row_max)
    np.testing.assert_allclose(a.row_sum, b.row_sum, rtol=tol, atol=0)
    np.testing.assert_allclose(a.acc_o, b.acc_o, rtol=tol, atol=tol * np.abs(a.acc_o).max())


@SETTINGS
@given(problem=problems(), causal=st.booleans(), cuts=st.lists(st.integers(0, 40), min_size=2,
                                                               max_size=2),
       threshold=st.sampled_from([0.0, 8.0]))
def test_merge_is_associative_commutative_and_exact(problem, causal, cuts, threshold):
    shape, seed, logit_size = problem
    q, k, v = _make(shape, seed, logit_size)
    sk = shape["seqlen_k"]
    c1, c2 = sorted(min(c, sk) for c in cuts)
    scale_log2 = osm.LOG2E / math.sqrt(shape["head_dim"])
    a, b, c = (_partial_state(q, k, v, r, causal, scale_log2, threshold)
               for r in (range(0, c1), range(c1, c2), range(c2, sk)))
    ab_c = merge_states(merge_states(a, b), c)
    a_bc = merge_states(a, merge_states(b, c))
    _close_states(ab_c, a_bc, 1e-12)
    ba = merge_states(b, a)
    ab = merge_states(a, b)
    np.testing.assert_array_equal(ab.row_sum, ba.row_sum)      # exactly symmetric
    np.testing.assert_array_equal(ab.acc_o, ba.acc_o)
    empty = init_state(a.row_max.shape, v.shape[-1], scale_log2)
    _close_states(merge_states(a, empty), a, 0)                # the empty state is the unit
    out, lse = finalize(ab_c)
    ref, ref_lse = attention_reference(q, k, v, causal=causal, return_lse=True)
    np.testing.assert_allclose(out.transpose(0, 2, 1, 3), ref, rtol=0, atol=1e-10)
    _assert_lse_close(lse, ref_lse, 1e-10)


def test_merge_rejects_mismatched_states():
    a = init_state((1, 2, 3), 4, 1.0)
    with pytest.raises(ValueError, match="scale_log2"):
        merge_states(a, init_state((1, 2, 3), 4, 2.0))
    with pytest.raises(ValueError, match="shapes"):
        merge_states(a, init_state((1, 2, 3), 5, 1.0))


@pytest.mark.parametrize("magnitude", [1e4, -1e4])
def test_extreme_logits_and_masked_rows(rng, magnitude):
    q = rng.standard_normal((1, 12, 2, 8))
    k = rng.standard_normal((1, 5, 1, 8))
    v = rng.standard_normal((1, 5, 1, 8))
    q = q / np.linalg.norm(q, axis=-1, keepdims=True) * math.sqrt(abs(magnitude)) * 1.7
    k = k / np.linalg.norm(k, axis=-1, keepdims=True) * math.sqrt(abs(magnitude)) * 1.7
    q = q * np.sign(magnitude)
    for threshold in (0.0, 8.0):
        out, lse = online_attention(q, k, v, block_n=2, causal=True, return_lse=True,
                                    rescale_threshold=threshold)
        ref, ref_lse = attention_reference(q, k, v, causal=True, return_lse=True)
        assert not np.isnan(out).any() and not np.isnan(lse).any()
        assert (out[:, :7] == 0).all() and np.isneginf(lse[:, :, :7]).all()   # 12 - 5 rows
        assert np.isfinite(lse[:, :, 7:]).all()
        np.testing.assert_allclose(out, ref, atol=1e-10)
        _assert_lse_close(lse, ref_lse, 1e-10)
    assert np.abs(ref_lse[np.isfinite(ref_lse)]).max() > 1e3     # the logits really are huge


def test_naive_overflows_safe_and_online_do_not():
    x = np.array([1e4, 1e4 - 1.0, 0.0, -1e4])
    assert np.isnan(osm.naive_softmax(x)).any()
    p = osm.safe_softmax(x)
    assert np.isfinite(p).all() and abs(p.sum() - 1) < 1e-15
    p1, m, total = osm.online_softmax_1d(x)
    np.testing.assert_allclose(p1, p, rtol=1e-15)
    assert m == 1e4 and total == pytest.approx(1 + math.exp(-1))
    small = np.random.default_rng(1).standard_normal(17)
    np.testing.assert_allclose(osm.naive_softmax(small), osm.safe_softmax(small), rtol=1e-14)


# ---- conditional rescaling ------------------------------------------------------------------

def test_conditional_rescaling_saves_rescales_and_stays_exact(rng):
    q, k, v = (rng.standard_normal(s) for s in ((1, 32, 2, 16), (1, 512, 2, 16),
                                               (1, 512, 2, 16)))
    ref = attention_reference(q, k, v)
    every = online_attention(q, k, v, block_n=32, trace=True)
    fa4 = online_attention(q, k, v, block_n=32, trace=True,
                           rescale_threshold=osm.FA4_RESCALE_THRESHOLD)
    assert every.rescales == every.max_rises > 0 and every.rescales_saved == 0
    assert fa4.max_rises == every.max_rises
    assert fa4.rescales < fa4.max_rises and fa4.rescales_saved > 0
    np.testing.assert_allclose(fa4.out, ref, atol=1e-12)


@SETTINGS
@given(problem=problems(), block_n=st.integers(1, 12), threshold=st.sampled_from([0.0, 2.0,
                                                                                    8.0]))
def test_stale_basis_bounds_p(problem, block_n, threshold):
    """The kept basis is never more than threshold (log2 units) below the true running max, so
    P <= 2**threshold, and every decision to rescale is recorded."""
    shape, seed, logit_size = problem
    q, k, v = _make(shape, seed, logit_size)
    t = online_attention(q, k, v, block_n=block_n, trace=True, rescale_threshold=threshold)
    true_max = np.full(t.steps[0].row_max_before.shape, -np.inf)
    for step in t.steps:
        true_max = np.maximum(true_max, step.block_max)
        gap = (true_max - step.row_max_after) * t.scale_log2
        assert (gap[np.isfinite(gap)] <= threshold + 1e-9).all()
        assert (step.block_max[step.rescaled] > step.row_max_before[step.rescaled]).all()
        assert (step.alpha[~step.rescaled & np.isfinite(step.row_max_before)] == 1).all()
    assert t.rescales + t.rescales_saved == t.max_rises


def test_trace_records_every_block(rng):
    q, k, v = (rng.standard_normal(s) for s in ((1, 4, 1, 8), (1, 50, 1, 8), (1, 50, 1, 8)))
    t = online_attention(q, k, v, block_n=16, trace=True)
    assert t.blocks == [(0, 16), (16, 32), (32, 48), (48, 50)]       # the tail block
    assert len(t.steps) == len(t.states) == 4
    np.testing.assert_allclose(t.partial_out(3), t.out)
    partial = attention_reference(q, k[:, :16], v[:, :16])
    np.testing.assert_allclose(t.partial_out(0), partial, atol=1e-12)


# ---- software exp2 --------------------------------------------------------------------------

def test_exp2_poly3_error_is_as_documented():
    err = osm.exp2_poly3_max_rel_error()
    assert err <= osm.EXP2_POLY3_MAX_REL_ERROR
    assert err > 0.9 * osm.EXP2_POLY3_MAX_REL_ERROR      # the quoted number is the measured one
    assert f"{osm.EXP2_POLY3_MAX_REL_ERROR:.1e}" in exp2_poly3.__doc__
    assert err < 2.0**-9                                  # well below bf16 rounding of P


def test_exp2_poly3_values(rng):
    x = rng.uniform(-125, 8, 10000).astype(np.float32)
    y = exp2_poly3(x)
    assert y.dtype == np.float32
    rel = np.abs(y / np.exp2(x.astype(np.float64)) - 1)
    assert rel.max() <= osm.EXP2_POLY3_MAX_REL_ERROR
    special = exp2_poly3(np.array([-np.inf, -1000.0, -127.0, -126.0, 128.0, 0.0, 3.0]))
    assert special[0] == special[1] == special[2] == 0.0 and np.isinf(special[4])
    assert special[3] == np.float32(2.0**-126)            # the smallest normal float32, exact
    special = special[[0, 1, 2, 4, 5, 6]]
    assert special[4] == pytest.approx(1, rel=1e-4) and special[5] == pytest.approx(8, rel=1e-4)
    c = osm.fit_exp2_poly3()
    assert len(c) == 4 and c[0] == pytest.approx(1, abs=1e-3)
    assert sum(c) == pytest.approx(2, abs=1e-3)           # p(1) ~ 2: continuous across n


def test_exp2_poly3_is_exact_at_integers_and_pinning_costs_little(rng):
    assert EXP2_POLY3[0] == 1.0
    x = np.arange(-120, 9).astype(np.float32)
    np.testing.assert_array_equal(exp2_poly3(x), np.exp2(x))                     # exact
    err = osm.exp2_poly3_max_rel_error()
    free = osm.fit_exp2_poly3()                  # the minimax cubic with c0 free
    free_err = osm.exp2_poly3_max_rel_error(coeffs=free)
    assert 0.9 * 7.5e-5 < free_err <= 7.5e-5
    assert free_err < err <= 8.6e-5 * 1.02                 # pinning costs a little
    y = rng.uniform(-100, 8, 1000).astype(np.float32)
    exact = np.exp2(y.astype(np.float64))
    assert np.abs(exp2_poly3(y) / exact - 1).max() <= err
    assert np.abs(exp2_poly3(y, free) / exact - 1).max() <= free_err


def test_the_fit_reproduces_the_stored_coefficients():
    """limits.EXP2_POLY3 (kernel, numpy replay, lesson) is the pinned Lawson fit, in float32."""
    fit = osm.fit_exp2_poly3(exact_at_zero=True)
    assert fit[0] == EXP2_POLY3[0] == 1.0
    np.testing.assert_allclose(fit, EXP2_POLY3, rtol=2e-5)
    stored_err = osm.exp2_poly3_max_rel_error()
    assert osm.exp2_poly3_max_rel_error(coeffs=fit) == pytest.approx(stored_err, rel=0.01)
    assert osm.EXP2_POLY3 is EXP2_POLY3                  # the lesson keeps no copy


def test_online_with_exp2_poly3(rng):
    q, k, v = (rng.standard_normal(s) for s in ((2, 24, 4, 16), (2, 70, 2, 16), (2, 70, 2, 16)))
    ref, ref_lse = attention_reference(q, k, v, causal=True, return_lse=True)
    out, lse = online_attention(q, k, v, block_n=16, causal=True, return_lse=True,
                                rescale_threshold=osm.FA4_RESCALE_THRESHOLD, exp2=exp2_poly3)
    bound = osm.EXP2_POLY3_MAX_REL_ERROR
    # each weight is off by at most `bound` relative, so out by ~2*bound*max|v|, lse by ~bound
    assert np.abs(out - ref).max() <= 4 * bound * np.abs(v).max()
    assert np.abs(lse - ref_lse).max() <= 2 * bound
    assert np.abs(out - ref).max() > 1e-9                 # it really used the polynomial


# ---- failure modes --------------------------------------------------------------------------

def test_each_mistake_is_caught():
    q, k, v = adversarial_inputs("rising", magnitude=1e4)
    ref = attention_reference(q, k, v)
    assert np.abs(online_attention(q, k, v, block_n=64, mistake="skip_rescale") - ref).max() > 0.5
    q, k, v = adversarial_inputs("rising", magnitude=3.0)
    ref = attention_reference(q, k, v)
    err = np.abs(online_attention(q, k, v, block_n=64, mistake="normalize_early") - ref).max()
    assert err > 1e-2
    err = np.abs(online_attention(q, k, v, block_n=64, mistake="gqa_modulo") - ref).max()
    assert err > 0.1
    q, k, v = adversarial_inputs("extreme", magnitude=1e4)
    ref = attention_reference(q, k, v)
    assert np.abs(online_attention(q, k, v, block_n=64, mistake="skip_rescale") - ref).max() > 0.5
    errors = osm.variant_errors(q, k, v)
    assert set(MISTAKES) <= set(errors)
    assert errors["online (threshold 8)"] < 1e-12


def test_mistakes_are_harmless_only_where_expected(rng):
    """Each mistake is invisible in the one case that hides it: that is why tests need
    multiple blocks and GQA with several KV heads."""
    q, k, v = adversarial_inputs("rising", magnitude=1e4, seqlen_k=32)
    ref = attention_reference(q, k, v)
    for m in ("skip_rescale", "normalize_early"):
        np.testing.assert_allclose(online_attention(q, k, v, block_n=32, mistake=m), ref,
                                   atol=1e-12)
    q, k, v = adversarial_inputs("rising", magnitude=3.0, heads_q=4, heads_kv=1)
    np.testing.assert_allclose(online_attention(q, k, v, block_n=8, mistake="gqa_modulo"),
                               attention_reference(q, k, v), atol=1e-12)


# ---- input checks ---------------------------------------------------------------------------

def _ok(rng):
    return (rng.standard_normal((1, 4, 2, 8)), rng.standard_normal((1, 6, 1, 8)),
            rng.standard_normal((1, 6, 1, 8)))


@pytest.mark.parametrize("make,kw,err,words", [
    (lambda q, k, v: (q, k[..., :4], v), {}, ValueError, "head_dim"),
    (lambda q, k, v: (q[:, :, :1], k[:, :, [0, 0]], v[:, :, [0, 0]]), {}, ValueError,
     "multiple of heads_kv"),
    (lambda q, k, v: (q, k, v[:, :3]), {}, ValueError, "seqlen_k"),
    (lambda q, k, v: (q, k.astype(np.int32), v), {}, TypeError, "k has dtype int32"),
    (lambda q, k, v: (q, k, v * np.nan), {}, ValueError, "v contains NaN"),
    (lambda q, k, v: (q, k, v), {"block_n": 0}, ValueError, "block_n"),
    (lambda q, k, v: (q, k, v), {"rescale_threshold": -1}, ValueError, "rescale_threshold"),
    (lambda q, k, v: (q, k, v), {"rescale_threshold": 100}, ValueError, "overflows"),
    (lambda q, k, v: (q, k, v), {"mistake": "typo"}, ValueError, "unknown mistake"),
    (lambda q, k, v: (q, k, v), {"block_order": [0, 0]}, ValueError, "permutation"),
    (lambda q, k, v: (q, k, v), {"softmax_scale": -2}, ValueError, "softmax_scale"),
])
def test_bad_input_is_named(rng, make, kw, err, words):
    with pytest.raises(err, match=words):
        online_attention(*make(*_ok(rng)), block_n=kw.pop("block_n", 4), **kw)


def test_torch_inputs_accepted(rng):
    q, k, v = _ok(rng)
    out = online_attention(*(torch.from_numpy(x) for x in (q, k, v)), block_n=4)
    np.testing.assert_allclose(out, attention_reference(q, k, v), atol=1e-12)
