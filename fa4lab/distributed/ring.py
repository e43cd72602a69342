"""Ring attention: context parallelism over torch.distributed, merged by LSE.

    out = ring_attention(q, k, v, causal=True)              # inside an initialised process group
    out, lse = ring_attention(q, k, v, causal=True, return_lse=True)
    out = simulate_ring(q, k, v, world=4, causal=True)      # one process, N virtual ranks

q, k, v are THIS rank's shards, laid out as `fa4lab.attention`'s: (batch, seqlen_local, heads,
head_dim), from `shard(x, rank, world, layout)` (layout "zigzag", the default, or "contiguous",
as passed here). out is this rank's shard of the output, lse (batch, heads_q, seqlen_local)
float32, natural log; `unshard(outs, layout)` and `unshard(lses, layout, dim=2)` put the ranks'
shards back together.

How: each rank keeps its queries and passes its K/V block to the next rank (rank + 1 mod N),
N - 1 times, so every rank sees every block once. At each step the local kernel
(`fa4lab.attention(..., return_lse=True)`) runs on the block that is here, on the slices and
with the causal flag `fa4lab.distributed.schedule.ring_step` gives (Note [zig-zag sharding]),
while the next block travels: `torch.distributed.batch_isend_irecv` (NCCL on GPUs, on a
separate CUDA stream; gloo on CPU). The partial results merge by their LSE with the one rule
of lesson 01 (`fa4lab.online_softmax.merge_out_lse`, Note [merge rule]), accumulated in float32
(float64 for float64 inputs), and the output is cast to q's dtype once at the end.

Requirements (checked before any K/V moves; the last check is one small all_gather that
compares every rank's shapes, dtype and options, so a mismatch raises on all ranks instead of
hanging): every rank holds the same shapes; with layout "zigzag" the local length is even (2
chunks); with causal, seqlen_q == seqlen_k (self-attention; the global length N * local is then
a multiple of 2N for zigzag, N for contiguous, which `shard` checks on the full tensor).

Options: `softmax_scale` and `softcap` compose trivially (a per-score function: passed to each
block); `learnable_sink` too: the sink adds e^sink[h] to every row's denominator once, which is
one more merge with a partial of out 0 and lse sink[h] after the ring. `pack_gqa` is passed on.
`window_size`, `score_mod`, `mask_mod` and `aux_tensors` raise: they depend on global token
positions, which the local blocks do not carry.

On CPU tensors `fa4lab.attention` computes the float64 reference and warns
SlowReferenceWarning; the ring keeps that warning (it says what ran).

GPU path: written for NCCL with a communication stream; tested on CPU with gloo (2-4
processes) and by `simulate_ring`, NOT YET RUN on GPUs (tests marked `multigpu` do, where two
or more GPUs exist; `python -m fa4lab.distributed bench` measures).
"""

from __future__ import annotations

import math

import torch

from fa4lab.call import check_call
from fa4lab.distributed.schedule import check_layout, chunks_per_rank, ring_step
from fa4lab.online_softmax import merge_out_lse
from fa4lab.spec import normalize_mask

_UNSUPPORTED = ("window_size", "score_mod", "mask_mod", "aux_tensors")
_LAYOUT_CODE = {"zigzag": 0, "contiguous": 1}


class _Partial:
    """This rank's running (out, lse): out (batch, heads_q, rows, head_dim_v) in the merge
    dtype, lse (batch, heads_q, rows); rows no block reached yet are out 0, lse -inf."""

    def __init__(self, q, head_dim_v):
        b, s, h, _ = q.shape
        self.dtype = torch.promote_types(q.dtype, torch.float32)
        self.out = torch.zeros((b, h, s, head_dim_v), dtype=self.dtype, device=q.device)
        self.lse = torch.full((b, h, s), -math.inf, dtype=self.dtype, device=q.device)

    def merge(self, rows: slice, out, lse):
        """Merge a block's result for local query rows `rows`: out (b, rows, h, dv) as the kernel
        returns it, lse (b, h, rows)."""
        o, m = merge_out_lse(self.out[:, :, rows], self.lse[:, :, rows],
                             out.transpose(1, 2).to(self.dtype), lse.to(self.dtype))
        self.out[:, :, rows] = o
        self.lse[:, :, rows] = m

    def result(self, out_dtype):
        return self.out.transpose(1, 2).to(out_dtype), self.lse.to(torch.float32)


def _check_options(options: dict) -> None:
    """ValueError naming the options the ring cannot honour (a (None, None) window is none)."""
    if normalize_mask(False, options["window_size"])[1] == (None, None):
        options = {**options, "window_size": None}
    given = [name for name in _UNSUPPORTED if options.get(name) is not None]
    if given:
        raise ValueError(
            f"ring_attention does not support {', '.join(given)}: they depend on global token "
            f"positions, which the ring's local blocks do not carry. Supported: causal, "
            f"softmax_scale, softcap, learnable_sink, pack_gqa, return_lse; for the others run "
            f"fa4lab.attention on one device")


def _check_local(q, k, v, *, causal, layout, softmax_scale, softcap, learnable_sink):
    """Every check that needs no communication; the softmax scale it resolves."""
    arch = None
    if q.is_cuda:
        from fa4lab.kernels import launch

        arch = launch.device_arch(q.device.index)
    call = check_call(q, k, v, softmax_scale=softmax_scale, softcap=softcap,
                      learnable_sink=learnable_sink, arch=arch)
    check_layout(layout)
    sq, sk = q.shape[1], k.shape[1]
    if causal and sq != sk:
        raise ValueError(f"causal ring attention is self-attention: q and k shards must have one "
                         f"length, got seqlen_q {sq} and seqlen_k {sk} on this rank")
    parts = chunks_per_rank(layout)
    for name, n in (("q", sq), ("k", sk)):
        if n % parts:
            raise ValueError(f"with layout {layout!r} each rank holds {parts} chunks, so its "
                             f"{name} shard's length must be a multiple of {parts}, got {n}. "
                             f"Shard the full sequence with fa4lab.distributed.shard (its "
                             f"length a multiple of 2 * world), or use layout='contiguous'")
    return call.spec.scale


def _block(q, k, v, step, parts, kernel_args, partial):
    """Run the kernel on this step's slices (`ring_step`, in chunks: the shard holds `parts`)
    and merge the result."""
    if step.q_part is None:
        return
    import fa4lab

    cq, ck = q.shape[1] // parts, k.shape[1] // parts
    qr = slice(step.q_part[0] * cq, step.q_part[1] * cq)
    kr = slice(step.kv_part[0] * ck, step.kv_part[1] * ck)
    out, lse = fa4lab.attention(q[:, qr].contiguous(), k[:, kr].contiguous(),
                                v[:, kr].contiguous(), causal=step.causal, return_lse=True,
                                **kernel_args)
    partial.merge(qr, out, lse)


def _ring(q, k, v, rank, world, exchange, *, causal, layout, kernel_args, learnable_sink):
    """The ring as one rank sees it; exchange(k, v) starts sending this block on and returns a
    wait() that gives the next one. Shared by `ring_attention` and `simulate_ring`."""
    partial = _Partial(q, v.shape[3])
    parts = chunks_per_rank(layout)
    for s in range(world):
        pending = exchange(k, v) if s < world - 1 else None     # overlaps the block below
        _block(q, k, v, ring_step(rank, s, world, causal=causal, layout=layout), parts,
               kernel_args, partial)
        if pending is not None:
            k, v = pending()
    if learnable_sink is not None:
        sink = learnable_sink.to(partial.dtype)[None, :, None].expand_as(partial.lse)
        partial.out, partial.lse = merge_out_lse(partial.out, partial.lse,
                                                 torch.zeros_like(partial.out), sink)
    return partial.result(q.dtype)


_COMM_STREAMS: dict = {}


def _p2p_exchange(rank, world, group):
    """exchange(k, v) over torch.distributed: send to rank + 1, receive from rank - 1."""
    import torch.distributed as dist

    nxt = dist.get_global_rank(group, (rank + 1) % world)
    prv = dist.get_global_rank(group, (rank - 1) % world)

    def exchange(k, v):
        recv = (torch.empty_like(k), torch.empty_like(v))
        ops = [dist.P2POp(dist.isend, t, nxt, group) for t in (k, v)]
        ops += [dist.P2POp(dist.irecv, t, prv, group) for t in recv]
        if k.is_cuda:
            # Note [ring comm stream]: the transfers are issued on their own stream, after the
            # compute stream has produced k and v; the compute stream waits for them only when
            # it needs the next block, so the kernel of this step runs meanwhile.
            compute = torch.cuda.current_stream(k.device)
            if k.device not in _COMM_STREAMS:
                _COMM_STREAMS[k.device] = torch.cuda.Stream(device=k.device)
            comm = _COMM_STREAMS[k.device]
            comm.wait_stream(compute)
            with torch.cuda.stream(comm):
                reqs = dist.batch_isend_irecv(ops)
        else:
            reqs = dist.batch_isend_irecv(ops)

        def wait():
            for r in reqs:
                r.wait()
            if k.is_cuda:
                compute.wait_stream(comm)
            return recv

        return wait

    return exchange


def _check_ranks(q, k, v, group, causal, layout, scale, softcap, sink) -> None:
    """One all_gather of every rank's shapes and options; ValueError on every rank when they
    differ (a mismatch would otherwise hang in the ring or mix different problems)."""
    import torch.distributed as dist

    dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    code = dtypes.index(q.dtype) if q.dtype in dtypes else -1
    mine = torch.tensor([*q.shape, *k.shape, *v.shape, int(causal), _LAYOUT_CODE[layout], code,
                         sink is not None], dtype=torch.float64, device=q.device)
    options = torch.tensor([scale, softcap], dtype=torch.float64, device=q.device)
    row = torch.cat([mine, options])
    world = dist.get_world_size(group)
    rows = [torch.empty_like(row) for _ in range(world)]
    dist.all_gather(rows, row, group=group)
    names = ("q shape", "k shape", "v shape", "causal", "layout", "dtype", "sink", "softmax_scale",
             "softcap")
    spans = [(0, 4), (4, 8), (8, 12), (12, 13), (13, 14), (14, 15), (15, 16), (16, 17), (17, 18)]
    for r, other in enumerate(rows):
        bad = [n for n, (a, b) in zip(names, spans) if not torch.equal(other[a:b], row[a:b])]
        if bad:
            raise ValueError(f"ring_attention: rank {r} differs from rank "
                             f"{dist.get_rank(group)} in {', '.join(bad)}; every rank must "
                             f"call it with shards of one shape and the same options")


def ring_attention(q, k, v, *, group=None, causal: bool = False,
                   softmax_scale: float | None = None, layout: str = "zigzag",
                   softcap: float = 0.0, learnable_sink=None, pack_gqa: bool | None = None,
                   window_size=(None, None), score_mod=None, mask_mod=None, aux_tensors=None,
                   return_lse: bool = False):
    """Attention of this rank's query shard against the whole sequence's keys, the K/V shards
    passed around the ring of `group` (default: the whole world). See the module docstring."""
    import torch.distributed as dist

    from fa4lab.backward import grad_error

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("ring_attention runs inside a torch.distributed process group: call "
                           "torch.distributed.init_process_group (nccl on GPUs, gloo on CPU) "
                           "first, or use fa4lab.distributed.simulate_ring in one process")
    _check_options(dict(window_size=window_size, score_mod=score_mod, mask_mod=mask_mod,
                        aux_tensors=aux_tensors))
    if torch.is_grad_enabled() and any(getattr(t, "requires_grad", False)
                                       for t in (q, k, v, learnable_sink)):
        raise grad_error(entry="fa4lab.distributed.ring_attention")
    causal = bool(causal)
    scale = _check_local(q, k, v, causal=causal, layout=layout, softmax_scale=softmax_scale,
                         softcap=softcap, learnable_sink=learnable_sink)
    group = dist.group.WORLD if group is None else group
    _check_ranks(q, k, v, group, causal, layout, scale, float(softcap), learnable_sink)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    k, v = k.contiguous(), v.contiguous()               # what travels must be one dense block
    out, lse = _ring(q, k, v, rank, world, _p2p_exchange(rank, world, group), causal=causal,
                     layout=layout, kernel_args=dict(softmax_scale=scale, softcap=softcap,
                                                     pack_gqa=pack_gqa),
                     learnable_sink=learnable_sink)
    return (out, lse) if return_lse else out


def _virtual_exchange(rank, world, ks, vs):
    """exchange(k, v) of virtual rank `rank`: the block rank - 1 would send, by indexing."""
    step = 0

    def exchange(k, v):
        nonlocal step
        step += 1
        src = (rank - step) % world
        return lambda: (ks[src], vs[src])

    return exchange


def simulate_ring(q, k, v, world: int, *, causal: bool = False,
                  softmax_scale: float | None = None, layout: str = "zigzag",
                  softcap: float = 0.0, learnable_sink=None, pack_gqa: bool | None = None,
                  window_size=(None, None), score_mod=None, mask_mod=None, aux_tensors=None,
                  return_lse: bool = False):
    """The ring algorithm in ONE process over `world` virtual ranks: the same schedule, kernel
    calls and merges as `ring_attention`, with the K/V hand-over done by indexing instead of
    communication. q, k, v are the FULL tensors (batch, seqlen, heads, head_dim); out (and
    lse) are the full results, unsharded. The ranks run one after another."""
    from fa4lab.distributed.schedule import shard, unshard

    _check_options(dict(window_size=window_size, score_mod=score_mod, mask_mod=mask_mod,
                        aux_tensors=aux_tensors))
    causal = bool(causal)
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"causal ring attention is self-attention: q and k must have one "
                         f"length, got seqlen_q {q.shape[1]} and seqlen_k {k.shape[1]}")
    qs = [shard(q, r, world, layout) for r in range(world)]
    ks = [shard(k, r, world, layout) for r in range(world)]
    vs = [shard(v, r, world, layout) for r in range(world)]
    scale = _check_local(qs[0], ks[0], vs[0], causal=causal, layout=layout,
                         softmax_scale=softmax_scale, softcap=softcap,
                         learnable_sink=learnable_sink)
    outs, lses = [], []
    for r in range(world):
        o, m = _ring(qs[r], ks[r], vs[r], r, world, _virtual_exchange(r, world, ks, vs),
                     causal=causal, layout=layout,
                     kernel_args=dict(softmax_scale=scale, softcap=softcap, pack_gqa=pack_gqa),
                     learnable_sink=learnable_sink)
        outs.append(o)
        lses.append(m)
    out, lse = unshard(outs, layout), unshard(lses, layout, dim=2)
    return (out, lse) if return_lse else out
