"""The FMA-pipe exp2 of the sm100 softmax (Note [exp2 by Cody-Waite + degree-3 polynomial]).

`fa4lab.online_softmax.exp2_poly3` replays the device instruction sequence in float32/int32;
these tests hold it to 2^x over the whole range the softmax uses, including the masked (-inf)
inputs, hold the device code to the same constants (fa4lab.limits' objects), and the packed row
sum (Note [packed exp2]) to its instruction count. The compiled counts are the audit's
(tests/test_compile_sm100.py).
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
from fa4lab.limits import EXP2_POLY3_MAX_REL_ERROR, RESCALE_THRESHOLD
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


def test_device_code_and_lesson_read_one_set_of_constants():
    # The same objects, not equal copies: limits holds them once.
    for name in ("EXP2_POLY3", "EXP2_CLAMP_LOW", "EXP2_ROUND_MAGIC"):
        assert getattr(exp2_device, name) is getattr(limits, name), name
        assert getattr(osm, name) is getattr(limits, name), name
    assert inspect.signature(osm.exp2_poly3).parameters["coeffs"].default is limits.EXP2_POLY3
    assert limits.EXP2_POLY3[0] == 1.0 and limits.EXP2_CLAMP_LOW == -127.0
    assert limits.EXP2_ROUND_MAGIC == 1.5 * 2**23
    assert limits.EXP2_PAIR_FFMA2 == len(limits.EXP2_POLY3) - 1     # one FFMA2 per Horner step
    # the clamp: -127 is the last input that gives +0.0; one ulp above it is not clamped
    assert exp2_poly3_numpy(np.float32(-127.0)) == 0.0
    assert exp2_poly3_numpy(np.nextafter(np.float32(-127.0), np.float32(0))) > 0.0


def test_exponent_insert_stays_integer():
    ptx = exp2_device.EXPONENT_INSERT_PTX
    assert "shl.b32 e, e, 23;" in ptx
    assert "add.s32" in ptx and "add.u32" not in ptx   # LEA on the ALU, not IMAD on the FMA pipe
    assert "ex2" not in ptx and ".f32" not in ptx       # no MUFU, no float arithmetic


@pytest.mark.parametrize("width", [1, 2, 4])
@pytest.mark.parametrize("pairs", [1, 3, 4, 5, 16, 64])
def test_packed_row_sum_chains(pairs, width, rng):
    """The sm100 row sum on f32x2 pairs (Note [packed exp2]): `width` running chains and a tree
    take pairs - 1 packed adds (the audit's FADD2 count) and give the row's sum up to fp32
    rounding."""
    softmax = pytest.importorskip("fa4lab.kernels.device.softmax")
    p = exp2_poly3_numpy(rng.uniform(-30, 8, (pairs, 2)).astype(np.float32))
    calls = []

    def add_x2(a, b):
        calls.append(1)
        return np.float32(a[0] + b[0]), np.float32(a[1] + b[1])

    chains = []
    for j in range(pairs):
        softmax.chain_into(chains, j, (p[j, 0], p[j, 1]), add_x2, width)
    assert len(chains) == min(pairs, width)
    lo, hi = softmax.join_chains(chains, add_x2)
    assert len(calls) == pairs - 1
    exact = p.astype(np.float64).sum()
    assert abs((float(lo) + float(hi)) - exact) <= 2 * pairs * 2.0**-24 * exact


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


def test_packed_cost_and_the_balanced_fraction():
    """Note [packed exp2 cost]: half an FMA-pipe instruction per element and lane of each
    FADD2 / FFMA2; at the balanced fraction MUFU and FMA take the same time per score; the sm100
    plan asks for it, capped by the softmax's registers."""
    from fa4lab.hardware import B200
    from fa4lab.plan import plan_forward
    from fa4lab.plan.costs import DEFAULT_COSTS as C
    from fa4lab.plan.costs import balanced_exp2_fraction
    from fa4lab.spec import AttentionSpec

    assert 2 * C.fma_ops_per_poly_exp2 == limits.EXP2_PAIR_FADD2 + limits.EXP2_PAIR_FFMA2
    f = balanced_exp2_fraction(B200, granularity=1 << 20)
    mufu = (1 - f) / B200.exp2_per_cycle
    fma = (C.fma_ops_per_score + f * C.fma_ops_per_poly_exp2) / B200.fma_per_cycle
    assert mufu == pytest.approx(fma, rel=1e-4)
    coarse = balanced_exp2_fraction(B200)
    assert abs(coarse - f) <= 1 / 32 and (coarse * 16).is_integer()
    for d in (64, 128):
        plan = plan_forward(AttentionSpec(1, 256, 256, 2, 2, d, d, causal=True), "sm100")
        assert plan.exp2_emulation_fraction == min(coarse, limits.SM100_EXP2_FRACTION_MAX)
