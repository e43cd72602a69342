"""The varlen tile figure draws exactly `varlen_tiles`' tiles, in its LPT order."""

from __future__ import annotations

import numpy as np
import pytest
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from fa4lab.errors import InputError
from fa4lab.varlen_tiles import varlen_tiles
from fa4lab.viz.varlen import varlen_tiles_figure


def _boxes(fig):
    """{(batch, m_block): (hatched, label or None)} of the figure's tile boxes."""
    ax = fig.axes[0]
    labels = {(int(t.get_position()[1]), int(t.get_position()[0])): t.get_text()
              for t in ax.texts}
    return {(int(r.get_y()), int(r.get_x())): (bool(r.get_hatch()),
                                               labels.get((int(r.get_y()), int(r.get_x()))))
            for r in ax.patches if isinstance(r, Rectangle)}


def _random_batch(rng, batch):
    """Lengths from 0 (an empty sequence) and 1 up to a few blocks, keys >= 0 of any length."""
    lens_q = rng.integers(0, 600, size=batch)
    lens_q[rng.integers(batch)] = 1
    lens_q[rng.integers(batch)] = 0
    lens_k = lens_q + rng.integers(0, 300, size=batch)
    return lens_q.tolist(), lens_k.tolist()


@pytest.mark.parametrize("heads, head, group", [(1, 0, 1), (3, 2, 1), (2, 1, 4)])
def test_the_figure_draws_each_real_tile_with_its_lpt_rank(rng, heads, head, group):
    lens_q, lens_k = _random_batch(rng, int(rng.integers(2, 9)))
    opts = dict(heads=heads, m_block_size=128, n_block_size=64, causal=bool(rng.integers(2)),
                qhead_per_kvhead=group, max_seqlen_q=max(lens_q) + int(rng.integers(0, 300)))
    tiles = varlen_tiles(lens_q, lens_k, **opts)
    fig = varlen_tiles_figure(lens_q, lens_k, head=head, **opts)
    assert isinstance(fig, Figure)
    boxes = _boxes(fig)
    want = {(b, m): str(i) for i, (b, h, m) in enumerate(tiles.tiles.tolist()) if h == head}
    real = {pos: label for pos, (hatched, label) in boxes.items() if not hatched}
    assert real == want, f"lengths {lens_q}, {opts}: the real boxes are not varlen_tiles' tiles"
    padding = [pos for pos, (hatched, label) in boxes.items() if hatched]
    assert all(boxes[pos][1] is None for pos in padding), "a padding box carries a rank"
    assert len(padding) == tiles.padding_tiles // heads
    assert len(boxes) == tiles.padded_tiles // heads
    assert f"{tiles.num_tiles} real tiles vs {tiles.padded_tiles}" in fig.axes[0].get_title()


def test_a_batch_of_empty_sequences_is_all_padding():
    fig = varlen_tiles_figure([0, 0, 0], [5, 0, 9], heads=1, m_block_size=64,
                              n_block_size=64, max_seqlen_q=130)
    boxes = _boxes(fig)
    assert len(boxes) == 9 and all(hatched for hatched, _ in boxes.values())


def test_a_head_outside_the_grid_is_refused():
    with pytest.raises(InputError, match="head=2 is not one of the 2 heads"):
        varlen_tiles_figure([10], [10], heads=2, head=2, m_block_size=64, n_block_size=64)


def test_a_large_batch_draws_boxes_without_labels():
    # 21 sequences of 20 blocks: 420 boxes, just past _MAX_LABELLED (400); trimmed from 64 x 64
    # boxes (10 s to draw on a 2-core machine), the rule being the count.
    from fa4lab.viz.varlen import _MAX_LABELLED

    lens = np.full(21, 20 * 128).tolist()
    assert 21 * 20 > _MAX_LABELLED
    fig = varlen_tiles_figure(lens, lens, heads=1, m_block_size=128, n_block_size=128)
    assert not fig.axes[0].texts and len(_boxes(fig)) == 21 * 20
