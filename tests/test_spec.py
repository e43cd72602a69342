"""AttentionSpec: fields, the normal form of causal + window_size, softcap, sinks, the input
check shared by every entry point."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fa4lab.reference import visible_mask
from fa4lab.spec import (
    AttentionSpec,
    check_qkv_shapes,
    normalize_dtype,
    visible_key_counts,
)


def test_defaults_and_derived():
    s = AttentionSpec(2, 100, 300, 8, 2, 64)
    assert s.head_dim_v == 64 and s.gqa_ratio == 4
    assert math.isclose(s.scale, 1 / 8)
    assert math.isclose(s.scale_log2, s.scale * math.log2(math.e))
    assert s.flops() == 4 * 2 * 8 * 100 * 300 * 64
    assert s.with_(causal=True).flops() == s.flops() / 2


@pytest.mark.parametrize("kwargs, words", [
    (dict(heads_q=6, heads_kv=4), "not a multiple"),
    (dict(seqlen_q=0), "seqlen_q must be >= 1"),
    (dict(head_dim=-1), "head_dim must be >= 1"),
    (dict(softmax_scale=float("nan")), "softmax_scale"),
])
def test_bad_specs_say_what_is_wrong(kwargs, words):
    base = dict(batch=1, seqlen_q=4, seqlen_k=4, heads_q=4, heads_kv=2, head_dim=64)
    with pytest.raises(ValueError, match=words):
        AttentionSpec(**{**base, **kwargs})


def test_dtype_names():
    assert normalize_dtype("bfloat16") == "bf16" and normalize_dtype("half") == "fp16"
    with pytest.raises(TypeError, match="bf16 or fp16"):
        normalize_dtype("float32")


def test_shape_checks():
    q = np.zeros((1, 3, 4, 8))
    k = np.zeros((1, 5, 2, 8))
    check_qkv_shapes(q, k, k)
    with pytest.raises(ValueError, match="4 dims"):
        check_qkv_shapes(q[0], k, k)
    with pytest.raises(ValueError, match="head_dim"):
        check_qkv_shapes(q, np.zeros((1, 5, 2, 16)), k)
    with pytest.raises(ValueError, match="multiple"):
        check_qkv_shapes(np.zeros((1, 3, 3, 8)), k, k)
    spec = AttentionSpec.from_tensors(q, k, k, causal=True)
    assert (spec.seqlen_q, spec.seqlen_k, spec.heads_q, spec.heads_kv) == (3, 5, 4, 2)


# ------------------------------------------------------------ window_size, softcap, sinks


BASE = dict(batch=2, seqlen_q=7, seqlen_k=11, heads_q=4, heads_kv=2, head_dim=8)


def test_new_options_default_to_the_old_spec():
    plain = AttentionSpec(**BASE)
    assert (plain.window_size, plain.softcap, plain.learnable_sink) == ((None, None), 0.0, False)
    assert plain.effective_window == (None, None) and not plain.has_mask
    causal = AttentionSpec(**BASE, causal=True)
    # causal with no window, however written, is one spec, stored as before windows existed
    assert causal.window_size == (None, None) and causal.effective_window == (None, 0)
    for window in [(None, None), (None, 0), [None, 0]]:
        assert AttentionSpec(**BASE, causal=True, window_size=window) == causal
    assert AttentionSpec(**BASE, window_size=(None, 0)) == causal


@pytest.mark.parametrize("causal,window,stored,effective", [
    (False, (5, None), (False, (5, None)), (5, None)),
    (False, (5, 3), (False, (5, 3)), (5, 3)),
    (False, (5, 0), (True, (5, None)), (5, 0)),         # right = 0 is causal
    (True, (5, 0), (True, (5, None)), (5, 0)),
    (True, (5, None), (True, (5, None)), (5, 0)),
    (False, (0, 0), (True, (0, None)), (0, 0)),
    (False, (None, 4), (False, (None, 4)), (None, 4)),
    (False, [3, None], (False, (3, None)), (3, None)),  # a list, as from a plan's JSON
    (False, (np.int64(2), 1), (False, (2, 1)), (2, 1)),
])
def test_window_normal_form(causal, window, stored, effective):
    s = AttentionSpec(**BASE, causal=causal, window_size=window)
    assert (s.causal, s.window_size) == stored and s.effective_window == effective
    assert type(s.window_size) is tuple and all(type(x) in (int, type(None))
                                                for x in s.window_size)
    # the stored form rebuilds the same spec (with_ and a JSON round trip of a plan)
    assert s.with_() == s
    assert AttentionSpec(**{**BASE, "causal": s.causal, "window_size": list(s.window_size)}) == s


def test_with_and_from_tensors_carry_the_options():
    s = AttentionSpec(**BASE).with_(window_size=(4, 2), softcap=30, learnable_sink=True)
    assert (s.window_size, s.softcap, s.learnable_sink) == ((4, 2), 30.0, True)
    assert s.with_(causal=False) == s and s.with_(window_size=(None, None)).window_size == (
        None, None)
    q, k = np.zeros((1, 3, 4, 8)), np.zeros((1, 5, 2, 8))
    t = AttentionSpec.from_tensors(q, k, k, window_size=(2, 0), softcap=5.0,
                                   learnable_sink=np.zeros(4, dtype=np.float32))
    assert (t.causal, t.window_size, t.softcap, t.learnable_sink) == (True, (2, None), 5.0, True)
    assert not AttentionSpec.from_tensors(q, k, k).learnable_sink
    with pytest.raises(ValueError, match=r"learnable_sink has shape \(3,\).*\(heads_q,\) = \(4,\)"):
        AttentionSpec.from_tensors(q, k, k, learnable_sink=np.zeros(3))


@pytest.mark.parametrize("kwargs,err,words", [
    (dict(causal=True, window_size=(4, 2)),
     ValueError, r"causal=True with window_size=\(4, 2\).*disagree"),
    (dict(causal=True, window_size=(3, -2)), ValueError,
     r"causal=True with window_size=\(3, -2\).*stop 2 keys before the diagonal"),
    (dict(window_size=4), TypeError, "window_size must be a pair"),
    (dict(window_size=(1, 2, 3)), TypeError, "window_size must be a pair"),
    (dict(window_size="ab"), TypeError, "window_size must be a pair"),
    (dict(window_size=(1.5, None)), TypeError, r"window_size=\(1.5, None\): left must be an int"),
    (dict(window_size=(None, True)), TypeError, "right must be an int"),
    (dict(softcap=-1.0), ValueError, "softcap must be 0.0 .off. or a positive finite"),
    (dict(softcap=float("inf")), ValueError, "softcap must be"),
    (dict(softcap=float("nan")), ValueError, "softcap must be"),
    (dict(softcap="30"), TypeError, "softcap must be a number"),
    (dict(softcap=True), TypeError, "softcap must be a number"),
    (dict(learnable_sink=np.zeros(4)), TypeError, "learnable_sink is a flag"),
    (dict(learnable_sink=None), TypeError, "learnable_sink is a flag"),
])
def test_bad_options_say_what_is_wrong(kwargs, err, words):
    with pytest.raises(err, match=words):
        AttentionSpec(**{**BASE, **kwargs})


def _brute_visible(sq, sk, causal, window):
    """visible[i, j] straight from the contract, one pair at a time."""
    left, right = window
    right = 0 if causal else right
    d = sk - sq
    return np.array([[(left is None or j >= i + d - left) and (right is None or j <= i + d + right)
                      for j in range(sk)] for i in range(sq)], dtype=bool).reshape(sq, sk)


_SIDE = st.one_of(st.none(), st.integers(0, 12))


@settings(max_examples=300, deadline=None)
@given(sq=st.integers(1, 14), sk=st.integers(1, 14), causal=st.booleans(), left=_SIDE,
       right=_SIDE)
def test_mask_properties_match_brute_force(sq, sk, causal, left, right):
    if causal and right:
        right = None                     # causal with right > 0 is an error (tested above)
    spec = AttentionSpec(1, sq, sk, 2, 1, 8, causal=causal, window_size=(left, right))
    vis = _brute_visible(sq, sk, causal, (left, right))
    assert spec.has_mask == (not vis.all())
    assert spec.visible_pairs() == vis.sum()
    np.testing.assert_array_equal(
        visible_key_counts(sq, sk, spec.effective_window), vis.sum(axis=1))
    np.testing.assert_array_equal(visible_mask(sq, sk, causal, window_size=(left, right)), vis)
    # flops: the causal convention (half of dense) unless the window hides more than causal
    dense = 4.0 * spec.heads_q * sq * sk * 8
    hides_left = not _brute_visible(sq, sk, False, (left, None)).all()
    if not hides_left and spec.causal:
        assert spec.flops() == dense / 2
    elif not spec.has_mask:
        assert spec.flops() == dense
    else:
        assert spec.flops() == 4.0 * spec.heads_q * vis.sum() * 8


def test_window_flops():
    s = AttentionSpec(1, 8192, 8192, 16, 16, 128, causal=True)
    assert s.with_(window_size=(8191, None)).flops() == s.flops()   # hides nothing more
    w = s.with_(window_size=(1023, None))
    # every row past the first 1023 sees exactly 1024 keys
    pairs = sum(min(i + 1, 1024) for i in range(8192))
    assert w.visible_pairs() == pairs and w.flops() == 4.0 * 16 * pairs * 128
    assert AttentionSpec(1, 4, 4, 1, 1, 8, window_size=(0, 0)).visible_pairs() == 4


def test_spec_of_keeps_a_spec_per_fields_and_checks_what_it_has_not_seen():
    """Note [spec cache]: the same fields give the same object; a field of another type is a
    new key, checked (a float window side still raises after the int one was kept); a spec
    that fails its checks raises every time; a field no key holds (a list) is checked afresh;
    `with_` goes through it and agrees with a spec made whole."""
    import torch

    from fa4lab.errors import InputError, InputTypeError
    from fa4lab.spec import spec_of

    kw = dict(batch=3, seqlen_q=5, seqlen_k=70, heads_q=8, heads_kv=2, head_dim=64,
              dtype=torch.float16, causal=False, window_size=(16, 0))
    a = spec_of(**kw)
    assert spec_of(**kw) is a and a == AttentionSpec(**kw)
    assert a.causal and a.window_size == (16, None) and a.dtype == "fp16"
    for _ in range(2):
        with pytest.raises(InputTypeError):
            spec_of(**{**kw, "window_size": (16.0, 0)})
        with pytest.raises(InputError):
            spec_of(**{**kw, "heads_kv": 3})
    listed = spec_of(**{**kw, "window_size": [16, 0]})
    assert listed == a and listed is not a
    assert spec_of(**{**kw, "softmax_scale": 1}).softmax_scale == 1.0
    b = a.with_(seqlen_q=1, page_size=16)
    assert b == AttentionSpec(**{**kw, "seqlen_q": 1, "page_size": 16})
    assert a.with_(seqlen_q=1, page_size=16) is b and a.seqlen_q == 5
