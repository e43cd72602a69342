"""A mask_mod's block table (`fa4lab.mods_blocks`, Note [mask_mod block table] in
fa4lab.tiling) on the CPU: the table against a brute-force evaluation of the mod over every
(b, h, q_idx, kv_idx), its cache (Note [block table cache]), and both kernels' key-block walk
narrowed by it, run on Python ints with the kernels' own index code (tests/kernel_walk.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_walk import check_walk

from fa4lab import mods as m
from fa4lab.mods import kernel_mods
from fa4lab.mods_blocks import block_table, clear_cache


def _doc_ids(rng, n, docs):
    """Sorted document ids of n positions in `docs` documents (some may be empty)."""
    return torch.from_numpy(np.sort(rng.integers(0, docs, n)).astype(np.int32))


def _mod_cases(rng, batch, heads, sq, sk):
    """(name, mask_mod, aux) cases: documents (shared and per batch row), prefix-LM, a mod of
    the head, and one that hides every key from some rows."""
    n = max(sq, sk)
    doc = m.document_mask(_doc_ids(rng, n, int(rng.integers(1, 6))))
    per_batch = m.document_mask(torch.stack([_doc_ids(rng, n, 3) for _ in range(batch)]))
    prefix = m.prefix_lm(int(rng.integers(0, sk + 1)))
    width = int(rng.integers(1, 9))

    def head_band(b, h, q_idx, kv_idx):           # head h sees keys within (h + 1) * width
        return m.abs(q_idx - kv_idx) <= (h + 1) * width

    cut = int(rng.integers(0, sq))

    def hide_rows(b, h, q_idx, kv_idx):           # rows >= cut see nothing
        return (q_idx < cut) & (kv_idx >= 0)

    return [("document", doc.mod, doc.aux_tensors), ("document_per_batch", per_batch.mod,
            per_batch.aux_tensors), ("prefix_lm", prefix.mod, ()), ("head", head_band, ()),
            ("hide_rows", hide_rows, ())]


def _brute(mask_mod, aux, batch, heads, sq, sk, cta_m, n_block, pack):
    """Per CTA tile, by explicit loops over its packed rows: the key blocks some (b, h, row)
    sees a key of, and those every (b, h, row) sees whole."""
    b, h, q, k = torch.meshgrid(torch.arange(batch), torch.arange(heads), torch.arange(sq),
                                torch.arange(sk), indexing="ij")
    vis = np.broadcast_to(m.call_mod(mask_mod, len(aux) > 0, (b, h, q, k), aux).numpy(),
                          (batch, heads, sq, sk))
    n_m, n_n = -(-sq * pack // cta_m), -(-sk // n_block)
    any_, all_ = np.zeros((n_m, n_n), bool), np.zeros((n_m, n_n), bool)
    for t in range(n_m):
        pos = sorted({r // pack for r in range(t * cta_m, min((t + 1) * cta_m, sq * pack))})
        for j in range(n_n):
            block = vis[:, :, pos, j * n_block:(j + 1) * n_block]
            any_[t, j], all_[t, j] = block.any(), block.all()
    return any_, all_


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("pack", [1, 2, 3])
def test_table_against_brute_force(seed, pack):
    rng = np.random.default_rng(seed)
    batch, heads = 2, 2 * pack
    sq, sk = int(rng.integers(1, 70)), int(rng.integers(1, 70))
    cta_m, n_block = int(rng.choice([4, 8, 16])), int(rng.choice([4, 8, 16]))
    for name, mask_mod, aux in _mod_cases(rng, batch, heads, sq, sk):
        clear_cache()
        table = block_table(kernel_mods(None, mask_mod, aux), aux, batch=batch, heads_q=heads,
                            seqlen_q=sq, seqlen_k=sk, cta_m=cta_m, n_block=n_block, pack=pack,
                            device="cpu").numpy()
        any_, all_ = _brute(mask_mod, aux, batch, heads, sq, sk, cta_m, n_block, pack)
        assert table.shape == (any_.shape[0], 4) and table.dtype == np.int32, name
        for t, (lo, hi, full_lo, full_hi) in enumerate(table):
            where = f"{name} tile {t}: table {table[t].tolist()}, any {any_[t].astype(int)}"
            seen = np.flatnonzero(any_[t])
            if len(seen) == 0:
                assert (lo, hi, full_lo, full_hi) == (0, 0, 0, 0), where
                continue
            assert (lo, hi) == (seen[0], seen[-1] + 1), where
            assert full_lo <= full_hi and all_[t, full_lo:full_hi].all(), where
            runs = np.diff(np.flatnonzero(np.diff(np.r_[0, all_[t], 0])))[::2]
            assert full_hi - full_lo == max(runs, default=0), where


def test_cache_follows_in_place_changes_and_new_tensors():
    rng = np.random.default_rng(0)
    ids = _doc_ids(rng, 64, 4)
    mod = m.document_mask(ids)
    kw = dict(batch=1, heads_q=1, seqlen_q=64, seqlen_k=64, cta_m=8, n_block=8, pack=1,
              device="cpu")

    def table(aux):
        return block_table(kernel_mods(None, mod.mod, aux), aux, **kw)

    def brute(aux):
        any_, _ = _brute(mod.mod, aux, 1, 1, 64, 64, 8, 8, 1)
        return any_

    first = table((ids,))
    assert table((ids,)) is first                 # a hit costs nothing
    ids[:32] = 7                                  # in place: _version moves, the table follows
    again = table((ids,))
    assert again is not first
    assert again[0, 1] == brute((ids,))[0].nonzero()[0][-1] + 1
    other = torch.zeros(64, dtype=torch.int32)    # a new tensor, same mod code: one document
    assert table((other,))[:, :2].tolist() == [[0, 8]] * 8


# ------------------------------------------------------------------ the kernels' walk
@pytest.mark.parametrize("arch", ["sm90", "sm100"])
@pytest.mark.parametrize("seed", range(4))
def test_kernel_walk_with_a_mask_mod(arch, seed):
    rng = np.random.default_rng(100 + seed)
    g = int(rng.choice([1, 2]))
    sq, sk = int(rng.integers(1, 700)), int(rng.integers(1, 700))
    causal = bool(rng.integers(0, 2))
    window = (int(rng.integers(0, 300)), None) if rng.integers(0, 3) == 0 else (None, None)
    for name, mask_mod, aux in _mod_cases(rng, 1, 2 * g, sq, sk):
        try:
            check_walk(arch, sq, sk, g, causal, window, mask_mod=mask_mod, aux=aux)
        except AssertionError as err:
            raise AssertionError(f"{name} sq={sq} sk={sk} g={g} causal={causal} "
                                 f"window={window}: {err}") from err


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_kernel_walk_many_documents_skips_most_blocks(arch):
    """64 documents in 4096 keys: each CTA visits only its documents' blocks."""
    from kernel_walk import _Rows, kernel_of

    from fa4lab.kernels.device import mask as mask_mod

    sq = sk = 4096
    ids = torch.arange(sq, dtype=torch.int32) // 64
    doc = m.document_mask(ids)
    check_walk(arch, sq, sk, 1, True, mask_mod=doc.mod, aux=doc.aux_tensors, heads_kv=1)
    kern = kernel_of(arch, 1)
    table = _Rows(block_table(kernel_mods(None, doc.mod, doc.aux_tensors), doc.aux_tensors,
                              batch=1, heads_q=1, seqlen_q=sq, seqlen_k=sk, cta_m=kern.cta_m,
                              n_block=kern.n_block, pack=1, device="cpu"))
    left, right = mask_mod.window_sides((None, 0), True, 0, 0)
    visits = [kern.visit_plan(t, sq, sk, left, right, table)[0]
              for t in range(sq // kern.cta_m)]
    assert max(visits) <= -(-kern.cta_m // kern.n_block) + 1, visits
