"""Start N processes that form a torch.distributed group, without torchrun.

    results = spawn(fn, world, args, backend="gloo")   # fn(rank, world, *args) -> picklable

Each process (forked on CPU, spawned for NCCL) joins the group through a file:// store in a
fresh temporary directory (no port to pick, nothing left behind), runs fn, and hands its return
value back through that directory;
`spawn` returns them in rank order. An exception in any rank is raised in the caller with that
rank's traceback (torch.multiprocessing's ProcessRaisedException). backend "nccl" puts rank r on
cuda:r and sets NCCL_NVLS_ENABLE=0 (NVLink SHARP multicast stays off: the ring uses
point-to-point transfers only). fn must be importable by name (a module-level function), as
torch.multiprocessing.spawn requires.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import time
import warnings
from pathlib import Path

import torch


def spawn(fn, world: int, args: tuple = (), *, backend: str = "gloo",
          timeout_s: float = 300.0) -> list:
    """[fn(0, world, *args), ..., fn(world - 1, world, *args)], each run in its own process.

    timeout_s bounds the whole run and each collective (the process group's timeout): ranks
    stuck in mismatched collectives are terminated and TimeoutError raised, never a hang."""
    import torch.multiprocessing as mp

    if backend == "nccl":
        have = torch.cuda.device_count()
        if have < world:
            raise RuntimeError(f"backend nccl with {world} ranks needs {world} GPUs, {have} "
                               f"visible; use backend='gloo' on CPU")
        os.environ["NCCL_NVLS_ENABLE"] = "0"
    # fork where it is safe (CPU only): the ranks inherit the imported modules, and start in
    # well under a second instead of importing torch again; CUDA needs fresh processes.
    method = "spawn" if backend == "nccl" or "fork" not in mp.get_all_start_methods() \
        else "fork"
    with tempfile.TemporaryDirectory(prefix="fa4lab-ring-") as tmp:
        ctx = mp.start_processes(_entry, args=(world, tmp, backend, fn, tuple(args), timeout_s,
                                               method == "fork"),
                                 nprocs=world, join=False, start_method=method)
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.terminate()
                raise TimeoutError(f"{world} ranks of {getattr(fn, '__name__', fn)} did not "
                                   f"finish in {timeout_s:g} s (a rank stuck in a collective the "
                                   f"others never entered?)")
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _entry(rank, world, tmp, backend, fn, args, timeout_s, forked):
    import torch.distributed as dist

    if forked:
        # A forked child inherits the parent's OpenMP state but not its worker threads: once
        # the parent has run a parallel op, the child's first one waits for them forever. One
        # thread per rank never enters a parallel team (and N ranks share the cores anyway).
        torch.set_num_threads(1)

    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{Path(tmp) / 'store'}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        result = fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
    torch.save(result, Path(tmp) / f"rank{rank}.pt")


def ring_shards(rank: int, world: int, cases: list) -> list:
    """Worker for `spawn`: for each (q, k, v, kwargs) of FULL tensors, this rank's shards through
    `ring_attention(..., return_lse=True, **kwargs)`, as CPU tensors (out, lse). kwargs may hold
    layout (default zigzag) and any option of ring_attention; learnable_sink is the full
    (heads_q,) tensor. SlowReferenceWarning is silenced here: every rank would print it."""
    from fa4lab.api import SlowReferenceWarning
    from fa4lab.distributed import ring_attention, shard

    results = []
    for q, k, v, kwargs in cases:
        layout = kwargs.get("layout", "zigzag")
        device = torch.device("cuda", rank) if torch.distributed.get_backend() == "nccl" \
            else torch.device("cpu")
        local = [shard(t, rank, world, layout).to(device) for t in (q, k, v)]
        kw = dict(kwargs)
        if kw.get("learnable_sink") is not None:
            kw["learnable_sink"] = kw["learnable_sink"].to(device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SlowReferenceWarning)
            out, lse = ring_attention(*local, return_lse=True, **kw)
        results.append((out.cpu(), lse.cpu()))
    return results
