"""Masking by bitmask (Note [bitmask masking] in fa4lab.kernels.device.mask): the column
patterns it recognises, the element counts it derives from a limit, and the 32-bit masks those
counts give under PTX's shift rules, held to the per-score rule on every limit."""

from __future__ import annotations

import pytest

from fa4lab.kernels.device.mask import MASK_BITS, column_pattern, elements_below


def _wgmma_columns(n_block: int) -> list[int]:
    # a thread's columns in one row of an sm90 accumulator: pairs every 8 (thread 0's)
    return [(j // 2) * 8 + j % 2 for j in range(n_block // 4)]


def _shr(val: int, shift: int) -> int:   # PTX shr.b32: a shift of 32 or more gives 0
    return 0 if shift >= 32 else (val >> shift) & 0xFFFFFFFF


def _shl(val: int, shift: int) -> int:   # PTX shl.b32
    return 0 if shift >= 32 else (val << shift) & 0xFFFFFFFF


def _kept(n: int, pattern, end: int, first: int | None) -> list[bool]:
    """Which of a row's n elements the chunk masks keep, as mask_row_bits builds them."""
    below = elements_below(end, pattern, max, min)
    above = None if first is None else elements_below(first, pattern, max, min)
    kept = []
    for base in range(0, n, MASK_BITS):
        keep = _shr(0xFFFFFFFF, max(base + MASK_BITS - below, 0))
        if above is not None:
            keep &= _shl(0xFFFFFFFF, max(above - base, 0))
        kept += [bool(keep >> i & 1) for i in range(min(MASK_BITS, n - base))]
    return kept


def test_column_patterns():
    assert column_pattern(_wgmma_columns(128)) == (2, 8)
    assert column_pattern(list(range(20))) == (20, 20)
    assert column_pattern([1, 2, 3]) is None                  # does not start at 0
    assert column_pattern([0, 1, 8, 10]) is None               # breaks the pattern
    assert column_pattern([0, 1, object()]) is None            # a runtime coordinate
    assert column_pattern([]) is None


@pytest.mark.parametrize("n_block", [16, 80, 112, 128, 176, 256])
def test_bitmask_keeps_what_the_rule_keeps(n_block):
    cols = _wgmma_columns(n_block)
    pattern = column_pattern(cols)
    span = range(-2 * n_block - 3, 2 * n_block + 4)
    for end in span:
        want = [c < end for c in cols]
        assert _kept(len(cols), pattern, end, None) == want, (n_block, end)
    for first in span[::3]:
        for end in span[::5]:
            want = [first <= c < end for c in cols]
            assert _kept(len(cols), pattern, end, first) == want, (n_block, first, end)


def test_contiguous_rows():
    cols = list(range(40))
    pattern = column_pattern(cols)
    for end in range(-3, 45):
        for first in range(-3, 45, 4):
            assert _kept(40, pattern, end, first) == [first <= c < end for c in cols]
