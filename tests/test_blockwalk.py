"""The kernels' walk over key blocks (fa4lab.blockwalk) against the float64 reference, on fresh
random inputs with large logits, for each option it models and both kernels' tiles: causal
with GQA and tails, a window's two sides, softcap, pack-GQA, a score_mod, mask_mods (with
their block tables), seqlen_q 1, and rows that see no key (out 0, lse -inf)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fa4lab import blockwalk, mods, tiling
from fa4lab.plan import plan_forward
from fa4lab.reference import attention_reference
from fa4lab.spec import AttentionSpec

ARCHS = ("sm90", "sm100")


def _documents(rng, seqlen: int, *, first: int = 0):
    """doc ids (seqlen,): sorted random documents; with `first`, positions [0, first) are doc
    0 and the rest other documents (a query past `first` shares no document with keys < first)."""
    ids = np.sort(rng.integers(0, 4, seqlen))
    if first:
        ids = np.where(np.arange(seqlen) < first, 0, 1 + np.sort(rng.integers(0, 3, seqlen)))
    return torch.from_numpy(ids).int()


# name: (spec, pack_gqa, mods(rng, spec) -> (score_mod, mask_mod, aux) or None, rows with no key)
CASES = {
    "causal-gqa-tails": (AttentionSpec(2, 300, 260, 4, 2, 64, causal=True), False, None, True),
    "window-left-right": (AttentionSpec(2, 200, 450, 2, 1, 64, window_size=(64, 32)), False,
                          None, False),
    # a window narrower than a block, seqlen_q > seqlen_k: the first rows see no key
    "window-causal-empty": (AttentionSpec(1, 300, 200, 4, 2, 64, causal=True,
                                          window_size=(40, None)), False, None, True),
    "softcap": (AttentionSpec(1, 150, 170, 2, 2, 128, causal=True, softcap=5.0), False, None,
                False),
    "seqlen-1": (AttentionSpec(1, 1, 1, 2, 2, 64, softcap=20.0), False, None, False),
    "pack-gqa-decode": (AttentionSpec(2, 1, 333, 8, 2, 128), True, None, False),
    "pack-gqa-causal-window": (AttentionSpec(1, 77, 300, 8, 2, 64, causal=True,
                                             window_size=(100, None)), True, None, False),
    "alibi-gqa": (AttentionSpec(2, 200, 200, 4, 2, 64, causal=True), False,
                  lambda rng, s: _alibi(rng, s), False),
    "document-causal": (AttentionSpec(1, 300, 300, 4, 2, 64, causal=True), False,
                        lambda rng, s: (None, *mods.document_mask(_documents(rng, 300))),
                        False),
    "prefix-lm": (AttentionSpec(1, 260, 300, 2, 1, 64), False,
                  lambda rng, s: (None, mods.prefix_lm(int(rng.integers(1, 200))).mod, ()),
                  False),
    # queries past position 100 share no document with the 100 keys
    "document-empty-rows": (AttentionSpec(1, 300, 100, 2, 2, 64), False,
                            lambda rng, s: (None, *mods.document_mask(_documents(rng, 300,
                                                                                 first=100))),
                            True),
    "pack-gqa-alibi-document": (AttentionSpec(1, 200, 200, 8, 2, 64, causal=True), True,
                                lambda rng, s: _alibi_and_documents(rng, s), False),
}


def _alibi(rng, spec):
    """(score_mod, mask_mod, aux): ALiBi with random slopes, no mask_mod."""
    alibi, aux = mods.alibi(torch.from_numpy(rng.uniform(0.01, 1.0, spec.heads_q)).float())
    return alibi, None, aux


def _alibi_and_documents(rng, spec):
    slopes = torch.from_numpy(rng.uniform(0.01, 1.0, spec.heads_q)).float()
    alibi, aux = mods.alibi(slopes)
    documents, doc_aux = mods.document_mask(_documents(rng, spec.seqlen_q), aux_index=1)
    return alibi, documents, aux + doc_aux


def _inputs(rng, spec, mag=8.0):
    return (mag * rng.standard_normal((spec.batch, spec.seqlen_q, spec.heads_q, spec.head_dim)),
            rng.standard_normal((spec.batch, spec.seqlen_k, spec.heads_kv, spec.head_dim)),
            rng.standard_normal((spec.batch, spec.seqlen_k, spec.heads_kv, spec.head_dim_v)))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_walk_matches_the_reference(arch, case, rng):
    spec, pack, make_mods, empty_rows = CASES[case]
    plan = plan_forward(spec, arch, pack_gqa=pack)
    assert plan.tiles.pack_gqa == pack
    score_mod, mask_mod, aux = make_mods(rng, spec) if make_mods else (None, None, ())
    km, kaux = mods.check_mods(score_mod, mask_mod, aux or None, "cpu")
    q, k, v = _inputs(rng, spec)
    out, lse, visits = blockwalk.walk(q, k, v, spec, plan.tiles, km or None, kaux)
    ref, ref_lse = (np.asarray(x) for x in attention_reference(
        q, k, v, causal=spec.causal, window_size=spec.window_size, softcap=spec.softcap,
        score_mod=score_mod, mask_mod=mask_mod, aux_tensors=aux or None, return_lse=True))
    np.testing.assert_allclose(out, ref, rtol=0, atol=blockwalk.TOLERANCE)
    empty = np.isneginf(ref_lse)                                     # (batch, heads_q, seqlen_q)
    assert np.array_equal(np.isneginf(lse), empty)
    np.testing.assert_allclose(lse[~empty], ref_lse[~empty], rtol=0, atol=blockwalk.TOLERANCE)
    assert not out[empty.transpose(0, 2, 1)].any()                   # O = 0 where no key is seen
    assert empty.any() == empty_rows, "the case no longer has (or newly has) rows with no key"
    dense = (tiling.num_m_blocks(spec.seqlen_q, plan.tiles.cta_m, blockwalk.packed(spec,
                                                                                   plan.tiles))
             * tiling.num_n_blocks(spec.seqlen_k, plan.tiles.n_block))
    assert 0 < visits <= dense


@pytest.mark.parametrize("arch", ARCHS)
def test_tile_blocks_without_a_table_follow_tilings_visit_order(arch, rng):
    """With no mask_mod a tile's walk is `fa4lab.tiling.visit_order` (the blocks and how many
    are masked), packed or not, whatever the window."""
    for _ in range(20):
        sq, sk = (int(x) for x in rng.integers(1, 700, 2))
        left, right = (None if rng.random() < 0.4 else int(rng.integers(0, 300)) for _ in "lr")
        causal = bool(rng.random() < 0.5)
        spec = AttentionSpec(1, sq, sk, 4, 2, 64, causal=causal,
                             window_size=(left, None if causal else right))
        tiles = plan_forward(spec, arch, pack_gqa=bool(rng.random() < 0.5)).tiles
        g = blockwalk.packed(spec, tiles)
        for m in range(tiling.num_m_blocks(sq, tiles.cta_m, g)):
            want = tiling.visit_order(m, seqlen_q=sq, seqlen_k=sk, m_block_size=tiles.cta_m,
                                      n_block_size=tiles.n_block, causal=spec.causal,
                                      qhead_per_kvhead=g, window_size=spec.window_size)
            got = blockwalk.tile_blocks(spec, tiles, m)
            assert (list(got.blocks), got.masked) == want, (spec, m)


def test_walk_fails_when_the_masked_runs_are_left_unmasked(rng, monkeypatch):
    """The walk can fail: claim every block unmasked, and causal rows see future keys."""
    spec = AttentionSpec(1, 300, 300, 2, 1, 64, causal=True)
    plan = plan_forward(spec, "sm90")
    q, k, v = _inputs(rng, spec)
    ref = np.asarray(attention_reference(q, k, v, causal=True))
    real = blockwalk.tile_blocks

    def unmasked(*args, **kwargs):
        return blockwalk.TileBlocks(real(*args, **kwargs).blocks, 0)

    monkeypatch.setattr(blockwalk, "tile_blocks", unmasked)
    out, _, _ = blockwalk.walk(q, k, v, spec, plan.tiles)
    assert np.abs(out - ref).max() > 1e-3


def test_walk_refuses_inputs_that_are_not_the_specs():
    spec = AttentionSpec(1, 10, 20, 2, 1, 64)
    tiles = plan_forward(spec, "sm90").tiles
    q, k, v = np.zeros((1, 10, 2, 64)), np.zeros((1, 20, 1, 64)), np.zeros((1, 20, 1, 64))
    with pytest.raises(ValueError, match=r"k has shape \(1, 21, 1, 64\), the spec says"):
        blockwalk.walk(q, np.zeros((1, 21, 1, 64)), v, spec, tiles)
    with pytest.raises(ValueError, match="no learnable sink"):
        blockwalk.walk(q, k, v, spec.with_(learnable_sink=True), tiles)
