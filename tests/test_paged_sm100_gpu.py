"""Paged K/V caches in the sm100 kernel on a B200 (marker `sm100`), held to the float64
reference on the gathered K/V as tests/test_paged_gpu.py holds the sm90 kernel (its inputs and
check). Grid (trimmed: one compile per (head_dim, page size, mask kind)): a gather of 8, 4 and
2 pages per key block (pages of 16, 32, 64: the load warp's run-time loop over the pieces,
Note [paged key blocks]) and one TMA box per block (128), the last key block partial; the
decode shape with pages of 16.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from test_paged_gpu import _check, paged_inputs  # noqa: E402

pytestmark = pytest.mark.sm100

# (page_size, pages_per_seq): the last key block partial where the pages do not fill it.
PAGINGS = [(16, 9), (32, 5), (64, 7), (128, 3)]


@pytest.mark.parametrize("page_size,pages", PAGINGS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_page_sizes(page_size, pages, causal, head_dim):
    for i, sq in enumerate([1, 300]):
        _check(*paged_inputs(2, sq, pages, page_size, 8, 2, head_dim,
                             seed=100 * page_size + i), causal=causal)


def test_decode_pack_gqa():
    """batch 8, seqlen_q 1, GQA 8 packed, pages of 16: the decode shape at 4096 keys."""
    inputs = paged_inputs(8, 1, 4096 // 16, 16, 64, 8, 128, seed=31)
    _check(*inputs, causal=True, pack_gqa=True)
