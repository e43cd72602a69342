"""The protocol table (fa4lab.plan.protocol): what it says of the kernels, and the kernels'
trace-time check against it (no compile: the table walk is plain Python)."""

from __future__ import annotations

from collections import Counter

import pytest

from fa4lab.plan import Plan, plan_forward
from fa4lab.plan.simulate import Arrive, Commit, Issue, Wait, programs_for
from fa4lab.spec import AttentionSpec


def plan(arch, hd=128, **kw):
    return plan_forward(AttentionSpec(2, 4096, 4096, 8, 8, hd), arch, **kw)


@pytest.mark.parametrize("n,masked", [(1, 1), (3, 0), (5, 2)])
def test_sm100_tile_counts_are_the_kernels(n, masked):
    """Per tile of N blocks (fwd_sm100.py): the softmax posts N + 1 times to the mailbox (a
    scale per block, then row sum and max); the MMA warp frees each K and each V buffer once
    (2N commits on kv_empty) and each Q tile once; the load warp issues 2N K/V copies."""
    p = plan("sm100")
    progs = programs_for(p, n, masked_blocks=masked)
    for i in range(2):
        posts = [op for op in progs[f"softmax{i}"] if isinstance(op, Arrive)
                 and op.barrier == "stats_full"]
        assert len(posts) == n + 1
    commits = Counter(op.barrier for op in progs["mma"] if isinstance(op, Commit))
    assert commits == {"kv_empty": 2 * n, "s_full": 2 * n, "o_final": 2, "q_empty": 2}
    copies = [op.label for op in progs["load"] if isinstance(op, Issue)]
    # Blocks from the last down: K_N-1, V_N-1, ..., K_0, V_0 (Q tiles in between).
    kv = [c for c in copies if c[0] in "KV"]
    assert kv == [f"{x}{j}" for j in range(n - 1, -1, -1) for x in "KV"]
    # The MMA's first score MMA reads the last block; the masked blocks come first.
    mmas = [op.label for op in progs["mma"] if isinstance(op, Issue)]
    assert mmas[0] == f"S0=Q0K{n - 1}" and mmas[-1].startswith("O1+=P1V0")


def test_sm90_turns_leave_no_arrival():
    """sm90: the ring's last consumer passes the turn N + 1 times (once to let consumer0 start);
    consumer0 takes N turns in its loop and the last pass once more after its last value wgmma."""
    p = plan("sm90")
    n = 4
    progs = programs_for(p, n)
    passes = [op for op in progs["consumer1"] if isinstance(op, Arrive) and op.barrier ==
              "mma_turn0"]
    takes = [op for op in progs["consumer0"] if isinstance(op, Wait) and op.barrier ==
             "mma_turn0"]
    assert (len(passes), len(takes)) == (n + 1, n + 1)


def test_phases_follow_the_table():
    """The k-th wait on a stage waits for phase k, or k - 1 on a barrier that starts released."""
    p = plan("sm100", kv_stage=3)
    mma = programs_for(p, 5)["mma"]
    kv_full = [(op.stage, op.k) for op in mma if isinstance(op, Wait) and op.barrier == "kv_full"]
    assert kv_full == [(g % 3, g // 3) for g in range(10)]
    load = programs_for(p, 5)["load"]
    kv_empty = [op.k for op in load if isinstance(op, Wait) and op.barrier == "kv_empty"]
    assert kv_empty == [g // 3 - 1 for g in range(10)]


def test_folded_sites_drop_branches_the_compiler_decides():
    p = plan("sm90")
    raw = [str(s) for s in p.protocol.sites("consumer", 2)]
    folded = [str(s) for s in p.protocol.sites("consumer", 2, folded=True)]
    # The last consumer's first pass: written for every consumer, compiled for consumer 1 only.
    assert raw[:2] == ["named_arrive mma_turn1[0]", "named_arrive mma_turn0[0]"]
    assert folded[0] == "named_arrive mma_turn0[0]" and folded[1] == "wait q_full[0]"
    assert len(raw) == len(folded) + 1


def test_protocol_round_trips_through_json():
    import json

    for arch in ("sm100", "sm90"):
        p = plan(arch)
        assert Plan.from_dict(json.loads(p.to_json())).protocol == p.protocol


def test_the_kernels_trace_check_rejects_an_op_the_table_does_not_have():
    from fa4lab.kernels.protocol import ProtocolMismatch, Sites

    p = plan("sm100")
    sites = Sites(p)
    for s in p.protocol.sites("load", 2)[:2]:
        sites._next("load", s.kind, s.barrier, s.stage)
    with pytest.raises(ProtocolMismatch, match="load op 2.*wait q_empty.*table has wait kv_empty"):
        sites._next("load", "wait", "q_empty", 1)
    with pytest.raises(ProtocolMismatch, match="issued 2 of the table's"):
        sites.finish()



@pytest.mark.parametrize("n", [1, 4])
def test_persistent_phases_run_on_across_tiles(n):
    """Note [persistent CTAs]: over 3 tiles the ring keeps turning (wait g on kv_full is slot
    g % 3, phase g // 3, g counting across tiles), and tile t's Q waits q_empty's phase t - 1
    (released first: the first tile passes), o_empty likewise; the sites are one tile loop
    around the block loops."""
    p = plan("sm100", kv_stage=3)
    assert p.protocol.persistent
    progs = programs_for(p, n, n_tiles=3)
    kv_full = [(op.stage, op.k) for op in progs["mma"]
               if isinstance(op, Wait) and op.barrier == "kv_full"]
    assert kv_full == [(g % 3, g // 3) for g in range(3 * 2 * n)]
    q_empty = [(op.stage, op.k) for op in progs["load"]
               if isinstance(op, Wait) and op.barrier == "q_empty"]
    assert q_empty == [(i, t - 1) for t in range(3) for i in range(2)]
    o_empty = [(op.stage, op.k) for op in progs["correction"]
               if isinstance(op, Wait) and op.barrier == "o_empty"]
    assert o_empty == q_empty
    loops = {s.loop for s in p.protocol.sites("load", 2)}
    assert loops == {"load/loop0", "load/loop1"}   # the tile loop, the block loop inside it
    one = plan("sm100", persistent=False)
    with pytest.raises(ValueError, match="one work tile per CTA"):
        from fa4lab.plan.costs import DEFAULT_COSTS
        from fa4lab.plan.sm100 import programs

        programs(one, n, 2, DEFAULT_COSTS)
