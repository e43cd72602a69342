"""The tile table kernel (`fa4lab.kernels.tile_table`, Note [one CTA builds the table]).

On the CPU: its window cap, and it compiles for both archs without
spills, with its three barriers. On a GPU (marker `gpu`): its four outputs equal the torch
build's (`launch_lengths`, `launch_tile_rows`) element for element, on random batches of good
and bad lengths (negative, huge, decreasing cu_seqlens, a table shorter than the real tiles),
causal or not, with and without a window and cu_seqlens_k, up to MAX_BATCH sequences; a larger
batch takes the torch build.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("causal, window, m, want", [
    (False, (None, None), 128, None),
    (True, (None, None), 128, None),
    (True, (100, None), 128, 228),          # causal: right side 0
    (False, (100, 20), 64, 184),
    (False, (None, 20), 64, None),
    (False, (-300, 20), 128, 0),            # a negative span sees nothing past 0
])
def test_seen_cap(causal, window, m, want):
    """left + right + m_block (right 0 when causal, at least 0), no cap with a side unbounded:
    the clamp `launch_tile_rows` applies to the key counts it orders by."""
    from fa4lab.varlen_tiles import seen_cap

    assert seen_cap(m, causal, window) == want


@pytest.mark.compile
@pytest.mark.parametrize("causal, with_cu_k, arch", [(True, True, "sm90a"),
                                                     (False, False, "sm100a")])
def test_tile_table_compiles(causal, with_cu_k, arch, tmp_path):
    """Both archs, no spill; three barriers (after the counts, the order, the ends)."""
    from fa4lab.kernels import binary
    from fa4lab.kernels.tile_table import compile_tile_table

    _, _, _, ptx_path, cubin_path = compile_tile_table(causal, with_cu_k, arch=arch,
                                                       keep_dir=tmp_path)
    ptx = ptx_path.read_text()
    assert f".target sm_{arch.removeprefix('sm')}" in ptx
    assert ptx.count("bar.sync") == 3
    res = binary.resource_usage(cubin_path)
    assert res["local"] == 0 and res["stack"] == 0, res


# ---- on a GPU -----------------------------------------------------------------------------------
def _lengths(rng, batch: int, bad: bool, with_cu_k: bool):
    """A VarlenLengths of `batch` sequences on the GPU, its values good or bad."""
    from fa4lab.varlen import VarlenLengths

    lens_q = rng.integers(0, 700, batch)
    keys = rng.integers(0, 5000, batch)
    if bad:
        pick = rng.integers(0, batch, max(1, batch // 4))
        lens_q[pick] = rng.choice([-300, 2**30, 2**31 - 2000, 9000], len(pick))
        keys[rng.integers(0, batch, max(1, batch // 4))] = -7
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int64)
    cu_q = np.clip(cu_q, -2**31, 2**31 - 1).astype(np.int32)
    cuda = dict(dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(np.abs(keys))]), **cuda) \
        if with_cu_k else None
    return VarlenLengths(torch.tensor(cu_q, **cuda), torch.tensor(keys, **cuda), cu_k,
                         None if with_cu_k else 16, 1 << 20, 1 << 20)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 2, 7, 64, 300, 1024, 1500])
@pytest.mark.parametrize("bad", [False, True])
def test_the_kernel_builds_the_torch_table(batch, bad):
    from fa4lab.kernels.tile_table import MAX_BATCH, build_launch_tables
    from fa4lab.varlen_tiles import max_tile_rows

    rng = np.random.default_rng(batch * 2 + bad)
    for trial in range(6):
        causal, with_cu_k = bool(trial & 1), bool(trial & 2)
        window = [(None, None), (300, 0), (64, 100)][trial % 3]
        m = [64, 128, 192][trial % 3]
        lengths = _lengths(rng, batch, bad, with_cu_k)
        total = int(max(lengths.cu_q[-1].item(), 1)) if not bad else 5000
        rows = max_tile_rows(total, batch, m)
        got = build_launch_tables(lengths, rows, m_block=m, causal=causal, window_size=window,
                                  kernel=True)
        want = build_launch_tables(lengths, rows, m_block=m, causal=causal, window_size=window,
                                   kernel=False)
        torch.cuda.synchronize()
        for name, g, w in zip(("cu_seqlens_q", "cu_seqlens_k", "seqused_k", "table"), got,
                              want):
            if w is None:
                assert g is None, name
                continue
            assert g.dtype == torch.int32 and g.shape == w.shape, (name, g.shape, w.shape)
            assert torch.equal(g, w.to(torch.int32)), (
                f"{name} differs (batch {batch}, bad {bad}, causal {causal}, window {window}, "
                f"m {m}, first at {int((g != w).nonzero()[0, 0])})")
        if batch > MAX_BATCH:
            break     # the torch build itself: once is enough
