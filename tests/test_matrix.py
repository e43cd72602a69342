"""tests/matrix.py: the pairwise sample holds every pair of levels, its shared rows first, the
same rows in every process; FA4LAB_FULL_MATRIX=1 gives the whole product."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import matrix
import pytest
from labserver import ROOT

GRIDS = [
    [(64, 128), (False, True), (1, 4), (False, True), ("bf16", "fp16")],
    [(4, 8), (64, 128), (False, True)],
    [range(5), ("sm90a", "sm100a")],
    [(1, 2, 3), "abc", (None, 0, 1), (True, False)],
    [(16, 32, 64)],
]


@pytest.mark.parametrize("factors", GRIDS, ids=lambda f: "x".join(str(len(x)) for x in f))
def test_every_pair_of_levels_is_in_a_row(factors):
    rows = matrix.pairwise(factors)
    product = list(itertools.product(*factors))
    assert set(rows) <= set(product) and len(set(rows)) == len(rows) <= len(product)
    for (i, a), (j, b) in itertools.combinations(enumerate(factors), 2):
        for x, y in itertools.product(a, b):
            assert any(r[i] == x and r[j] == y for r in rows), (i, x, j, y)
    for i, levels in enumerate(factors):
        assert {r[i] for r in rows} == set(levels)


def test_the_sample_is_smaller_and_keeps_the_shared_rows_first():
    grid = GRIDS[0]
    must = [(128, True, 1, True, "bf16"), (128, False, 4, False, "bf16")]
    rows = matrix.pairwise(grid, must=must)
    assert rows[:2] == must and len(rows) <= 8 < 32
    assert matrix.pairwise(grid, must=must) == rows


def test_full_matrix_is_the_product_and_the_sample_is_the_same_in_every_process():
    grid = [(64, 128), (0, 1), (1, 4), (0, 1), ("bf16", "fp16")]
    must = [(128, 1, 1, 1, "bf16")]
    code = f"import json, matrix; print(json.dumps(matrix.matrix({grid!r}, must={must!r})))"
    out = {}
    for full in ("0", "1"):
        env = {"FA4LAB_FULL_MATRIX": full, "PYTHONHASHSEED": "random", "PATH": ""}
        out[full] = json.loads(subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT / "tests", env=env, capture_output=True,
            text=True, check=True).stdout)
    assert [tuple(r) for r in out["0"]] == matrix.pairwise(grid, must=must)
    assert len(out["1"]) == 32 and tuple(out["1"][0]) == must[0]
    assert sorted(map(tuple, out["1"])) == sorted(itertools.product(*grid))
