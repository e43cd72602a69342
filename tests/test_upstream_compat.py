"""fa4lab as a drop-in for upstream FA4's forward: calls shaped like `flash_attn_func` /
`flash_attn_varlen_func` calls (their argument names, layouts and return values) that fa4lab
once refused -- empty inputs, head dims the kernels do not build, negative window sides,
strided or unaligned views, `deterministic`, varlen `num_splits` / `pack_gqa`, page sizes the
tuned key blocks do not fit -- answered as upstream answers them.

On the CPU each call is held to an independent float64 softmax written from the math here;
with a Hopper or B200 GPU the same calls run on the kernels and are held to the float64
reference under FA4's rule (`tests/kernel_checks.py`)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

import fa4lab
from fa4lab.api import SlowReferenceWarning

GPU = torch.cuda.is_available() and fa4lab.kernels.launch.device_arch(0) is not None


def _brute(q, k, v, *, causal=False, window_size=(None, None), softmax_scale=None,
           learnable_sink=None):
    """(out, lse) in float64 straight from the definition: bottom-right window, empty rows 0
    and -inf (or the sink), sides read as upstream reads them (both negative = no window)."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    left, right = window_size
    if left is not None and right is not None and left < 0 and right < 0:
        left = right = None
    if causal:
        right = 0
    i = torch.arange(sq)[:, None] + sk - sq
    j = torch.arange(sk)[None, :]
    seen = torch.ones(sq, sk, dtype=torch.bool)
    if left is not None:
        seen &= j >= i - left
    if right is not None:
        seen &= j <= i + right
    kk = k.double().repeat_interleave(hq // hkv, dim=2)
    vv = v.double().repeat_interleave(hq // hkv, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), kk) * scale
    s = s.masked_fill(~seen, -math.inf)
    if learnable_sink is not None:
        sink = learnable_sink.double()[None, :, None, None].expand(b, hq, sq, 1)
        s = torch.cat([s, sink], dim=-1)
    lse = torch.logsumexp(s, dim=-1) if s.shape[-1] else torch.full((b, hq, sq), -math.inf,
                                                                       dtype=torch.float64)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    if learnable_sink is not None:
        p = p[..., :-1]
    out = torch.einsum("bhqk,bkhd->bqhd", p, vv)
    return out, lse


def _call(q, k, v, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowReferenceWarning)
        return fa4lab.attention(q, k, v, return_lse=True, **kw)


def _qkv(b, sq, sk, hq, hkv, d, dv, device="cpu", dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = (lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype))
    return make(b, sq, hq, d), make(b, sk, hkv, d), make(b, sk, hkv, dv)


# The rows of the parity table: what upstream answers and fa4lab refused.
CASES = {
    "seqlen_k 0": dict(shape=(2, 5, 0, 4, 2, 64, 64)),
    "seqlen_q 0": dict(shape=(2, 0, 7, 4, 2, 64, 64)),
    "batch 0": dict(shape=(0, 3, 7, 4, 4, 64, 64)),
    "seqlen_k 0, sink": dict(shape=(1, 3, 0, 4, 1, 64, 64), sink=True),
    "head_dim 8": dict(shape=(2, 37, 53, 4, 2, 8, 8), causal=True),
    "head_dim 16": dict(shape=(1, 64, 64, 2, 1, 16, 16)),
    "head_dim 32": dict(shape=(1, 70, 130, 4, 4, 32, 32), causal=True),
    "head_dim 80": dict(shape=(1, 33, 65, 2, 2, 80, 80)),
    "(144, 64)": dict(shape=(1, 40, 90, 4, 2, 144, 64), causal=True),
    "(160, 96)": dict(shape=(1, 40, 90, 2, 1, 160, 96)),
    "(64, 128)": dict(shape=(1, 40, 90, 2, 2, 64, 128)),
    "window (None, -3)": dict(shape=(2, 50, 80, 4, 2, 64, 64), window=(None, -3)),
    "window (-5, None)": dict(shape=(2, 50, 80, 4, 2, 64, 64), window=(-5, None)),
    "window (9, -2)": dict(shape=(1, 70, 70, 2, 2, 128, 128), window=(9, -2)),
    "window (-2, 6)": dict(shape=(1, 70, 70, 2, 2, 128, 128), window=(-2, 6)),
    "window (-1, -1)": dict(shape=(1, 20, 30, 2, 2, 64, 64), window=(-1, -1)),
    "window (-1, 0): every key hidden": dict(shape=(1, 20, 30, 2, 2, 64, 64), window=(-1, 0)),
    "window (None, -3), sink": dict(shape=(1, 20, 30, 4, 2, 64, 64), window=(None, -3),
                                    sink=True),
}


def _run(name, device, dtype):
    case = CASES[name]
    q, k, v = _qkv(*case["shape"], device=device, dtype=dtype)
    sink = (torch.randn(q.shape[2], generator=torch.Generator().manual_seed(1)).to(device)
            if case.get("sink") else None)
    kw = dict(causal=case.get("causal", False), window_size=case.get("window", (None, None)),
              learnable_sink=sink, deterministic=True)
    return q, k, v, kw


@pytest.mark.parametrize("name", list(CASES))
def test_upstream_calls_on_the_reference(name):
    q, k, v, kw = _run(name, "cpu", torch.float32)
    out, lse = _call(q, k, v, **kw)
    want, want_lse = _brute(q, k, v, **{n: kw[n] for n in ("causal", "window_size",
                                                              "learnable_sink")})
    assert out.shape == (*q.shape[:3], v.shape[3]) and lse.shape == (q.shape[0], q.shape[2],
                                                                     q.shape[1])
    np.testing.assert_allclose(out.double().numpy(), want.numpy(), atol=2e-5)
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    np.testing.assert_allclose(lse[finite].double().numpy(), want_lse[finite].numpy(),
                               atol=2e-5)


def test_negative_sides_hide_rows_as_upstream_reads_them():
    # (None, -r): query i sees keys up to r before its diagonal; the first r rows see nothing
    q, k, v = _qkv(1, 6, 6, 1, 1, 16, 16)
    out, lse = _call(q, k, v, window_size=(None, -2))
    assert torch.isinf(lse[0, 0, :2]).all() and (out[0, :2] == 0).all()
    assert torch.isfinite(lse[0, 0, 2:]).all()
    # FA2's (-1, -1) is no window; causal=True with a negative right side disagrees
    assert torch.equal(_call(q, k, v, window_size=(-1, -1))[0], _call(q, k, v)[0])
    with pytest.raises(ValueError, match="causal=True with window_size"):
        fa4lab.attention(q, k, v, causal=True, window_size=(4, -1))


def test_varlen_takes_upstreams_switches_and_empty_batches():
    g = torch.Generator().manual_seed(3)
    lens_q, lens_k = [3, 0, 5], [4, 2, 6]
    q = torch.randn(sum(lens_q), 4, 64, generator=g)
    k, v = (torch.randn(sum(lens_k), 2, 64, generator=g) for _ in range(2))
    cu_q, cu_k = (torch.tensor(np.cumsum([0] + n), dtype=torch.int32) for n in (lens_q, lens_k))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowReferenceWarning)
        base = fa4lab.attention_varlen(q, k, v, cu_q, cu_k, 5, 6, causal=True)
        tuned = fa4lab.attention_varlen(q, k, v, cu_q, cu_k, 5, 6, causal=True, num_splits=3,
                                        pack_gqa=True, deterministic=True)
        assert torch.equal(base, tuned)
        empty_q = q[:0]
        out, lse = fa4lab.attention_varlen(empty_q, k, v, torch.zeros(4, dtype=torch.int32),
                                           cu_k, 0, 6, return_lse=True)
        assert out.shape == (0, 4, 64) and lse.shape == (4, 0)
        no_k = k[:0]
        out, lse = fa4lab.attention_varlen(q, no_k, v[:0], cu_q,
                                           torch.zeros(4, dtype=torch.int32), 5, 0,
                                           return_lse=True)
        assert (out == 0).all() and torch.isinf(lse).all()
    with pytest.raises(TypeError, match="deterministic must be True or False"):
        fa4lab.attention_varlen(q, k, v, cu_q, cu_k, 5, 6, deterministic="yes")


def test_fake_implementations_give_upstreams_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = torch.empty(2, 0, 4, 80), torch.empty(2, 9, 2, 80), torch.empty(2, 9, 2, 48)
        out, lse = torch.ops.fa4lab.attention_forward(q, k, v, False, None, True, None, 0.0,
                                                      None, -3)
        assert out.shape == (2, 0, 4, 48) and lse.shape == (2, 4, 0)


# ---------------------------------------------------------------------------- on the GPU

gpu = pytest.mark.skipif(not GPU, reason="needs an H100/H200 or B200 GPU (the kernels)")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_upstream_calls_on_the_kernels(name, dtype):
    from kernel_checks import check_kernel

    q, k, v, kw = _run(name, "cuda", dtype)
    if q.numel() == 0 or k.shape[1] == 0:
        out, lse = _call(q, k, v, **kw)
        want, want_lse = _brute(q.cpu(), k.cpu(), v.cpu(), causal=kw["causal"],
                                window_size=kw["window_size"],
                                learnable_sink=None if kw["learnable_sink"] is None
                                else kw["learnable_sink"].cpu())
        assert torch.equal(out.cpu().double(), want) and torch.equal(lse.cpu().double(),
                                                                      want_lse.float().double())
        return
    kw.pop("deterministic")
    check_kernel(fa4lab.attention, q, k, v, **kw)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("layout", ["padded_stride", "unaligned_offset", "transposed_last"])
def test_views_tma_cannot_read_are_copied(layout):
    from kernel_checks import check_kernel

    shape = (1, 65, 4, 64)
    g = torch.Generator(device="cuda").manual_seed(0)
    if layout == "padded_stride":
        q, k, v = (torch.randn(*shape[:-1], 72, device="cuda", generator=g,
                               dtype=torch.bfloat16)[..., :64] for _ in range(3))
    elif layout == "unaligned_offset":
        q, k, v = (torch.randn(math.prod(shape) + 1, device="cuda", generator=g,
                               dtype=torch.bfloat16)[1:].view(shape) for _ in range(3))
    else:
        q, k, v = (torch.randn(1, 65, 64, 4, device="cuda", generator=g,
                               dtype=torch.bfloat16).transpose(2, 3) for _ in range(3))
    check_kernel(fa4lab.attention, q, k, v, causal=True)


def _paged_cache(seed, b, hkv, pages_per_seq, page_size, d, dv, spare):
    """(generator, k cache, v cache, page table, k, v gathered dense) on the GPU: b sequences
    of pages_per_seq scattered pages each, `spare` pages no sequence reads."""
    from fa4lab.varlen import gather_paged

    g = torch.Generator(device="cuda").manual_seed(seed)
    num_pages = b * pages_per_seq + spare
    kc, vc = (torch.randn(num_pages, page_size, hkv, e, device="cuda", generator=g,
                          dtype=torch.bfloat16) for e in (d, dv))
    table = torch.randperm(num_pages, device="cuda", generator=g)[:b * pages_per_seq]
    table = table.view(b, pages_per_seq).to(torch.int32)
    full = [pages_per_seq * page_size] * b
    k, v = (torch.stack(gather_paged(c, table, full)) for c in (kc, vc))
    return g, kc, vc, table, k, v


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("d, dv, page_size", [(256, 256, 64), (256, 256, 128),
                                              (192, 128, 64), (192, 128, 256), (128, 128, 48)])
def test_page_sizes_the_tuned_blocks_do_not_fit(d, dv, page_size):
    """The plan takes a key block the pages fit (`fa4lab.limits.key_block_for_pages`)."""
    from kernel_checks import check_kernel

    b, hq = 2, 4
    g, kc, vc, table, k, v = _paged_cache(0, b, 2, 3, page_size, d, dv, spare=2)
    q = torch.randn(b, 7, hq, d, device="cuda", generator=g, dtype=torch.bfloat16)
    out = fa4lab.attention(q, kc, vc, causal=True, page_table=table)
    check_kernel(lambda *a, **kw: fa4lab.attention(q, kc, vc, page_table=table, **kw),
                 q, k, v, causal=True)
    assert out.shape == (b, 7, hq, dv)


# ------------------------------------------------- upstream's varlen forms and small pages
# Dense q / k with their cu_seqlens None and seqused_q (Note [upstream varlen forms] in
# fa4lab.varlen_forms); page sizes below 16 (Note [paged key blocks]).

def _brute_used(q, k, v, used_q, used_k, **kw):
    """float64 (out, lse) of a dense batch whose sequence b uses used_q[b] query rows and
    used_k[b] keys: each sequence is its own problem on those rows; the unused rows 0 / -inf
    (or the sink)."""
    b, sq, hq, _ = q.shape
    out = torch.zeros(b, sq, hq, v.shape[-1], dtype=torch.float64)
    lse = torch.full((b, hq, sq), -math.inf, dtype=torch.float64)
    sink = kw.get("learnable_sink")
    if sink is not None:
        lse[:] = sink.double()[None, :, None]
    for i in range(b):
        uq, uk = used_q[i], used_k[i]
        if uq == 0:
            continue
        o, s = _brute(q[i:i + 1, :uq], k[i:i + 1, :uk], v[i:i + 1, :uk], **kw)
        out[i, :uq], lse[i, :, :uq] = o[0], s[0]
    return out, lse


def _varlen(*a, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowReferenceWarning)
        return fa4lab.attention_varlen(*a, return_lse=True, **kw)


SEQUSED = [dict(causal=True), dict(window_size=(5, 0), causal=True), dict(),
           dict(causal=True, sink=True)]


def _seqused_case(device, dtype, opts, seed=0):
    q, k, v = _qkv(3, 21, 40, 4, 2, 64, 64, device=device, dtype=dtype, seed=seed)
    used_q, used_k = [21, 0, 9], [33, 40, 17]
    t = (lambda x: torch.tensor(x, dtype=torch.int32, device=device))
    sink = (torch.randn(4, generator=torch.Generator().manual_seed(1)).to(device)
            if opts.get("sink") else None)
    kw = dict(causal=opts.get("causal", False), window_size=opts.get("window_size",
                                                                     (None, None)),
              learnable_sink=sink)
    return q, k, v, t(used_q), t(used_k), used_q, used_k, kw


@pytest.mark.parametrize("opts", SEQUSED, ids=lambda o: "-".join(o) or "full")
def test_seqused_q_on_dense_and_packed_q(opts):
    """Upstream's dense q (cu_seqlens_q None, seqused_q) and the packed form of the same
    batch; dense k with cu_seqlens_k None and seqused_k: out (b, s, h, dv), lse (b, h, s)."""
    q, k, v, sq, sk, used_q, used_k, kw = _seqused_case("cpu", torch.float32, opts)
    want, want_lse = _brute_used(q, k, v, used_q, used_k, **kw)
    out, lse = _varlen(q, k, v, None, None, q.shape[1], k.shape[1], seqused_q=sq,
                       seqused_k=sk, **kw)
    assert out.shape == (*q.shape[:3], v.shape[-1]) and lse.shape == (3, 4, q.shape[1])
    np.testing.assert_allclose(out.double().numpy(), want.numpy(), atol=2e-5)
    assert torch.equal(torch.isfinite(lse), torch.isfinite(want_lse))
    finite = torch.isfinite(want_lse)
    np.testing.assert_allclose(lse[finite].double().numpy(), want_lse[finite].numpy(),
                               atol=2e-5)
    # the same batch packed: cu_seqlens over whole rows, seqused_q picking the used ones
    cu_q = torch.arange(4, dtype=torch.int32) * q.shape[1]
    cu_k = torch.arange(4, dtype=torch.int32) * k.shape[1]
    out_p, lse_p = _varlen(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k,
                           q.shape[1], k.shape[1], seqused_q=sq, seqused_k=sk, **kw)
    assert torch.equal(out_p.view_as(out), out)
    assert torch.equal(lse_p.view(4, 3, -1).transpose(0, 1), lse)


def test_seqused_q_over_a_paged_cache_and_bad_counts():
    """seqused_q with a page table (pages of 4); counts past a sequence's rows are clamped
    (all rows), negative ones read as 0 rows; a wrong dtype or shape raises before launch."""
    q, k, v, _, sk, _, used_k, kw = _seqused_case("cpu", torch.float32, dict(causal=True))
    page, per_seq = 4, 10
    kc = k.reshape(3 * per_seq, page, 2, 64)
    vc = v.reshape(3 * per_seq, page, 2, 64)
    table = torch.arange(3 * per_seq, dtype=torch.int32).view(3, per_seq)
    sq = torch.tensor([99, -3, 9], dtype=torch.int32)
    want, want_lse = _brute_used(q, k, v, [21, 0, 9], used_k, **kw)
    out, lse = _varlen(q, kc, vc, None, None, 21, 40, seqused_q=sq, seqused_k=sk,
                       page_table=table, **kw)
    np.testing.assert_allclose(out.double().numpy(), want.numpy(), atol=2e-5)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    with pytest.raises(TypeError, match="seqused_q must be an int32"):
        _varlen(q, k, v, None, None, 21, 40, seqused_q=sq.long())
    with pytest.raises(ValueError, match=r"seqused_q must be \(batch,\)"):
        _varlen(q, k, v, None, None, 21, 40, seqused_q=sq[:2])


def test_pages_below_16_are_planned():
    """Every divisor of a key block is a page size the kernels read (a gather of that many
    pages per block) and the plan keeps its tuned block."""
    from fa4lab.limits import key_block_for_pages, page_fits

    for n_block in (80, 112, 128, 176):
        for page in (1, 2, 4, 8, 16):
            if n_block % page == 0:
                assert page_fits(page, n_block) and key_block_for_pages(n_block, page) == n_block


SMALL_PAGES = [(64, 64, 1), (128, 128, 1), (128, 128, 4), (96, 96, 8), (256, 256, 4),
               (192, 128, 2), (128, 128, 8), (96, 96, 2), (96, 96, 1), (64, 64, 16),
               (128, 128, 3), (64, 64, 12), (128, 128, 100), (192, 128, 5)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("d, dv, page_size", SMALL_PAGES)
def test_small_pages_on_the_kernels(d, dv, page_size):
    """Pages of 1 to 16, and sizes that straddle key blocks (3, 5, 12, 100), through the
    kernels' gathers (cp.async on sm90: Note [cp.async pages] in fa4lab.limits): a dense paged
    call (prefill over the pages, causal) and the varlen decode batch over the same cache, held
    to FA4's rule against float64; sm100 refuses the sizes its TMA gather cannot read."""
    from kernel_checks import check_kernel, check_sequences

    from fa4lab.errors import PlanError
    from fa4lab.limits import arch_of_capability, min_page, page_fits, page_loader
    from fa4lab.plan import plan_forward
    from fa4lab.reference import attention_varlen_reference
    from fa4lab.spec import AttentionSpec

    b, hq, seqlen = 2, 8, 300
    pages_per_seq = -(-seqlen // page_size)
    full = pages_per_seq * page_size
    g, kc, vc, table, k, v = _paged_cache(page_size + d, b, 2, pages_per_seq, page_size, d, dv,
                                          spare=3)
    q = torch.randn(b, 45, hq, d, device="cuda", generator=g, dtype=torch.bfloat16)
    arch = arch_of_capability(torch.cuda.get_device_capability())
    n_block = plan_forward(AttentionSpec(b, 45, full, hq, 2, d, dv, causal=True,
                                         page_size=page_size), arch).tiles.n_block
    if page_loader(arch, page_size, n_block) == "tma" and not page_fits(
            page_size, n_block, min_page(arch, d, dv)):
        # sm100's TMA gather: a divisor of the block whose SMEM slices start 128-byte aligned
        with pytest.raises(PlanError, match=f"page_size={page_size}"):
            fa4lab.attention(q, kc, vc, page_table=table, causal=True)
        return
    check_kernel(lambda *a, **kw: fa4lab.attention(q, kc, vc, page_table=table, **kw),
                 q, k, v, causal=True)
    # decode: one query per sequence, ragged key counts
    lens_k = [seqlen, 77]
    used = torch.tensor(lens_k, dtype=torch.int32, device="cuda")
    q1 = q[:, :1].reshape(b, hq, d)
    cu_q = torch.arange(b + 1, dtype=torch.int32, device="cuda")
    out, lse = fa4lab.attention_varlen(q1, kc, vc, cu_q, None, 1, full, seqused_k=used,
                                       page_table=table, return_lse=True)
    ref, ref_lse = attention_varlen_reference(q1, kc, vc, cu_q, None, seqused_k=used,
                                              page_table=table, return_lse=True)
    check_sequences(out, lse, ref.to("cuda"), ref_lse.to("cuda"), q1, list(range(b + 1)),
                    lens_k, lambda i: (k[i, :lens_k[i]], v[i, :lens_k[i]]), {},
                    what=f", pages of {page_size}")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("opts", SEQUSED, ids=lambda o: "-".join(o) or "full")
def test_seqused_q_on_the_kernels(opts):
    """Upstream's dense-q seqused_q call on the kernels: the used rows held to FA4's rule
    sequence by sequence against the float64 reference of the same sequences alone, the
    unused rows 0 with LSE -inf (or the sink)."""
    from kernel_checks import check_sequences

    from fa4lab.acceptance import LSE_ATOL, LSE_RTOL
    from fa4lab.reference import attention_varlen_reference

    q, k, v, sq, sk, used_q, used_k, kw = _seqused_case("cuda", torch.bfloat16, opts, seed=4)
    out, lse = fa4lab.attention_varlen(q, k, v, None, None, q.shape[1], k.shape[1],
                                       seqused_q=sq, seqused_k=sk, return_lse=True, **kw)
    rows = [(i, r) for i in range(q.shape[0]) for r in range(used_q[i])]
    pick = torch.tensor([i * q.shape[1] + r for i, r in rows], device="cuda")
    q_used = q.flatten(0, 1)[pick]
    cu_q = [0]
    for n in used_q:
        cu_q.append(cu_q[-1] + n)
    k_used = torch.cat([k[i, :n] for i, n in enumerate(used_k)])
    v_used = torch.cat([v[i, :n] for i, n in enumerate(used_k)])
    cu_k = [0]
    for n in used_k:
        cu_k.append(cu_k[-1] + n)
    t = (lambda x: torch.tensor(x, dtype=torch.int32, device="cuda"))
    ref, ref_lse = attention_varlen_reference(q_used, k_used, v_used, t(cu_q), t(cu_k),
                                              return_lse=True, **kw)
    opts = {n: x for n, x in kw.items() if x is not None}
    check_sequences(out.flatten(0, 1)[pick], lse.transpose(0, 1).flatten(1)[:, pick],
                    ref.to("cuda"), ref_lse.to("cuda"), q_used, cu_q, used_k,
                    lambda b: (k[b, :used_k[b]], v[b, :used_k[b]]), opts, what=", seqused_q")
    unused = torch.ones(q.shape[:2], dtype=torch.bool, device="cuda")
    unused.view(-1)[pick] = False
    assert (out[unused] == 0).all()
    empty_lse = lse.transpose(1, 2)[unused]
    if kw["learnable_sink"] is None:
        assert torch.isneginf(empty_lse).all()
    else:   # the sink's logit, to the LSE tolerance (the kernel works in log2 units)
        torch.testing.assert_close(empty_lse, kw["learnable_sink"].expand_as(empty_lse),
                                   rtol=LSE_RTOL, atol=LSE_ATOL)
