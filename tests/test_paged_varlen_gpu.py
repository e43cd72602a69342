"""Chunked prefill over a paged cache: ONE varlen launch over the pages (marker `sm90`).

`fa4lab.kernels.launch.forward_varlen(..., page_table=)` runs packed q with ragged query counts
against a paged K/V cache read in place (Note [paged key blocks] in
fa4lab.kernels.device.paged): no cu_seqlens_k, each sequence's keys its seqused_k, the tile
table's padding rows on a phantom sequence past the page table's last row. `attention_varlen`
routes such batches there on the archs of `launch.PAGED_VARLEN_ARCHS`; these tests hold the
launch to tests/kernel_checks.py's rule against the float64 `attention_varlen_reference`,
sequence by sequence, before an arch joins that tuple.

Grid (each (page size, mask kind) is one compile): page sizes 16 (a gather of pages per key
block) and 128 (one TMA box per block); pages in random order with spare pages and one page
read by two sequences; sequences with no query, one query, more queries than keys, no key, a
key count ending inside a page; causal, a window, softcap and a learnable sink.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kernel_checks import check_sequences, replays_in_a_cuda_graph  # noqa: E402

pytestmark = pytest.mark.sm90

# (queries, keys) per sequence: no query, one query, more queries than keys, no key, keys
# ending inside a page, a long chunk.
LENGTHS = [(0, 40), (1, 700), (300, 129), (5, 0), (129, 1000), (640, 2000), (37, 37)]


def chunked_prefill(lengths, page_size, hq=16, hkv=4, d=128, seed=0, spare=3):
    """Packed q, a cache of random pages (in random order, `spare` never read, the last
    sequence's first page shared with the first's), the page table, cu_seqlens_q, seqused_k."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    lens_q, lens_k = [a for a, _ in lengths], [b for _, b in lengths]
    pages_per_seq = max(1, -(-max(lens_k) // page_size))
    batch = len(lengths)
    num_pages = batch * pages_per_seq + spare
    q = torch.randn(sum(lens_q), hq, d, device="cuda", generator=g).to(torch.bfloat16)
    k_cache, v_cache = (torch.randn(num_pages, page_size, hkv, d, device="cuda", generator=g)
                        .to(torch.bfloat16) for _ in range(2))
    table = torch.randperm(num_pages, device="cuda", generator=g)[
        :batch * pages_per_seq].view(batch, pages_per_seq).to(torch.int32)
    table[-1, 0] = table[0, 0]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32,
                        device="cuda")
    used = torch.tensor(lens_k, dtype=torch.int32, device="cuda")
    return q, k_cache, v_cache, table, cu_q, used


def one_launch(q, k_cache, v_cache, table, cu_q, used, *, return_lse=True, check=True, **opts):
    from fa4lab.call import check_call
    from fa4lab.kernels import launch
    from fa4lab.varlen import check_varlen

    lengths = check_varlen(q, k_cache, v_cache, cu_q, None, None, None, used, table,
                           check_indices=check)
    call = check_call(q, k_cache, v_cache, causal=opts.get("causal", False),
                      window_size=opts.get("window_size", (None, None)),
                      softcap=opts.get("softcap", 0.0),
                      learnable_sink=opts.get("learnable_sink"), return_lse=return_lse,
                      page_table=table, lengths=lengths)
    return launch.forward_varlen(call.for_kernel("sm90", pad=False), "sm90")


def _check(inputs, **opts):
    from fa4lab.reference import attention_varlen_reference
    from fa4lab.varlen import gather_paged

    q, k_cache, v_cache, table, cu_q, used = inputs
    (out, lse), (out2, lse2) = one_launch(*inputs, **opts), one_launch(*inputs, **opts)
    assert torch.equal(out, out2) and torch.equal(lse, lse2), "two runs differ"
    ref, ref_lse = attention_varlen_reference(q, k_cache, v_cache, cu_q, None, seqused_k=used,
                                              page_table=table, return_lse=True, **opts)
    lens_k = used.tolist()
    ks, vs = (gather_paged(c, table, lens_k) for c in (k_cache, v_cache))
    full = dict(causal=False, window_size=(None, None), softcap=0.0, learnable_sink=None)
    check_sequences(out, lse, ref, ref_lse, q, cu_q.tolist(), lens_k,
                    lambda b: (ks[b], vs[b]), {**full, **opts},
                    what=f", page {k_cache.shape[1]}")


@pytest.mark.parametrize("page_size", [16, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_chunked_prefill_over_pages(page_size, causal):
    _check(chunked_prefill(LENGTHS, page_size, seed=page_size + causal), causal=causal)


@pytest.mark.parametrize("page_size", [16, 128])
def test_windows_softcap_and_sinks(page_size):
    inputs = chunked_prefill(LENGTHS, page_size, seed=11 + page_size)
    _check(inputs, causal=True, window_size=(200, 0))
    _check(inputs, causal=False, softcap=20.0)
    _check(inputs, causal=True, learnable_sink=torch.linspace(-3.0, 3.0, 16, device="cuda"))


def test_attention_varlen_routes_ragged_paged_batches_to_the_one_launch(monkeypatch):
    """With sm90 in PAGED_VARLEN_ARCHS, attention_varlen gives the one launch's answer bit for
    bit; without, the per-sequence path's (held to the same rule)."""
    from fa4lab import attention_varlen
    from fa4lab.kernels import launch

    q, k_cache, v_cache, table, cu_q, used = inputs = chunked_prefill(LENGTHS, 128, seed=5)
    direct = one_launch(*inputs, causal=True)
    monkeypatch.setattr(launch, "PAGED_VARLEN_ARCHS", ("sm90",))
    routed = attention_varlen(q, k_cache, v_cache, cu_q, None, None, None, seqused_k=used,
                              page_table=table, causal=True, return_lse=True)
    assert torch.equal(routed[0], direct[0]) and torch.equal(routed[1], direct[1])


def test_one_launch_replays_in_a_cuda_graph():
    """No host read of an index value with check_indices=False: one captured graph replays a
    new page table and new key counts as eager calls compute them."""
    q, k_cache, v_cache, table, cu_q, used = chunked_prefill(LENGTHS, 16, seed=21)
    table2 = table.flip(1).contiguous()
    used2 = used.flip(0).clamp(max=table.shape[1] * 16).contiguous()
    buf_table, buf_used = table.clone(), used.clone()

    def call():
        return one_launch(q, k_cache, v_cache, buf_table, cu_q, buf_used, causal=True,
                          check=False)

    replays_in_a_cuda_graph(call, (buf_table, buf_used), [(table, used), (table2, used2)])


@pytest.mark.parametrize("check", [False, "device"])
def test_the_entry_point_never_waits_and_replays_in_a_cuda_graph(check):
    """`attention_varlen` itself, not only the launch: a ragged batch over pages is routed to
    the one launch from the shapes, no length read on the host (`VarlenLengths
    .same_query_count`: Note [reading the lengths] in fa4lab.varlen), so with check_indices
    False or "device" (the default) the call never synchronises and one captured CUDA graph
    replays a new page table and new key counts as eager calls compute them."""
    import functools

    from fa4lab import attention_varlen

    q, k_cache, v_cache, table, cu_q, used = chunked_prefill(LENGTHS, 128, seed=31)
    table2 = table.flip(1).contiguous()
    used2 = used.flip(0).clamp(max=table.shape[1] * 128).contiguous()
    buf_table, buf_used = table.clone(), used.clone()
    call = functools.partial(attention_varlen, q, k_cache, v_cache, cu_q, None,
                             max(a for a, _ in LENGTHS), None, seqused_k=buf_used,
                             page_table=buf_table, causal=True, return_lse=True,
                             check_indices=check)
    replays_in_a_cuda_graph(call, (buf_table, buf_used), [(table, used), (table2, used2)])
