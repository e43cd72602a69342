"""The ring's time model (fa4lab.distributed.model) and its figures: limits the model must reach
exactly, computed here from the schedule and the FLOP count, not copied from the code."""

from __future__ import annotations

import math

import pytest

from fa4lab import AttentionSpec
from fa4lab.distributed import work_per_rank
from fa4lab.distributed.model import RingCost, RingProblem, h200_cost, ring_timeline
from fa4lab.viz.ring import plot_ring_timeline, plot_scaling, plot_work_per_rank

FREE_LINK = RingCost(flops_per_s=1e15, link_bytes_per_s=math.inf)


@pytest.mark.parametrize("world", [1, 2, 4, 8])
@pytest.mark.parametrize("causal", [False, True])
def test_zigzag_with_a_free_link_scales_perfectly(world, causal):
    tl = ring_timeline(RingProblem(seqlen=2 * world * 256, causal=causal), world, FREE_LINK)
    assert tl.efficiency == pytest.approx(1.0, rel=1e-12)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_contiguous_causal_waits_for_the_busiest_rank(world):
    """With a free link the last rank never waits, so the ring takes exactly its work (one
    diagonal block, N - 1 full ones; FLOPs as the benchmarks count them)."""
    p = RingProblem(seqlen=world * 512, layout="contiguous")
    tl = ring_timeline(p, world, FREE_LINK)
    block = AttentionSpec(1, 512, 512, p.heads_q, p.heads_kv, p.head_dim)
    last = block.with_(causal=True).flops() + (world - 1) * block.flops()
    assert tl.total_s == pytest.approx(last / FREE_LINK.flops_per_s, rel=1e-12)
    assert work_per_rank(p.seqlen, world, causal=True, layout="contiguous").sum(axis=1).argmax() \
        == world - 1
    assert tl.efficiency < 1 - 0.5 / world


@pytest.mark.parametrize("world", [2, 3, 8])
def test_a_slow_link_is_all_that_counts(world):
    """With free compute the ring is N - 1 back-to-back transfers of one rank's K/V shards."""
    p = RingProblem(seqlen=2 * world * 1024, heads_q=8, heads_kv=2, head_dim=64)
    cost = RingCost(flops_per_s=math.inf, link_bytes_per_s=1e9)
    shard_bytes = (p.seqlen // world) * p.heads_kv * 2 * p.head_dim * 2      # K and V, bf16
    tl = ring_timeline(p, world, cost)
    assert tl.total_s == pytest.approx((world - 1) * shard_bytes / 1e9, rel=1e-12)


def test_h200_cost_names_its_sources():
    cost = h200_cost("ib_ndr")
    assert "ASSUMED" in cost.describe() and len(cost.sources) == 3
    with pytest.raises(ValueError, match="link must be one of"):
        h200_cost("carrier-pigeon")


def test_figures_build_and_say_modelled():
    tl = ring_timeline(RingProblem(seqlen=4096), 4, h200_cost())
    assert len(plot_work_per_rank(64, 4).axes) == 2
    for fig in (plot_ring_timeline(tl), plot_scaling({4096: [1.0, 0.9, 0.8]}, [1, 2, 4])):
        text = "".join(ax.get_title() + ax.get_xlabel() for ax in fig.axes)
        assert "MODELLED" in text, text
