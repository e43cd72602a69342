"""Paged K/V caches on the CPU: the kernels' block -> page mapping against
`fa4lab.varlen_tiles.key_block_pages`, the page sizes a kernel takes, the checks and the reference
path of `fa4lab.attention(q, k_cache, v_cache, page_table=...)`, the launch key, and the
batch view of `fa4lab.attention_varlen`'s one paged decode launch.
(The kernels themselves: tests/test_sm90_compile.py, tests/test_compile_sm100.py on the CPU,
tests/test_paged_gpu.py and tests/test_paged_decode_gpu.py on an H200.)"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("cutlass")
torch = pytest.importorskip("torch")

from fa4lab.errors import InputError, InputTypeError, PlanError  # noqa: E402
from fa4lab.kernels.device import paged  # noqa: E402
from fa4lab.tiling import ceil_div  # noqa: E402
from fa4lab.varlen import gather_paged  # noqa: E402
from fa4lab.varlen_tiles import key_block_pages  # noqa: E402

N_BLOCKS = [80, 96, 112, 128, 176]


def _page_sizes(n_block):
    return ([p for p in range(1, n_block) if n_block % p == 0]
            + [n_block * m for m in (1, 2, 4)])


@given(n_block=st.sampled_from(N_BLOCKS), data=st.data(), seqlen_k=st.integers(1, 5000))
@settings(max_examples=100, deadline=None)    # trimmed from 300 (3 s: every block of a sequence)
def test_block_reads_are_key_block_pages(n_block, data, seqlen_k):
    """Every piece the kernel copies is the piece key_block_pages names (same slot, same rows
    of the page, in key order); a gather's pieces past the last key (the last block's slots
    past the sequence's pages) are all keys >= seqlen_k, which the mask hides."""
    page_size = data.draw(st.sampled_from(_page_sizes(n_block)))
    paged.check_page_size(page_size, n_block)
    want = key_block_pages(seqlen_k, page_size, n_block)
    assert len(want) == ceil_div(seqlen_k, n_block)
    for n, pieces in enumerate(want):
        got = paged.block_reads(n, page_size, n_block)
        assert len(got) == paged.pages_per_block(page_size, n_block)
        assert sum(rows for _, _, rows in got) == n_block       # one whole SMEM stage
        for i, (slot, row_block, rows) in enumerate(got):
            first = row_block * rows
            key = slot * page_size + first                       # the piece's first key
            assert key == n * n_block + i * rows                 # in key order
            if i < len(pieces):
                p = pieces[i]
                assert (slot, first) == (p.slot, p.first)
                assert first + rows >= p.stop                    # covers it (tail masked)
            else:
                assert key >= seqlen_k


def test_block_reads_on_dsl_style_ints():
    """The same formulas serve the kernel's Int32 (// and % only)."""
    assert paged.block_reads(5, 256, 128) == [(2, 1, 128)]
    assert paged.block_reads(3, 16, 128) == [(24 + j, 0, 16) for j in range(8)]
    assert paged.blocks_per_page(512, 128) == 4 and paged.pages_per_block(32, 128) == 4


@pytest.mark.parametrize("page_size,n_block", [(16, 128), (64, 128), (128, 128), (256, 128),
                                               (16, 80), (80, 80), (160, 80), (16, 112),
                                               (1, 128), (4, 80), (8, 112), (2, 176),
                                               (24, 96)])
def test_page_sizes_that_fit(page_size, n_block):
    paged.check_page_size(page_size, n_block)


@pytest.mark.parametrize("page_size,n_block", [(12, 128), (48, 128), (100, 128), (192, 128),
                                               (128, 80), (32, 80), (64, 112), (3, 128)])
def test_page_sizes_that_do_not_fit(page_size, n_block):
    with pytest.raises(PlanError, match=f"page_size={page_size} does not fit key blocks of "
                                        f"{n_block} rows"):
        paged.check_page_size(page_size, n_block)


def _paged(batch=2, sq=5, pages=3, page_size=16, hq=4, hkv=2, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_pages = batch * pages + 2
    q = torch.randn(batch, sq, hq, d, generator=g)
    kc, vc = (torch.randn(num_pages, page_size, hkv, d, generator=g) for _ in range(2))
    table = torch.randperm(num_pages, generator=g)[:batch * pages].view(batch, pages)
    table[1, 0] = table[0, 2]                   # one page in two sequences
    return q, kc, vc, table.to(torch.int32)


@pytest.mark.parametrize("causal,window", [(False, (None, None)), (True, (None, None)),
                                           (False, (7, 3))])
def test_attention_on_a_paged_cache_is_the_reference_on_gathered_kv(causal, window):
    import fa4lab
    from fa4lab.api import SlowReferenceWarning
    from fa4lab.reference import attention_reference

    q, kc, vc, table = _paged(seed=3)
    seqlens = [table.shape[1] * kc.shape[1]] * q.shape[0]
    k, v = (torch.stack(gather_paged(c, table, seqlens)) for c in (kc, vc))
    sink = torch.randn(q.shape[2])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowReferenceWarning)
        out, lse = fa4lab.attention(q, kc, vc, page_table=table, causal=causal,
                                    window_size=window, learnable_sink=sink, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, causal=causal, window_size=window,
                                       learnable_sink=sink, return_lse=True)
    torch.testing.assert_close(out, ref.to(out.dtype))
    torch.testing.assert_close(lse, ref_lse.float())


def test_paged_inputs_are_checked_before_anything_runs():
    import fa4lab

    q, kc, vc, table = _paged()
    with pytest.raises(InputTypeError, match="page_table has dtype torch.int64"):
        fa4lab.attention(q, kc, vc, page_table=table.long())
    bad = table.clone()
    bad[1, 2] = kc.shape[0]
    with pytest.raises(InputError, match=r"page_table\[1, 2\] = 8 is not a page of the cache"):
        fa4lab.attention(q, kc, vc, page_table=bad)
    with pytest.raises(InputError, match="page_table has 1 rows but q has 2 sequences"):
        fa4lab.attention(q, kc, vc, page_table=table[:1])
    with pytest.raises(InputError, match="expected .num_pages, page_size, heads_kv, head_dim."):
        fa4lab.attention(q, kc[0], vc[0], page_table=table)
    with pytest.raises(InputError, match="disagree on .num_pages, page_size, heads_kv."):
        fa4lab.attention(q, kc, vc[:, :8], page_table=table)
    with pytest.raises(InputError, match="q has shape"):
        fa4lab.attention(q[0], kc, vc, page_table=table)


def test_launch_key_and_kernel_name_carry_the_page_size():
    from fa4lab.call import check_call
    from fa4lab.kernels import launch
    from fa4lab.plan.key import config_name

    q, kc, vc, table = (t.to(torch.bfloat16) if t.is_floating_point() else t
                        for t in _paged(d=128))
    paged = check_call(q, kc, vc, causal=True, page_table=table)
    key = paged.key("sm90")
    k_dense = kc.new_zeros(q.shape[0], 64, *kc.shape[2:])    # contiguous K/V, same dims
    dense = check_call(q, k_dense, k_dense, causal=True).key("sm90")
    assert key.page_size == kc.shape[1] and dense.page_size is None
    assert dataclasses.replace(key, page_size=None, persistent=dense.persistent) == dense
    spec = key.spec()
    assert spec.page_size == kc.shape[1]
    assert config_name(spec, "sm90a").endswith("-page16")
    launch.check_paged_call(dataclasses.replace(key, page_size=9), None)   # sm90: cp.async
    on_b200 = paged.key("sm100")
    with pytest.raises(PlanError, match="page_size=9"):
        launch.check_paged_call(dataclasses.replace(on_b200, page_size=9), None)


@pytest.mark.parametrize("arch,page_size,fits", [
    ("sm90", 16, True), ("sm90", 48, True), ("sm90", 24, True), ("sm90", 9, True),
    ("sm90", 1, True), ("sm90", 100, True), ("sm90", 1000, True), ("sm100", 64, True),
    ("sm100", 32, True), ("sm100", 16, True), ("sm100", 48, True), ("sm100", 8, True),
    ("sm100", 4, True), ("sm100", 100, False)])
def test_kernels_refuse_page_sizes_they_do_not_build(arch, page_size, fits):
    """Built from the plan, before any compile: a page size the kernel does not read is a
    PlanError naming it. The sm100 kernel gathers any divisor of its key block (Note [paged key
    blocks]); the sm90 kernel reads every other page with cp.async (Note [cp.async pages])."""
    from fa4lab.kernels.compile import kernel_class
    from fa4lab.plan import plan_forward
    from fa4lab.spec import AttentionSpec

    plan = plan_forward(AttentionSpec(2, 64, 1024, 8, 2, 128, page_size=page_size), arch)
    make = kernel_class(arch + "a")
    if fits:
        assert make(plan).page_size == page_size
    else:
        with pytest.raises(PlanError, match=f"page_size={page_size}"):
            make(plan)


def test_the_op_takes_a_page_table():
    """`torch.ops.fa4lab.attention_forward` (what torch.compile sees) with a page table: the
    same answer as `fa4lab.attention`, and its fake implementation's shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import fa4lab
    from fa4lab.api import SlowReferenceWarning

    q, kc, vc, table = _paged(seed=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowReferenceWarning)
        out, lse = torch.ops.fa4lab.attention_forward(q, kc, vc, True, None, True, None, 0.0,
                                                      None, None, None, None, table)
        want, want_lse = fa4lab.attention(q, kc, vc, page_table=table, causal=True,
                                          return_lse=True)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in (q, kc, vc, table)]
        out, lse = torch.ops.fa4lab.attention_forward(*fake[:3], False, None, True, None, 0.0,
                                                      None, None, None, None, fake[3])
    assert out.shape == q.shape and lse.shape == (q.shape[0], q.shape[2], q.shape[1])


@pytest.mark.parametrize("L", [1, 3])
def test_paged_decode_views_q_as_a_batch(L, monkeypatch):
    """attention_varlen's one paged launch for L queries per sequence (`_paged_same_length`):
    packed q viewed as (batch, L, heads, d) and the launch's out / lse put back in varlen form
    are the varlen reference, seqused_k reaching the launch. The launch is stood in for by the
    float64 reference on each sequence's first seqused_k keys (the kernel's contract)."""
    from fa4lab.api import varlen as api_varlen
    from fa4lab.call import check_call
    from fa4lab.kernels import launch
    from fa4lab.reference import attention_reference, attention_varlen_reference
    from fa4lab.varlen import check_varlen

    q4, kc, vc, table = _paged(batch=3, sq=L, pages=3, seed=9 + L)
    q = q4.reshape(-1, *q4.shape[2:])
    cu_q = (torch.arange(4) * L).to(torch.int32)
    used = torch.tensor([40, 0, 17], dtype=torch.int32)

    def forward(call, arch):
        q_b, k_cache, v_cache, page_table = call.q, call.k, call.v, call.page_table
        causal, window_size = call.spec.causal, call.window_size
        assert q_b.shape == q4.shape and page_table is table and call.seqused_k is used
        assert call.num_splits is None and call.pack_gqa is None   # the call's, passed on
        assert not call.spec.varlen and call.spec.seqlen_q == L and call.lengths is None
        outs, lses = [], []
        for b, (k, v) in enumerate(zip(gather_paged(k_cache, page_table, used.tolist()),
                                       gather_paged(v_cache, page_table, used.tolist()))):
            if k.shape[0] == 0:     # no key: the kernel's 0 and -inf
                outs.append(torch.zeros_like(q_b[b:b + 1], dtype=torch.float64))
                lses.append(torch.full((1, q_b.shape[2], L), -float("inf"), dtype=torch.float64))
                continue
            o, lse = attention_reference(q_b[b:b + 1], k[None], v[None], causal=causal,
                                         window_size=window_size, return_lse=True)
            outs.append(o)
            lses.append(lse)
        return torch.cat(outs), torch.cat(lses)

    monkeypatch.setattr(launch, "forward", forward)
    lengths = check_varlen(q, kc, vc, cu_q, None, L, None, used, table)
    call = check_call(q, kc, vc, causal=True, return_lse=True, page_table=table,
                      seqused_k=used, lengths=lengths)
    out, lse = api_varlen._paged_same_length(call, "sm90")
    want, want_lse = attention_varlen_reference(q, kc, vc, cu_q, None, seqused_k=used,
                                                page_table=table, causal=True, return_lse=True)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse)


def test_split_kernel_key_carries_the_page_size():
    """A paged call's split kernel is one key: split_kv and the page size, one compiled kernel
    (`-page16-splitkv`)."""
    from fa4lab.call import check_call
    from fa4lab.plan.key import config_name

    q, kc, vc, table = (t.to(torch.bfloat16) if t.is_floating_point() else t
                        for t in _paged(d=128))
    key = check_call(q, kc, vc, page_table=table).key("sm90", split_kv=True)
    spec = key.spec()
    assert spec.split_kv and spec.page_size == kc.shape[1]
    assert config_name(spec, "sm90a").endswith("-page16-splitkv")


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_a_paged_call_splits_over_the_table_capacity(arch, monkeypatch):
    """num_splits with a page table: a given count is capped at the key blocks of
    pages_per_seq * page_size keys; None asks `choose_num_splits` about that capacity (seqused_k
    is on the GPU: Note [choosing num_splits]) where the arch chooses, and gives 1 elsewhere."""
    from fa4lab.call import check_call
    from fa4lab.kernels import launch
    from fa4lab.splitkv import choose_num_splits

    monkeypatch.setattr(launch, "num_sms", lambda index: 132)
    q, kc, vc, table = (t.to(torch.bfloat16) if t.is_floating_point() else t
                        for t in _paged(batch=2, sq=1, pages=64, hq=16, hkv=2, d=128))
    call = check_call(q, kc, vc, page_table=table)
    key = call.key(arch)
    cta_m, n_block, pack = launch.cta_tiles(key)
    blocks = -(-64 * 16 // n_block)
    assert [launch.splits_for(key, dataclasses.replace(call, num_splits=n))
            for n in (1, 3, blocks + 5)] == [1, 3, blocks]
    want = (choose_num_splits(2, 2 if pack > 1 else 16, pack, 64 * 16, n_block, 132,
                              m_block=cta_m) if arch in launch.AUTO_SPLIT_ARCHS else 1)
    assert launch.splits_for(key, call) == want
    assert want > 1 or arch not in launch.AUTO_SPLIT_ARCHS


def test_the_paged_decode_runs_split_kv_and_the_combine(monkeypatch):
    """attention_varlen's paged decode (`_paged_same_length`) on a shape too small for the GPU:
    `launch.forward` chooses splits over the table's capacity and runs the split kernel -- given
    the page table, the caller's seqused_k, the split count and float32 partials to fill -- then
    the combine; the result is the varlen reference. The split kernel is stood in for by the
    float64 partials of each sequence's first seqused_k keys (its contract: every split cuts its
    sequence's own key blocks; a sequence with no key, or one key, leaves splits empty)."""
    from fa4lab.api import varlen as api_varlen
    from fa4lab.call import check_call
    from fa4lab.kernels import launch
    from fa4lab.reference import attention_varlen_reference
    from fa4lab.splitkv import partial_attention_reference
    from fa4lab.varlen import check_varlen

    q4, kc, vc, table = (t.to(torch.bfloat16) if t.is_floating_point() else t
                         for t in _paged(batch=3, sq=1, pages=64, hq=16, hkv=2, d=64, seed=4))
    q = q4.reshape(-1, *q4.shape[2:])
    cu_q = torch.arange(4, dtype=torch.int32)
    used = torch.tensor([0, 1, 700], dtype=torch.int32)
    n_block = launch.cta_tiles(check_call(q4, kc, vc, causal=True, page_table=table)
                               .key("sm90", split_kv=True))[1]
    seen = []

    def split_kernel(q_, k_, v_, out, lse, sink, scale_log2, pre_scale, left, right, aux,
                     mask_blocks, cu_seqlens_q, cu_seqlens_k, seqused_k, tile_table, page_table,
                     num_splits, out_partial, lse_partial):
        assert page_table is table and seqused_k is used and k_ is kc and v_ is vc
        assert out_partial.shape == (num_splits, *q4.shape[:3], vc.shape[-1])
        assert lse_partial.shape == (num_splits, *q4.shape[:3]) and lse is None
        seen.append(num_splits)
        for b, (k, v) in enumerate(zip(gather_paged(kc, table, used.tolist()),
                                       gather_paged(vc, table, used.tolist()))):
            if k.shape[0] == 0:
                out_partial[:, b], lse_partial[:, b] = 0.0, -float("inf")
                continue
            o_p, lse_p = partial_attention_reference(q_[b:b + 1], k[None], v[None],
                                                     num_splits=num_splits,
                                                     n_block_size=n_block, causal=True)
            out_partial[:, b], lse_partial[:, b] = o_p[:, 0], lse_p[:, 0]

    monkeypatch.setattr(launch, "num_sms", lambda index: 132)
    monkeypatch.setattr(launch, "kernel_for", lambda key, mods=None: split_kernel)
    lengths = check_varlen(q, kc, vc, cu_q, None, 1, None, used, table)
    call = check_call(q, kc, vc, causal=True, return_lse=True, page_table=table,
                      seqused_k=used, lengths=lengths)
    out, lse = api_varlen._paged_same_length(call, "sm90")
    assert len(seen) == 1 and seen[0] > 1
    want, want_lse = attention_varlen_reference(q, kc, vc, cu_q, None, seqused_k=used,
                                                page_table=table, causal=True, return_lse=True)
    torch.testing.assert_close(out, want.to(out.dtype))
    torch.testing.assert_close(lse, want_lse.float())


def test_the_paged_varlen_launch_passes_the_pages_and_every_real_tile(monkeypatch):
    """`launch.forward_varlen` with a page table (chunked prefill, ragged query counts) hands
    the kernel the cache itself, the page table, no cu_seqlens_k, each sequence's key count
    (the phantom sequence's 0 appended) and a tile table naming every real (sequence, m_block)
    once: a stand-in kernel that computes exactly the tiles it is given, from the arguments it
    is given, reproduces the float64 reference on every row."""
    from fa4lab.call import check_call
    from fa4lab.kernels import launch
    from fa4lab.reference import attention_varlen_reference
    from fa4lab.varlen import check_varlen

    _, kc, vc, table = _paged(batch=4, pages=6, page_size=16, hq=4, hkv=2, d=64, seed=8)
    kc, vc = kc.to(torch.bfloat16), vc.to(torch.bfloat16)
    lens_q, used = [0, 1, 200, 7], torch.tensor([50, 0, 96, 3], dtype=torch.int32)
    q = torch.randn(sum(lens_q), 4, 64, generator=torch.Generator().manual_seed(9))
    q = q.to(torch.bfloat16)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    lengths = check_varlen(q, kc, vc, cu_q, None, None, None, used, table)
    call = check_call(q, kc, vc, causal=True, return_lse=True, page_table=table,
                      lengths=lengths)
    cta_m = launch.cta_tiles(call.key("sm90"))[0]
    tiles = []

    def varlen_kernel(q_, k_, v_, out, lse, sink, scale_log2, pre_scale, left, right, aux,
                      mask_blocks, cu_seqlens_q, cu_seqlens_k, seqused_k, tile_table,
                      page_table, num_splits, out_partial, lse_partial):
        assert k_ is kc and v_ is vc and page_table is table and cu_seqlens_k is None
        assert num_splits == 1 and out_partial is None and lse_partial is None
        assert seqused_k.tolist() == [*used.tolist(), 0] and cu_seqlens_q[-1] == cu_q[-1]
        o_ref, lse_ref = attention_varlen_reference(
            q_, k_, v_, cu_seqlens_q[:-1], None, seqused_k=seqused_k[:-1],
            page_table=page_table, causal=True, return_lse=True)
        for b, m in tile_table.tolist():
            if b == len(lens_q):        # a padding row: the phantom sequence, nothing to do
                continue
            tiles.append((b, m))
            rows = slice(int(cu_seqlens_q[b]) + m * cta_m,
                         min(int(cu_seqlens_q[b + 1]), int(cu_seqlens_q[b]) + (m + 1) * cta_m))
            out[rows], lse[:, rows] = o_ref[rows].to(out.dtype), lse_ref[:, rows].float()

    monkeypatch.setattr(launch, "kernel_for", lambda key, mods=None: varlen_kernel)
    out, lse = launch.forward_varlen(call, "sm90")
    want = [(b, m) for b, n in enumerate(lens_q) for m in range(ceil_div(n, cta_m))]
    assert sorted(tiles) == want
    ref, ref_lse = attention_varlen_reference(q, kc, vc, cu_q, None, seqused_k=used,
                                              page_table=table, causal=True, return_lse=True)
    torch.testing.assert_close(out, ref.to(out.dtype), atol=0, rtol=0)
    torch.testing.assert_close(lse, ref_lse.float(), atol=0, rtol=0)


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_gathered_pages_start_128_byte_aligned(arch):
    """A gathered page's SMEM slice starts on a 128-byte boundary (what a TMA copy needs): at
    head_dim 96, whose swizzle rows are 64 bytes, the sm100 kernel refuses a page of 1 before
    any compile, naming the sizes that fit, and takes pages of 2 (`fa4lab.limits
    .min_gather_page`); the sm90 kernel copies pages below 16 by cp.async, where no alignment
    limits the page (Note [cp.async pages])."""
    from fa4lab.kernels.compile import kernel_class
    from fa4lab.limits import min_gather_page, swizzle_bytes
    from fa4lab.plan import plan_forward
    from fa4lab.spec import AttentionSpec

    assert [swizzle_bytes(c) for c in (64, 96, 128, 192, 256)] == [128, 64, 128, 128, 128]
    assert min_gather_page(96, 96) == 2 and min_gather_page(192, 128) == 1
    assert min_gather_page(64, 96) == 2 and min_gather_page(128, 128) == 1
    make = kernel_class(arch + "a")
    two = plan_forward(AttentionSpec(2, 1, 1024, 8, 2, 96, page_size=2), arch)
    assert make(two).page_size == 2
    one = plan_forward(AttentionSpec(2, 1, 1024, 8, 2, 96, page_size=1), arch)
    if arch == "sm90":
        assert one.tiles.kv_load == two.tiles.kv_load == "cp.async"
        assert make(one).page_size == 1
        return
    with pytest.raises(PlanError, match=r"page_size=1 does not fit .* multiple of 2 .*128-byte"):
        make(one)


@pytest.mark.parametrize("d,dv", [(64, 64), (96, 96), (128, 128), (192, 128), (256, 256)])
def test_which_pages_cp_async_reads(d, dv):
    """sm90: pages below 16 and pages no TMA read fits go through cp.async at the tuned key
    block, the rest through TMA; sm100 reads every page it takes by TMA (Note [cp.async
    pages] in fa4lab.limits). A cp.async block is whole passes of the 128 producer threads."""
    from fa4lab.limits import (
        CP_ASYNC_THREADS,
        cp_async_row_threads,
        cp_async_rows_per_pass,
        page_loader,
    )
    from fa4lab.plan import plan_forward
    from fa4lab.plan.sm90 import SM90_TUNING
    from fa4lab.spec import AttentionSpec

    tuned = SM90_TUNING[(d, dv)].n_block
    tpr = cp_async_row_threads(d, dv)
    assert tpr * 16 in (64, 128) and cp_async_rows_per_pass(d, dv) * tpr == CP_ASYNC_THREADS
    # below 16, or straddling every key block; 24 and the powers of two from 16 fit a TMA read
    # (24 on a block of 96 or 48, 64 to 256 on 64 at head dims (192, 128) and 256)
    by_cp_async = (1, 2, 3, 4, 5, 8, 12, 100, 1000)
    for page_size in by_cp_async + (16, 24, 32, 64, 128, 256):
        p = plan_forward(AttentionSpec(2, 300, 1024, 8, 2, d, dv, page_size=page_size), "sm90")
        n = p.tiles.n_block
        cp_async = page_size in by_cp_async
        assert p.tiles.kv_load == ("cp.async" if cp_async else "tma"), page_size
        assert page_loader("sm90", page_size, n) == p.tiles.kv_load
        if cp_async:
            assert n == tuned and n % cp_async_rows_per_pass(d, dv) == 0
            assert n // cp_async_rows_per_pass(d, dv) <= tpr
        assert page_loader("sm100", page_size, n) == "tma"
    assert plan_forward(AttentionSpec(2, 300, 1024, 8, 2, d, dv), "sm90").tiles.kv_load == "tma"


def test_cp_async_key_blocks_are_whole_passes():
    """An explicit key block a cp.async producer cannot copy in whole passes, or in more passes
    than a thread holds page indices for, is a PlanError naming the blocks it takes."""
    from fa4lab.plan import plan_forward
    from fa4lab.spec import AttentionSpec

    spec = AttentionSpec(2, 300, 1024, 8, 2, 64, page_size=4)
    assert plan_forward(spec, "sm90", n_block=64).tiles.kv_load == "cp.async"
    with pytest.raises(PlanError, match=r"n_block=144: .* 16 rows per pass .*, at most 8 passes"):
        plan_forward(spec, "sm90", n_block=144)
    wide = AttentionSpec(2, 300, 1024, 8, 2, 96, page_size=4)
    with pytest.raises(PlanError, match="n_block=48: .* 32 rows per pass"):
        plan_forward(wide, "sm90", n_block=48)
