"""pack-GQA on sm100 without a GPU: the plan switch, the kernel's index maps, compile and audit.

The GPU half (the kernel's numbers against the float64 reference) is `test_pack_gqa` in
tests/test_sm100.py, which needs a B200. Here, tier 0 and 1:
* `plan_forward(spec, "sm100", pack_gqa=True)` records the switch, round-trips through JSON,
  keeps TMEM, SMEM, barriers, roles and MMAs of the unpacked plan, and refuses a head ratio that
  does not divide m_block = 128;
* the kernel's block ranges (fa4lab.tiling's over positions: cta_m / g per CTA, m_block / g
  per Q tile for the softmax's mask_min, see Note [sm100 pack-GQA kernel] in
  fa4lab/kernels/fwd_sm100.py) agree with `fa4lab.tiling`, and the kernel's own walk run on
  the CPU (tests/kernel_walk.py: softmax mask on row // g, LSE address) covers every
  (position, head) row exactly once, sees exactly its visible keys and leaves unmasked only
  fully visible blocks;
* the Q TMA view (the score MMA's A-operand atom) and the O view map tile rows to the right
  (head, position) coordinates (traced, static shapes), and the packed kernel compiles for
  sm_100a and passes the binary audit.
"""

from __future__ import annotations

import json

import pytest
from audit_checks import compile_and_audit
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_walk import check_walk
from matrix import matrix

from fa4lab import gqa, tiling
from fa4lab.errors import PlanError, UnsupportedArchError
from fa4lab.kernels.device import scheduler
from fa4lab.plan import Plan, plan_forward
from fa4lab.spec import AttentionSpec

M_BLOCK, Q_STAGE = 128, 2   # the sm100 plan's Q tile (one TMEM lane per row) and Q tiles per CTA
CTA_M = M_BLOCK * Q_STAGE


def spec(hd=128, causal=False, hq=8, hkv=2, sq=300, sk=700, lse=True):
    return AttentionSpec(2, sq, sk, hq, hkv, hd, causal=causal, return_lse=lse)


# ------------------------------------------------------------------------------ the plan

@pytest.mark.parametrize("hq,hkv", [(8, 2), (16, 2), (128, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_plan_accepts_and_round_trips(causal, hq, hkv):
    p = plan_forward(spec(causal=causal, hq=hq, hkv=hkv), "sm100", pack_gqa=True)
    q = plan_forward(spec(causal=causal, hq=hq, hkv=hkv), "sm100")
    assert p.tiles.pack_gqa is True and q.tiles.pack_gqa is False
    assert p != q
    d = json.loads(p.to_json())
    assert d["tiles"]["pack_gqa"] is True
    assert Plan.from_dict(d) == p and Plan.from_json(p.to_json()) == p
    # Packing changes only which rows a CTA owns.
    assert (p.tmem, p.smem, p.barriers, p.mmas, p.roles) == (q.tmem, q.smem, q.barriers,
                                                              q.mmas, q.roles)
    assert p.tiles.m_block % (hq // hkv) == 0
    assert any("pack-GQA" in n for n in p.notes)


def test_plan_pack_without_gqa_is_a_no_op():
    p = plan_forward(spec(hq=4, hkv=4), "sm100", pack_gqa=True)
    assert p.tiles.pack_gqa is False and p == plan_forward(spec(hq=4, hkv=4), "sm100")


@pytest.mark.parametrize("hq,hkv", [(12, 4), (6, 2), (10, 2), (48, 1)])
def test_plan_rejects_a_ratio_that_does_not_divide_m_block(hq, hkv):
    with pytest.raises(PlanError) as info:
        plan_forward(spec(hq=hq, hkv=hkv), "sm100", pack_gqa=True)
    msg = str(info.value)
    assert f"qhead_per_kvhead={hq // hkv}" in msg and "divide m_block=128" in msg
    assert "pack_gqa=False" in msg  # the alternative
    assert plan_forward(spec(hq=hq, hkv=hkv), "sm100").tiles.pack_gqa is False


def test_plan_rejects_non_bool():
    with pytest.raises(PlanError, match="True or False"):
        plan_forward(spec(), "sm100", pack_gqa=1)


def test_kernel_key_tells_packed_from_unpacked():
    torch = pytest.importorskip("torch")
    from fa4lab.call import check_call

    def key(s, arch, packed=False):
        q = torch.empty(1, 8, s.heads_q, s.head_dim, dtype=torch.bfloat16)
        k = torch.empty(1, 8, s.heads_kv, s.head_dim, dtype=torch.bfloat16)
        return check_call(q, k, k, causal=s.causal, return_lse=s.return_lse,
                          pack_gqa=packed).key(arch)

    s = spec()
    assert key(s, "sm100", True) != key(s, "sm100")
    assert key(s, "sm100", True) != key(s, "sm90", True)
    one = spec(hq=4, hkv=4)  # nothing to pack: one kernel
    assert key(one, "sm100", True) == key(one, "sm100")


# ------------------------------------------------------- the kernel's index maps (emulated)

def kernel_row_map(m_block, stage, r, kv_head, g):
    """What the kernel computes for row r (= TMEM lane) of Q tile `stage` (fwd_sm100's
    softmax row_start and correction's LSE address)."""
    from fa4lab.kernels.device.pack_gqa import unpack_row

    row = (m_block * Q_STAGE + stage) * M_BLOCK + r
    pos, head = unpack_row(row, kv_head, g)
    return row, head, pos


@pytest.mark.parametrize("g", [2, 4, 8, 16])
def test_row_map_matches_tiling(g):
    hkv, sq = 3, 70
    hq = hkv * g
    for kv in range(hkv):
        for m in range(scheduler.num_m_blocks(sq * g, CTA_M)):
            for stage in range(Q_STAGE):
                for r in range(M_BLOCK):
                    row, head, pos = kernel_row_map(m, stage, r, kv, g)
                    if row >= sq * g:
                        continue
                    assert (head, pos) == gqa.unpack_gqa_row(
                        kv, row, heads_q=hq, heads_kv=hkv, seqlen_q=sq)


@given(sq=st.integers(1, 1500), sk=st.integers(1, 3000), g=st.sampled_from([2, 4, 8, 16, 128]),
       causal=st.booleans(), data=st.data())
@settings(max_examples=300, deadline=None)
def test_packed_block_ranges_match_tiling(sq, sk, g, causal, data):
    """The block range per CTA (cta_m rows, pack g) and mask_min per Q tile (m_block rows)."""
    n = 128
    right = 0 if causal else None
    m = data.draw(st.integers(0, tiling.num_m_blocks(sq, CTA_M, g) - 1))
    kw = dict(seqlen_q=sq, seqlen_k=sk, n_block_size=n, causal=causal, qhead_per_kvhead=g)
    lo, hi = tiling.n_block_range(m, m_block_size=CTA_M, **kw)
    assert scheduler.block_range(m, CTA_M, g, n, sq, sk, None, right) == (lo, hi)
    for stage in range(Q_STAGE):
        tile = m * Q_STAGE + stage
        if tile >= tiling.num_m_blocks(sq, M_BLOCK, g):
            continue  # a Q tile wholly past seqlen_q * g: its rows are never stored
        mask_lo, mask_hi = tiling.n_block_masked_range(tile, m_block_size=M_BLOCK, **kw)
        _, mask_min = scheduler.mask_split(tile, M_BLOCK, g, n, sq, sk, None, right, lo, hi)
        # The tile's masked range starts at mask_min; the CTA's n_max may reach past the tile's
        # own range (the other Q tile's rows see more keys): those blocks are masked too.
        assert mask_min == mask_lo and mask_hi <= hi


@pytest.mark.parametrize("sq,sk", [(1, 1), (1, 1000), (17, 1000), (1000, 17), (300, 301),
                                   (5, 3), (129, 128)])
@pytest.mark.parametrize("g", [2, 8])
@pytest.mark.parametrize("causal", [False, True])
def test_emulated_tile_loop(sq, sk, g, causal):
    """Every packed CTA as the sm100 kernel walks it (its own index code on the CPU: the
    blocks each Q tile visits, masked ones first; the rows it stores and the LSE address)
    against the brute-force visibility of each (position, key). Windows:
    tests/test_window_sink.py."""
    check_walk("sm100", sq, sk, g, causal)


# --------------------------------------------------------------- traced TMA views, compile

def _fake_q(sq, hq, d, batch=2):
    import cutlass
    from cutlass.cute.runtime import make_fake_tensor

    return make_fake_tensor(cutlass.BFloat16, (batch, sq, hq, d), (sq * hq * d, hq * d, d, 1),
                            assumed_align=16)


@pytest.mark.compile
@pytest.mark.parametrize("g", [4, 8])
def test_packed_q_and_o_tma_views(g):
    """Q through the kernel's `packed_a_tma` (tcgen05 A-operand atom) and O through `packed_tma`,
    tiled as the kernel tiles them: row r of tile t of KV head kv is TMA coordinate
    (col, kv * g + r % g, t * 128 / g + r // g, batch); the Q view also partitions for TMA."""
    pytest.importorskip("cutlass")
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.blackwell_helpers as sm100_utils
    from cutlass.cute.nvgpu import cpasync, tcgen05
    from cutlass.tensor_utils import LayoutEnum

    from fa4lab.kernels.compile import target_arch
    from fa4lab.kernels.device.pack_gqa import packed_a_tma, packed_tma

    sq, hq, d, kv, batch = 300, 2 * g, 128, 1, 1
    tiler = (M_BLOCK, 128, d)
    n_tiles = tiling.ceil_div(sq * g, M_BLOCK)
    picks = (0, 3, n_tiles - 1)  # the first, one inside, the tail tile (past seqlen_q)
    seen = {}

    @cute.jit
    def trace(mQ, mO):  # no annotation: postponed ones would not resolve in the DSL
        mQ = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[1, 3, 2, 0]))
        mO = cute.make_tensor(mO.iterator, cute.select(mO.layout, mode=[1, 3, 2, 0]))
        mma = sm100_utils.make_trivial_tiled_mma(
            cutlass.BFloat16, cutlass.BFloat16, cute.nvgpu.OperandMajorMode.K,
            cute.nvgpu.OperandMajorMode.K, cutlass.Float32, tcgen05.CtaGroup.ONE, tiler[:2])
        cluster = cute.tiled_divide(cute.make_layout((1, 1, 1)), (mma.thr_id.shape,))
        sQ = sm100_utils.make_smem_layout_a(mma, tiler, cutlass.BFloat16, Q_STAGE)
        atom, q_coords = packed_a_tma(cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE),
                                      mQ, sQ, mma, tiler, cluster.shape, g)
        sO = sm100_utils.make_smem_layout_epi(cutlass.BFloat16, LayoutEnum.ROW_MAJOR,
                                              (M_BLOCK, d), Q_STAGE)
        _, o_coords = packed_tma(cpasync.CopyBulkTensorTileS2GOp(), mO,
                                 cute.select(sO, mode=[0, 1]), (M_BLOCK, d), g)
        gQ = cute.local_tile(q_coords[None, None, kv, batch], (M_BLOCK, d), (None, 0))
        gO = cute.local_tile(o_coords[None, None, kv, batch], (M_BLOCK, d), (None, 0))
        # The load role's partition: one TMA copy per Q tile, as many tiles as rows allow.
        smem = cute.make_ptr(cutlass.BFloat16, 0, cute.AddressSpace.smem, assumed_align=1024)
        sQ_tile = cute.make_tensor(smem, cute.select(sQ, mode=[0, 1, 2]))
        _, tQgQ = cpasync.tma_partition(
            atom, 0, cute.make_layout(1), cute.group_modes(sQ_tile, 0, 3),
            cute.group_modes(mma.get_slice(0).partition_A(gQ), 0, 3))
        seen["tiles"] = (cute.size(gQ, mode=[2]), cute.size(gO, mode=[2]),
                         cute.size(tQgQ, mode=[1]))
        for t in picks:
            for r in tuple(range(M_BLOCK)):  # a Python loop: static coordinates
                seen[("q", t, r)] = tuple(int(x) for x in gQ[(r, 5, t)])
                seen[("o", t, r)] = tuple(int(x) for x in gO[(r, 5, t)])

    with target_arch("sm_100a"):
        cute.compile(trace, _fake_q(sq, hq, d), _fake_q(sq, hq, d))
    assert seen["tiles"] == (n_tiles,) * 3
    for t in picks:
        for r in range(M_BLOCK):
            head, pos = gqa.unpack_gqa_row(kv, t * M_BLOCK + r, heads_q=hq, heads_kv=hq // g,
                                              seqlen_q=sq + M_BLOCK)
            assert seen[("q", t, r)] == (5, head, pos, batch), (t, r)
            assert seen[("o", t, r)] == (5, head, pos, batch), (t, r)


# GQA {4, 8} x head_dim {64, 128} x causal, sampled pairwise (tests/matrix.py: 4 of the 8
# compiles, every two factors' levels together at least once); FA4LAB_FULL_MATRIX=1 runs all 8.
PACKED = matrix([(4, 8), (64, 128), (False, True)])


@pytest.mark.slow
@pytest.mark.compile
@pytest.mark.parametrize("gqa,head_dim,causal", PACKED, ids=[
    f"{g}-{d}-{c}" for g, d, c in PACKED])
def test_packed_kernel_compiles_and_passes_audit(gqa, head_dim, causal, tmp_path):
    plan = plan_forward(spec(head_dim, causal, hq=16, hkv=16 // gqa, lse=causal), "sm100",
                        pack_gqa=True)
    assert plan.tiles.pack_gqa and plan.spec.qhead_per_kvhead == gqa
    cf = compile_and_audit(plan, "sm100a", tmp_path)
    assert cf.kernel.pack == gqa and cf.keep_dir.name.endswith("-packgqa")


# ------------------------------------------------------------------------------ the API

def test_attention_sm100_checks_pack_gqa_off_a_b200():
    torch = pytest.importorskip("torch")
    from fa4lab.kernels.launch import attention_sm100

    q = torch.zeros(1, 4, 4, 64, dtype=torch.bfloat16)
    k = v = torch.zeros(1, 4, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"pack_gqa must be None \(choose\), True or False"):
        attention_sm100(q, k, v, pack_gqa="yes")
    with pytest.raises(UnsupportedArchError, match="compute-capability-10"):
        attention_sm100(q, k, v, pack_gqa=True)


def test_fa4lab_attention_passes_pack_gqa_to_the_sm100_kernel(monkeypatch):
    """On a cc-10 GPU fa4lab.attention checks for and launches the sm100 kernel with pack_gqa
    (the device faked here: no GPU)."""
    torch = pytest.importorskip("torch")
    import fa4lab
    from fa4lab.kernels import launch

    calls = []

    def forward(call, arch):
        """The launch, given the call in the sm100 kernel's form (checked: `Call.for_kernel`)."""
        s = call.spec
        assert call.mods is None and call.aux == () and call.num_splits is None
        assert call.page_table is None
        calls.append(dict(arch=arch, causal=s.causal, softmax_scale=s.softmax_scale,
                          return_lse=s.return_lse, pack_gqa=call.pack_gqa, softcap=s.softcap,
                          window_size=s.window_size, sink=call.sink))
        return call.q, None

    q = torch.zeros(1, 4, 4, 64, dtype=torch.bfloat16)
    k = v = torch.zeros(1, 4, 1, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(type(q), "is_cuda", property(lambda self: True))
    monkeypatch.setattr(launch, "device_arch", lambda index: "sm100")
    monkeypatch.setattr(launch, "forward", forward)
    sink = torch.zeros(4)
    for pack in (True, False, None):
        fa4lab.attention(q, k, v, causal=True, pack_gqa=pack, softcap=2.0,
                         window_size=(7, None), learnable_sink=sink)
        assert calls[-1] == dict(arch="sm100", causal=True, softmax_scale=None,
                                 return_lse=False, pack_gqa=pack, softcap=2.0,
                                 window_size=(7, None), sink=sink)
    assert len(calls) == 3
