"""pack-GQA on sm90 without a GPU: the plan switch, the kernel's index maps, compile and audit.

The GPU half (the kernel's numbers against the float64 reference) is `test_pack_gqa` in
tests/test_sm90.py. Here, tier 1:
* `plan_forward(spec, "sm90", pack_gqa=True)` records the switch, round-trips through JSON,
  and refuses what the kernel cannot do (a head ratio that does not divide m_block);
* the kernel's packed row map and its block ranges (fa4lab.tiling's over positions, see
  Note [sm90 pack-GQA kernel] in fa4lab/kernels/fwd_sm90.py) agree with `fa4lab.tiling`, and
  the kernel's own walk run on the CPU (tests/kernel_walk.py) covers every (position, head)
  row exactly once, skips only invisible keys and leaves unmasked only fully visible blocks;
* the Q/O TMA view maps tile rows to the right (head, position) coordinates (traced, static
  shapes), and the kernel compiles for sm_90a and passes the binary audit.
"""

from __future__ import annotations

import json

import pytest
from audit_checks import compile_and_audit
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_walk import check_walk

from fa4lab import gqa, tiling
from fa4lab.errors import PlanError
from fa4lab.kernels.device import scheduler
from fa4lab.plan import Plan, plan_forward
from fa4lab.spec import AttentionSpec

M_BLOCK, Q_STAGE = 64, 2   # the sm90 plan's consumer tile and consumer count


def spec(hd=128, causal=False, hq=8, hkv=2, sq=300, sk=700, lse=True):
    return AttentionSpec(2, sq, sk, hq, hkv, hd, causal=causal, return_lse=lse)


# ------------------------------------------------------------------------------ the plan

def test_plan_default_is_unpacked():
    assert plan_forward(spec(), "sm90").tiles.pack_gqa is False
    assert plan_forward(spec(), "sm100").tiles.pack_gqa is False


@pytest.mark.parametrize("causal", [False, True])
def test_plan_override_round_trips(causal):
    p = plan_forward(spec(causal=causal), "sm90", pack_gqa=True)
    assert p.tiles.pack_gqa is True
    assert p != plan_forward(spec(causal=causal), "sm90")
    d = json.loads(p.to_json())
    assert d["tiles"]["pack_gqa"] is True
    assert Plan.from_dict(d) == p and Plan.from_json(p.to_json()) == p
    # A plan written before the switch existed reads back unpacked.
    del d["tiles"]["pack_gqa"]
    assert Plan.from_dict(d).tiles.pack_gqa is False
    # Packing changes only which rows a CTA owns: same SMEM, barriers and MMAs.
    q = plan_forward(spec(causal=causal), "sm90")
    assert (p.smem, p.barriers, p.mmas, p.roles) == (q.smem, q.barriers, q.mmas, q.roles)


def test_plan_pack_without_gqa_is_a_no_op():
    assert plan_forward(spec(hq=4, hkv=4), "sm90", pack_gqa=True).tiles.pack_gqa is False


def test_plan_rejects_bad_ratio_and_non_bool():
    # sm100 packs too (tests/test_pack_gqa_sm100.py).
    assert plan_forward(spec(), "sm100", pack_gqa=True).tiles.pack_gqa is True
    with pytest.raises(PlanError, match="qhead_per_kvhead must divide m_block"):
        plan_forward(spec(hq=12, hkv=4), "sm90", pack_gqa=True)
    with pytest.raises(PlanError, match="True or False"):
        plan_forward(spec(), "sm90", pack_gqa=1)
    assert plan_forward(spec(), "sm100", pack_gqa=False).tiles.pack_gqa is False


def test_kernel_key_tells_packed_from_unpacked():
    torch = pytest.importorskip("torch")
    from fa4lab.call import check_call

    def key(s, arch, packed=False):
        q = torch.empty(1, 8, s.heads_q, s.head_dim, dtype=torch.bfloat16)
        k = torch.empty(1, 8, s.heads_kv, s.head_dim, dtype=torch.bfloat16)
        return check_call(q, k, k, causal=s.causal, return_lse=s.return_lse,
                          pack_gqa=packed).key(arch)

    s = spec()
    assert key(s, "sm90", True) != key(s, "sm90")
    assert key(s, "sm90", False) == key(s, "sm90")
    one = spec(hq=4, hkv=4)  # nothing to pack: one kernel
    assert key(one, "sm90", True) == key(one, "sm90")
    # pack_gqa=None (the API's default) is limits.pack_gqa_default: pack a ratio that divides
    # the Q tile's rows (64 on sm90) when that takes fewer tiles (here 8 rows: 1 tile, not 4).
    assert key(s, "sm90", None) == key(s, "sm90", True) == key(s, "sm90", None)
    odd = spec(hq=6, hkv=2)
    assert key(odd, "sm90", None) == key(odd, "sm90", False)
    assert key(one, "sm90", None) == key(one, "sm90", False)


def test_pack_gqa_default_packs_when_it_takes_fewer_tiles():
    from fa4lab.limits import Q_TILE_ROWS, pack_gqa_default

    def tiles(sq, g, rows, packed):  # Q tiles the CTAs of one KV head compute, by enumeration
        if packed:
            return len({r // rows for r in range(sq * g)})
        return sum(len({i // rows for i in range(sq)}) for _ in range(g))

    for arch, rows in Q_TILE_ROWS.items():
        for g in range(1, 20):
            for sq in (1, 2, 7, rows // 2, rows - 1, rows, rows + 1, 3 * rows, 1000):
                want = (g > 1 and rows % g == 0
                        and tiles(sq, g, rows, True) < tiles(sq, g, rows, False))
                assert pack_gqa_default(arch, g, sq) == want, (arch, g, sq)
        assert pack_gqa_default(arch, 4, 1) and not pack_gqa_default(arch, 4, 8192)
        assert plan_forward(spec(), arch).tiles.m_block == rows   # the plans' tile, said once



@pytest.mark.parametrize("g", [2, 4, 8, 16])
def test_pack_gqa_default_packs_narrow_windows_on_sm90(g):
    """Under a window, a packed tile's rows hold g times fewer positions, so it reads fewer
    keys: counted here tile by tile (the keys from its first row's window start to its last
    row's window end), packed against unpacked; pack_gqa=None packs on sm90 where that count
    falls by NARROW_WINDOW_PACK_GAIN or more (Note [narrow windows pack]), never on sm100."""
    from fa4lab.limits import NARROW_WINDOW_PACK_GAIN, Q_TILE_ROWS, pack_gqa_default

    rows, seqlen = Q_TILE_ROWS["sm90"], 4096

    def keys_read(positions_of_tiles, left, right):
        return sum(min(seqlen - 1, hi + right) - max(0, lo - left) + 1
                   for lo, hi in positions_of_tiles)

    unpacked = [(t, min(t + rows, seqlen) - 1) for t in range(0, seqlen, rows)]
    packed = [(r // g, (min(r + rows, seqlen * g) - 1) // g) for r in range(0, seqlen * g, rows)]
    decided = 0
    for left, right in [(0, 0), (16, 0), (63, 0), (128, 0), (127, 128), (256, 0), (512, 0),
                        (1024, 0), (4096, 0), (None, 0), (128, None)]:
        window = (left, right)
        if left is None or right is None:
            assert not pack_gqa_default("sm90", g, seqlen, window)
            continue
        gain = g * keys_read(unpacked, left, right) / keys_read(packed, left, right)
        assert not pack_gqa_default("sm100", g, seqlen, window), window
        if abs(gain - NARROW_WINDOW_PACK_GAIN) < 0.05:     # the edge of a sequence decides
            continue
        assert pack_gqa_default("sm90", g, seqlen, window) == (gain >= NARROW_WINDOW_PACK_GAIN), \
            (g, window, gain)
        decided += 1
    assert decided >= 6
    # negative sides (upstream's: no key seen near the diagonal) leave a span of 0 or less
    assert pack_gqa_default("sm90", g, seqlen, (-40, 8))

# ------------------------------------------------------- the kernel's index maps (emulated)

def kernel_row_map(m_block, wg, r, kv_head, g):
    """What the kernel computes for row r of consumer wg's tile (see fwd_sm90.epilogue)."""
    from fa4lab.kernels.device.pack_gqa import unpack_row

    row = (m_block * Q_STAGE + wg) * M_BLOCK + r
    pos, head = unpack_row(row, kv_head, g)
    return row, head, pos


@pytest.mark.parametrize("g", [2, 4, 8])
def test_row_map_matches_tiling(g):
    hkv, sq = 3, 70
    hq = hkv * g
    n_m = scheduler.num_m_blocks(sq * g, M_BLOCK * Q_STAGE)
    for kv in range(hkv):
        for m in range(n_m):
            for wg in range(Q_STAGE):
                for r in range(M_BLOCK):
                    row, head, pos = kernel_row_map(m, wg, r, kv, g)
                    if row >= sq * g:
                        continue
                    assert (head, pos) == gqa.unpack_gqa_row(
                        kv, row, heads_q=hq, heads_kv=hkv, seqlen_q=sq)
                    assert gqa.pack_gqa_row(head, pos, heads_q=hq, heads_kv=hkv,
                                               seqlen_q=sq) == (kv, row)


@given(sq=st.integers(1, 1500), sk=st.integers(1, 3000), g=st.sampled_from([2, 4, 8, 16]),
       q_stage=st.sampled_from([1, 2]), n=st.sampled_from([80, 128]), causal=st.booleans(),
       data=st.data())
@settings(max_examples=300, deadline=None)
def test_packed_block_ranges_match_tiling(sq, sk, g, q_stage, n, causal, data):
    """The kernel's block ranges with pack = g are fa4lab.tiling's packed ranges."""
    cta_m = M_BLOCK * q_stage
    m = data.draw(st.integers(0, tiling.num_m_blocks(sq, cta_m, g) - 1))
    kw = dict(seqlen_q=sq, seqlen_k=sk, m_block_size=cta_m, n_block_size=n, causal=causal,
              qhead_per_kvhead=g)
    lo, hi = tiling.n_block_range(m, **kw)
    mask_lo, _ = tiling.n_block_masked_range(m, **kw)
    right = 0 if causal else None
    assert scheduler.block_range(m, cta_m, g, n, sq, sk, None, right) == (lo, hi)
    assert scheduler.mask_split(m, cta_m, g, n, sq, sk, None, right, lo, hi)[1] == mask_lo


@pytest.mark.parametrize("sq,sk", [(1, 1000), (17, 1000), (1000, 17), (300, 301), (5, 3)])
@pytest.mark.parametrize("g", [2, 8])
@pytest.mark.parametrize("causal", [False, True])
def test_emulated_tile_loop(sq, sk, g, causal):
    """Every packed tile as the kernel walks it (its own index code on the CPU: the rows it
    stores, the blocks it visits, the ones it masks) against the brute-force visibility of
    each (position, key). Windows: tests/test_window_sink.py."""
    check_walk("sm90", sq, sk, g, causal)


# --------------------------------------------------------------- traced TMA view, compile

@pytest.mark.compile
def test_packed_tma_view_coordinates():
    """`_packed_tma`'s view, tiled as the kernel tiles it: row r of tile t of KV head kv is
    TMA coordinate (col, kv * g + r % g, t * 64 / g + r // g, batch)."""
    pytest.importorskip("cutlass")
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.nvgpu import cpasync
    from cutlass.cute.runtime import make_fake_tensor

    from fa4lab.kernels.compile import target_arch
    from fa4lab.kernels.fwd_sm90 import _packed_tma, _smem_layout

    g, sq, hq, d, kv, batch = 4, 300, 8, 128, 1, 1
    seen = {}

    @cute.jit
    def trace(mQ):  # no annotation: postponed ones would not resolve in the DSL
        mQ = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[1, 3, 2, 0]))
        sQ = _smem_layout(cutlass.BFloat16, M_BLOCK, d, Q_STAGE)
        _, coords = _packed_tma(cpasync.CopyBulkTensorTileG2SOp(), mQ,
                                cute.select(sQ, mode=[0, 1]), (M_BLOCK, d), g)
        gQ = cute.local_tile(coords[None, None, kv, batch], (M_BLOCK, d), (None, 0))
        seen["tiles"] = cute.size(gQ, mode=[2])
        for t in (0, 3, 18):
            for r in tuple(range(M_BLOCK)):  # a Python loop: static coordinates
                seen[(t, r)] = tuple(int(x) for x in gQ[(r, 5, t)])

    q = make_fake_tensor(cutlass.BFloat16, (2, sq, hq, d), (sq * hq * d, hq * d, d, 1),
                         assumed_align=16)
    with target_arch("sm_90a"):
        cute.compile(trace, q)
    assert seen["tiles"] == tiling.ceil_div(sq * g, M_BLOCK)
    for t in (0, 3, 18):
        for r in range(M_BLOCK):
            head, pos = gqa.unpack_gqa_row(kv, t * M_BLOCK + r, heads_q=hq,
                                              heads_kv=hq // g, seqlen_q=sq + M_BLOCK)
            assert seen[(t, r)] == (5, head, pos, batch), (t, r)


@pytest.mark.slow
@pytest.mark.compile
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_packed_kernel_compiles_and_passes_audit(head_dim, causal, tmp_path):
    plan = plan_forward(spec(head_dim, causal, hq=8, hkv=2, lse=causal), "sm90", pack_gqa=True)
    assert plan.tiles.pack_gqa and plan.spec.qhead_per_kvhead == 4
    cf = compile_and_audit(plan, "sm90a", tmp_path)
    assert cf.kernel.pack == 4


def test_api_reference_ignores_pack_gqa():
    torch = pytest.importorskip("torch")
    import fa4lab
    from fa4lab.api import SlowReferenceWarning

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, h, 64, generator=g) for n, h in ((5, 4), (9, 2), (9, 2)))
    with pytest.warns(SlowReferenceWarning):
        packed = fa4lab.attention(q, k, v, causal=True, pack_gqa=True)
    with pytest.warns(SlowReferenceWarning):
        assert torch.equal(packed, fa4lab.attention(q, k, v, causal=True))
    with pytest.raises(TypeError, match=r"pack_gqa must be None \(choose\), True or False"):
        fa4lab.attention(q, k, v, pack_gqa="yes")


def test_sm90_packs_head_dim_64_with_its_three_consumers():
    """Note [sm90 packs head_dim 64]: pack_gqa=None packs a GQA call at head_dim 64 on sm90 (a
    long prompt, where the tile count alone would not), never at 128 or on sm100, and the
    packed plan keeps the tuning's three consumers."""
    from fa4lab.limits import pack_gqa_default

    for g in (2, 4, 8, 16):
        assert pack_gqa_default("sm90", g, 4096, head_dim=64)
        assert not pack_gqa_default("sm90", g, 4096, head_dim=128)
        assert not pack_gqa_default("sm100", g, 4096, head_dim=64)
    assert not pack_gqa_default("sm90", 1, 4096, head_dim=64)      # nothing to pack
    assert not pack_gqa_default("sm90", 6, 4096, head_dim=64)      # 6 does not divide 64 rows
    packed = plan_forward(spec(hd=64, hq=16, hkv=2, sq=4096, sk=4096), "sm90", pack_gqa=True)
    unpacked = plan_forward(spec(hd=64, hq=16, hkv=2, sq=4096, sk=4096), "sm90")
    assert packed.tiles.pack_gqa and packed.tiles.q_stage == unpacked.tiles.q_stage == 3
