"""Variable-length batches and paged K/V (`fa4lab.varlen`, `attention_varlen_reference`,
`fa4lab.attention_varlen`) against the float64 reference of each sequence on its own.

Every batch is built from per-sequence tensors first and then packed (or paged, token by token
in a Python loop), so the layout code under test never builds its own expectation. Hypothesis
grids are trimmed (<= 4 sequences of <= 9 queries and <= 12 keys, <= 40 examples) to run in
seconds on a 2-core CPU; empty sequences, length 1, seqlen_q > seqlen_k, GQA, causal, windows,
softcap and sinks all fall inside them. The CUDA test (marker `gpu`) holds the per-sequence
kernel path to the acceptance rule of tests/kernel_checks.py.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fa4lab
from fa4lab.api import SlowReferenceWarning
from fa4lab.errors import InputError, InputTypeError
from fa4lab.reference import attention_reference, attention_varlen_reference, visible_mask
from fa4lab.scheduling import CostModel
from fa4lab.tiling import ceil_div
from fa4lab.varlen import check_varlen, gather_paged, pack, pad, unpack
from fa4lab.varlen_tiles import key_block_pages, varlen_tiles

SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])
I32 = torch.int32


def _cu(lengths) -> torch.Tensor:
    return torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=I32)


@st.composite
def options(draw):
    """causal / window / softcap / sink / logit size of one call."""
    causal = draw(st.booleans())
    left = draw(st.sampled_from([None, 0, 3]))
    right = None if causal else draw(st.sampled_from([None, 0, 2]))
    return dict(causal=causal, window_size=(left, right),
                softcap=draw(st.sampled_from([0.0, 5.0])),
                sink=draw(st.booleans()), logit=draw(st.sampled_from([1.0, 1e4])))


@st.composite
def batches(draw):
    batch = draw(st.integers(1, 4))
    hkv = draw(st.integers(1, 2))
    shape = dict(hq=hkv * draw(st.integers(1, 3)), hkv=hkv, d=draw(st.sampled_from([4, 8])),
                 dv=draw(st.sampled_from([3, 8])))
    lens_q = draw(st.lists(st.integers(0, 9), min_size=batch, max_size=batch))
    lens_k = draw(st.lists(st.integers(0, 12), min_size=batch, max_size=batch))
    return shape, lens_q, lens_k, draw(st.integers(0, 2**32 - 1))


def _sequences(rng, shape, lens_q, lens_k, logit=1.0):
    """Per-sequence (q_b, k_b, v_b) float64 tensors; logits of size ~logit."""
    s = math.sqrt(logit)
    def t(n, h, d):
        return torch.from_numpy(rng.standard_normal((n, h, d)))
    return [(t(lq, shape["hq"], shape["d"]) * s, t(lk, shape["hkv"], shape["d"]) * s,
             t(lk, shape["hkv"], shape["dv"])) for lq, lk in zip(lens_q, lens_k)]


def _expected(seqs, used, opts, sink):
    """Each sequence through `attention_reference` on its own, concatenated: (out, lse)."""
    outs, lses = [], []
    for (q_b, k_b, v_b), n in zip(seqs, used):
        lq, hq = q_b.shape[0], q_b.shape[1]
        if lq == 0:
            continue
        if n == 0:     # no key: the contract's empty rows
            outs.append(torch.zeros(lq, hq, v_b.shape[-1], dtype=torch.float64))
            fill = sink[:, None].double().expand(hq, lq) if sink is not None else \
                torch.full((hq, lq), -math.inf, dtype=torch.float64)
            lses.append(fill)
            continue
        o, lse = attention_reference(q_b[None], k_b[None, :n], v_b[None, :n], return_lse=True,
                                     learnable_sink=sink, **opts)
        outs.append(o[0])
        lses.append(lse[0])
    hq, dv = seqs[0][0].shape[1], seqs[0][2].shape[-1]
    if not outs:
        return torch.zeros(0, hq, dv, dtype=torch.float64), torch.zeros(hq, 0,
                                                                         dtype=torch.float64)
    return torch.cat(outs), torch.cat(lses, dim=1)


def _assert_same(out, lse, ref, ref_lse, tol=1e-9):
    assert out.shape == ref.shape and lse.shape == ref_lse.shape
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=tol, rtol=tol)


def _call_opts(opts):
    return dict(causal=opts["causal"], window_size=opts["window_size"], softcap=opts["softcap"])


def _sink(opts, hq, rng):
    if not opts["sink"]:
        return None
    sink = torch.from_numpy(rng.standard_normal(hq)).float() * 3
    sink[0] = -math.inf        # no sink on head 0
    return sink


# --------------------------------------------------------------------------- the reference


@SETTINGS
@given(batches(), options(), st.booleans())
def test_packed_reference_matches_each_sequence(problem, opts, use_seqused):
    shape, lens_q, lens_k, seed = problem
    rng = np.random.default_rng(seed)
    seqs = _sequences(rng, shape, lens_q, lens_k, opts["logit"])
    q, cu_q = pack([s[0] for s in seqs])
    k, cu_k = pack([s[1] for s in seqs])
    v, _ = pack([s[2] for s in seqs])
    used = [int(rng.integers(0, n + 1)) for n in lens_k] if use_seqused else lens_k
    seqused = torch.tensor(used, dtype=I32) if use_seqused else None
    sink = _sink(opts, shape["hq"], rng)
    out, lse = attention_varlen_reference(q, k, v, cu_q, cu_k, seqused_k=seqused,
                                          learnable_sink=sink, return_lse=True,
                                          **_call_opts(opts))
    ref, ref_lse = _expected(seqs, used, _call_opts(opts), sink)
    _assert_same(out, lse, ref, ref_lse)


def _paged(rng, seqs, page_size, shared_page: bool):
    """A paged cache holding each sequence's K/V in shuffled pages (plus unused garbage pages),
    its page table, and with `shared_page` one sequence whose two slots name the same page
    (its expected keys then repeat that page's tokens). Returns (k_cache, v_cache, table,
    per-sequence (k_b, v_b) the table really describes)."""
    hkv, d, dv = seqs[0][1].shape[1], seqs[0][1].shape[2], seqs[0][2].shape[2]
    slots = [ceil_div(s[1].shape[0], page_size) for s in seqs]
    width = max(max(slots), 2)
    num_pages = sum(slots) + 3
    order = rng.permutation(num_pages)
    k_cache = torch.from_numpy(rng.standard_normal((num_pages, page_size, hkv, d)))
    v_cache = torch.from_numpy(rng.standard_normal((num_pages, page_size, hkv, dv)))
    table = torch.full((len(seqs), width), -1, dtype=I32)     # unused slots: garbage
    nxt = 0
    for b, (_, k_b, v_b) in enumerate(seqs):
        for slot in range(slots[b]):
            page = int(order[nxt])
            nxt += 1
            table[b, slot] = page
            t0, t1 = slot * page_size, min((slot + 1) * page_size, k_b.shape[0])
            k_cache[page, :t1 - t0] = k_b[t0:t1]
            v_cache[page, :t1 - t0] = v_b[t0:t1]
    if shared_page:
        b = int(np.argmax(slots))
        if slots[b] >= 2:
            table[b, 1] = table[b, 0]
    described = []
    for b, (_, k_b, _) in enumerate(seqs):
        n = k_b.shape[0]
        keys = [k_cache[int(table[b, t // page_size]), t % page_size] for t in range(n)]
        vals = [v_cache[int(table[b, t // page_size]), t % page_size] for t in range(n)]
        described.append((torch.stack(keys) if n else k_b, torch.stack(vals) if n else
                          seqs[b][2]))
    return k_cache, v_cache, table, described


@SETTINGS
@given(batches(), options(), st.sampled_from([1, 3, 4]), st.booleans())
def test_paged_reference_matches_each_sequence(problem, opts, page_size, shared_page):
    shape, lens_q, lens_k, seed = problem
    rng = np.random.default_rng(seed)
    seqs = _sequences(rng, shape, lens_q, lens_k, opts["logit"])
    q, cu_q = pack([s[0] for s in seqs])
    k_cache, v_cache, table, described = _paged(rng, seqs, page_size, shared_page)
    used = [int(rng.integers(0, n + 1)) for n in lens_k]
    sink = _sink(opts, shape["hq"], rng)
    out, lse = attention_varlen_reference(q, k_cache, v_cache, cu_q, None,
                                          seqused_k=torch.tensor(used, dtype=I32),
                                          page_table=table, learnable_sink=sink,
                                          return_lse=True, **_call_opts(opts))
    expect_seqs = [(s[0], kb, vb) for s, (kb, vb) in zip(seqs, described)]
    ref, ref_lse = _expected(expect_seqs, used, _call_opts(opts), sink)
    _assert_same(out, lse, ref, ref_lse)


def test_gather_paged_follows_the_table_token_by_token(rng):
    seqs = _sequences(rng, dict(hq=2, hkv=2, d=4, dv=4), [1, 1, 1], [5, 0, 9])
    k_cache, _, table, described = _paged(rng, seqs, 2, shared_page=True)
    got = gather_paged(k_cache, table, [5, 0, 9])
    for b, (kb, _) in enumerate(described):
        assert torch.equal(got[b], kb[:got[b].shape[0]]), f"sequence {b}"
    assert [g.shape[0] for g in got] == [5, 0, 9]


def test_pack_unpack_pad_round_trip(rng):
    seqs = [torch.from_numpy(rng.standard_normal((n, 3))) for n in (4, 0, 1, 7)]
    packed, cu = pack(seqs)
    assert cu.dtype == I32 and cu.tolist() == [0, 4, 4, 5, 12]
    for a, b in zip(unpack(packed, cu), seqs):
        assert torch.equal(a, b)
    padded = pad(packed, cu, 8)
    assert padded.shape == (4, 8, 3)
    for b, s in enumerate(seqs):
        assert torch.equal(padded[b, :len(s)], s) and (padded[b, len(s):] == 0).all()


# --------------------------------------------------------------------------- the API on CPU


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("paged", [False, True])
def test_attention_varlen_on_cpu_is_the_reference(rng, dtype, paged):
    shape = dict(hq=4, hkv=2, d=8, dv=8)
    lens_q, lens_k = [5, 0, 1, 7], [3, 4, 0, 12]
    seqs = _sequences(rng, shape, lens_q, lens_k)
    q, cu_q = pack([s[0].to(dtype) for s in seqs])
    if paged:
        k, v, table, _ = _paged(rng, seqs, 4, shared_page=False)
        k, v, cu_k, extra = k.to(dtype), v.to(dtype), None, dict(
            page_table=table, seqused_k=torch.tensor(lens_k, dtype=I32))
    else:
        k, cu_k = pack([s[1].to(dtype) for s in seqs])
        v, _ = pack([s[2].to(dtype) for s in seqs])
        extra = {}
    sink = torch.tensor([0.5, -1.0, 2.0, -math.inf])
    opts = dict(causal=True, window_size=(4, None), softcap=3.0, learnable_sink=sink)
    with pytest.warns(SlowReferenceWarning, match="attention_varlen"):
        out, lse = fa4lab.attention_varlen(q, k, v, cu_q, cu_k, 7, 12, return_lse=True,
                                           **extra, **opts)
    ref, ref_lse = attention_varlen_reference(q, k, v, cu_q, cu_k, return_lse=True, **extra,
                                              **opts)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert torch.equal(out, ref.to(dtype)) and torch.equal(lse, ref_lse.float())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowReferenceWarning)
        assert torch.equal(fa4lab.attention_varlen(q, k, v, cu_q, cu_k, 7, 12, **extra, **opts),
                           out)


def test_attention_varlen_differentiates_cpu_inputs():
    """CPU inputs that require grad get the reference's gradient (tests/
    test_attention_varlen_op.py checks it against the reference); under no_grad nothing is
    recorded."""
    q = torch.randn(3, 2, 8, requires_grad=True)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    cu = torch.tensor([0, 3], dtype=I32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowReferenceWarning)
        (dq,) = torch.autograd.grad(fa4lab.attention_varlen(q, k, v, cu, cu, 3, 3,
                                                            causal=True)[2].sum(), q)
        assert (dq[2] != 0).any() and (dq[:2] == 0).all()     # only row 2 was read
        with torch.no_grad():
            assert not fa4lab.attention_varlen(q, k, v, cu, cu, 3, 3).requires_grad


def test_attention_varlen_checks_the_options_like_attention():
    q, k, v = torch.randn(3, 2, 8), torch.randn(3, 1, 8), torch.randn(3, 1, 8)
    cu = torch.tensor([0, 3], dtype=I32)
    with pytest.raises(ValueError, match="causal=True with window_size"):
        fa4lab.attention_varlen(q, k, v, cu, cu, 3, 3, causal=True, window_size=(1, 2))
    with pytest.raises(ValueError, match="softcap"):
        fa4lab.attention_varlen(q, k, v, cu, cu, 3, 3, softcap=-1.0)
    with pytest.raises(ValueError, match=r"learnable_sink has shape \(3,\)"):
        fa4lab.attention_varlen(q, k, v, cu, cu, 3, 3, learnable_sink=torch.zeros(3))


# --------------------------------------------------------------------------- bad inputs


def _good():
    """A valid packed call (2 sequences: 3 and 2 queries, 4 and 1 keys) and a paged one."""
    q, k, v = torch.randn(5, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 6)
    cache_k, cache_v = torch.randn(6, 4, 2, 8), torch.randn(6, 4, 2, 6)
    return dict(q=q, k=k, v=v, cu_seqlens_q=torch.tensor([0, 3, 5], dtype=I32),
                cu_seqlens_k=torch.tensor([0, 4, 5], dtype=I32), max_seqlen_q=3,
                max_seqlen_k=4), dict(
        q=q, k=cache_k, v=cache_v, cu_seqlens_q=torch.tensor([0, 3, 5], dtype=I32),
        cu_seqlens_k=None, max_seqlen_q=3, max_seqlen_k=8,
        page_table=torch.tensor([[5, 2], [0, -1]], dtype=I32),
        seqused_k=torch.tensor([6, 3], dtype=I32))


BAD = {   # name: (changes, paged?, error, words the message must contain)
    "decreasing": (dict(cu_seqlens_q=torch.tensor([0, 3, 2, 5], dtype=I32),
                        cu_seqlens_k=torch.tensor([0, 1, 4, 5], dtype=I32)), False, InputError,
                   r"cu_seqlens_q decreases at index 2"),
    "not_zero": (dict(cu_seqlens_k=torch.tensor([1, 4, 5], dtype=I32)), False, InputError,
                 r"must start at 0, got cu_seqlens_k\[0\] = 1"),
    "last": (dict(cu_seqlens_q=torch.tensor([0, 3, 4], dtype=I32)), False, InputError,
             r"last entry is 4 but the packed q have 5 tokens"),
    "batches": (dict(cu_seqlens_k=torch.tensor([0, 2, 4, 5], dtype=I32)), False, InputError,
                r"cu_seqlens_k has 4 entries but cu_seqlens_q has 3.*batch \+ 1"),
    "int64": (dict(cu_seqlens_q=torch.tensor([0, 3, 5])), False, InputTypeError,
              r"torch.int64.*cu_seqlens_q.to\(torch.int32\)"),
    "device": (dict(cu_seqlens_k=torch.tensor([0, 4, 5], dtype=I32, device="meta")), False,
               InputError, r"cu_seqlens_k is on meta but q is on cpu.*\.to\(q.device\)"),
    "v_device": (dict(v=torch.randn(5, 2, 6, device="meta")), False, InputError,
                 r"v is on meta but q is on cpu"),
    "max_q": (dict(max_seqlen_q=2), False, InputError,
              r"max_seqlen_q=2 is smaller than sequence 0's query length 3"),
    "max_k": (dict(max_seqlen_k=3), False, InputError,
              r"max_seqlen_k=3 is smaller than sequence 0's key length 4"),
    "seqused": (dict(seqused_k=torch.tensor([4, 2], dtype=I32)), False, InputError,
                r"seqused_k\[1\] = 2 but cu_seqlens_k gives it 1 keys"),
    "kv_mismatch": (dict(v=torch.randn(4, 2, 6)), False, InputError,
                    r"k \(5, 2, 8\) and v \(4, 2, 6\) disagree on \(total_k, heads_kv\)"),
    "gqa": (dict(k=torch.randn(5, 3, 8), v=torch.randn(5, 3, 6)), False, InputError,
            r"heads_q=4 is not a multiple of heads_kv=3"),
    "page_range": (dict(page_table=torch.tensor([[5, 6], [0, -1]], dtype=I32)), True,
                   InputError, r"page_table\[0, 1\] = 6 is not a page of the cache "
                               r"\(num_pages = 6\)"),
    "page_negative": (dict(seqused_k=torch.tensor([6, 5], dtype=I32)), True, InputError,
                      r"page_table\[1, 1\] = -1 is not a page"),
    "page_int64": (dict(page_table=torch.tensor([[5, 2], [0, 1]])), True, InputTypeError,
                   r"page_table has dtype torch.int64.*page_table.to\(torch.int32\)"),
    "page_rows": (dict(page_table=torch.tensor([[5, 2]], dtype=I32)), True, InputError,
                  r"page_table has 1 rows but cu_seqlens_q describes 2 sequences"),
    "seqused_pages": (dict(seqused_k=torch.tensor([9, 3], dtype=I32)), True, InputError,
                      r"seqused_k\[0\] = 9 but its 2 pages of 4 hold 8 keys"),
    "cache_shape": (dict(v=torch.randn(6, 2, 2, 6)), True, InputError,
                    r"disagree on \(num_pages, page_size, heads_kv\)"),
    "cache_dims": (dict(k=torch.randn(24, 2, 8)), True, InputError,
                   r"k has shape \(24, 2, 8\): expected \(num_pages, page_size, heads_kv"),
    "paged_cu_k": (dict(cu_seqlens_k=torch.tensor([0, 4, 5], dtype=I32)), True, InputError,
                   r"cu_seqlens_k must be None with a page_table.*seqused_k"),
    "q_dims": (dict(q=torch.randn(1, 5, 4, 8)), False, InputError,
               r"q has shape \(1, 5, 4, 8\): expected \(total_q, heads_q, head_dim\)"),
    "dtype": (dict(k=torch.randn(5, 2, 8, dtype=torch.float64)), False, InputTypeError,
              r"q, k, v must share one dtype"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_inputs_raise_before_anything_runs(name):
    changes, paged, error, words = BAD[name]
    args = {**_good()[paged], **changes}
    with pytest.raises(error, match=words):
        check_varlen(**args)
    assert issubclass(error, fa4lab.Fa4labError)
    with pytest.raises(error, match=words):
        fa4lab.attention_varlen(**args)
    if not name.startswith("max_"):       # the reference takes no max_seqlen
        ref_args = {n: a for n, a in args.items() if not n.startswith("max_")}
        with pytest.raises(error, match=words):
            attention_varlen_reference(**ref_args)


@given(st.lists(st.integers(0, 6), min_size=2, max_size=8), st.data())
def test_the_first_decrease_of_cu_seqlens_is_named(steps, data):
    cu = np.cumsum([0, *steps]).tolist()
    i = data.draw(st.integers(1, len(cu) - 1))
    cu[i] = cu[i - 1] - data.draw(st.integers(1, 3))       # a decrease at i (maybe others after)
    first = next(j for j in range(1, len(cu)) if cu[j] < cu[j - 1])
    q = torch.zeros(max(cu[-1], 0), 1, 4)
    cu_t = torch.tensor(cu, dtype=I32)
    with pytest.raises(InputError, match=rf"cu_seqlens_q decreases at index {first} "):
        check_varlen(q, q[:0], q[:0], cu_t, torch.zeros(len(cu), dtype=I32), None, None)


def test_good_inputs_pass_and_unused_slots_may_hold_anything():
    packed, paged = _good()
    lengths = check_varlen(**packed)
    assert lengths.seqlens_q == (3, 2) and lengths.seqlens_k == (4, 1)
    lengths = check_varlen(**paged)      # page_table[1, 1] = -1 is past sequence 1's keys
    assert lengths.seqlens_k == (6, 3) and lengths.page_size == 4
    no_used = {**paged, "seqused_k": None, "page_table": torch.tensor([[5, 2], [0, 1]], dtype=I32)}
    assert check_varlen(**no_used).seqlens_k == (8, 8)


def test_a_batch_of_empty_sequences_has_no_rows(quiet_reference):
    q, k, v = torch.randn(0, 2, 8), torch.randn(4, 1, 8), torch.randn(4, 1, 8)
    cu_q, cu_k = torch.tensor([0, 0, 0], dtype=I32), torch.tensor([0, 4, 4], dtype=I32)
    out, lse = fa4lab.attention_varlen(q, k, v, cu_q, cu_k, 0, 4, causal=True,
                                       return_lse=True)
    assert out.shape == (0, 2, 8) and lse.shape == (2, 0)
    assert varlen_tiles([0, 0], [4, 0], heads=2, m_block_size=4, n_block_size=4).num_tiles == 0


# --------------------------------------------------------------------------- tiles and pages


def _visible_blocks(lq, lk, m, group, m_block, n_block, causal, window):
    """Key blocks the real rows of tile m see, brute force from the element mask."""
    if lk == 0:
        return 0
    rows = range((m * m_block) // group, min(ceil_div((m + 1) * m_block, group), lq))
    mask = visible_mask(lq, lk, causal, window_size=window)[list(rows)]
    return sum(mask[:, n:n + n_block].any() for n in range(0, lk, n_block))


def assert_lpt_by_sequence(batches, costs):
    """Tiles in LPT order by sequence (Note [varlen tiles]): each sequence's tiles together,
    longest first, and the sequences ordered by their longest tile, longest first."""
    batches, costs = np.asarray(batches), np.asarray(costs)
    if len(costs) == 0:
        return
    starts = np.flatnonzero(np.r_[True, batches[1:] != batches[:-1]])
    assert len(set(batches[starts].tolist())) == len(starts), "a sequence's tiles are apart"
    for lo, hi in zip(starts, np.r_[starts[1:], len(costs)]):
        assert np.all(np.diff(costs[lo:hi]) <= 0), "a sequence's tiles are not longest first"
    assert np.all(np.diff(costs[starts]) <= 0), "the sequences are not longest first"

@SETTINGS
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 50)), min_size=1, max_size=5),
       st.sampled_from([4, 8]), st.sampled_from([4, 16]), st.integers(1, 3), st.booleans(),
       st.sampled_from([None, 5]), st.sampled_from([1, 2]), st.integers(0, 6))
def test_varlen_tiles_are_real_and_longest_first(lengths, m_block, n_block, heads, causal,
                                                 left, group, extra_max):
    lens_q, lens_k = [a for a, _ in lengths], [b for _, b in lengths]
    window = (left, None)
    max_q = max(lens_q) + extra_max
    t = varlen_tiles(lens_q, lens_k, heads=heads, m_block_size=m_block, n_block_size=n_block,
                     causal=causal, window_size=window, qhead_per_kvhead=group,
                     max_seqlen_q=max_q)
    want = {(b, h, m) for b, lq in enumerate(lens_q) for h in range(heads)
            for m in range(ceil_div(lq * group, m_block))}
    got = [tuple(r) for r in t.tiles.tolist()]
    assert len(got) == len(set(got)) and set(got) == want, "a padding tile or a missing tile"
    assert t.padded_tiles == len(lens_q) * heads * ceil_div(max_q * group, m_block)
    assert t.padding_tiles == t.padded_tiles - len(want) >= 0
    assert_lpt_by_sequence(t.tiles[:, 0], t.costs)
    overhead = CostModel().tile_overhead
    for (b, _, m), blocks, cost in zip(got, t.key_blocks.tolist(), t.costs.tolist()):
        assert blocks == _visible_blocks(lens_q[b], lens_k[b], m, group, m_block, n_block,
                                         causal, window), (b, m)
        assert blocks + overhead <= cost <= CostModel().masked_block_cost * blocks + overhead


@SETTINGS
@given(st.integers(0, 70), st.sampled_from([1, 3, 4, 16, 64]), st.sampled_from([4, 16, 32]),
       st.booleans(), st.integers(0, 2**32 - 1))
def test_key_block_pages_cover_each_key_once(seqlen_k, page_size, n_block, with_row, seed):
    rng = np.random.default_rng(seed)
    slots = ceil_div(seqlen_k, page_size)
    row = rng.integers(0, 1000, size=slots).tolist() if with_row else None
    blocks = key_block_pages(seqlen_k, page_size, n_block, row)
    assert len(blocks) == ceil_div(seqlen_k, n_block)
    keys = []
    for n, pieces in enumerate(blocks):
        block_keys = [p.slot * page_size + t for p in pieces for t in range(p.first, p.stop)]
        assert block_keys == list(range(n * n_block, min((n + 1) * n_block, seqlen_k)))
        for p in pieces:
            assert 0 <= p.first < p.stop <= page_size
            assert p.page == (row[p.slot] if with_row else p.slot)
        if page_size % n_block == 0:
            assert len(pieces) == 1, "a page holds whole blocks: one piece per block"
        elif n_block % page_size == 0:
            assert len(pieces) == ceil_div(len(block_keys), page_size)
        keys += block_keys
    assert keys == list(range(seqlen_k))


# --------------------------------------------------------------------------- CUDA


def _cuda_batch(seed, paged: bool, dtype=torch.bfloat16):
    rng = np.random.default_rng(seed)
    shape = dict(hq=4, hkv=2, d=128, dv=128)
    lens_q, lens_k = [37, 0, 1, 300, 5], [400, 7, 0, 129, 1]
    seqs = _sequences(rng, shape, lens_q, lens_k)
    q, cu_q = pack([s[0] for s in seqs])
    if paged:
        k, v, table, _ = _paged(rng, seqs, 64, shared_page=True)
        extra = dict(page_table=table.cuda(), seqused_k=torch.tensor(lens_k, dtype=I32).cuda())
        cu_k = None
    else:
        k, cu_k = pack([s[1] for s in seqs])
        v, _ = pack([s[2] for s in seqs])
        cu_k, extra = cu_k.cuda(), {}
    return (q.to(dtype).cuda(), k.to(dtype).cuda(), v.to(dtype).cuda(), cu_q.cuda(), cu_k,
            extra, lens_q)


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("opts", [dict(causal=True), dict(causal=False),
                                  dict(causal=True, window_size=(50, None), softcap=20.0)],
                         ids=["causal", "full", "window_softcap"])
def test_attention_varlen_on_cuda_meets_the_kernel_rule(paged, opts):
    from kernel_checks import check_kernel

    q, k, v, cu_q, cu_k, extra, lens_q = _cuda_batch(7, paged)
    out, lse = fa4lab.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), 512, return_lse=True,
                                       **extra, **opts)
    assert out.dtype == q.dtype and lse.dtype == torch.float32 and out.is_cuda
    ref, ref_lse = attention_varlen_reference(q, k, v, cu_q, cu_k, return_lse=True, **extra,
                                              **opts)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    assert not torch.isnan(out).any()
    # Each non-empty sequence, with keys, against FA4's acceptance rule (its own SDPA error).
    from fa4lab.varlen import check_varlen, sequence_kv

    lengths = check_varlen(q, k, v, cu_q, cu_k, None, None, extra.get("seqused_k"),
                           extra.get("page_table"))
    starts = lengths.cu_seqlens_q
    for b, (k_b, v_b) in enumerate(sequence_kv(lengths, k, v, extra.get("page_table"))):
        rows = slice(starts[b], starts[b + 1])
        if rows.stop == rows.start or k_b.shape[0] == 0:
            assert (out[rows] == 0).all()
            continue

        def one_sequence(q_, k_, v_, *, return_lse, rows=rows, **kw):
            o, lse_ = fa4lab.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), 512,
                                              return_lse=True, **extra, **kw)
            return o[rows][None], lse_[:, rows][None]

        check_kernel(one_sequence, q[rows][None], k_b[None], v_b[None], **opts)


# The rules of BAD that read index values (Note [reading the lengths]); the rest read shapes.
VALUE_RULES = {"decreasing", "not_zero", "last", "max_q", "max_k", "seqused", "page_range",
               "page_negative", "seqused_pages"}


@pytest.mark.parametrize("name", list(BAD))
def test_check_indices_false_skips_exactly_the_value_rules(name):
    changes, paged, error, words = BAD[name]
    args = {**_good()[paged], **changes}
    if name in VALUE_RULES:
        lengths = check_varlen(**args, check_indices=False)     # no value read, no error
        assert lengths.batch == args["cu_seqlens_q"].shape[0] - 1
    else:
        with pytest.raises(error, match=words):
            check_varlen(**args, check_indices=False)


def test_same_query_count_reads_no_value_unless_asked():
    """A decode batch is known from the shapes (max_seqlen_q times the batch is the packed
    total); a ragged batch is not read to find out (Note [reading the lengths]) unless `read`
    says the caller reads the values anyway."""
    from fa4lab.varlen import VarlenLengths

    class Unread:
        shape = (5,)

        def tolist(self):
            raise AssertionError("the lengths were read")

    decode = VarlenLengths(Unread(), None, None, 16, 1, 100)
    assert decode.same_query_count(4) and not decode.same_query_count(0)
    ragged = VarlenLengths(Unread(), None, None, 16, 7, 100)
    assert not ragged.same_query_count(12)
    with pytest.raises(AssertionError, match="read"):
        ragged.same_query_count(12, read=True)
    even = VarlenLengths(torch.tensor([0, 3, 6, 9, 12]), None, None, 16, 7, 100)
    assert even.same_query_count(12, read=True) and not even.same_query_count(12)
