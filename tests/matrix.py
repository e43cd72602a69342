"""Pairwise samples of the tests' configuration grids (FA4LAB_FULL_MATRIX=1: every combination).

A compile grid's cross product repeats itself: a kernel defect that one combination shows
almost always needs at most two of its factors at particular levels (a head dim with causal,
GQA with a dtype), so a covering array of strength 2 (every level of every factor beside every
level of every other factor, in some row) finds what the full product finds at a fraction of
the compiles: 6 rows for five two-level factors instead of 32. `pairwise` picks its rows
greedily from the product in a fixed order, so every run and every machine compiles the same
sample; `matrix` is that sample, or the whole product where FA4LAB_FULL_MATRIX=1 is set (the
run to make after changing a kernel's code paths).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence

FULL_MATRIX = os.environ.get("FA4LAB_FULL_MATRIX") == "1"


def _covers(row: Sequence[int]) -> set[tuple[int, ...]]:
    """What a row of level indices covers: each pair of factors' levels (each factor's level
    where there is one factor)."""
    if len(row) == 1:
        return {(0, row[0])}
    return {(i, a, j, b) for (i, a), (j, b) in itertools.combinations(enumerate(row), 2)}


def pairwise(factors: Sequence[Sequence], must: Sequence[tuple] = ()) -> list[tuple]:
    """Rows of the product of `factors` (each a sequence of levels) that hold every level of
    every factor beside every level of every other factor; the rows of `must` first (rows that
    other tests share), then, while a pair is missing, the product's row (the first in product
    order) that adds the most missing pairs: 4 rows for three two-level factors, 6 for five."""
    product = list(itertools.product(*(range(len(f)) for f in factors)))
    missing = set().union(*map(_covers, product))
    picked = []
    for row in must:
        index = tuple(list(f).index(level) for f, level in zip(factors, row, strict=True))
        picked.append(index)
        missing -= _covers(index)
    while missing:
        best = max(product, key=lambda row: len(_covers(row) & missing))
        picked.append(best)
        missing -= _covers(best)
    return [tuple(f[i] for f, i in zip(factors, row)) for row in picked]


def matrix(factors: Sequence[Sequence], must: Sequence[tuple] = ()) -> list[tuple]:
    """The grid a test runs: `pairwise(factors, must)`, or under FA4LAB_FULL_MATRIX=1 the whole
    product (`must` first, as pairwise orders them)."""
    if not FULL_MATRIX:
        return pairwise(factors, must)
    rest = [row for row in itertools.product(*factors) if row not in [tuple(m) for m in must]]
    return [tuple(m) for m in must] + rest


def repeats(rows: Sequence[tuple]) -> list[tuple]:
    """Rows of a hand-written list that repeat a code path another row compiles (the same
    gather at another page size or head dim): none in a sampled run, all of them under
    FA4LAB_FULL_MATRIX=1."""
    return list(rows) if FULL_MATRIX else []
