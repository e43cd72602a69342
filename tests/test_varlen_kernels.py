"""The varlen kernels on the CPU: the tile table against a brute-force enumeration, the device
sequence helpers on Python ints, and the sm90a / sm100a varlen kernels compiled and audited
(no spills, the plan's protocol). Tier 0 and tier 1: no GPU."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_varlen import assert_lpt_by_sequence

from fa4lab import tiling
from fa4lab.errors import PlanError
from fa4lab.spec import AttentionSpec
from fa4lab.varlen_tiles import varlen_tile_table, varlen_tiles

_LENGTHS = st.lists(st.tuples(st.integers(0, 300), st.integers(0, 400)), min_size=1,
                    max_size=6)


@settings(max_examples=100, deadline=None)
@given(_LENGTHS, st.sampled_from([64, 128, 192]), st.sampled_from([64, 128]), st.booleans(),
       st.sampled_from([(None, None), (50, None), (30, 7)]), st.integers(1, 5))
def test_tile_table_is_every_real_tile_longest_first(lengths, cta_m, n_block, causal, window,
                                                     heads):
    lens_q, lens_k = [a for a, _ in lengths], [b for _, b in lengths]
    window = (window[0], 0 if causal and window[1] is not None else window[1])
    opts = dict(m_block_size=cta_m, n_block_size=n_block, causal=causal, window_size=window)
    rows = varlen_tile_table(lens_q, lens_k, **opts)
    assert rows.table.dtype == np.int32 and rows.table.shape[1] == 2
    want = {(b, m) for b, lq in enumerate(lens_q) for m in range(tiling.ceil_div(lq, cta_m))}
    got = [tuple(r) for r in rows.table.tolist()]
    assert len(got) == len(set(got)) and set(got) == want, "a padding tile or a missing tile"
    assert_lpt_by_sequence(rows.table[:, 0], rows.costs)
    # Each row's key blocks: the brute-force count of blocks with a visible key.
    for (b, m), blocks in zip(got, rows.key_blocks.tolist()):
        lq, lk = lens_q[b], lens_k[b]
        if lk == 0:
            assert blocks == 0
            continue
        from fa4lab.reference import visible_mask

        mask = visible_mask(lq, lk, causal, window_size=window)[m * cta_m:(m + 1) * cta_m]
        assert blocks == sum(mask[:, n:n + n_block].any() for n in range(0, lk, n_block)), (b, m)
    # The kernel's lookup (tile t -> row t // heads, head t % heads) walks varlen_tiles' list.
    from fa4lab.kernels.device import scheduler

    listed = varlen_tiles(lens_q, lens_k, heads=heads, **opts)
    looked_up = [scheduler.varlen_coords(t, rows.table, heads)
                 for t in range(len(got) * heads)]
    assert [(int(b), int(h), int(m)) for m, h, b in looked_up] == [
        tuple(r) for r in listed.tiles.tolist()]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50), st.integers(0, 50)),
                min_size=1, max_size=6), st.booleans(), st.data())
def test_sequence_reads_offsets_and_lengths(lengths, with_used, data):
    from fa4lab.kernels.device.seqlen import sequence

    lens_q = [a for a, _, _ in lengths]
    lens_k = [b + c for _, b, c in lengths]
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).tolist()
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).tolist()
    used = [b for _, b, _ in lengths] if with_used else None
    b = data.draw(st.integers(0, len(lengths) - 1))
    s = sequence(b, 999, 998, cu_q, cu_k, used)
    assert (s.offset_q, s.seqlen_q) == (sum(lens_q[:b]), lens_q[b])
    assert (s.offset_k, s.seqlen_k) == (sum(lens_k[:b]), (used or lens_k)[b])
    # Not varlen: the fixed sizes, with or without seqused_k (ragged keys on the padded layout).
    assert sequence(b, 999, 998)[:4] == (0, 999, 0, 998)
    assert sequence(b, 999, 998, seqused_k=used)[:4] == (0, 999, 0, used[b] if used else 998)
    assert s.reread_offset_k() == s.offset_k


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-2**31, 2**31 - 1), min_size=2, max_size=6),
       st.lists(st.integers(-2**31, 2**31 - 1), min_size=2, max_size=6),
       st.integers(0, 5000), st.integers(0, 5000), st.data())
def test_bad_cu_seqlens_stay_inside_the_packed_rows(cu_q, cu_k, total_q, total_k, data):
    """Note [clamped lengths]: whatever cu_seqlens hold, a sequence's rows lie inside the
    launch's packed totals (so every store and plain load stays inside the tensors), and the
    re-read of offset_k is clamped the same way."""
    from fa4lab.kernels.device.seqlen import sequence

    batch = min(len(cu_q), len(cu_k)) - 1
    b = data.draw(st.integers(0, batch - 1))
    s = sequence(b, total_q, total_k, cu_q, cu_k)
    assert 0 <= s.offset_q and 0 <= s.seqlen_q and s.offset_q + s.seqlen_q <= total_q
    assert 0 <= s.offset_k and 0 <= s.seqlen_k and s.offset_k + s.seqlen_k <= total_k
    assert s.reread_offset_k() == s.offset_k
    if 0 <= cu_q[b] <= cu_q[b + 1] <= total_q:      # a good entry: the clamp changes nothing
        assert (s.offset_q, s.seqlen_q) == (cu_q[b], cu_q[b + 1] - cu_q[b])


def test_varlen_plans_refuse_pack_gqa():
    from fa4lab.plan import plan_forward

    spec = AttentionSpec(3, 500, 700, 8, 2, 128, varlen=True)
    for arch in ("sm90", "sm100"):
        assert not getattr(plan_forward(spec, arch).tiles, "pack_gqa", False)
        with pytest.raises(PlanError, match="varlen"):
            plan_forward(spec, arch, pack_gqa=True)


# The sm90 varlen variants: persistent (non-causal) and one CTA per tile (causal), a window
# with a learnable sink, and head_dim 64 (three consumers, the tightest registers).
SM90_VARLEN = {
    "hd128-full": dict(head_dim=128),
    "hd128-causal-softcap": dict(head_dim=128, causal=True, softcap=30.0),
    "hd64-causal-left-sink": dict(head_dim=64, causal=True, window_size=(100, 0),
                                  learnable_sink=True),
    "hd256-full-right": dict(head_dim=256, window_size=(None, 40)),
    "hd96-causal": dict(head_dim=96, causal=True),
    "hd192-128-full": dict(head_dim=192, head_dim_v=128),
}


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_varlen_row_stores_tile_every_head_dim(arch):
    """The varlen epilogue's row store (`seqlen.store_rows`) at every head_dim_v the kernel
    builds: whole rows per pass, a power of two of them (so a pass divides the 64- or 128-row
    staging tile and its 8-row swizzle atom), no more threads than the role has. Head dim 96
    (12 chunks of 16 bytes per row) once took 10 rows per pass with 120 of 128 threads: a
    tiling of the 64-row swizzled tile that no pass divides, which wrote NaN and other rows'
    values into O on every call."""
    from fa4lab.kernels.device.seqlen import store_rows_threads
    from fa4lab.limits import Q_TILE_ROWS, head_dims_for

    threads = {"sm90": 128, "sm100": 32}[arch]   # a consumer warpgroup; the epilogue warp
    for _, dv in head_dims_for(arch):
        cols = dv * 2 // 16
        rows, active = store_rows_threads(cols, threads)
        assert rows & (rows - 1) == 0 and Q_TILE_ROWS[arch] % rows == 0, (dv, rows)
        assert active == rows * cols <= threads, (dv, active)
        assert 2 * rows * cols > threads, f"dv {dv}: {rows} rows per pass leave half idle"


@pytest.mark.compile
@pytest.mark.parametrize("name", list(SM90_VARLEN))
def test_varlen_compiles_for_sm90a(name, tmp_path):
    """The varlen kernel (seqused_k included: a varlen launch always passes the key counts)
    compiles for sm_90a and its binary holds to the plan: no spills, the protocol table."""
    from audit_checks import compile_and_audit

    from fa4lab.plan import plan_forward

    spec = AttentionSpec(3, 500, 700, 8, 2, return_lse=True, varlen=True, **SM90_VARLEN[name])
    cf = compile_and_audit(plan_forward(spec, "sm90"), "sm90a", tmp_path)
    assert cf.keep_dir.name.endswith("-varlen")
    ptx = cf.ptx_path.read_text()
    # O leaves row by row (16-byte stores), not by a TMA store that would cross a sequence.
    assert "cp.async.bulk.tensor" in ptx and "st.global.v4" in ptx
    assert "cp.async.bulk.tensor.2d.global.shared" not in ptx.replace("::", ".")


@pytest.mark.compile
@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_seqused_k_without_varlen_compiles(arch, tmp_path):
    """seqused_k on the padded (batch, seqlen, heads, d) layout (ragged keys, as a paged decode
    needs): the kernel reads each sequence's key count, and audits like the others."""
    from audit_checks import compile_and_audit

    from fa4lab.plan import plan_forward

    spec = AttentionSpec(3, 500, 700, 8, 2, 128, causal=True, return_lse=True)
    cf = compile_and_audit(plan_forward(spec, arch), arch + "a", tmp_path, seqused_k=True)
    assert cf.keep_dir.name.endswith("-seqused")
    assert "ld.global" in cf.ptx_path.read_text()     # the key counts


@pytest.mark.compile
@pytest.mark.parametrize("arch,page_size", [("sm90", 16), ("sm90", 128), ("sm100", 16),
                                            ("sm100", 64), ("sm100", 128)])
def test_paged_varlen_compiles(arch, page_size, tmp_path):
    """Packed q beside a paged cache (Note [paged key blocks] in fa4lab.kernels.device.paged:
    the cache is neither offset nor viewed as a batch of one, and a paged varlen launch has no
    cu_seqlens_k): compiles and audits like the others, on a gather and a one-box page."""
    from audit_checks import compile_and_audit

    from fa4lab.plan import plan_forward

    spec = AttentionSpec(3, 500, 700, 8, 2, 128, causal=True, return_lse=True, varlen=True,
                         page_size=page_size)
    cf = compile_and_audit(plan_forward(spec, arch), arch + "a", tmp_path)
    assert cf.keep_dir.name.endswith(f"-varlen-page{page_size}")


@settings(max_examples=100, deadline=None)
@given(_LENGTHS, st.sampled_from([64, 128, 192]), st.sampled_from([64, 128]), st.booleans(),
       st.sampled_from([(None, None), (50, None)]), st.integers(0, 3))
def test_device_tile_rows_are_the_table_then_padding(lengths, cta_m, n_block, causal, window,
                                                     extra_rows):
    """A launch's table (`tile_rows` sized by `max_tile_rows`, no read of the lengths) is the
    host table's rows, then padding rows (batch, 0) of the phantom sequence, cost -1."""
    import torch

    from fa4lab.varlen_tiles import max_tile_rows, tile_rows

    lens_q, lens_k = [a for a, _ in lengths], [b for _, b in lengths]
    opts = dict(m_block_size=cta_m, n_block_size=n_block, causal=causal, window_size=window)
    host = varlen_tile_table(lens_q, lens_k, **opts)
    bound = max_tile_rows(sum(lens_q), len(lens_q), cta_m)
    assert len(host.table) <= bound, "the bound undercounts"
    table, costs, blocks = tile_rows(torch.tensor(lens_q), torch.tensor(lens_k),
                                     bound + extra_rows, **opts)
    real = len(host.table)
    assert table.shape == (bound + extra_rows, 2) and table.dtype == torch.int32
    assert np.array_equal(table[:real].numpy(), host.table)
    assert np.array_equal(costs[:real].numpy(), host.costs)
    assert np.array_equal(blocks[:real].numpy(), host.key_blocks)
    assert (table[real:, 0] == len(lens_q)).all() and (table[real:, 1] == 0).all()
    assert (costs[real:] == -1).all() and (blocks[real:] == 0).all()


@settings(max_examples=150, deadline=None)
@given(_LENGTHS, st.sampled_from([64, 128, 192]), st.booleans(),
       st.sampled_from([(None, None), (50, None), (30, 7)]), st.integers(0, 3))
def test_launch_tile_rows_hold_every_real_tile_by_sequence(lengths, cta_m, causal, window,
                                                           extra_rows):
    """The launch's cheap table (Note [launch tile table]): exactly the host table's real
    rows, each sequence's rows together (its L2 section), padding rows (batch, 0) last; causal
    without a window, the cost model's order itself where key counts rank the sequences as
    their longest tiles' costs do."""
    import torch

    from fa4lab.varlen_tiles import launch_tile_rows, max_tile_rows

    if causal and window[1] is not None:
        window = (window[0], 0)
    lens_q, lens_k = [a for a, _ in lengths], [b for _, b in lengths]
    host = varlen_tile_table(lens_q, lens_k, m_block_size=cta_m, n_block_size=128,
                             causal=causal, window_size=window)
    rows = max_tile_rows(sum(lens_q), len(lens_q), cta_m) + extra_rows
    table = launch_tile_rows(torch.tensor(lens_q), torch.tensor(lens_k), rows,
                             m_block_size=cta_m, causal=causal, window_size=window).numpy()
    real = len(host.table)
    assert table.shape == (rows, 2) and table.dtype == np.int32
    assert sorted(map(tuple, table[:real])) == sorted(map(tuple, host.table))
    assert (table[real:, 0] == len(lens_q)).all() and (table[real:, 1] == 0).all()
    seqs = [b for i, b in enumerate(table[:real, 0]) if i == 0 or table[i - 1, 0] != b]
    assert len(seqs) == len(set(seqs)), "a sequence's rows are not together"
    cost = {tuple(row): c for row, c in zip(host.table, host.costs)}
    step = -1 if causal else 1      # each sequence's m_blocks: last first when causal
    assert all(table[i + 1, 1] - table[i, 1] == step for i in range(real - 1)
               if table[i, 0] == table[i + 1, 0])
    if causal and window == (None, None):
        tops = [max(c for row, c in cost.items() if row[0] == s) for s in seqs]
        host_seqs = [b for i, b in enumerate(host.table[:, 0])
                     if i == 0 or host.table[i - 1, 0] != b]
        if len(set(tops)) == len(tops) and tops == sorted(tops, reverse=True):
            assert seqs == host_seqs
