"""Benchmark ring attention on N GPUs: exactness against one GPU, and scaling efficiency.

    python -m fa4lab.distributed bench --seqlen 131072 --world 8            # NCCL, 8 GPUs
    python -m fa4lab.distributed bench --seqlen 64 --world 2 --backend gloo # CPU: the path only

Each rank builds the same full q, k, v from one seed on its own device, keeps its shard
(`shard`, layout zigzag by default) and runs `ring_attention`: one warm-up call, then --reps
timed calls between barriers (median). Rank 0 also runs `fa4lab.attention` on the whole
sequence (the single-GPU time and result), gathers the ring's output and compares:
efficiency = T(1) / (N * T(N)), and max |ring - single GPU| next to the model's prediction
(`fa4lab.distributed.model`, ASSUMED rates). The record goes to benchmarks/ring/ (a
subdirectory: its kind "ring" is not one of the throughput records of benchmarks/*.json).

Not yet run on GPUs: no multi-GPU machine was available when it was written. With gloo on CPU
it runs the float64 reference per block: the timings there say nothing about GPUs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch


def _time(fn, reps: int, sync) -> float:
    """Median seconds of fn() over reps calls, each between barriers."""
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_rank(rank: int, world: int, cfg: dict) -> dict | None:
    """Worker for `spawn` (fa4lab.distributed.launch): one rank of the benchmark."""
    import torch.distributed as dist

    import fa4lab
    from fa4lab.api import SlowReferenceWarning
    from fa4lab.distributed import ring_attention, shard, unshard

    warnings.simplefilter("ignore", SlowReferenceWarning)
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dtype = getattr(torch, cfg["dtype"])
    gen = torch.Generator(device=device).manual_seed(cfg["seed"])
    s, b, hq, hkv, d = cfg["seqlen"], cfg["batch"], cfg["heads"], cfg["heads_kv"], cfg["head_dim"]
    q = torch.randn(b, s, hq, d, generator=gen, device=device, dtype=dtype)
    k = torch.randn(b, s, hkv, d, generator=gen, device=device, dtype=dtype)
    v = torch.randn(b, s, hkv, d, generator=gen, device=device, dtype=dtype)
    layout, causal = cfg["layout"], cfg["causal"]
    local = [shard(t, rank, world, layout).contiguous() for t in (q, k, v)]

    def sync():
        if cuda:
            torch.cuda.synchronize(device)
        dist.barrier()

    def ring():
        return ring_attention(*local, causal=causal, layout=layout)

    with torch.inference_mode():
        out = ring()                                         # warm-up (and compile)
        ring_s = _time(ring, cfg["reps"], sync)
        shards = [torch.empty_like(out) for _ in range(world)]
        dist.all_gather(shards, out.contiguous())
        if rank != 0:
            del q, k, v
            dist.barrier()                                   # rank 0 times one GPU meanwhile
            return None
        full = unshard(shards, layout)

        def single():
            return fa4lab.attention(q, k, v, causal=causal)

        ref = single()
        single_s = _time(single, cfg["reps"], lambda: torch.cuda.synchronize(device) if cuda
                         else None)
        diff = (full.float() - ref.float()).abs().max().item()
        dist.barrier()
    return {"world": world, "seqlen": s, "layout": layout, "causal": causal,
            "ring_ms": ring_s * 1e3, "single_ms": single_s * 1e3,
            "efficiency": single_s / (world * ring_s), "max_abs_diff_vs_single": diff}


def run(argv=None) -> int:
    from fa4lab.distributed.launch import spawn

    p = argparse.ArgumentParser(prog="python -m fa4lab.distributed bench",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlen", type=int, nargs="+", default=[131072])
    p.add_argument("--world", type=int, default=None, help="ranks (default: every GPU)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--heads-kv", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layout", default="zigzag", choices=["zigzag", "contiguous"])
    p.add_argument("--no-causal", dest="causal", action="store_false")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole run")
    p.add_argument("--out", type=Path, default=None, help="record path (default benchmarks/ring/)")
    a = p.parse_args(argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    world = a.world or gpus
    if a.backend == "nccl" and (gpus < 2 or world < 2 or world > gpus):
        print(f"ring bench with NCCL needs 2 or more CUDA GPUs (asked {world}, {gpus} visible); "
              f"nothing measured. On CPU, --backend gloo --world 2 runs the code path only.",
              file=sys.stderr)
        return 2
    if a.backend == "gloo" and world < 1:
        world = 2
    cfg = dict(batch=a.batch, heads=a.heads, heads_kv=a.heads_kv, head_dim=a.head_dim,
               layout=a.layout, causal=a.causal, reps=a.reps, seed=a.seed,
               dtype="bfloat16" if a.backend == "nccl" else "float32")
    results = []
    for s in a.seqlen:
        row = spawn(bench_rank, world, ({**cfg, "seqlen": s},), backend=a.backend,
                    timeout_s=a.timeout)[0]
        row["modelled_efficiency"] = _modelled(cfg, s, world)
        print(json.dumps(row))
        results.append(row)
    path = write_record(results, cfg, world, a.backend, argv, a.out)
    print(f"record: {path}")
    return 0


def _modelled(cfg, seqlen, world) -> float:
    from fa4lab.distributed.model import RingProblem, h200_cost, ring_timeline

    p = RingProblem(seqlen=seqlen, heads_q=cfg["heads"], heads_kv=cfg["heads_kv"],
                    head_dim=cfg["head_dim"], batch=cfg["batch"], causal=cfg["causal"],
                    layout=cfg["layout"])
    return ring_timeline(p, world, h200_cost("nvlink_h200")).efficiency


def write_record(results, cfg, world, backend, argv, out) -> Path:
    from fa4lab.bench.records import BENCHMARKS_DIR, record_header
    from fa4lab.environment import gpu

    g = gpu() if backend == "nccl" else None
    name = f"{g.name} x{world}" if g else f"CPU gloo x{world}"
    command = "python -m fa4lab.distributed bench " + " ".join(argv or sys.argv[2:])
    record = record_header("ring", gpu_name=name, arch=g.arch if g else None, command=command,
                           config={**cfg, "world": world, "backend": backend},
                           label=f"ring attention on {name}",
                           notes="" if g else "CPU gloo: the code path only, no GPU timing")
    record["results"] = results
    stamp = record["time_utc"].replace(":", "")
    tag = name.lower().replace(" ", "-")
    path = out or BENCHMARKS_DIR / "ring" / f"{record['date']}_{tag}_{stamp}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path
