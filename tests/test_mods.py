"""score_mod / mask_mod (`fa4lab.mods`) on the CPU: the ready-made mods through the float64
reference against formulas written out here, the order of the score transforms, the functions
that dispatch on their arguments' type, the launch-cache identity of a mod, and the checks that
run before anything does. Compiling a mod into the kernels: the `compile` tests at the end
(and the compile matrices, tests/test_sm90_compile.py and tests/test_compile_sm100.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fa4lab import mods
from fa4lab.mods import ModCompileError
from fa4lab.reference import attention_reference, visible_mask


def _inputs(rng, b=2, sq=9, sk=13, hq=4, hkv=2, d=8, q_scale=1.0):
    q = torch.from_numpy(rng.standard_normal((b, sq, hq, d)) * q_scale)
    k = torch.from_numpy(rng.standard_normal((b, sk, hkv, d)))
    v = torch.from_numpy(rng.standard_normal((b, sk, hkv, d)))
    return q, k, v


def _by_hand(q, k, v, *, causal=False, bias=None, visible=None, softcap=0.0):
    """softmax(cap(scale * q k^T) + bias, masked) v in float64, GQA by repeat_interleave:
    bias (b, h, sq, sk) or None, visible (b, h, sq, sk) bool or None. Rows with no visible key
    give 0 and lse -inf."""
    g = q.shape[2] // k.shape[2]
    kk, vv = (x.double().repeat_interleave(g, dim=2) for x in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), kk) / math.sqrt(q.shape[-1])
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    allowed = torch.from_numpy(visible_mask(q.shape[1], k.shape[1], causal))
    if visible is not None:
        allowed = allowed & visible
    s = s.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, vv), lse


def _grid(b, h, sq, sk):
    """int64 index grids (b, h, sq, sk) of the batch, head, query and key indices."""
    return torch.meshgrid(torch.arange(b), torch.arange(h), torch.arange(sq), torch.arange(sk),
                          indexing="ij")


def _assert_close(got, want):
    out, lse = got
    ref_out, ref_lse = want
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], rtol=1e-10, atol=1e-10)


# ---- the ready-made mods against their formulas ----------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk,hq,hkv", [(9, 13, 4, 2), (13, 9, 4, 4), (1, 1, 2, 1),
                                          (1, 17, 6, 3)])
def test_alibi(rng, causal, sq, sk, hq, hkv):
    q, k, v = _inputs(rng, sq=sq, sk=sk, hq=hq, hkv=hkv)
    slopes = torch.from_numpy(rng.uniform(0.01, 1.0, hq)).float()
    score_mod, aux = mods.alibi(slopes)
    got = attention_reference(q, k, v, causal=causal, score_mod=score_mod, aux_tensors=aux,
                              return_lse=True)
    _, h, i, j = _grid(2, hq, sq, sk)
    bias = slopes.double()[h] * (j - i)
    _assert_close(got, _by_hand(q, k, v, causal=causal, bias=bias))


@pytest.mark.parametrize("per_head", [False, True])
def test_relative_bias(rng, per_head):
    sq, sk, hq, radius = 11, 16, 4, 3
    q, k, v = _inputs(rng, sq=sq, sk=sk, hq=hq)
    shape = (hq, 2 * radius + 1) if per_head else (2 * radius + 1,)
    table = torch.from_numpy(rng.standard_normal(shape) * 3).float()
    score_mod, aux = mods.relative_bias(table)
    got = attention_reference(q, k, v, score_mod=score_mod, aux_tensors=aux, return_lse=True)
    _, h, i, j = _grid(2, hq, sq, sk)
    offset = np.clip((j - i).numpy(), -radius, radius) + radius       # saturates past +-R
    t = table.double()
    bias = t[h, offset] if per_head else t[offset]
    _assert_close(got, _by_hand(q, k, v, bias=bias))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("per_batch", [False, True])
def test_document_mask(rng, causal, per_batch):
    b, s = 2, 19
    q, k, v = _inputs(rng, b=b, sq=s, sk=s)
    docs = np.sort(rng.integers(0, 4, (b, s) if per_batch else (s,)), axis=-1)
    doc_ids = torch.from_numpy(docs).int()
    mask_mod, aux = mods.document_mask(doc_ids)
    got = attention_reference(q, k, v, causal=causal, mask_mod=mask_mod, aux_tensors=aux,
                              return_lse=True)
    bi, _, i, j = _grid(b, 4, s, s)
    d = doc_ids.long()
    visible = (d[bi, i] == d[bi, j]) if per_batch else (d[i] == d[j])
    _assert_close(got, _by_hand(q, k, v, causal=causal, visible=visible))


def test_prefix_lm(rng):
    b, s = 3, 17
    q, k, v = _inputs(rng, b=b, sq=s, sk=s)
    prefix = 5
    mask_mod, aux = mods.prefix_lm(prefix)
    assert aux == ()
    got = attention_reference(q, k, v, mask_mod=mask_mod, return_lse=True)
    _, _, i, j = _grid(b, 4, s, s)
    _assert_close(got, _by_hand(q, k, v, visible=(j < prefix) | (j <= i)))
    # per batch row: lengths read from an aux tensor
    lengths = torch.from_numpy(rng.integers(0, s, b)).int()
    mask_mod, aux = mods.prefix_lm(lengths)
    got = attention_reference(q, k, v, mask_mod=mask_mod, aux_tensors=aux, return_lse=True)
    bi, _, i, j = _grid(b, 4, s, s)
    _assert_close(got, _by_hand(q, k, v, visible=(j < lengths.long()[bi]) | (j <= i)))


def test_two_mods_share_aux_by_index(rng):
    q, k, v = _inputs(rng, sq=12, sk=12)
    slopes = torch.from_numpy(rng.uniform(0.1, 1.0, 4)).float()
    doc_ids = torch.from_numpy(np.sort(rng.integers(0, 3, 12))).int()
    score_mod, aux1 = mods.alibi(slopes)
    mask_mod, aux2 = mods.document_mask(doc_ids, aux_index=1)
    got = attention_reference(q, k, v, causal=True, score_mod=score_mod, mask_mod=mask_mod,
                              aux_tensors=aux1 + aux2, return_lse=True)
    _, h, i, j = _grid(2, 4, 12, 12)
    d = doc_ids.long()
    want = _by_hand(q, k, v, causal=True, bias=slopes.double()[h] * (j - i),
                    visible=d[i] == d[j])
    _assert_close(got, want)


# ---- semantics: order, masks, empty rows, extreme scores -------------------------------------

def test_score_mod_sees_the_scaled_capped_score(rng):
    """Note [order of score transforms]: scale, softcap, score_mod, then masks."""
    q, k, v = _inputs(rng, q_scale=8.0)
    cap = 5.0

    def square(score, b, h, q_idx, kv_idx):
        return score * score / cap - 1.0

    got = attention_reference(q, k, v, causal=True, softcap=cap, score_mod=square,
                              return_lse=True)
    g = 2
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(g, 2)) / math.sqrt(8)
    s = cap * torch.tanh(s / cap)
    bias = s * s / cap - 1.0 - s      # score_mod(s) - s: the bias _by_hand adds to s
    _assert_close(got, _by_hand(q, k, v, causal=True, softcap=cap, bias=bias))


def test_mask_mod_leaves_rows_without_keys(rng):
    """A mask_mod ANDed with causal: rows with no visible key give O = 0 and lse -inf."""
    q, k, v = _inputs(rng, sq=10, sk=10)

    def late_queries_only(b, h, q_idx, kv_idx):
        return (q_idx >= 6) & (h != 1)

    out, lse = attention_reference(q, k, v, causal=True, mask_mod=late_queries_only,
                                   return_lse=True)
    assert torch.isneginf(lse[:, :, :6]).all() and torch.isneginf(lse[:, 1]).all()
    assert (out[:, :6] == 0).all() and (out[:, :, 1] == 0).all()
    _, h, i, j = _grid(2, 4, 10, 10)
    _assert_close((out, lse), _by_hand(q, k, v, causal=True, visible=(i >= 6) & (h != 1)))


def test_extreme_scores_stay_finite(rng):
    """Logits ~1e4 with a bias of the same size: one-hot rows, no NaN, exact against the
    formula."""
    q, k, v = _inputs(rng, q_scale=3e3)
    slopes = torch.full((4,), 500.0)
    score_mod, aux = mods.alibi(slopes)
    out, lse = attention_reference(q, k, v, score_mod=score_mod, aux_tensors=aux,
                                   return_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    _, h, i, j = _grid(2, 4, 9, 13)
    _assert_close((out, lse), _by_hand(q, k, v, bias=500.0 * (j - i).double()))


def test_dispatching_functions_in_a_mod(rng):
    """where / minimum / maximum / abs / tanh / exp2 / log2 inside a mod, against torch."""
    q, k, v = _inputs(rng)

    def mixed(score, b, h, q_idx, kv_idx):
        d = mods.abs(kv_idx - q_idx)
        near = mods.where(d < 3, mods.tanh(score), score)
        return near + mods.log2(mods.exp2(mods.minimum(mods.maximum(d, 1), 4) * 1.0))

    got = attention_reference(q, k, v, score_mod=mixed, return_lse=True)
    g = 2
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(g, 2)) / math.sqrt(8)
    _, _, i, j = _grid(2, 4, 9, 13)
    d = (j - i).abs()
    want_s = torch.where(d < 3, torch.tanh(s), s) + d.clamp(1, 4).double()
    _assert_close(got, _by_hand(q, k, v, bias=want_s - s))


def test_dispatch_on_numpy_and_python():
    a, b = np.array([1.0, -2.0]), np.array([0.5, 3.0])
    np.testing.assert_array_equal(mods.where(a > 0, a, b), [1.0, 3.0])
    np.testing.assert_array_equal(mods.minimum(a, b), [0.5, -2.0])
    np.testing.assert_array_equal(mods.maximum(a, 0.0), [1.0, 0.0])
    assert mods.where(True, 1, 2) == 1 and mods.minimum(3, 2) == 2 and mods.abs(-2) == 2
    assert mods.exp2(3.0) == 8.0 and mods.log2(8.0) == 3.0
    assert mods.tanh(0.5) == pytest.approx(math.tanh(0.5))


def test_numpy_inputs_take_cpu_aux(rng):
    q, k, v = (x.numpy() for x in _inputs(rng))
    score_mod, aux = mods.alibi(torch.full((4,), 0.25))
    out = attention_reference(q, k, v, score_mod=score_mod, aux_tensors=aux)
    assert isinstance(out, np.ndarray) and np.isfinite(out).all()


# ---- the launch cache's identity of a mod ----------------------------------------------------

def _make_mod(offset):
    return lambda score, b, h, q_idx, kv_idx: score + offset


def test_mod_key_follows_code_and_captured_values():
    """Note [mods in the kernels]: a lambda re-created per call keeps its key; a new captured
    value or new code is a new key; an unhashable capture is keyed by identity."""
    assert mods.mod_key(_make_mod(1.0)) == mods.mod_key(_make_mod(1.0))
    assert mods.mod_key(_make_mod(1.0)) != mods.mod_key(_make_mod(2.0))
    assert mods.mod_key(_make_mod(1.0)) != mods.mod_key(lambda s, b, h, q, k: s + 1.0)
    assert mods.mod_key(mods.prefix_lm(4).mod) == mods.mod_key(mods.prefix_lm(4).mod)
    assert mods.mod_key(mods.prefix_lm(4).mod) != mods.mod_key(mods.prefix_lm(5).mod)
    table = torch.zeros(7)
    assert (mods.mod_key(mods.relative_bias(table).mod)
            == mods.mod_key(mods.relative_bias(torch.ones(7)).mod))   # tensors go in aux
    values = [1]
    assert mods.mod_key(_captures(values)) == mods.mod_key(_captures(values))  # same object
    assert mods.mod_key(_captures([1])) != mods.mod_key(_captures([1]))
    assert mods.mod_key(None) is None


def _captures(values):
    return lambda s, b, h, q, k: s + values[0]


def test_kernel_mods_key_and_aux_signature():
    slopes = torch.ones(4)
    score_mod, aux = mods.alibi(slopes)
    km, aux2 = mods.check_mods(score_mod, None, aux, torch.device("cpu"))
    assert aux2 == aux and km.aux_signature == (("float32", 1),)
    assert km.score_takes_aux and not km.mask_takes_aux and bool(km)
    km2, _ = mods.check_mods(mods.alibi(torch.zeros(8)).mod, None, (torch.zeros(8),), "cpu")
    assert km2.key == km.key
    none, _ = mods.check_mods(None, None, None, "cpu")
    assert not none


# ---- checks before anything runs -------------------------------------------------------------

def _call(rng, **kwargs):
    q, k, v = _inputs(rng)
    return attention_reference(q, k, v, **kwargs)


def test_not_callable_or_wrong_arity(rng):
    with pytest.raises(TypeError, match=r"score_mod must be a callable score_mod\(score, b"):
        _call(rng, score_mod=3.0)
    with pytest.raises(TypeError, match=r"mask_mod .*takes \(b, h, q_idx\).*mask_mod\(b, h"):
        _call(rng, mask_mod=lambda b, h, q_idx: q_idx > 0)
    with pytest.raises(TypeError, match=r"score_mod .*takes .*it must be score_mod"):
        _call(rng, score_mod=lambda s, b, h, qi, ki, aux, extra: s)
    # aux optional; *args accepted
    _call(rng, score_mod=lambda s, b, h, qi, ki: s, mask_mod=lambda *args: args[2] >= 0)


def test_results_of_the_wrong_kind(rng):
    with pytest.raises(TypeError, match=r"score_mod .*returned dtype torch.int32.*floating"):
        _call(rng, score_mod=lambda s, b, h, qi, ki: qi - ki)
    with pytest.raises(TypeError, match=r"mask_mod .*returned dtype torch.float32.*bool"):
        _call(rng, mask_mod=lambda b, h, qi, ki: (qi - ki) * 1.0)
    with pytest.raises(TypeError, match=r"mask_mod .*returned bool, not a tensor"):
        _call(rng, mask_mod=lambda b, h, qi, ki: True)
    table = torch.zeros((4, 5))
    with pytest.raises(ValueError, match=r"returned shape \(1, 1, 2, 1, 5\).*broadcast"):
        _call(rng, mask_mod=lambda b, h, qi, ki, aux: aux[0][qi] > 0, aux_tensors=(table,))


def test_a_mod_that_branches_names_itself(rng):
    def branchy(score, b, h, q_idx, kv_idx):
        if q_idx > kv_idx:
            return score
        return score - 1.0

    with pytest.raises(ModCompileError) as info:
        _call(rng, score_mod=branchy)
    msg = str(info.value)
    assert "test_a_mod_that_branches_names_itself.<locals>.branchy" in msg
    assert f"test_mods.py:{branchy.__code__.co_firstlineno}" in msg
    assert "fa4lab.mods.where" in msg


def test_bad_aux_tensors(rng):
    mod = lambda s, b, h, qi, ki, aux: s + aux[0][h]  # noqa: E731
    with pytest.raises(TypeError, match="aux_tensors must be a tuple or list"):
        _call(rng, score_mod=mod, aux_tensors=torch.ones(4))
    with pytest.raises(TypeError, match=r"aux_tensors\[0\] is a ndarray, not a torch tensor"):
        _call(rng, score_mod=mod, aux_tensors=(np.ones(4),))
    with pytest.raises(TypeError, match=r"aux_tensors\[0\] has dtype torch.float64.*float32"):
        _call(rng, score_mod=mod, aux_tensors=(torch.ones(4, dtype=torch.float64),))
    with pytest.raises(ValueError, match=r"aux_tensors\[0\] is on meta but q is on cpu"):
        _call(rng, score_mod=mod, aux_tensors=(torch.ones(4, device="meta"),))
    with pytest.raises(ValueError, match="without a score_mod or mask_mod"):
        _call(rng, aux_tensors=(torch.ones(4),))
    with pytest.raises(ModCompileError, match="IndexError"):
        _call(rng, score_mod=mod)                       # reads aux[0], none given


def test_ready_made_mods_check_their_tensors():
    with pytest.raises(TypeError, match="slopes has dtype torch.float64"):
        mods.alibi(torch.ones(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="odd number of offsets"):
        mods.relative_bias(torch.ones(4))
    with pytest.raises(TypeError, match="doc_ids has dtype torch.int64"):
        mods.document_mask(torch.zeros(8, dtype=torch.int64))
    with pytest.raises(ValueError, match="prefix_len must be >= 0"):
        mods.prefix_lm(-1)


# ---- compiling a mod into the kernels (CPU, sm_90a / sm_100a) --------------------------------

def _clamped(score, b, h, q_idx, kv_idx):
    return score.clamp(min=-5.0)          # a tensor method: fine in torch, not in the kernel


@pytest.mark.compile
def test_a_mod_that_cannot_compile_names_itself(tmp_path):
    pytest.importorskip("cutlass")
    from fa4lab.kernels import compile_forward
    from fa4lab.spec import AttentionSpec

    km = mods.kernel_mods(_clamped, None, ())
    spec = AttentionSpec(1, 256, 256, 2, 2, 64)
    with pytest.raises(ModCompileError) as info:
        compile_forward(spec, arch="sm90a", keep_dir=tmp_path, mods=km)
    msg = str(info.value)
    assert "score_mod _clamped" in msg and f"test_mods.py:{_clamped.__code__.co_firstlineno}" \
        in msg
    assert "cannot be compiled into the kernel: AttributeError" in msg


def test_attention_with_mods_breaks_torch_compile_graphs(rng):
    """Note [mods in the kernels]: a call with mods skips the custom op; torch.compile runs it
    between graphs, and fullgraph=True refuses it."""
    import warnings

    import fa4lab
    from fa4lab.api import SlowReferenceWarning

    q, k, v = (x.float() for x in _inputs(rng))
    score_mod, aux = mods.alibi(torch.full((4,), 0.5))
    want = attention_reference(q, k, v, causal=True, score_mod=score_mod, aux_tensors=aux)

    def block(q, k, v):
        return 2 * fa4lab.attention(q, k, v, causal=True, score_mod=score_mod, aux_tensors=aux)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowReferenceWarning)
        torch.testing.assert_close(block(q, k, v).double(), 2 * want, rtol=1e-5, atol=1e-5)
        compiled = torch.compile(block, backend="eager")
        torch.testing.assert_close(compiled(q, k, v).double(), 2 * want, rtol=1e-5, atol=1e-5)
        torch._dynamo.reset()         # a fresh compile of `block`, not the cached one
        with pytest.raises(torch._dynamo.exc.Unsupported):
            torch.compile(block, backend="eager", fullgraph=True)(q, k, v)
