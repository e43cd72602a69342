"""The sm90 kernel compiles for sm_90a on a CPU (fake tensors), and its block ranges match
`fa4lab.tiling`. Tier 1: no GPU needed, nvidia-cutlass-dsl required."""

from __future__ import annotations

import re

import cutlass
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fa4lab import scheduling, tiling
from fa4lab.kernels.device import scheduler
from fa4lab.limits import (
    KERNEL_HEAD_DIMS,
    cp_async_row_threads,
    cp_async_rows_per_pass,
    page_loader,
)
from fa4lab.spec import AttentionSpec, effective_window

_SIDE = st.one_of(st.none(), st.integers(0, 3000))


@given(sq=st.integers(1, 3000), sk=st.integers(1, 3000), cta_m=st.sampled_from([64, 128]),
       n=st.sampled_from([80, 128, 176]), causal=st.booleans(), left=_SIDE, right=_SIDE,
       data=st.data())
@settings(max_examples=150, deadline=None)    # trimmed from 300 (2 s on a 2-core machine)
def test_block_ranges_match_tiling(sq, sk, cta_m, n, causal, left, right, data):
    """The device scheduler on Python ints (the DSL's min/max) is fa4lab.tiling's rule."""
    right = 0 if causal and right else right
    m = data.draw(st.integers(0, tiling.num_m_blocks(sq, cta_m) - 1))
    kw = dict(seqlen_q=sq, seqlen_k=sk, m_block_size=cta_m, n_block_size=n, causal=causal,
              window_size=(left, right))
    lo, hi = tiling.n_block_range(m, **kw)
    mask_lo, _ = tiling.n_block_masked_range(m, **kw)
    _, left_end = tiling.n_block_left_masked_range(m, **kw)
    eff = effective_window(causal, (left, right))
    assert scheduler.block_range(m, cta_m, 1, n, sq, sk, *eff) == (lo, hi)
    assert scheduler.mask_split(m, cta_m, 1, n, sq, sk, *eff, lo, hi) == (left_end, mask_lo)


@given(batch=st.integers(1, 6), heads=st.integers(1, 40), sq=st.integers(1, 5000),
       sk=st.sampled_from([1, 100, 4096, 50_000, 400_000, 3_000_000]),
       cta_m=st.sampled_from([64, 128, 192]), head_dim=st.sampled_from([64, 128, 256]))
@settings(max_examples=60, deadline=None)    # trimmed from 150 (3 s: every tile of each grid)
def test_lpt_coords_follow_tiling_lpt_order(batch, heads, sq, sk, cta_m, head_dim):
    # The kernel's device formula (run here on Python ints) against the numpy order notebook 02
    # teaches: same tile at every linear index, so every tile exactly once.
    work = scheduling.Workload(batch=batch, heads=heads, seqlen_q=sq, seqlen_k=sk,
                           m_block_size=cta_m, n_block_size=128, causal=True, head_dim=head_dim)
    swizzle = scheduling.l2_swizzle(sk, 4 * head_dim, imax=cutlass.max)   # as the kernel reads it
    assert swizzle == work.l2_swizzle
    n_m = scheduler.num_m_blocks(sq, cta_m)
    grid = scheduler.grid_shape(sq, heads, batch, cta_m, "lpt")
    assert grid == (work.num_tiles, 1, 1)
    got = [scheduler.lpt_coords(t, n_m, heads, batch, swizzle) for t in range(grid[0])]
    want = [(m, h, b) for b, h, m in scheduling.lpt_order(work).tolist()]
    assert got == want


def test_pow2_floor_and_orders():
    assert [scheduling.pow2_floor(x) for x in (1, 2, 3, 4, 5, 1023, 1024, 2**31 - 1)] == [
        1, 2, 2, 4, 4, 512, 1024, 2**30]
    assert scheduler.grid_shape(1000, 8, 2, 128, "grid") == (8, 8, 2)
    assert scheduler.grid_shape(1000, 8, 2, 128, "grid_reversed") == (8, 8, 2)
    with pytest.raises(ValueError, match="unknown tile order"):
        scheduler.grid_shape(1000, 8, 2, 128, "spiral")
    # Persistent (Note [persistent CTAs] in fa4lab.plan.sm100): min(tiles, CTAs), one-dimensional.
    assert scheduler.grid_shape(1000, 8, 2, 128, "grid", num_ctas=148) == (128, 1, 1)
    assert scheduler.grid_shape(1000, 8, 2, 128, "lpt", num_ctas=100) == (100, 1, 1)
    assert [scheduler.coords(t, "grid", 8, 8, 2) for t in (0, 9, 127)] == [
        (0, 0, 0), (1, 1, 0), (7, 7, 1)]


@pytest.mark.parametrize("causal", [False, True])
def test_plans_name_their_tile_order(causal):
    from fa4lab.plan import plan_forward

    spec = AttentionSpec(2, 1000, 1000, 8, 8, 128, causal=causal)
    assert plan_forward(spec, "sm90").tiles.order == ("lpt" if causal else "grid")
    # sm100: persistent CTAs take LPT; one CTA per tile the grid with m_blocks reversed.
    assert plan_forward(spec, "sm100").tiles.order == ("lpt" if causal else "grid")
    assert plan_forward(spec, "sm100", persistent=False).tiles.order == (
        "grid_reversed" if causal else "grid")
    assert plan_forward(spec, "sm90").tiles.order in scheduling.SCHEDULERS


# Every (head_dim, head_dim_v) pair the kernel builds; 64, 128 and 256 both ways of causal, the
# others (96, (192, 128)) causal only (trimmed: one compile per added pair).
_GRID_DIMS = (64, 128, 256)
SM90_CONFIGS = [((d, dv), c) for d, dv in KERNEL_HEAD_DIMS["sm90"] for c in (False, True)
                if c or (d == dv and d in _GRID_DIMS)]


@pytest.mark.compile
@pytest.mark.parametrize("dims,causal", SM90_CONFIGS, ids=[
    f"hd{d if d == dv else f'{d}x{dv}'}-{'causal' if c else 'full'}"
    for (d, dv), c in SM90_CONFIGS])
def test_compiles_for_sm90a(dims, causal, tmp_path):
    """Every sm90 kernel configuration compiles and its binary holds to the plan: resources,
    no spills, and the barrier protocol (inits, per-path op sequence, loops, named barriers,
    SMEM offsets) against `plan.protocol`."""
    from audit_checks import compile_and_audit

    from fa4lab.kernels.fwd_sm90 import FlashForwardSm90
    from fa4lab.plan import plan_forward

    spec = AttentionSpec(2, 300, 700, 8, 2, *dims, causal=causal, return_lse=causal)
    cf = compile_and_audit(plan_forward(spec, "sm90"), "sm90a", tmp_path)
    assert isinstance(cf.kernel, FlashForwardSm90) and cf.seconds > 0


@pytest.mark.compile
@pytest.mark.parametrize("options", [
    dict(head_dim=64, causal=True, window_size=(100, 0)),      # the tightest registers
    dict(head_dim=256, causal=False, window_size=(None, 40), learnable_sink=True),
], ids=["hd64-causal-left", "hd256-right-sink"])
def test_window_and_sink_compile_for_sm90a(options, tmp_path):
    """A sliding window (left with causal; right alone) and a learnable sink: the same audit
    (no spills; one masked and one unmasked loop per consumer, as the protocol table has)."""
    from audit_checks import compile_and_audit

    from fa4lab.plan import plan_forward

    spec = AttentionSpec(2, 300, 700, 8, 2, return_lse=True, **options)
    cf = compile_and_audit(plan_forward(spec, "sm90"), "sm90a", tmp_path)
    assert ("-sink" in cf.keep_dir.name) == spec.learnable_sink
    assert "-window" in cf.keep_dir.name


@pytest.mark.compile
@pytest.mark.parametrize("head_dim,causal", [(64, True), (128, False)])
def test_softcap_compiles_for_sm90a(head_dim, causal, tmp_path):
    """With softcap (Note [softcap]): the same audit, the cap's tanh included."""
    from audit_checks import compile_and_audit

    from fa4lab.plan import plan_forward

    spec = AttentionSpec(2, 300, 700, 8, 2, head_dim, causal=causal, return_lse=True,
                         softcap=30.0)
    cf = compile_and_audit(plan_forward(spec, "sm90"), "sm90a", tmp_path)
    assert "tanh.approx.f32" in cf.ptx_path.read_text()


@pytest.mark.compile
@pytest.mark.parametrize("options, pack_gqa", [
    (dict(head_dim=128), True),                                   # decode: persistent, packed
    (dict(head_dim=128, causal=True), True),                      # LPT order, packed
    (dict(head_dim=64, causal=True, window_size=(100, 0)), False),  # the tightest registers
    (dict(head_dim=256, window_size=(None, 40), softcap=5.0, learnable_sink=True), False),
], ids=["hd128-full-packed", "hd128-causal-packed", "hd64-causal-left", "hd256-right-cap-sink"])
def test_split_kv_compiles_for_sm90a(options, pack_gqa, tmp_path):
    """The split-KV kernel (fa4lab.kernels.device.split): the same audit, no spills, the
    protocol table unchanged; float32 partial stores in pairs (st.global.v2) and no TMA store
    of O."""
    from audit_checks import compile_and_audit

    from fa4lab.plan import plan_forward

    spec = AttentionSpec(2, 300, 700, 8, 1, split_kv=True, **options)
    cf = compile_and_audit(plan_forward(spec, "sm90", pack_gqa=pack_gqa), "sm90a", tmp_path)
    ptx = cf.ptx_path.read_text()
    assert cf.keep_dir.name.split("-packgqa")[0].endswith("-splitkv")
    assert "st.global.v2.f32" in ptx or "st.global.v2.b32" in ptx
    assert "cp.async.bulk.tensor.4d.global.shared" not in ptx


def _mod_configs():
    """One score_mod config (ALiBi, reading an aux tensor, after a softcap) and one mask_mod
    config (document ids), as `fa4lab.mods.KernelMods`."""
    import torch

    from fa4lab import mods

    alibi, slopes = mods.alibi(torch.ones(8))
    documents, doc_ids = mods.document_mask(torch.zeros(16, dtype=torch.int32))
    return {"score_mod": mods.kernel_mods(alibi, None, slopes),
            "mask_mod": mods.kernel_mods(None, documents, doc_ids)}


@pytest.mark.compile
@pytest.mark.parametrize("which,head_dim,softcap", [("score_mod", 128, 30.0),
                                                    ("mask_mod", 128, 0.0)])
def test_mods_compile_for_sm90a(which, head_dim, softcap, tmp_path):
    """A score_mod and a mask_mod compiled in (fa4lab.kernels.device.mods): the same audit, no
    spills and the protocol table unchanged (Note [mask_mod blocks])."""
    from audit_checks import compile_and_audit

    from fa4lab.plan import plan_forward

    spec = AttentionSpec(2, 300, 700, 8, 2, head_dim, causal=True, return_lse=True,
                         softcap=softcap)
    cf = compile_and_audit(plan_forward(spec, "sm90"), "sm90a", tmp_path,
                           mods=_mod_configs()[which])
    assert cf.keep_dir.name.endswith("-mods")
    assert "ld.global" in cf.ptx_path.read_text()      # the aux tensor's reads


def test_port_table_reads_the_plans():
    from fa4lab.plan import plan_forward
    from fa4lab.viz.port import port_table

    spec = AttentionSpec(1, 2048, 2048, 8, 8, 128, causal=True)
    rows = {what: (b, h) for what, b, h in port_table(spec)}
    b, h = plan_forward(spec, arch="sm100"), plan_forward(spec, arch="sm90")
    assert rows["mbarriers"] == (str(b.barriers.mbarrier_count), str(h.barriers.mbarrier_count))
    assert rows["TMEM allocation"][0] == f"{b.tmem.alloc_cols} columns"
    assert f"{h.tiles.m_block * h.tiles.n_block // 128} fp32" in rows["S = Q K^T"][1]
    assert str(h.role("consumer0").registers) in rows["softmax"][1]


@pytest.mark.compile
@pytest.mark.parametrize("q_stage", [1, 2])
def test_audit_against_plan(q_stage):
    """The binary has what the plan says: barriers, setmaxnreg budgets, no spills, wgmma."""
    pytest.importorskip("cutlass")
    audit = pytest.importorskip("fa4lab.kernels.audit")
    from fa4lab.plan import plan_forward

    plan = plan_forward(AttentionSpec(1, 512, 512, 4, 4, 128, causal=True, return_lse=True),
                        arch="sm90", q_stage=q_stage)
    try:
        result = audit.audit(plan, arch="sm90a")
    except FileNotFoundError as e:
        pytest.skip(f"CUDA binary tools missing: {e}")
    assert result.row("mbarrier.init").found == plan.barriers.mbarrier_count
    if q_stage == 2:  # the shipped configuration: every row of the audit holds
        assert result.ok, result.failures()
    else:  # one consumer: compiles and keeps the plan's barriers and MMAs (registers untuned)
        rows = [r for r in result.rows if r.name.startswith(("setmaxnreg", "wgmma", "HGMMA"))]
        assert len(rows) >= 3 and all(r.ok for r in rows), rows


# Paged K/V caches: rows copied by cp.async (pages 1, 4: Note [cp.async gather] in
# fa4lab.kernels.device.page_rows), a TMA gather of pages per key block (16, 32, 64: Note [paged
# key blocks] in fa4lab.kernels.device.paged) and one TMA box per block (128, 256); the decode
# shape (seqlen_q 1, GQA 8 packed) on some of each.
PAGED = [(16, True, False), (32, False, False), (64, False, False), (128, True, True),
         (256, False, False), (16, True, True), (1, True, False), (4, False, True)]


def _pieces_per_iteration(plan, page_size):
    """The TMA copies of one key block's pieces in the PTX: a gather's run-time loop issues
    GATHER_UNROLL per iteration, one loop per group of 32 pages (Note [paged key blocks])."""
    from fa4lab.kernels.device.paged import GATHER_UNROLL, page_groups, pages_per_block

    n_block = plan.tiles.n_block
    return page_groups(page_size, n_block) * min(pages_per_block(page_size, n_block),
                                                 GATHER_UNROLL)


def _cp_async_copies_per_block(plan):
    """The 16-byte cp.async copies of one key block's K and V per thread in the PTX: the block's
    passes times each row's spans a thread takes (Note [cp.async gather])."""
    d, dv = plan.tiles.head_dim, plan.tiles.head_dim_v
    tpr = cp_async_row_threads(d, dv)
    passes = plan.tiles.n_block // cp_async_rows_per_pass(d, dv)
    return passes * (d * 2 // 16 // tpr + dv * 2 // 16 // tpr)


@pytest.mark.compile
@pytest.mark.parametrize("page_size,causal,decode", PAGED, ids=[
    f"page{p}-{'causal' if c else 'full'}{'-decode' if d else ''}" for p, c, d in PAGED])
def test_paged_compiles_for_sm90a(page_size, causal, decode, tmp_path):
    """The paged K/V loads: the same audit (no spills, the protocol table unchanged: a gather's
    copies all land on the block's one full barrier)."""
    from audit_checks import compile_and_audit

    from fa4lab.plan import plan_forward

    shape = (64, 1, 8192, 64, 8) if decode else (2, 300, 1024, 8, 2)
    spec = AttentionSpec(*shape, 128, causal=causal, return_lse=True, page_size=page_size)
    plan = plan_forward(spec, "sm90", pack_gqa=True) if decode else plan_forward(spec, "sm90")
    cf = compile_and_audit(plan, "sm90a", tmp_path)
    assert cf.keep_dir.name.endswith(f"-page{page_size}" + ("-packgqa" if decode else ""))
    ptx = cf.ptx_path.read_text()
    # (a page of one key is a 3-d box: its unit key mode folds away)
    loads = len(re.findall(r"cp\.async\.bulk\.tensor\.[34]d\.shared::cta\.global", ptx))
    rows = len(re.findall(r"cp\.async\.cg\.shared\.global", ptx))
    arrives = len(re.findall(r"cp\.async\.mbarrier\.arrive\.noinc", ptx))
    # Q: one copy per consumer and 64-column half. K and V at four sites (first K, the loop's
    # K and V, last V): pages below 16 by cp.async, each site a block's passes times its
    # 16-byte spans per thread and one arrival (Note [cp.async gather]); larger pages by TMA,
    # each site the pieces of one iteration of the gather's loop times the halves.
    if page_loader("sm90", page_size, plan.tiles.n_block) == "cp.async":
        assert (loads, rows, arrives) == (plan.tiles.q_stage * 2,
                                          2 * _cp_async_copies_per_block(plan), 4)
    else:
        assert rows == arrives == 0
        assert loads == plan.tiles.q_stage * 2 + 4 * _pieces_per_iteration(plan, page_size) * 2


# cp.async pages at every other head dim (Note [cp.async gather] in
# fa4lab.kernels.device.page_rows): a page of one key at head_dim 96 (four threads a row, 32 rows
# a pass), three consumers at 64, key blocks of 112 and 80 keys, a page no TMA read fits (100).
CP_ASYNC = [(96, 96, 1, True), (64, 64, 4, False), (192, 128, 2, True), (256, 256, 100, False)]


@pytest.mark.compile
@pytest.mark.parametrize("d,dv,page_size,causal", CP_ASYNC,
                         ids=[f"hd{d}x{dv}-page{p}" for d, dv, p, _ in CP_ASYNC])
def test_cp_async_pages_compile_at_every_head_dim(d, dv, page_size, causal, tmp_path):
    """The audit holds (no spills, the producer's and consumers' setmaxnreg, k_full / v_full
    initialised with 128 arrivals, the protocol table op by op), and the PTX copies each key
    block in 16-byte cp.async rows: a block's passes times each thread's spans, K then V."""
    from audit_checks import compile_and_audit

    from fa4lab.plan import plan_forward

    spec = AttentionSpec(2, 300, 1024, 8, 2, d, dv, causal=causal, page_size=page_size)
    plan = plan_forward(spec, "sm90")
    assert plan.tiles.kv_load == "cp.async"
    cf = compile_and_audit(plan, "sm90a", tmp_path)
    ptx = cf.ptx_path.read_text()
    copies = 2 * _cp_async_copies_per_block(plan)   # K and V each at two sites
    assert len(re.findall(r"cp\.async\.cg\.shared\.global", ptx)) == copies
    assert len(re.findall(r"cp\.async\.mbarrier\.arrive\.noinc", ptx)) == 4


# Split-KV over a paged cache (Note [empty splits] in fa4lab.kernels.device.split): the decode
# shape (seqlen_q 1, GQA 8 packed) one CTA per tile, as paged launches run (ragged key counts:
# `persistent_default`), a gather of 8 and 2 pages per key block and one TMA box per block;
# causal is LPT order, the producer's tightest registers.
PAGED_SPLIT = [(16, True), (64, False), (128, True)]


@pytest.mark.compile
@pytest.mark.parametrize("page_size,causal", PAGED_SPLIT, ids=[
    f"page{p}-{'causal' if c else 'full'}" for p, c in PAGED_SPLIT])
def test_paged_split_kv_compiles_for_sm90a(page_size, causal, tmp_path):
    """The split kernel over a paged cache: the same audit (no spills, the protocol table
    unchanged), its pages read as the one-launch paged kernel reads them and its partials
    stored as the split kernel stores them."""
    from audit_checks import compile_and_audit

    from fa4lab.plan import plan_forward
    from fa4lab.plan.sm90 import persistent_default

    spec = AttentionSpec(64, 1, 8192, 64, 8, 128, causal=causal, page_size=page_size,
                         split_kv=True)
    persistent = persistent_default(128, 128, causal, 1, 8192, ragged=True)
    plan = plan_forward(spec, "sm90", pack_gqa=True, persistent=persistent)
    cf = compile_and_audit(plan, "sm90a", tmp_path)
    assert cf.keep_dir.name.endswith(f"-page{page_size}-splitkv-packgqa")
    ptx = cf.ptx_path.read_text()
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.[34]d\.shared::cta\.global", ptx)) == (
        plan.tiles.q_stage * 2 + 4 * _pieces_per_iteration(plan, page_size) * 2)
    assert "st.global.v2.f32" in ptx or "st.global.v2.b32" in ptx
    assert "cp.async.bulk.tensor.4d.global.shared" not in ptx
