"""Paged decode through `fa4lab.attention_varlen` on a Hopper GPU (marker `sm90`).

`attention_varlen(q, k_cache, v_cache, cu_seqlens_q, None, ..., seqused_k=, page_table=)` with
the same query count L in every sequence is ONE launch of the paged kernel (q viewed as
(batch, L, heads_q, d), each sequence's key count its seqused_k). Each sequence is held to
tests/kernel_checks.py's rule against the float64 `attention_varlen_reference`: max error at
most twice the error of PyTorch's own 16-bit attention of that sequence's gathered K/V plus
ATOL; rows that see no key exactly 0 with LSE -inf; LSE to 1e-3 + 1e-5 |lse|; no NaN.

Grid (trimmed; each (page size, mask kind, pack-GQA) is one compile): page sizes 16 (a gather
of pages per key block) and 128 (one TMA box per block); pages in random order with spare
pages; ragged seqused_k: keys ending inside a page, on a page edge, inside the first page, a
sequence with no key (seqused_k 0), one with every page's keys; L = 1 with GQA 8 (the decode
shape the benchmark measures, pack-GQA) and L = 4.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kernel_checks import check_sequences, replays_in_a_cuda_graph  # noqa: E402

pytestmark = pytest.mark.sm90


def decode_inputs(seqused, L, pages_per_seq, page_size, hq, hkv, d, seed, *, spare=5,
                  dtype=torch.bfloat16):
    """Packed q (batch * L, hq, d), a cache of batch * pages_per_seq + spare random pages, a
    page table of the pages in random order, cu_seqlens_q (L per sequence) and seqused_k."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    batch = len(seqused)
    num_pages = batch * pages_per_seq + spare
    q = torch.randn(batch * L, hq, d, device="cuda", generator=g).to(dtype)
    k_cache, v_cache = (torch.randn(num_pages, page_size, hkv, d, device="cuda",
                                    generator=g).to(dtype) for _ in range(2))
    table = torch.randperm(num_pages, device="cuda", generator=g)[
        :batch * pages_per_seq].view(batch, pages_per_seq).to(torch.int32)
    cu_q = (torch.arange(batch + 1, device="cuda") * L).to(torch.int32)
    used = torch.tensor(seqused, dtype=torch.int32, device="cuda")
    return q, k_cache, v_cache, table, cu_q, used


def ragged(batch, pages_per_seq, page_size, seed) -> list[int]:
    """Key counts for `batch` sequences: 0, every key, a page edge, inside the first page, then
    random counts (most ending inside a page)."""
    full = pages_per_seq * page_size
    g = torch.Generator().manual_seed(seed)
    fixed = [0, full, 2 * page_size, page_size // 2 + 1, full - 1]
    rest = torch.randint(1, full + 1, (batch - len(fixed),), generator=g).tolist()
    return (fixed + rest)[:batch]


def _check(q, k_cache, v_cache, table, cu_q, seqused_k, *, causal=False,
           window_size=(None, None), learnable_sink=None, launches=1, pack_gqa=None):
    from fa4lab import attention_varlen
    from fa4lab.kernels import launch
    from fa4lab.reference import attention_varlen_reference
    from fa4lab.varlen import gather_paged

    cq, used = cu_q.tolist(), seqused_k.tolist()
    lens_q = [b - a for a, b in zip(cq, cq[1:])]
    opts = dict(causal=causal, window_size=window_size, learnable_sink=learnable_sink)
    calls = []
    forward = launch.forward

    def counted(*args, **kwargs):
        calls.append(args[0].page_table is not None)      # the call
        return forward(*args, **kwargs)

    launch.forward = counted
    try:
        out, lse = attention_varlen(q, k_cache, v_cache, cu_q, None, max(lens_q), max(used),
                                    seqused_k=seqused_k, page_table=table, return_lse=True,
                                    pack_gqa=pack_gqa, **opts)
    finally:
        launch.forward = forward
    assert calls.count(True) == launches and (launches == 0 or len(calls) == 1), \
        f"expected {launches} paged launch(es) and nothing else, got {calls}"
    ref, ref_lse = attention_varlen_reference(q, k_cache, v_cache, cu_q, None,
                                              seqused_k=seqused_k, page_table=table,
                                              return_lse=True, **opts)
    ks, vs = (gather_paged(c, table, used) for c in (k_cache, v_cache))
    check_sequences(out, lse, ref, ref_lse, q, cq, used, lambda b: (ks[b], vs[b]), opts,
                    what=f", page {k_cache.shape[1]}")


@pytest.mark.parametrize("page_size", [16, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_decode_batch_64(page_size, causal):
    """The benchmark's shape: batch 64, L = 1, hd128, GQA 8 (pack-GQA), ragged seqused_k."""
    pages = 2048 // page_size
    used = ragged(64, pages, page_size, seed=page_size)
    _check(*decode_inputs(used, 1, pages, page_size, 64, 8, 128, seed=61 + page_size),
           causal=causal)


@pytest.mark.parametrize("page_size", [16, 128])
def test_several_queries_per_sequence(page_size):
    """L = 4 (speculative decode): bottom-right causal on each sequence's own key count, a
    window, a learnable sink."""
    pages = 1024 // page_size
    used = ragged(9, pages, page_size, seed=7 + page_size)
    inputs = decode_inputs(used, 4, pages, page_size, 16, 4, 128, seed=71 + page_size)
    _check(*inputs, causal=True)
    _check(*inputs, causal=True, window_size=(200, 0))
    sink = torch.linspace(-3.0, 3.0, 16, device="cuda")
    _check(*inputs, causal=False, learnable_sink=sink)


@pytest.mark.parametrize("pack_gqa", [False, True])
def test_equal_chunks_over_many_tiles(pack_gqa):
    """L = 256 queries in each of 8 sequences, causal, over a cache of 4096 keys per sequence
    with ragged key counts: one launch of several m_blocks in the LPT order, with more (batch,
    head) pairs than its L2 sections hold. Every re-read of a tile's coordinates must take the
    launch's key count, as its first read did (Note [the launch's sizes] in
    fa4lab.kernels.fwd_sm90): a sequence's own count gives another swizzle, and its output
    would land on another tile's rows."""
    from fa4lab.scheduling import l2_swizzle

    pages, page_size = 32, 128
    used = ragged(8, pages, page_size, seed=5)
    bytes_per_key = 2 * (128 + 128)
    swizzles = {l2_swizzle(n, bytes_per_key) for n in (*used, pages * page_size)}
    assert len(swizzles) > 1 and min(swizzles) < 8 * 8, "the case must cross L2 sections"
    _check(*decode_inputs(used, 256, pages, page_size, 32, 8, 128, seed=57), causal=True,
           pack_gqa=pack_gqa)


def test_ragged_query_counts_run_per_sequence():
    """Sequences with different query counts keep the per-sequence path (not one launch)."""
    q, k_cache, v_cache, table, _, used = decode_inputs([40, 300, 0], 2, 3, 128, 8, 2, 128,
                                                        seed=81)
    cu_q = torch.tensor([0, 1, 4, 6], dtype=torch.int32, device="cuda")
    # Per sequence: `fa4lab.attention` on the gathered K/V (no paged launch); the keyless
    # sequence's rows come from the reference.
    _check(q, k_cache, v_cache, table, cu_q, used, causal=True, launches=0)


@pytest.mark.parametrize("page_size", [16, 128])
def test_paged_decode_never_waits_for_the_gpu_and_replays_in_a_cuda_graph(page_size):
    """A decode step reads no index value on the host with check_indices=False (Note [reading
    the lengths] in fa4lab.varlen): it never synchronises, and one captured CUDA graph
    replays new key counts and a new page table, as eager calls compute them."""
    from fa4lab import attention_varlen

    pages = 1024 // page_size
    used = ragged(16, pages, page_size, seed=90 + page_size)
    q, k_cache, v_cache, table, cu_q, seqused = decode_inputs(used, 1, pages, page_size, 32,
                                                              4, 128, seed=91 + page_size)
    used2 = torch.tensor(ragged(16, pages, page_size, seed=92 + page_size)[::-1],
                         dtype=torch.int32, device="cuda")
    table2 = table.flip(0).contiguous()
    _check(q, k_cache, v_cache, table2, cu_q, used2, causal=True)     # eager vs reference
    buf_used, buf_table = seqused.clone(), table.clone()

    def call():
        return attention_varlen(q, k_cache, v_cache, cu_q, None, 1, pages * page_size,
                                seqused_k=buf_used, page_table=buf_table, causal=True,
                                return_lse=True, check_indices=False)

    replays_in_a_cuda_graph(call, (buf_used, buf_table), [(seqused, table), (used2, table2)])
