"""Paged K/V caches in the sm90 kernel on a Hopper GPU (marker `sm90`).

Each case builds a cache of random pages and a page table, and holds
`fa4lab.attention(q, k_cache, v_cache, page_table=...)` to the acceptance rule of
tests/kernel_checks.py against the float64 reference on the gathered K/V (what the page table
says each sequence's keys are, `fa4lab.varlen.gather_paged`). Grid (trimmed; each (head_dim,
page size, mask kind, pack-GQA) is one compile):
* page sizes 16, 32, 64 (a gather of pages per key block) and 128, 256 (one TMA box per block),
  pages in random order with spare pages, a table that points to one page from several slots
  and sequences, key counts that leave the last key block partial (and, with a gather, clamp
  its slots past the last page);
* causal, a window, softcap, a learnable sink; extreme logits;
* decode: seqlen_q 1 with GQA 8 packed (the shape the paged benchmark measures).
A key count that ends inside a page (seqused_k): tests/test_paged_decode_gpu.py.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kernel_checks import check_kernel, output_ulp_atol  # noqa: E402

pytestmark = pytest.mark.sm90


def paged_inputs(batch, sq, pages_per_seq, page_size, hq, hkv, d, seed, *, spare=3,
                 shared=False, q_scale=1.0, dtype=torch.bfloat16):
    """q (batch, sq, hq, d), a cache of batch * pages_per_seq + spare random pages, a page
    table (pages in random order; with `shared`, slots drawn with repeats, so one page serves
    several slots and sequences) and the dense k, v the table describes."""
    from fa4lab.varlen import gather_paged

    g = torch.Generator(device="cuda").manual_seed(seed)
    num_pages = batch * pages_per_seq + spare
    q = (torch.randn(batch, sq, hq, d, device="cuda", generator=g) * q_scale).to(dtype)
    k_cache, v_cache = (torch.randn(num_pages, page_size, hkv, d, device="cuda",
                                    generator=g).to(dtype) for _ in range(2))
    if shared:
        table = torch.randint(0, num_pages, (batch, pages_per_seq), device="cuda", generator=g)
        table[:, -1] = table[0, 0]          # one page in every sequence, twice in the first
    else:
        table = torch.randperm(num_pages, device="cuda", generator=g)[
            :batch * pages_per_seq].view(batch, pages_per_seq)
    table = table.to(torch.int32)
    seqlens = [pages_per_seq * page_size] * batch
    k, v = (torch.stack(gather_paged(c, table, seqlens)) for c in (k_cache, v_cache))
    return q, k_cache, v_cache, table, k, v


def _check(q, k_cache, v_cache, table, k, v, **checks):
    """check_kernel on the dense k, v, running the kernel on the cache they were gathered from."""
    import fa4lab

    def paged_attention(q, k, v, **options):
        return fa4lab.attention(q, k_cache, v_cache, page_table=table, **options)

    check_kernel(paged_attention, q, k, v, **checks)


# (page_size, pages_per_seq): the last key block partial where the pages do not fill it.
PAGINGS = [(16, 9), (16, 40), (32, 5), (64, 7), (128, 3), (256, 2)]


@pytest.mark.parametrize("page_size,pages", PAGINGS)
@pytest.mark.parametrize("causal", [False, True])
def test_page_sizes(page_size, pages, causal):
    for i, sq in enumerate([1, 77, 300]):
        _check(*paged_inputs(2, sq, pages, page_size, 8, 2, 128, seed=100 * page_size + i),
               causal=causal)


@pytest.mark.parametrize("page_size", [16, 128])
def test_a_page_in_several_slots(page_size):
    _check(*paged_inputs(3, 65, 1024 // page_size, page_size, 8, 8, 128, seed=7, shared=True),
           causal=True)


@pytest.mark.parametrize("page_size", [16, 128])
@pytest.mark.parametrize("head_dim", [64, 256])
def test_head_dims(page_size, head_dim):
    # head_dim 256 with pages of 128: the tuned 80-key block does not fit them, the plan takes
    # 64-key blocks (fa4lab.limits.key_block_for_pages)
    inputs = paged_inputs(2, 200, 1024 // page_size, page_size, 4, 4, head_dim, seed=11)
    _check(*inputs, causal=False)


@pytest.mark.parametrize("page_size", [16, 128])
def test_options(page_size):
    pages = 2048 // page_size
    inputs = paged_inputs(2, 130, pages, page_size, 8, 2, 128, seed=21)
    _check(*inputs, causal=True, window_size=(300, 0))
    _check(*inputs, causal=False, window_size=(100, 40))
    _check(*inputs, causal=False, softcap=30.0)
    sink = torch.tensor([0.5, -2.0, 30.0, -30.0, 1e3, -1e3, -float("inf"), 3.0], device="cuda")
    _check(*inputs, causal=True, learnable_sink=sink)


@pytest.mark.parametrize("page_size", [16, 128])
def test_decode_pack_gqa(page_size):
    """batch 8, seqlen_q 1, GQA 8 packed: the decode shape, at 4096 keys (and a short cache)."""
    for i, keys in enumerate([4096, 384]):
        inputs = paged_inputs(8, 1, keys // page_size, page_size, 64, 8, 128, seed=31 + i)
        _check(*inputs, causal=True, pack_gqa=True)
        _check(*inputs, causal=False, pack_gqa=False)


@pytest.mark.parametrize("page_size", [16, 128])
def test_extreme_logits(page_size):
    q, k_cache, v_cache, table, k, v = paged_inputs(2, 100, 1024 // page_size, page_size, 8, 2,
                                                    128, seed=41, q_scale=300.0)
    _check(q, k_cache, v_cache, table, k, v, causal=True, atol=output_ulp_atol(v, "bf16"))


def test_page_size_is_in_the_launch_key():
    """Two page sizes are two kernels; a new page table or pages_per_seq is not a compile."""
    from fa4lab.call import check_call

    inputs = [paged_inputs(2, 16, n, p, 8, 2, 128, seed=51) for p, n in ((16, 16), (128, 2),
                                                                          (128, 5))]
    keys = [check_call(q, kc, vc, causal=True, return_lse=True, page_table=t).key("sm90")
            for q, kc, vc, t, _, _ in inputs]
    assert keys[0] != keys[1] and keys[1] == keys[2] and keys[1].page_size == 128
