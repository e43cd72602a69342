"""The index check on the device (`fa4lab.indexcheck`, `fa4lab.kernels.index_check`) on the CPU:
the kernel's per-entry tests replayed against the synchronous check, the pending verdicts, the
check_indices modes, the clamps of the kernels' lengths, and (tier 1) the kernel's compile.
On the GPU: tests/test_indexcheck_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fa4lab
from fa4lab import indexcheck, varlen, varlen_tiles
from fa4lab.errors import InputError, InputTypeError
from fa4lab.indexcheck import CheckContext, IndexCheckPlan, Rule, Verdict, message

I32 = torch.int32


def _random_call(rng, paged: bool):
    """A random varlen call's arguments (CPU), good, then with 0-3 random corruptions of its
    index values (a moved cu_seqlens entry, a seqused_k out of range, a page outside the cache,
    a max_seqlen too small)."""
    batch = int(rng.integers(1, 6))
    lens_q = rng.integers(0, 9, batch)
    cu_q = np.concatenate([[0], np.cumsum(lens_q)])
    q = torch.zeros(int(cu_q[-1]), 2, 8)
    args = dict(cu_seqlens_k=None, seqused_k=None, page_table=None, max_seqlen_q=None,
                max_seqlen_k=None)
    if paged:
        page_size, pages, num_pages = int(rng.choice([2, 4])), int(rng.integers(1, 5)), 12
        k = v = torch.zeros(num_pages, page_size, 1, 8)
        table = rng.integers(0, num_pages, (batch, pages))
        keys = np.full(batch, pages * page_size)
        if rng.random() < 0.7:
            keys = rng.integers(0, pages * page_size + 1, batch)
            args["seqused_k"] = keys.copy()
            for b in range(batch):      # slots past a sequence's pages may hold anything
                table[b, -(-keys[b] // page_size):] = rng.integers(-3, 30)
        args["page_table"] = table
    else:
        keys = rng.integers(0, 9, batch)
        cu_k = np.concatenate([[0], np.cumsum(keys)])
        k = v = torch.zeros(int(cu_k[-1]), 1, 8)
        args["cu_seqlens_k"] = cu_k
        if rng.random() < 0.5:
            keys = np.minimum(keys, rng.integers(0, 9, batch))
            args["seqused_k"] = keys.copy()
    if rng.random() < 0.6:
        args["max_seqlen_q"] = int(lens_q.max()) + int(rng.integers(0, 3))
        args["max_seqlen_k"] = int(keys.max()) + int(rng.integers(0, 3))
    for _ in range(int(rng.integers(0, 4))):
        name = rng.choice([n for n in ("cu_seqlens_q", "cu_seqlens_k", "seqused_k",
                                       "page_table", "max_seqlen_q", "max_seqlen_k")
                           if n == "cu_seqlens_q" or args[n] is not None])
        if name == "cu_seqlens_q":
            cu_q = cu_q.copy()
            cu_q[rng.integers(0, len(cu_q))] += int(rng.integers(-4, 5))
        elif name.startswith("max_"):
            args[name] = int(rng.integers(0, 4))
        else:
            t = args[name].copy()
            t.reshape(-1)[rng.integers(0, t.size)] += int(rng.choice([-13, -2, -1, 1, 2, 13]))
            args[name] = t
    return dict(q=q, k=k, v=v, cu_seqlens_q=torch.tensor(cu_q, dtype=I32),
                **{n: torch.tensor(a, dtype=I32) if isinstance(a, np.ndarray) else a
                   for n, a in args.items()})


def _sync_error(call) -> str | None:
    try:
        varlen.check_varlen(**call, check_indices=True)
    except InputError as e:
        return str(e)
    return None


def _device_inputs(call, monkeypatch) -> tuple:
    """(context, cu_q, cu_k, used, table) as check_varlen hands them to the device check."""
    seen = []
    monkeypatch.setattr(varlen, "_run_check", lambda q, mode, context, rules, *tensors:
                        seen.append((context, *tensors)))
    varlen.check_varlen(**call, check_indices="device")
    monkeypatch.undo()
    (got,) = seen
    return got


@pytest.mark.parametrize("paged", [False, True])
def test_the_kernels_verdict_is_the_synchronous_checks(paged, monkeypatch):
    """On random good and bad index tensors, the kernel's logic (`replay`: its per-entry tests
    and its choice of the first broken rule and index) names the same rule, index and values,
    in the same words, as the synchronous check, or passes where it passes."""
    from fa4lab.kernels.index_check import replay

    rng = np.random.default_rng(1234 + paged)
    broken = 0
    for case in range(400):
        call = _random_call(rng, paged)
        want = _sync_error(call)
        context, *tensors = _device_inputs(call, monkeypatch)
        verdict = replay(context, *tensors)
        got = message(verdict, context) if verdict.broken else None
        assert got == want, f"case {case}: {call}"
        broken += verdict.broken
    assert 100 < broken < 350, f"{broken} of 400 cases broken: the generator lost its mix"


def test_the_dense_paged_check_is_the_synchronous_one(monkeypatch):
    from fa4lab.kernels.index_check import replay

    q = torch.zeros(2, 3, 2, 8)
    cache = torch.zeros(5, 4, 1, 8)
    for table, words in (([[4, 0], [1, 2]], None), ([[4, 0], [5, 2]], r"page_table\[1, 0\] = 5"),
                         ([[4, -1], [1, 2]], r"page_table\[0, 1\] = -1")):
        table = torch.tensor(table, dtype=I32)
        seen = []
        monkeypatch.setattr(varlen, "_run_check", lambda q, mode, context, rules, table,
                            seen=seen: seen.append((context, table)))
        varlen.check_paged(q, cache, cache, table)
        monkeypatch.undo()
        context, table_seen = seen[0]
        verdict = replay(context, table=table_seen)
        if words is None:
            assert not verdict.broken
            varlen.check_paged(q, cache, cache, table)
            continue
        with pytest.raises(InputError, match=words) as sync:
            varlen.check_paged(q, cache, cache, table)    # CPU: the synchronous check
        assert message(verdict, context) == str(sync.value)


def test_the_launch_path_installs_the_device_check(monkeypatch):
    """fa4lab.varlen's checks reach the check kernel through `indexcheck.queue_check`, which the
    launch path installs (Note [who launches the device check]); with nothing installed it
    queues nothing and the caller checks synchronously."""
    from fa4lab.kernels import launch

    assert indexcheck._device_check is launch.queue_index_check
    calls = []
    monkeypatch.setattr(indexcheck, "_device_check", lambda *args: calls.append(args) or True)
    assert indexcheck.queue_check(CheckContext(total_q=3), table="t") is True
    assert calls == [(CheckContext(total_q=3), None, None, None, "t")]
    monkeypatch.setattr(indexcheck, "_device_check", None)
    assert indexcheck.queue_check(CheckContext(total_q=3)) is False


def test_check_indices_modes():
    assert [varlen.check_mode(m) for m in ("device", True, "sync", False, "off")] == [
        "device", "sync", "sync", "off", "off"]
    for bad in ("yes", 1, None):
        with pytest.raises(InputTypeError, match="check_indices must be"):
            varlen.check_mode(bad)
    q = torch.zeros(4, 2, 8)
    cu = torch.tensor([0, 4], dtype=I32)
    with pytest.raises(InputTypeError, match="check_indices must be"):
        fa4lab.attention_varlen(q, q, q, cu, cu, 4, 4, check_indices="later")


def test_on_the_cpu_the_default_check_raises_at_once():
    """CPU tensors: "device" is the synchronous check (nothing to overlap), before any work."""
    q = torch.zeros(5, 2, 8)
    cu_q, cu_k = torch.tensor([0, 3, 2, 5], dtype=I32), torch.tensor([0, 1, 4, 5], dtype=I32)
    with pytest.raises(InputError, match="cu_seqlens_q decreases at index 2"):
        fa4lab.attention_varlen(q, q, q, cu_q, cu_k, None, None)
    assert indexcheck.pending() == 0


def test_plans_and_their_rules():
    plan = IndexCheckPlan(cu_q=True, cu_k=True, seqused_k=False, paged=False)
    assert Rule.PAGE not in plan.rules and Rule.SEQUSED_K not in plan.rules
    assert list(plan.rules) == sorted(plan.rules)
    assert IndexCheckPlan(False, False, False, True).rules == (Rule.PAGE,)
    assert (IndexCheckPlan(True, False, True, True).name("sm90a")
            == "indexcheck-sm90a-cuq-used-pages")
    with pytest.raises(ValueError):
        IndexCheckPlan(True, True, False, True)
    with pytest.raises(ValueError):
        IndexCheckPlan(False, False, True, True)


# ---- the pending verdicts, with a stand-in for the mapped rows -------------------------------
class _Pool:
    """A pool whose host rows are plain numpy: a check "runs" when its ticket is written."""

    def __init__(self, n):
        self.host_rows = np.zeros((n, indexcheck.HOST_WORDS), dtype=np.int32)
        self.free, self.waits, self.queued = [], 0, {}

    def run(self, slot, ticket):
        self.host_rows[slot, indexcheck.TICKET_AT] = ticket

    def wait(self):         # the device synchronised: every queued check has run
        self.waits += 1
        for slot, ticket in self.queued.items():
            self.run(slot, ticket)


def _queue(verdicts):
    pool = _Pool(len(verdicts))
    context = CheckContext(total_q=5, entry="fa4lab.attention_varlen")
    for slot, v in enumerate(verdicts):
        pool.host_rows[slot, :indexcheck.VERDICT_WORDS] = v
        pool.queued[slot] = 100 + slot
        indexcheck._queue.append(indexcheck._Pending(pool, slot, 100 + slot, context))
    return pool


def test_poll_raises_finished_bad_verdicts_only_and_check_errors_waits(monkeypatch):
    monkeypatch.setattr(indexcheck, "_queue", type(indexcheck._queue)())
    bad = Verdict(Rule.CU_Q_END, 0, 4, 0)
    pool = _queue([Verdict(), bad, Verdict()])
    indexcheck.poll()                         # nothing has run: nothing read, no wait
    assert indexcheck.pending() == 3 and pool.waits == 0
    pool.run(0, 99)                           # an earlier check's ticket: not this one's
    indexcheck.poll()
    assert indexcheck.pending() == 3
    pool.run(0, 100)
    indexcheck.poll()
    assert indexcheck.pending() == 2 and pool.free == [0]
    pool.run(2, 102)                          # the bad one is still running: stays queued
    indexcheck.poll()
    assert indexcheck.pending() == 2 and pool.waits == 0
    with pytest.raises(InputError, match=r"earlier call of fa4lab.attention_varlen.*"
                                         r"cu_seqlens_q's last entry is 4 but the packed q "
                                         r"have 5 tokens"):
        indexcheck.check_errors()
    assert pool.waits == 1 and sorted(pool.free) == [0, 1]
    indexcheck.check_errors()                 # the good one left, already run: no wait
    assert indexcheck.pending() == 0 and sorted(pool.free) == [0, 1, 2] and pool.waits == 1


def test_a_check_that_never_reports_is_an_error_not_a_hang(monkeypatch):
    monkeypatch.setattr(indexcheck, "_queue", type(indexcheck._queue)())
    pool = _queue([Verdict()])
    pool.wait = lambda: None                  # synchronised, and still no ticket
    with pytest.raises(RuntimeError, match="never reported"):
        indexcheck.check_errors()
    assert pool.free == [0] and indexcheck.pending() == 0


def test_tickets_skip_zero_and_wrap(monkeypatch):
    monkeypatch.setattr(indexcheck, "_pools", {})
    pool = _Pool(2)
    pool.free, pool.ticket = [0, 1], 2**31 - 2
    pool.device_rows = pool.mapped_rows = np.zeros((2, indexcheck.HOST_WORDS), dtype=np.int32)
    indexcheck._pools[0] = pool
    dev = torch.device("cpu")
    monkeypatch.setattr(indexcheck, "_current_device", lambda: 0)
    assert [indexcheck.slot_for(dev).ticket for _ in range(2)] == [2**31 - 1, 1]


def test_messages_name_the_tensor_and_index():
    ctx = CheckContext(total_q=7, total_k=9, num_pages=6, page_size=4, pages_per_seq=3,
                       max_seqlen_q=2, max_seqlen_k=5)
    assert message(Verdict(Rule.PAGE, 4, 9, 10), ctx).startswith(
        "page_table[1, 1] = 9 is not a page of the cache (num_pages = 6): sequence 1 reads 10 "
        "keys, so its slots 0..2")
    assert message(Verdict(Rule.CU_K_ORDER, 2, 5, 3), ctx).startswith(
        "cu_seqlens_k decreases at index 3 (cu_seqlens_k[2] = 5, cu_seqlens_k[3] = 3)")
    assert "seqused_k[0] = 13 but its 3 pages of 4 hold 12 keys" in message(
        Verdict(Rule.SEQUSED_K, 0, 13, 12), ctx)
    assert message(Verdict(Rule.MAX_K, 1, 8), ctx).startswith(
        "max_seqlen_k=5 is smaller than sequence 1's key length 8")


# ---- the kernels' clamps ----------------------------------------------------------------------
def test_tile_rows_of_bad_lengths_stay_in_the_table():
    """Note [tile rows on the device]: negative or huge lengths give rows (batch, m_block) with
    batch in [0, batch] and m_block in [0, rows): no tile indexes past its table or overflows."""
    rng = np.random.default_rng(3)
    for _ in range(50):
        batch = int(rng.integers(1, 6))
        lens_q = torch.tensor(rng.integers(-2**31, 2**31 - 1, batch), dtype=torch.int64)
        lens_k = torch.tensor(rng.integers(-100, 1000, batch), dtype=torch.int64)
        rows = int(rng.integers(1, 20))
        table, _, _ = varlen_tiles.tile_rows(lens_q, lens_k, rows, m_block_size=128,
                                             n_block_size=128, causal=bool(rng.integers(0, 2)))
        assert table.shape == (rows, 2)
        assert ((table[:, 0] >= 0) & (table[:, 0] <= batch)).all()
        assert ((table[:, 1] >= 0) & (table[:, 1] < rows)).all()


# ---- tier 1: compile on the CPU -----------------------------------------------------------------
PLANS = [IndexCheckPlan(True, True, False, False), IndexCheckPlan(True, True, True, False),
         IndexCheckPlan(True, False, False, True), IndexCheckPlan(True, False, True, True),
         IndexCheckPlan(False, False, False, True)]


@pytest.mark.compile
@pytest.mark.parametrize("arch", ["sm90a", "sm100a"])
@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.name("")[len("indexcheck--"):])
def test_index_check_compiles(arch, plan, tmp_path):
    """Every plan compiles for both archs without spills, with the atomics of Note [one
    verdict from many CTAs]: a min per rule, the acq_rel count, the swaps that reset the
    scratch."""
    from fa4lab.kernels import binary
    from fa4lab.kernels.index_check import compile_index_check

    cc = compile_index_check(plan, arch=arch, keep_dir=tmp_path)
    ptx = cc.ptx_path.read_text()
    assert f".target sm_{arch.removeprefix('sm')}" in ptx
    res = binary.resource_usage(cc.cubin_path)
    assert res["local"] == 0 and res["stack"] == 0, f"{plan.name(arch)} spills: {res}"
    assert ptx.count("atom.global.min.s32") == len(plan.rules)
    assert ptx.count("atom.global.acq_rel.add") == 1
    assert ptx.count("atom.global.exch") == len(plan.rules) + 1
