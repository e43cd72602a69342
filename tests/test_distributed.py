"""Ring attention (fa4lab.distributed) against the float64 reference.

CPU: the schedule against the global causal mask, shard/unshard, the merge of (out, lse) pairs,
`simulate_ring` (one process), and `ring_attention` over gloo in 2-4 forked processes (under a
second per world size: tiny shapes, several cases per launch). GPU: the same ring over NCCL,
marked `gpu` + `multigpu`, skipped with a reason where fewer than 2 GPUs exist.

Tolerance (`_tol`): the kernels return lse in float32, so each merge weight exp(lse_i - m)
carries a relative error of about eps32 * |lse|; the merged output is a convex combination of
partial outputs, so its error is at most a few eps32 * (1 + max |lse|) * max |v|.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fa4lab.distributed import (
    LAYOUTS,
    ring_attention,
    ring_schedule,
    shard,
    simulate_ring,
    unshard,
    work_per_rank,
)
from fa4lab.distributed.launch import ring_shards, spawn
from fa4lab.online_softmax import merge_out_lse
from fa4lab.reference import attention_reference, visible_mask

pytestmark = pytest.mark.usefixtures("quiet_reference")
EPS32 = float(np.finfo(np.float32).eps)


def _inputs(rng, *, seqlen, batch=1, heads_q=4, heads_kv=2, head_dim=8, head_dim_v=None,
            magnitude=None):
    """float64 q, k, v; magnitude: normalise q and k so logits reach about +-magnitude."""
    shape = lambda h, d: (batch, seqlen, h, d)  # noqa: E731
    q = rng.standard_normal(shape(heads_q, head_dim))
    k = rng.standard_normal(shape(heads_kv, head_dim))
    v = rng.standard_normal(shape(heads_kv, head_dim_v or head_dim))
    if magnitude is not None:
        scale = math.sqrt(magnitude * math.sqrt(head_dim))
        q = scale * q / np.linalg.norm(q, axis=-1, keepdims=True)
        k = scale * k / np.linalg.norm(k, axis=-1, keepdims=True)
    return tuple(torch.from_numpy(x) for x in (q, k, v))


def _tol(ref_lse, v):
    lse = ref_lse[torch.isfinite(ref_lse)]
    big = 1.0 + (lse.abs().max().item() if lse.numel() else 0.0)
    return 8 * EPS32 * big * (1.0 + v.abs().max().item()), 8 * EPS32 * big


def _assert_matches_reference(out, lse, q, k, v, where, **kw):
    ref, ref_lse = attention_reference(q, k, v, return_lse=True, **kw)
    tol_out, tol_lse = _tol(ref_lse, v)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), f"{where}: NaN"
    err = (out.double() - ref).abs().max().item()
    assert err <= tol_out, f"{where}: max |out - reference| = {err:.3g} > {tol_out:.3g}"
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen), f"{where}: lse -inf on the wrong rows"
    lerr = (lse.double() - ref_lse)[seen].abs().max().item() if seen.any() else 0.0
    assert lerr <= tol_lse, f"{where}: max |lse - reference| = {lerr:.3g} > {tol_lse:.3g}"


# ---- the schedule --------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_shard_unshard_roundtrip(layout, world, rng):
    x = rng.standard_normal((2, 2 * world * 3, 3))
    parts = [shard(x, r, world, layout) for r in range(world)]
    assert all(p.shape[1] == x.shape[1] // world for p in parts)
    np.testing.assert_array_equal(unshard(parts, layout), x)
    t = torch.from_numpy(x)
    assert torch.equal(unshard([shard(t, r, world, layout) for r in range(world)], layout), t)
    # every token lands on exactly one rank
    pos = np.arange(x.shape[1])[None, :]
    owned = np.concatenate([shard(pos, r, world, layout)[0] for r in range(world)])
    assert sorted(owned.tolist()) == list(range(x.shape[1]))


def test_shard_says_what_divides():
    with pytest.raises(ValueError, match=r"multiple of 8 .*Pad or trim the sequence to 16 or 8"):
        shard(np.zeros((1, 10, 1)), 0, 4, "zigzag")
    with pytest.raises(ValueError, match="layout must be one of"):
        shard(np.zeros((1, 8, 1)), 0, 2, "striped")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ring_steps_cover_the_global_mask_once(layout, causal, world):
    """Each rank's steps, mapped back to global positions, compute exactly the visible (query,
    key) pairs of its queries under the global mask, each once."""
    seqlen = 2 * world * 3
    pos = np.arange(seqlen)[None, :]
    full = visible_mask(seqlen, seqlen, causal)
    for r, steps in enumerate(ring_schedule(world, causal=causal, layout=layout)):
        qpos = shard(pos, r, world, layout)[0]
        covered = np.zeros((len(qpos), seqlen), dtype=int)
        assert sorted(st.src for st in steps) == list(range(world))
        for st in steps:
            if st.q_part is None:
                continue
            kpos = shard(pos, st.src, world, layout)[0]
            c = len(qpos) // (2 if layout == "zigzag" else 1)
            qi = np.arange(st.q_part[0] * c, st.q_part[1] * c)
            kj = kpos[st.kv_part[0] * c:st.kv_part[1] * c]
            local = visible_mask(len(qi), len(kj), st.causal)
            covered[np.ix_(qi, kj)] += local
        np.testing.assert_array_equal(covered, full[qpos].astype(int),
                                      err_msg=f"rank {r}, layout {layout}, causal {causal}")


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_zigzag_balances_causal_work(world):
    seqlen = 2 * world * 16
    total = int(visible_mask(seqlen, seqlen, True).sum())
    zig = work_per_rank(seqlen, world, causal=True, layout="zigzag")
    con = work_per_rank(seqlen, world, causal=True, layout="contiguous")
    assert zig.sum() == con.sum() == total
    assert zig.sum(axis=1).max() - zig.sum(axis=1).min() == 0     # every rank: the same pairs
    assert con.sum(axis=1).max() > 1.5 * con.sum(axis=1).min()    # contiguous: the last does most
    assert np.ptp(zig[:, 1:]) == 0                                # every off-diagonal step equal


# ---- the merge ----------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_merge_out_lse_is_attention_over_the_union(rng, backend):
    """Split the keys in two: merging the halves' (out, lse) gives the whole; rows one half or
    both halves never see (causal with seqlen_q > seqlen_k) stay finite, and out 0 / lse -inf
    where no key is seen."""
    q, k, v = _inputs(rng, seqlen=12, magnitude=300.0)
    q = torch.cat([q, q[:, :6]], dim=1)                       # 18 queries, 12 keys
    cut = 5
    mask = torch.as_tensor(visible_mask(18, 12, True))
    whole, whole_lse = attention_reference(q, k, v, causal=True, return_lse=True)

    def part(lo, hi):
        sub = mask[:, lo:hi]
        bias = torch.where(sub, 0.0, -math.inf).double()
        s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(2, dim=2)[:, lo:hi])
        s = s / math.sqrt(q.shape[-1]) + bias
        lse = torch.logsumexp(s, dim=-1)
        p = torch.where(torch.isfinite(lse)[..., None], torch.exp(s - lse[..., None]), 0.0)
        out = torch.einsum("bhqk,bkhd->bhqd", p, v.repeat_interleave(2, dim=2)[:, lo:hi])
        return out, lse

    (oa, la), (ob, lb) = part(0, cut), part(cut, 12)
    assert torch.isneginf(la).any() and torch.isneginf(lb).any()  # empty rows on both sides
    if backend == "numpy":
        oa, la, ob, lb = (x.numpy() for x in (oa, la, ob, lb))
    out, lse = merge_out_lse(oa, la, ob, lb)
    out, lse = torch.as_tensor(out), torch.as_tensor(lse)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    seen = torch.isfinite(whole_lse)
    assert torch.equal(torch.isfinite(lse), seen)
    assert (out.transpose(1, 2)[~seen.transpose(1, 2)] == 0).all()
    torch.testing.assert_close(out.transpose(1, 2), whole, rtol=0, atol=1e-9)
    torch.testing.assert_close(lse[seen], whole_lse[seen], rtol=1e-12, atol=1e-9)
    # both sides empty: out 0, lse -inf, no NaN
    o2, l2 = merge_out_lse(np.ones((2, 3)), np.full(2, -np.inf), np.ones((2, 3)),
                           np.full(2, -np.inf))
    assert np.all(o2 == 0) and np.all(np.isneginf(l2))


def test_merge_out_lse_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="one shape"):
        merge_out_lse(np.zeros((2, 3)), np.zeros(2), np.zeros((3, 3)), np.zeros(3))


# ---- the ring in one process --------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_simulate_ring_matches_reference(rng, layout, causal, world):
    """GQA 4:2, head_dim_v != head_dim, batch 2, logits up to ~200, a chunk of one token."""
    seqlen = world * (2 if layout == "zigzag" else 1)           # one token per chunk
    for s, magnitude in ((seqlen, None), (3 * seqlen, 200.0)):
        q, k, v = _inputs(rng, seqlen=s, batch=2, head_dim_v=6, magnitude=magnitude)
        out, lse = simulate_ring(q, k, v, world, causal=causal, layout=layout, return_lse=True)
        _assert_matches_reference(out, lse, q, k, v, f"seqlen {s}", causal=causal)


@pytest.mark.parametrize("world", [2, 3])
def test_simulate_ring_options_that_compose(rng, world):
    """softmax_scale, softcap and learnable_sink are exact through the ring."""
    q, k, v = _inputs(rng, seqlen=4 * world, heads_q=6, heads_kv=3)
    sink = torch.from_numpy(rng.standard_normal(6) * 3).float()
    kw = dict(causal=True, softmax_scale=0.7, softcap=2.5, learnable_sink=sink)
    out, lse = simulate_ring(q, k, v, world, return_lse=True, **kw)
    _assert_matches_reference(out, lse, q, k, v, "scale, softcap, sink", **kw)


def test_ring_rejects_what_it_cannot_do(rng):
    q, k, v = _inputs(rng, seqlen=8)
    for kw, name in ((dict(window_size=(3, 0)), "window_size"),
                     (dict(score_mod=lambda s, b, h, i, j: s), "score_mod"),
                     (dict(mask_mod=lambda b, h, i, j: i >= j), "mask_mod")):
        with pytest.raises(ValueError, match=f"does not support {name}"):
            simulate_ring(q, k, v, 2, **kw)
    with pytest.raises(ValueError, match="multiple of 4"):
        simulate_ring(q[:, :6], k[:, :6], v[:, :6], 2, causal=True)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ring_attention(q, k, v)


# ---- the ring over gloo, in processes --------------------------------------------------------
@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_attention_gloo_matches_reference(rng, world):
    cases = []
    for layout in LAYOUTS:
        for causal in (False, True):
            n = 2 * world if layout == "zigzag" else world
            q, k, v = _inputs(rng, seqlen=3 * n, batch=2, magnitude=100.0 if causal else None)
            cases.append((q, k, v, dict(causal=causal, layout=layout)))
    q, k, v = _inputs(rng, seqlen=2 * world, heads_q=6, heads_kv=2)    # one token per chunk
    sink = torch.from_numpy(rng.standard_normal(6)).float()
    cases.append((q, k, v, dict(causal=True, softcap=3.0, learnable_sink=sink)))
    results = spawn(ring_shards, world, (cases,))
    for i, (q, k, v, kw) in enumerate(cases):
        layout = kw.pop("layout", "zigzag")
        out = unshard([r[i][0] for r in results], layout)
        lse = unshard([r[i][1] for r in results], layout, dim=2)
        _assert_matches_reference(out, lse, q, k, v, f"world {world}, case {i} ({layout}, {kw})",
                                  **kw)


def _mismatch_worker(rank, world):
    """An odd zig-zag shard raises before any communication; then rank 1 passes a shorter
    shard than rank 0: every rank must raise, none hang."""
    import torch.distributed as dist

    q = torch.zeros(1, 4 if rank == 0 else 2, 2, 8)
    messages = []
    for call in (lambda: ring_attention(q[:, :1], q[:, :1], q[:, :1]),
                 lambda: ring_attention(q, q, q, causal=True)):
        try:
            call()
        except ValueError as err:
            messages.append(str(err))
        dist.barrier()                             # nobody is stuck in a collective
    return messages


def test_ring_attention_mismatch_raises_on_every_rank():
    results = spawn(_mismatch_worker, 2, timeout_s=60)
    for r in results:
        assert len(r) == 2 and "multiple of 2" in r[0], r
        assert "differs" in r[1] and "q shape" in r[1], r


def test_bench_code_path_on_cpu_gloo(tmp_path, capsys):
    """The benchmark's whole path (spawn, shard, ring, gather, compare, record) on CPU; its
    timings mean nothing here, its exactness does."""
    import json

    from fa4lab.distributed.bench import run

    path = tmp_path / "ring.json"
    assert run(["--seqlen", "8", "--world", "2", "--heads", "2", "--heads-kv", "1",
                "--head-dim", "8", "--reps", "1", "--backend", "gloo", "--out", str(path)]) == 0
    record = json.loads(path.read_text())
    assert record["kind"] == "ring" and "no GPU timing" in record["notes"]
    (row,) = record["results"]
    assert row["world"] == 2 and row["max_abs_diff_vs_single"] <= 16 * EPS32


def test_bench_without_gpus_measures_nothing(capsys):
    from fa4lab.distributed.bench import run

    if _gpus() >= 2:
        pytest.skip("GPUs are here: the bench would run")
    assert run(["--seqlen", "64"]) == 2
    assert "nothing measured" in capsys.readouterr().err


# ---- GPUs ---------------------------------------------------------------------------------------
def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_simulate_ring_on_one_gpu(rng, causal):
    """The kernel on each block of the ring (bf16), merged: FA4's rule against the reference
    (at most twice SDPA's own bf16 error, plus a small atol)."""
    from fa4lab.api import sdpa_same_dtype

    q, k, v = (t.cuda().bfloat16() for t in _inputs(rng, seqlen=1024, batch=2, heads_q=8,
                                                      heads_kv=2, head_dim=128))
    out = simulate_ring(q, k, v, 4, causal=causal)
    ref = attention_reference(q, k, v, causal=causal).cuda()
    sdpa = (sdpa_same_dtype(q, k, v, causal=causal).double() - ref).abs().max().item()
    err = (out.double() - ref).abs().max().item()
    assert err <= 2 * sdpa + 1e-3, f"ring {err:.3g} vs SDPA {sdpa:.3g}"


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.skipif(_gpus() < 2, reason=f"needs 2 or more CUDA GPUs; {_gpus()} visible")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_ring_attention_nccl(rng, layout):
    from fa4lab.api import sdpa_same_dtype

    world = min(_gpus(), 4)
    q, k, v = (t.bfloat16() for t in _inputs(rng, seqlen=512 * world, heads_q=8, heads_kv=2,
                                              head_dim=128))
    results = spawn(ring_shards, world, ([(q, k, v, dict(causal=True, layout=layout))],),
                    backend="nccl")
    out = unshard([r[0][0] for r in results], layout)
    ref = attention_reference(q, k, v, causal=True)
    sdpa = (sdpa_same_dtype(q.cuda(), k.cuda(), v.cuda(), causal=True).double().cpu()
            - ref).abs().max().item()
    err = (out.double() - ref).abs().max().item()
    assert err <= 2 * sdpa + 1e-3, f"ring over NCCL ({world} GPUs) {err:.3g} vs SDPA {sdpa:.3g}"
