"""The kernels' key-block walk, emulated on the CPU with the kernels' own index code.

`check_walk(arch, ...)` builds the sm90 or sm100 kernel object from its plan (no DSL code runs)
and calls the very functions its launch and device code call, on Python ints: the launch's
`window_args`, `mask.window_sides`, the CTA's `visit_plan` (and the sm100 softmax's
`softmax_plan`), `scheduler.visit_block`, `mask.key_range` and `pack_gqa.unpack_row`. For
every CTA it walks the blocks as each role does and checks, against the math contract
(`fa4lab.reference.visible_mask`):
* every role of a CTA visits the same blocks in the same order, each block once, inside
  [0, ceil(seqlen_k / n_block)) (sm90's fully masked CTA: one block);
* a block visited without the mask is in bounds and fully visible to every row stored;
* each stored row sees exactly its visible keys (none skipped, none leaked), and every
  (position, query head) is stored exactly once.
With a `mask_mod` the CTA narrows its walk with the mod's block table
(`fa4lab.mods_blocks.block_table`, Note [mask_mod block table] in fa4lab.tiling), a masked
block also applies the mod and an unmasked one must be visible whole under it.
"""

from __future__ import annotations

from functools import cache

import numpy as np

from fa4lab.reference import visible_mask
from fa4lab.spec import AttentionSpec, normalize_mask


@cache
def kernel_of(arch: str, g: int):
    """The arch's kernel object for GQA ratio g (packed when g > 1), from its default plan."""
    from fa4lab.plan import plan_forward

    spec = AttentionSpec(1, 128, 128, 2 * g, 2, 128)
    plan = plan_forward(spec, arch, pack_gqa=g > 1)
    if arch == "sm90":
        from fa4lab.kernels.fwd_sm90 import FlashForwardSm90

        return FlashForwardSm90(plan)
    from fa4lab.kernels.fwd_sm100 import FlashForwardSm100

    return FlashForwardSm100(plan)


class _Rows:
    """A (rows, 4) table read as the kernels read theirs, table[m, i], as Python ints."""

    def __init__(self, table):
        self.table = table.cpu().numpy()

    def __getitem__(self, index):
        return int(self.table[index])


def check_walk(arch, sq, sk, g, causal, window=(None, None), heads_kv=2, mask_mod=None,
               aux=(), batch=0):
    """The walk of every CTA of batch row `batch` (the mask_mod's b; its table spans batch +
    1 rows) against the math contract: see the module's docstring."""
    user_mask = mask_mod
    from fa4lab.kernels.device import mask as mask_mod
    from fa4lab.kernels.device import scheduler
    from fa4lab.kernels.device.arguments import window_args
    from fa4lab.kernels.device.pack_gqa import unpack_row

    kern = kernel_of(arch, g)
    stored_causal, stored = normalize_mask(causal, window)
    left, right = mask_mod.window_sides(stored, stored_causal, *window_args(stored, sq, sk))
    n, m_block, q_stage = kern.n_block, kern.m_block, kern.q_stage
    visible = visible_mask(sq, sk, causal, window_size=window)
    stored = np.zeros((sq, heads_kv * g), dtype=int)
    n_blocks_k = -(-sk // n)
    table, mod_vis = None, np.ones((heads_kv * g, sq, sk), dtype=bool)
    if user_mask is not None:
        import torch

        from fa4lab.mods import kernel_mods
        from fa4lab.mods_blocks import block_table

        mods = kernel_mods(None, user_mask, aux)
        table = _Rows(block_table(mods, aux, batch=batch + 1, heads_q=heads_kv * g, seqlen_q=sq,
                                  seqlen_k=sk, cta_m=kern.cta_m, n_block=n, pack=kern.pack,
                                  device="cpu"))
        grid = torch.meshgrid(torch.tensor([batch]), torch.arange(heads_kv * g),
                              torch.arange(sq), torch.arange(sk), indexing="ij")
        mod_vis = np.broadcast_to(mods.mask(*grid, aux).numpy(), (1, heads_kv * g, sq, sk))[0]
    for kv in range(heads_kv):
        for m in range(-(-sq * g // kern.cta_m)):
            n_blocks, n_masked, order = kern.visit_plan(m, sq, sk, left, right, table)
            walk = [scheduler.visit_block(s, *order) for s in range(n_blocks)]   # load, MMA
            assert len(set(walk)) == len(walk) and all(0 <= b < n_blocks_k for b in walk), walk
            for stage in range(q_stage):
                if arch == "sm100":   # each Q tile's softmax: its own masked prefix
                    _, n_masked, t_order, unmasked_end = kern.softmax_plan(
                        stage, m, sq, sk, left, right, table)
                    walk_t = [scheduler.visit_block(s, *t_order) for s in range(n_masked)]
                    walk_t += list(range(t_order[1] - 1, unmasked_end - 1, -1))
                    assert walk_t == walk, (m, stage, walk_t, walk)
                row0 = (m * q_stage + stage) * m_block
                rows = range(row0, min(row0 + m_block, sq * g))   # the rows stored
                if not rows:
                    continue    # past seqlen_q: TMA clips the store, the LSE store is guarded
                # each row's mask, once per tile as the kernel does: [first, end)
                bounds = [mask_mod.key_range(r, sq, sk, left, right, g) for r in rows]
                first = np.array([0 if f is None else f for f, _ in bounds])[:, None]
                end = np.array([e for _, e in bounds])[:, None]
                pos_head = [unpack_row(r, kv, g) for r in rows]
                vis = visible[[p for p, _ in pos_head]] & mod_vis[
                    [h for _, h in pos_head], [p for p, _ in pos_head]]
                shown = mod_vis[[h for _, h in pos_head], [p for p, _ in pos_head]]
                seen = np.zeros(vis.shape, dtype=bool)
                for step, b in enumerate(walk):
                    cols = np.arange(b * n, min((b + 1) * n, sk))
                    if step < n_masked:
                        seen[:, cols] |= ((cols[None] < end) & (cols[None] >= first)
                                          & shown[:, cols])
                    else:                       # unmasked: in bounds, all visible
                        assert (b + 1) * n <= sk and vis[:, cols].all(), (m, stage, b)
                        seen[:, cols] = True
                assert (seen == vis).all(), (kv, m, stage)
                for p, h in pos_head:
                    stored[p, h] += 1
    assert (stored == 1).all()
