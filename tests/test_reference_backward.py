"""The float64 backward: gradcheck of the reference forward (finite differences), the explicit
backward (`fa4lab.reference_backward`) against torch autograd through the reference, and no NaN
where the gradient is 0 (rows that see no key)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fa4lab.reference as reference
from fa4lab import mods
from fa4lab.reference import attention_reference, attention_varlen_reference
from fa4lab.reference_backward import (
    attention_backward_reference,
    attention_varlen_backward_reference,
    scatter_paged,
)

F64 = torch.float64
I32 = torch.int32


def _leaf(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=F64).requires_grad_()


def _qkv(gen, b=1, sq=4, sk=5, hq=2, hkv=1, d=3, dv=2):
    return _leaf(gen, b, sq, hq, d), _leaf(gen, b, sk, hkv, d), _leaf(gen, b, sk, hkv, dv)


def _finite(lse):
    """lse with its -inf (rows that see no key: a constant) as 0, so a loss may read it."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _autograd(q, k, v, dout, dlse, sink=None, **options):
    """dq, dk, dv (, dsink) of <out, dout> + <lse, dlse> by torch autograd of the reference."""
    out, lse = attention_reference(q, k, v, return_lse=True, learnable_sink=sink, **options)
    loss = (out * dout).sum() + (0 if dlse is None else (_finite(lse) * dlse).sum())
    inputs = (q, k, v) if sink is None else (q, k, v, sink)
    return torch.autograd.grad(loss, inputs)


def _assert_same(explicit, autograd, rtol=1e-10):
    """Each explicit gradient equals autograd's to rtol of the largest entry (atol scaled, so
    extreme logits' large gradients are held to the same relative bar)."""
    for name, e, a in zip(("dq", "dk", "dv", "dsink"), explicit, autograd):
        assert not torch.isnan(e).any(), f"{name} has NaN"
        scale = max(1.0, a.abs().max().item())
        torch.testing.assert_close(e, a, rtol=rtol, atol=rtol * scale,
                                   msg=lambda m, name=name: f"{name}: {m}")


# ---- (a) gradcheck: the reference forward against finite differences ----------------------

GRADCHECK_CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "causal, seqlen_q > seqlen_k (rows that see no key)": dict(causal=True, sq=6, sk=3),
    "causal, seqlen_q < seqlen_k": dict(causal=True, sq=2, sk=5),
    "window": dict(window_size=(1, 1)),
    "window with a negative side": dict(window_size=(2, -1)),
    "softcap": dict(softcap=0.7, softmax_scale=2.0),
    "sink": dict(sink=True),
    "sink on rows that see no key": dict(sink=True, causal=True, sq=5, sk=2),
    "GQA": dict(hq=4, hkv=2),
    "seqlen 1": dict(sq=1, sk=1),
    "alibi score_mod": dict(alibi=True, causal=True),
    "tanh score_mod and a mask_mod": dict(
        score_mod=lambda s, b, h, qi, ki: 2.0 * mods.tanh(s / 2.0),
        mask_mod=lambda b, h, qi, ki: (qi + ki) % 3 != 0),
}


@pytest.mark.parametrize("case", GRADCHECK_CASES)
def test_gradcheck_of_the_reference(gen, case):
    opts = dict(GRADCHECK_CASES[case])
    shape = {n: opts.pop(n) for n in ("sq", "sk", "hq", "hkv") if n in opts}
    q, k, v = _qkv(gen, **shape)
    sink = _leaf(gen, q.shape[2]) if opts.pop("sink", False) else None
    if opts.pop("alibi", False):
        opts["score_mod"], opts["aux_tensors"] = mods.alibi(torch.rand(q.shape[2],
                                                                       generator=gen))
    inputs = (q, k, v) if sink is None else (q, k, v, sink)

    def f(q, k, v, sink=None):
        out, lse = attention_reference(q, k, v, return_lse=True, learnable_sink=sink, **opts)
        return out, _finite(lse)

    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-7)


def test_gradcheck_of_the_varlen_reference(gen):
    """Three sequences: 2 queries over 3 keys, 3 queries over none (out 0, lse the sink), none
    over 2 keys; causal and a sink."""
    cu_q, cu_k = torch.tensor([0, 2, 5, 5], dtype=I32), torch.tensor([0, 3, 3, 5], dtype=I32)
    q, k, v = _leaf(gen, 5, 2, 3), _leaf(gen, 5, 1, 3), _leaf(gen, 5, 1, 2)
    sink = _leaf(gen, 2)

    def f(q, k, v, sink):
        out, lse = attention_varlen_reference(q, k, v, cu_q, cu_k, causal=True,
                                              learnable_sink=sink, return_lse=True)
        return out, _finite(lse)

    assert torch.autograd.gradcheck(f, (q, k, v, sink), eps=1e-6, atol=1e-7)


# ---- (b) the explicit backward equals autograd of the reference ----------------------------

@settings(max_examples=40, deadline=None)
@given(data=st.data(), b=st.integers(1, 2), sq=st.integers(1, 6), sk=st.integers(1, 6),
       ratio=st.sampled_from([1, 2, 3]), hkv=st.integers(1, 2), d=st.integers(1, 5),
       dv=st.integers(1, 4), causal=st.booleans(), sink=st.booleans(), with_dlse=st.booleans(),
       softcap=st.sampled_from([0.0, 0.5, 20.0]),
       scale=st.sampled_from([None, 0.05, 3.0, 40.0]), seed=st.integers(0, 2**31 - 1))
def test_explicit_backward_equals_autograd(data, b, sq, sk, ratio, hkv, d, dv, causal, sink,
                                           with_dlse, softcap, scale, seed):
    """Every option together on fresh random inputs; scale 40 makes logits in the hundreds
    (a softmax of one key per row), where a sloppy P = exp(S - LSE) or D overflows."""
    left = data.draw(st.sampled_from([None, 0, 2, -1]))
    right = data.draw(st.sampled_from([None, 0, 1, -1]))
    if causal:
        right = None
    gen = torch.Generator().manual_seed(seed)
    q, k, v = _qkv(gen, b, sq, sk, hkv * ratio, hkv, d, dv)
    s = None
    if sink:
        s = _leaf(gen, hkv * ratio)
        s.data[0] = -math.inf if data.draw(st.booleans()) else s.data[0]   # a head with none
    opts = dict(causal=causal, window_size=(left, right), softcap=softcap, softmax_scale=scale)
    out, lse = attention_reference(q, k, v, return_lse=True, learnable_sink=s, **opts)
    dout = torch.randn(out.shape, generator=gen, dtype=F64)
    dlse = torch.randn(lse.shape, generator=gen, dtype=F64) if with_dlse else None
    explicit = attention_backward_reference(q, k, v, dout, learnable_sink=s, dlse=dlse, **opts)
    _assert_same(explicit[:3 if s is None else 4], _autograd(q, k, v, dout, dlse, s, **opts))
    # The forward's saved O and LSE in, the same gradients out.
    saved = attention_backward_reference(q, k, v, dout, learnable_sink=s, dlse=dlse, out=out,
                                         lse=lse, **opts)
    for a, e in zip(saved, explicit):
        assert (a is None and e is None) or torch.equal(a, e)


@pytest.mark.parametrize("which", ["alibi", "relative_bias", "tanh", "where"])
def test_score_mod_backward_equals_autograd(gen, which):
    """Note [score_mod backward]: fa4lab.mods' bias mods and user mods that reshape the score."""
    q, k, v = _qkv(gen, b=2, sq=5, sk=6, hq=4, hkv=2, d=4, dv=3)
    opts = dict(causal=True, softcap=5.0)
    if which == "alibi":
        opts["score_mod"], opts["aux_tensors"] = mods.alibi(torch.rand(4, generator=gen))
    elif which == "relative_bias":
        opts["score_mod"], opts["aux_tensors"] = mods.relative_bias(
            torch.randn(4, 5, generator=gen))
    elif which == "tanh":
        opts["score_mod"] = lambda s, b, h, qi, ki: 3.0 * mods.tanh(s * s / 3.0)
    else:
        opts["score_mod"] = lambda s, b, h, qi, ki: mods.where(qi - ki > 1, s * 0.5, s + 1.0)
        opts["mask_mod"] = lambda b, h, qi, ki: (h != 1) | (ki > 0)
    dout = torch.randn(2, 5, 4, 3, generator=gen, dtype=F64)
    dlse = torch.randn(2, 4, 5, generator=gen, dtype=F64)
    _assert_same(attention_backward_reference(q, k, v, dout, dlse=dlse, **opts),
                 _autograd(q, k, v, dout, dlse, **opts))


def test_numpy_in_numpy_out(rng):
    q, k, v = (rng.standard_normal(s) for s in ((1, 3, 2, 4), (1, 5, 1, 4), (1, 5, 1, 4)))
    dout = rng.standard_normal((1, 3, 2, 4))
    g = attention_backward_reference(q, k, v, dout, causal=True)
    assert all(isinstance(x, np.ndarray) and x.dtype == np.float64 for x in g[:3])
    t = attention_backward_reference(*(torch.from_numpy(x) for x in (q, k, v, dout)),
                                     causal=True)
    for a, e in zip(g[:3], t[:3]):
        np.testing.assert_array_equal(a, e.numpy())


def test_chunked_backward_equals_one_chunk(gen, monkeypatch):
    """A score budget smaller than one head's scores makes the backward walk single heads and
    slices of queries, accumulating dK / dV across them (Note [GQA backward])."""
    q, k, v = _qkv(gen, b=2, sq=7, sk=5, hq=4, hkv=2, d=3, dv=3)
    dout = torch.randn(2, 7, 4, 3, generator=gen, dtype=F64)
    opts = dict(causal=True, learnable_sink=torch.randn(4, generator=gen, dtype=F64))
    whole = attention_backward_reference(q, k, v, dout, **opts)
    monkeypatch.setattr(reference, "_SCORE_BUDGET", 10)
    assert len(list(reference.score_chunks(2, 7, 4, 5))) > 8
    for a, e in zip(attention_backward_reference(q, k, v, dout, **opts), whole):
        torch.testing.assert_close(a, e, rtol=1e-13, atol=1e-13)


def test_p_is_read_from_the_saved_lse(gen):
    """The backward recomputes P = exp(S - LSE) from the LSE it is given: a wrong one gives
    wrong gradients (the check above is not vacuous)."""
    q, k, v = _qkv(gen, sq=3, sk=4)
    out, lse = attention_reference(q, k, v, return_lse=True)
    dout = torch.randn(out.shape, generator=gen, dtype=F64)
    right = attention_backward_reference(q, k, v, dout, out=out, lse=lse)
    wrong = attention_backward_reference(q, k, v, dout, out=out, lse=lse + 0.1)
    assert not torch.allclose(right.dv, wrong.dv, rtol=1e-3, atol=0)


def test_sink_gradient_is_minus_sum_of_p_sink_times_d(gen):
    """Note [sink backward] written out: d(sink_h) = -sum over rows of P_sink * D, D =
    rowsum(dO * O), P_sink = exp(sink_h - lse); and autograd agrees."""
    q, k, v = _qkv(gen, b=2, sq=4, sk=3, hq=2, hkv=1)
    sink = _leaf(gen, 2)
    out, lse = attention_reference(q, k, v, learnable_sink=sink, return_lse=True)
    dout = torch.randn(out.shape, generator=gen, dtype=F64)
    d_row = (dout * out).sum(-1).transpose(1, 2)                    # (b, h, sq)
    by_hand = -(torch.exp(sink[None, :, None] - lse) * d_row).sum(dim=(0, 2))
    g = attention_backward_reference(q, k, v, dout, learnable_sink=sink)
    torch.testing.assert_close(g.dsink, by_hand.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g.dsink, _autograd(q, k, v, dout, None, sink)[3],
                               rtol=1e-12, atol=1e-12)


# ---- varlen and paged ----------------------------------------------------------------------

def test_varlen_backward_equals_autograd(gen):
    """Packed sequences with seqused_k, one with no key and one with no query, a window and a
    sink: each sequence's dK / dV lands in its own packed rows."""
    cu_q = torch.tensor([0, 3, 3, 5, 9], dtype=I32)
    cu_k = torch.tensor([0, 4, 6, 6, 11], dtype=I32)
    used = torch.tensor([3, 2, 0, 4], dtype=I32)
    q, k, v = _leaf(gen, 9, 4, 3), _leaf(gen, 11, 2, 3), _leaf(gen, 11, 2, 2)
    sink = _leaf(gen, 4)
    opts = dict(seqused_k=used, causal=True, window_size=(2, None), softcap=2.0,
                learnable_sink=sink)
    out, lse = attention_varlen_reference(q, k, v, cu_q, cu_k, return_lse=True, **opts)
    dout, dlse = torch.randn(out.shape, generator=gen, dtype=F64), torch.randn(
        lse.shape, generator=gen, dtype=F64)
    auto = torch.autograd.grad((out * dout).sum() + (lse * dlse).sum(), (q, k, v, sink))
    explicit = attention_varlen_backward_reference(q, k, v, cu_q, cu_k, dout, dlse=dlse, **opts)
    _assert_same(explicit, auto)
    assert (explicit.dk[3] == 0).all() and (explicit.dk[10] == 0).all()   # keys past used


def test_paged_backward_equals_autograd(gen):
    """A page shared by two sequences sums their gradients; pages no sequence reads get 0."""
    cache_k, cache_v = _leaf(gen, 5, 2, 2, 3), _leaf(gen, 5, 2, 2, 3)
    table = torch.tensor([[1, 3], [3, 0]], dtype=I32)
    used = torch.tensor([4, 3], dtype=I32)
    cu_q = torch.tensor([0, 2, 5], dtype=I32)
    q = _leaf(gen, 5, 2, 3)
    opts = dict(seqused_k=used, page_table=table, causal=True)
    out = attention_varlen_reference(q, cache_k, cache_v, cu_q, None, **opts)
    dout = torch.randn(out.shape, generator=gen, dtype=F64)
    auto = torch.autograd.grad((out * dout).sum(), (q, cache_k, cache_v))
    explicit = attention_varlen_backward_reference(q, cache_k, cache_v, cu_q, None, dout, **opts)
    _assert_same(explicit[:3], auto)
    assert (explicit.dk[2] == 0).all() and (explicit.dk[4] == 0).all()
    assert (explicit.dk[3] != 0).any()


def test_scatter_paged_is_the_adjoint_of_gather_paged(gen):
    """<gather(cache), g> == <cache, scatter(g)> for every cache and g: the definition of the
    adjoint, on a table with a shared page and a clamped (out of range) id."""
    from fa4lab.varlen import gather_paged

    cache = torch.randn(4, 3, 2, 2, generator=gen, dtype=F64)
    table = torch.tensor([[2, 0], [0, 9]], dtype=I32)
    seqlens = [5, 4]
    grads = [torch.randn(n, 2, 2, generator=gen, dtype=F64) for n in seqlens]
    lhs = sum((x * g).sum() for x, g in zip(gather_paged(cache, table, seqlens), grads))
    rhs = (cache * scatter_paged(grads, table, cache.shape)).sum()
    torch.testing.assert_close(lhs, rhs, rtol=1e-13, atol=1e-13)


# ---- (c) no NaN where the math says 0 ------------------------------------------------------

@pytest.mark.parametrize("sink", [False, True])
def test_rows_that_see_no_key_get_zero_gradients(gen, sink):
    """causal with seqlen_q > seqlen_k: the first rows see no key (lse -inf, or the sink). Their
    dq is exactly 0, nothing is NaN; with a sink, those rows' dLSE goes to the sink."""
    q, k, v = _qkv(gen, b=1, sq=6, sk=2, hq=2, hkv=1)
    s = _leaf(gen, 2) if sink else None
    out, lse = attention_reference(q, k, v, causal=True, learnable_sink=s, return_lse=True)
    dout = torch.randn(out.shape, generator=gen, dtype=F64)
    dlse = torch.randn(lse.shape, generator=gen, dtype=F64)
    g = attention_backward_reference(q, k, v, dout, causal=True, learnable_sink=s, dlse=dlse)
    for x in g:
        assert x is None or not torch.isnan(x).any()
    assert (g.dq[:, :4] == 0).all() and (g.dq[:, 4:] != 0).all()
    auto = _autograd(q, k, v, dout, dlse, s, causal=True)
    assert not any(torch.isnan(a).any() for a in auto)
    _assert_same(g[:3 if s is None else 4], auto)
    if sink:    # rows that see no key: lse = sink, so d lse / d sink = 1 there (P_sink = 1)
        only_empty = torch.zeros_like(dlse)
        only_empty[..., :4] = dlse[..., :4]
        g_empty = attention_backward_reference(q, k, v, torch.zeros_like(dout), causal=True,
                                               learnable_sink=s, dlse=only_empty)
        torch.testing.assert_close(g_empty.dsink, dlse[..., :4].sum(dim=(0, 2)),
                                   rtol=1e-13, atol=1e-13)


def test_a_mask_mod_that_hides_every_key_gives_zero_gradients(gen):
    q, k, v = _qkv(gen, sq=3, sk=4)
    dout = torch.randn(1, 3, 2, 2, generator=gen, dtype=F64)
    g = attention_backward_reference(q, k, v, dout, mask_mod=lambda b, h, qi, ki: ki < 0,
                                     dlse=torch.randn(1, 2, 3, generator=gen, dtype=F64))
    for x in g[:3]:
        assert not torch.isnan(x).any() and (x == 0).all()


def test_no_key_at_all(gen):
    """seqlen_k 0 or no query: zero gradients, and the sink gets dLSE (lse is the sink)."""
    q, k, v = _leaf(gen, 1, 3, 2, 4), _leaf(gen, 1, 0, 1, 4), _leaf(gen, 1, 0, 1, 2)
    sink = torch.tensor([0.5, -math.inf], dtype=F64)
    dlse = torch.randn(1, 2, 3, generator=gen, dtype=F64)
    g = attention_backward_reference(q, k, v, torch.randn(1, 3, 2, 2, generator=gen,
                                                          dtype=F64),
                                     learnable_sink=sink, dlse=dlse)
    assert g.dq.shape == q.shape and (g.dq == 0).all() and g.dk.shape == (1, 0, 1, 4)
    torch.testing.assert_close(g.dsink, torch.stack([dlse[0, 0].sum(), torch.tensor(0.0,
                                                                                   dtype=F64)]))


def test_shapes_of_dout_and_dlse_are_checked(gen):
    q, k, v = _qkv(gen)
    with pytest.raises(ValueError, match="dout has shape"):
        attention_backward_reference(q, k, v, torch.zeros(1, 4, 2, 3, dtype=F64))
    with pytest.raises(ValueError, match="dlse has shape"):
        attention_backward_reference(q, k, v, torch.zeros(1, 4, 2, 2, dtype=F64),
                                     dlse=torch.zeros(1, 4, 2, dtype=F64))
