"""The block walk of the backward (fa4lab.backward_blocks) against the float64 reference backward:
every mask, GQA, tails, rows that see no key; the step's own identities; the order of dQ's
float32 additions."""

from __future__ import annotations

import numpy as np
import pytest

from fa4lab.backward_blocks import backward_blockwise, backward_step, block_pairs, row_d
from fa4lab.reference import attention_reference, visible_mask
from fa4lab.reference_backward import attention_backward_reference


def _inputs(rng, batch=2, seqlen_q=13, seqlen_k=11, heads_q=4, heads_kv=2, d=8, dv=5):
    q = rng.standard_normal((batch, seqlen_q, heads_q, d))
    k = rng.standard_normal((batch, seqlen_k, heads_kv, d))
    v = rng.standard_normal((batch, seqlen_k, heads_kv, dv))
    return q, k, v, rng.standard_normal((batch, seqlen_q, heads_q, dv))


# A trimmed grid: each mask once with tails (blocks that do not divide the lengths), GQA always.
@pytest.mark.parametrize("causal,window,block_m,block_n", [
    (False, (None, None), 4, 3),
    (True, (None, None), 4, 3),        # seqlen_q > seqlen_k: rows 0 and 1 see no key
    (False, (3, 1), 5, 2),
    (True, (2, 0), 13, 11),            # one tile
    (False, (None, None), 1, 1),       # one element per tile
])
def test_blockwise_equals_the_reference_backward(causal, window, block_m, block_n):
    rng = np.random.default_rng(10)
    q, k, v, dout = _inputs(rng)
    got = backward_blockwise(q, k, v, dout, causal=causal, window_size=window,
                             block_m=block_m, block_n=block_n, softmax_scale=0.3)
    want = attention_backward_reference(q, k, v, dout, causal=causal, window_size=window,
                                        softmax_scale=0.3)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12, err_msg=name)
        assert np.isfinite(g).all()
    assert got.dsink is None


def test_blockwise_reads_the_forwards_saved_out_and_lse():
    """Given out and lse, the walk uses them (a wrong lse changes the gradients); given the
    right ones, it matches."""
    rng = np.random.default_rng(11)
    q, k, v, dout = _inputs(rng, batch=1)
    out, lse = attention_reference(q, k, v, causal=True, return_lse=True)
    want = attention_backward_reference(q, k, v, dout, causal=True)
    got = backward_blockwise(q, k, v, dout, out, lse, causal=True, block_m=4, block_n=4)
    np.testing.assert_allclose(got.dq, want.dq, rtol=1e-10, atol=1e-12)
    off = backward_blockwise(q, k, v, dout, out, lse + 0.5, causal=True, block_m=4, block_n=4)
    assert not np.allclose(off.dv, want.dv)


def test_float32_dq_depends_on_the_order_of_key_blocks():
    """Note [dQ's order of additions]: float32 partials added in two orders differ in their last
    bits, and both stay within float32 rounding of the float64 answer; float64 walks agree."""
    rng = np.random.default_rng(12)
    q, k, v, dout = _inputs(rng, batch=1, seqlen_q=16, seqlen_k=32, heads_q=2, heads_kv=2)
    kw = dict(block_m=8, block_n=4)
    exact = backward_blockwise(q, k, v, dout, **kw).dq
    forward = backward_blockwise(q, k, v, dout, dq_dtype=np.float32, **kw).dq
    backward = backward_blockwise(q, k, v, dout, dq_dtype=np.float32, key_order=range(7, -1, -1),
                                  **kw).dq
    assert (forward != backward).any()
    for dq in (forward, backward):
        np.testing.assert_allclose(dq, exact, rtol=0, atol=1e-5 * np.abs(exact).max())
    reordered = backward_blockwise(q, k, v, dout, key_order=[3, 1, 0, 2, 7, 6, 5, 4], **kw).dq
    np.testing.assert_allclose(reordered, exact, rtol=1e-13, atol=1e-15)


def test_key_order_must_visit_every_key_block_once():
    rng = np.random.default_rng(13)
    q, k, v, dout = _inputs(rng, batch=1)
    with pytest.raises(ValueError, match="each of the 4 key blocks once"):
        backward_blockwise(q, k, v, dout, block_m=4, block_n=3, key_order=[0, 1, 2, 2])


def test_a_step_over_every_key_of_its_rows_has_rows_of_ds_summing_to_zero():
    """With all of a row's keys in one tile, sum_j dS_ij = sum_j P_ij dP_ij - D_i sum_j P_ij
    = D_i - D_i = 0 (Note [the FlashAttention backward]): dQ's rows are then dS K with no
    component along the keys' mean, and dK's rows sum to zero."""
    rng = np.random.default_rng(14)
    q, k, v, dout = (rng.standard_normal(s) for s in ((6, 4), (9, 4), (9, 3), (6, 3)))
    out, lse = attention_reference(q[None, :, None], k[None, :, None], v[None, :, None],
                                   return_lse=True)
    d_row = row_d(dout, out[0, :, 0])
    _, dk, dv = backward_step(q, k, v, dout, lse[0, 0], d_row, 0.5, np.ones((6, 9), bool))
    np.testing.assert_allclose(dk.sum(axis=0), 0.0, atol=1e-12)
    # dV's column sums are dO's: every row's P sums to one
    np.testing.assert_allclose(dv.sum(axis=0), dout.sum(axis=0), rtol=1e-12)


def test_step_gives_rows_that_see_no_key_zero_gradients_without_warnings():
    rng = np.random.default_rng(15)
    q, k, v, dout = (rng.standard_normal(s) for s in ((3, 4), (2, 4), (2, 3), (3, 3)))
    lse = np.array([-np.inf, 0.3, -np.inf])
    visible = np.array([[False, False], [True, False], [False, False]])
    with np.errstate(all="raise"):
        dq, dk, dv = backward_step(q, k, v, dout, lse, np.ones(3), 0.5, visible)
    assert np.all(dq[[0, 2]] == 0) and np.isfinite(dk).all() and np.isfinite(dv).all()
    assert np.allclose(dv, np.exp(0.5 * q[1] @ k[0] - 0.3) * np.outer([1, 0], dout[1]))


def test_block_pairs_skips_tiles_nothing_sees():
    """Causal bottom-right, 8 x 8 in 4 x 4 tiles: key block 1 is hidden from query block 0."""
    pairs = block_pairs(visible_mask(8, 8, True), 4, 4)
    assert pairs == [(0, [0, 1]), (1, [1])]
    assert block_pairs(visible_mask(8, 8, False), 4, 4) == [(0, [0, 1]), (1, [0, 1])]
