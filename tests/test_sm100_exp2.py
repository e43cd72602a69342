"""The FMA-pipe exp2 of the sm100 softmax (Note [exp2 by Cody-Waite + degree-3 polynomial]).

`fa4lab.online_softmax.exp2_poly3` replays the device instruction sequence in float32/int32;
these tests hold it to 2^x over the whole range the softmax uses, including the masked (-inf)
inputs, and hold the PTX and the lesson to the same constants (fa4lab.limits' objects).
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fa4lab import limits
from fa4lab import online_softmax as osm
from fa4lab.kernels.device import exp2 as exp2_device
from fa4lab.kernels.device.exp2 import CLAMP_LOW, EXP2_POLY3_PTX, ROUND_MAGIC
from fa4lab.limits import EXP2_POLY3, EXP2_POLY3_MAX_REL_ERROR, RESCALE_THRESHOLD
from fa4lab.online_softmax import emulated_pairs
from fa4lab.online_softmax import exp2_poly3 as exp2_poly3_numpy


def test_relative_error_over_softmax_range(rng):
    # P = exp2(s * scale_log2 - max * scale_log2) takes arguments in (-inf, 8]: 8 is the
    # conditional-rescale threshold.
    x = np.concatenate([rng.uniform(-126, 8, 200_000), np.arange(-126, 9)]).astype(np.float32)
    got = exp2_poly3_numpy(x).astype(np.float64)
    ref = np.exp2(x.astype(np.float64))
    rel = np.abs(got - ref) / ref
    assert rel.max() < 1.0e-4  # 2^-13.3, far below a bf16 (2^-8) or fp16 (2^-11) ulp of P
    in_range = (x >= -125) & (x <= RESCALE_THRESHOLD)
    assert rel[in_range].max() <= EXP2_POLY3_MAX_REL_ERROR     # the number limits quotes


def test_integers_are_exact_and_masked_scores_give_zero():
    x = np.arange(-126, 9, dtype=np.float32)
    assert np.array_equal(exp2_poly3_numpy(x), np.exp2(x))
    out = exp2_poly3_numpy(np.array([-np.inf, -1e30, -127.0, -200.0], dtype=np.float32))
    assert np.all(out == 0.0) and not np.any(np.signbit(out))


@given(st.floats(-140.0, 8.0, width=32))
@settings(max_examples=500, deadline=None)
def test_monotone_and_finite(x):
    a, b = exp2_poly3_numpy(np.array([x, np.nextafter(np.float32(x), np.float32(9))],
                                     dtype=np.float32))
    assert np.isfinite(a) and np.isfinite(b) and 0.0 <= a <= b * (1 + 2e-4)


def test_polynomial_constant_term_is_one_and_ptx_uses_the_same_constants():
    assert EXP2_POLY3[0] == 1.0
    for c in (*EXP2_POLY3, ROUND_MAGIC, CLAMP_LOW):
        word = np.float32(c).view(np.uint32).item()
        assert f"0f{word:08X}" in EXP2_POLY3_PTX
    assert "ex2" not in EXP2_POLY3_PTX  # it must not fall back to MUFU


def test_device_code_and_lesson_read_one_set_of_constants():
    # The same objects, not equal copies: fa4lab.limits holds them once.
    assert exp2_device.EXP2_POLY3 is limits.EXP2_POLY3 is osm.EXP2_POLY3
    assert CLAMP_LOW is limits.EXP2_CLAMP_LOW is osm.EXP2_CLAMP_LOW
    assert ROUND_MAGIC is limits.EXP2_ROUND_MAGIC is osm.EXP2_ROUND_MAGIC
    assert inspect.signature(osm.exp2_poly3).parameters["coeffs"].default is limits.EXP2_POLY3
    assert CLAMP_LOW == -127.0 and ROUND_MAGIC == 1.5 * 2**23
    # the clamp: -127 is the last input that gives +0.0; one ulp above it is not clamped
    assert exp2_poly3_numpy(np.float32(-127.0)) == 0.0
    assert exp2_poly3_numpy(np.nextafter(np.float32(-127.0), np.float32(0))) > 0.0


@pytest.mark.parametrize("fraction", [0.0, 0.125, 0.25, 0.3125, 0.5, 1.0])
def test_emulated_pairs_count_and_spread(fraction):
    pairs = emulated_pairs(128, fraction)
    assert len(pairs) == 64
    assert sum(pairs) == int(64 * fraction)
    # evenly spread: every window of 16 pairs holds the same share, give or take one
    for start in range(0, 64, 16):
        assert abs(sum(pairs[start:start + 16]) - 16 * fraction) <= 1


def test_emulated_pairs_rejects_bad_fraction():
    with pytest.raises(ValueError, match="exp2_emulation_fraction"):
        emulated_pairs(128, 1.5)
