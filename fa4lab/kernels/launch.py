"""The one launch path: torch tensors in, the compiled kernel of their configuration launched.

`forward` is what `fa4lab.attention` runs on a GPU with a kernel. It takes the call checked
once by `fa4lab.call.check_call` (in the kernel's form: `Call.for_kernel`), finds the compiled
function of its `KernelKey` (`Call.key`) in a dict, allocates out (and lse) and calls the
function with the torch tensors themselves (`KernelArgs.of` the call; Note [TVM-FFI launch] in
`fa4lab.kernels.compile`: no DLPack conversion or stream query in Python). Nothing here checks
an input again (Note [one check per call] in fa4lab.call).

On a miss the kernel comes from the disk cache (`fa4lab.kernels.cache`, milliseconds) or is compiled
(seconds) from `KernelKey.plan`, the plan of a canonical spec of the key: the plan, hence the
kernel, depends on what the key holds -- arch, head dims, dtype, causal, GQA ratio, LSE, pack-GQA,
whether scores are capped, which sides a window has, whether a learnable sink comes, the page size
of a paged K/V cache -- and never on batch, sequence lengths, head counts, the softmax scale, the
cap's value, the window's sizes, the sink's values or the page table, which are runtime values (Note
[runtime scale] and Note [runtime window] in `fa4lab.kernels.compile`).

With a score_mod / mask_mod (`fa4lab.mods`) the key also holds the mods' identity, and the
kernel is compiled in this process, never read from or written to disk (Note [mods in the
kernels] in `fa4lab.mods`); a mask_mod comes with its block table (`mask_blocks_for`, cached:
Note [block table cache] in `fa4lab.mods_blocks`).

Split-KV (`fa4lab.splitkv`): with num_splits > 1 (or None and `splits_for`'s choice) `forward`
runs the split kernel of the key with split_kv set (`partials`: float32 partial outputs and
LSEs, the split count a runtime argument) and merges them with the combine kernel
(`fa4lab.kernels.combine.combine`); over contiguous K/V or a paged cache alike (each split cuts
its sequence's own key count: Note [empty splits] in fa4lab.kernels.device.split).

`compile_plan(plan, example)` builds the kernel of any plan (other tiles than the default, as
notebook 07's widget asks) and returns a runner for the bench. `attention_sm100` /
`attention_sm90` run one arch's kernel and nothing else (`attention_on`: no reference fallback).
"""

from __future__ import annotations

import threading
from collections import Counter
from functools import cache

# Loaded with the API rather than by the first call: every cached kernel is a TVM-FFI module,
# and importing tvm_ffi takes longer than loading a kernel (tens of milliseconds).
import tvm_ffi  # noqa: F401

from fa4lab import indexcheck
from fa4lab.call import check_call
from fa4lab.errors import InputError, UnsupportedArchError
from fa4lab.kernels.compile import device_arch
from fa4lab.kernels.device.arguments import KernelArgs
from fa4lab.plan.key import KernelKey
from fa4lab.tiling import num_n_blocks


def queue_index_check(context, cu_q=None, cu_k=None, used=None, table=None) -> bool:
    """`fa4lab.kernels.index_check.check_async`, its module (and the CuTe DSL) loaded at the
    first device check: the device check of `fa4lab.varlen`'s checks, installed when this
    module loads (Note [who launches the device check] in fa4lab.indexcheck)."""
    from fa4lab.kernels.index_check import check_async

    return check_async(context, cu_q, cu_k, used, table)


indexcheck.install_device_check(queue_index_check)

_lock = threading.Lock()
_kernels: dict = {}   # KernelKey, or (KernelKey, mods key) -> compiled function
_stats: Counter = Counter()    # "compiled" / "loaded": misses of the in-process dict


def stats() -> dict[str, int]:
    """Kernels this process compiled or loaded from disk (each a miss of the in-process dict)."""
    return {"compiled": _stats["compiled"], "loaded": _stats["loaded"],
            "misses": _stats["compiled"] + _stats["loaded"]}


def clear() -> None:
    """Forget the kernels this process holds (the disk cache stays)."""
    with _lock:
        _kernels.clear()
        _stats.clear()


def _build(key: KernelKey):
    from fa4lab.kernels import cache
    from fa4lab.kernels.compile import compile_plan

    def compile_default_plan():
        return compile_plan(key.plan())[1]

    # The plan is a function of the key and of the sources the cache's fingerprint hashes, so
    # a disk hit needs neither the planner nor the DSL.
    fn, how, _ = cache.load_or_compile(key.disk_key, compile_default_plan, key.name)
    _stats[how] += 1
    return fn


def _build_with_mods(key: KernelKey, mods):
    """The kernel of `key` with `mods` compiled in: in this process only, never on disk
    (Note [mods in the kernels] in fa4lab.mods)."""
    from fa4lab.kernels.compile import compile_plan

    fn = compile_plan(key.plan(), mods=mods)[1]
    _stats["compiled"] += 1
    return fn


@cache
def cta_tiles(key: KernelKey) -> tuple[int, int, int]:
    """(cta_m, n_block, pack) of the kernel of `key`: the tiles a mask_mod's block table is
    made for (`fa4lab.mods_blocks.block_table`)."""
    plan = key.plan()
    t = plan.tiles
    pack = plan.spec.qhead_per_kvhead if getattr(t, "pack_gqa", False) else 1
    return t.m_block * t.q_stage, t.n_block, pack


def mask_blocks_for(key: KernelKey, call):
    """The block table of `call`'s mask_mod for the kernel of `key` (Note [mask_mod block
    table] in fa4lab.tiling), or None without a mask_mod."""
    mods = call.mods
    if mods is None or mods.mask_mod is None:
        return None
    from fa4lab.mods_blocks import block_table

    cta_m, n_block, pack = cta_tiles(key)
    s = call.spec
    return block_table(mods, call.aux, batch=s.batch, heads_q=s.heads_q, seqlen_q=s.seqlen_q,
                       seqlen_k=s.seqlen_k, cta_m=cta_m, n_block=n_block, pack=pack,
                       device=call.q.device)


def kernel_for(key: KernelKey, mods=None):
    """The compiled function of `key` (and of `mods`, a `fa4lab.mods.KernelMods`, by
    `mods.key`), built on the first miss."""
    full = (key, mods.key) if mods else key
    fn = _kernels.get(full)
    if fn is None:
        with _lock:
            fn = _kernels.get(full)
            if fn is None:
                fn = _kernels[full] = _build_with_mods(key, mods) if mods else _build(key)
    return fn


@cache
def num_sms(index: int) -> int:
    """SMs of CUDA device `index`: asked once per device."""
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count


@cache
def _chosen_splits(key: KernelKey, batch: int, heads: int, rows: int, seqlen_k: int,
                   sms: int) -> int:
    from fa4lab.splitkv import choose_num_splits

    cta_m, n_block, _ = cta_tiles(key)
    return choose_num_splits(batch, heads, rows, seqlen_k, n_block, sms, m_block=cta_m)


# The archs whose split-KV kernel num_splits=None may choose: the ones it has run on. The sm100
# split kernel is compiled and audited but has not run on a B200; num_splits > 1 asks for it.
AUTO_SPLIT_ARCHS = ("sm90",)


def splits_for(key: KernelKey, call) -> int:
    """`call`'s split count: its num_splits, or with None `fa4lab.splitkv.choose_num_splits`
    for the shape and the kernel of `key` (its tiles, its pack-GQA rows and grid heads) on q's
    GPU (Note [choosing num_splits]): decode shapes split, prefill does not; 1 on an arch not
    in AUTO_SPLIT_ARCHS. A given num_splits is capped at the key blocks. With a page table the
    key count is the table's capacity, pages_per_seq * page_size (the spec's seqlen_k; Note
    [choosing num_splits] says why not seqused_k)."""
    s = call.spec
    if call.num_splits is not None:   # more splits than key blocks would only add empty ones
        return min(call.num_splits, num_n_blocks(s.seqlen_k, cta_tiles(key)[1]))
    if key.arch not in AUTO_SPLIT_ARCHS:
        return 1
    _, _, pack = cta_tiles(key)
    heads = s.heads_kv if pack > 1 else s.heads_q
    return _chosen_splits(key, s.batch, heads, s.seqlen_q * pack, s.seqlen_k,
                          num_sms(call.q.device.index))


def partials(call, arch: str, num_splits: int):
    """(out_partial, lse_partial) of the `arch` split-KV kernel on checked `call` (in the
    kernel's form): float32 (num_splits, batch, seqlen_q, heads_q, head_dim_v) and (num_splits,
    batch, seqlen_q, heads_q), as `fa4lab.splitkv.partial_attention_reference` gives them (no
    sink: the combine adds it). num_splits is a runtime value of one compiled kernel. With a
    page table, k and v are a paged cache and seqused_k (or every page's keys) each sequence's
    key count, which its splits cut (`_seqused_k`)."""
    import torch

    key = call.key(arch, split_kv=True)
    fn = kernel_for(key)
    q = call.q
    b, sq, hq, _ = q.shape
    dv = call.spec.head_dim_v
    out_p = torch.empty((num_splits, b, sq, hq, dv), dtype=torch.float32, device=q.device)
    lse_p = torch.empty((num_splits, b, sq, hq), dtype=torch.float32, device=q.device)
    unused_out = torch.empty((b, sq, hq, dv), dtype=q.dtype, device=q.device)
    fn(*KernelArgs.of(call, unused_out, None, sink=None, seqused_k=_seqused_k(call),
                      num_splits=num_splits, out_partial=out_p, lse_partial=lse_p))
    return out_p, lse_p


def forward(call, arch: str):
    """out, lse (None unless the spec returns it) of the `arch` kernel on checked `call` (in
    the kernel's form: `fa4lab.call.Call.for_kernel`), its mods compiled in. Its num_splits
    None chooses (`splits_for`); more than 1 runs the split-KV kernel and the combine
    (`fa4lab.kernels.combine.combine`, the learnable sink joining there). With a page table, k
    and v are a paged cache, the call's seqused_k (int32 (batch,), or None: every page's keys)
    each sequence's key count, split or not."""
    import torch

    key = call.key(arch)
    if call.page_table is not None:
        check_paged_call(key, call.mods)
    splits = 1 if call.mods is not None else splits_for(key, call)
    q, return_lse = call.q, call.spec.return_lse
    if splits > 1:
        from fa4lab.kernels.combine import combine

        out_p, lse_p = partials(call, arch, splits)
        out, lse = combine(out_p, lse_p, learnable_sink=call.sink, out_dtype=q.dtype)
        return out, (lse.transpose(1, 2).contiguous() if return_lse else None)
    fn = kernel_for(key, call.mods)
    b, sq, hq, _ = q.shape
    out = torch.empty((b, sq, hq, call.spec.head_dim_v), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device) if return_lse else None
    fn(*KernelArgs.of(call, out, lse, mask_blocks=mask_blocks_for(key, call),
                      seqused_k=_seqused_k(call)))
    return out, lse


def _seqused_k(call):
    """The seqused_k slot of a padded launch (no cu_seqlens, no tile table): with a page
    table always, the call's or the table's capacity for every sequence (Note [paged key
    blocks] in fa4lab.kernels.device.paged); the call's (None) without."""
    if call.page_table is None or call.seqused_k is not None:
        return call.seqused_k
    import torch

    return torch.full((call.spec.batch,), call.spec.seqlen_k, dtype=torch.int32,
                      device=call.q.device)


# The archs on which `fa4lab.attention_varlen` runs a paged batch with ragged query counts
# (chunked prefill over a paged cache) as ONE varlen launch over the pages: the ones it has run
# on, where tests/test_paged_varlen_gpu.py holds it to the float64 reference. The sm100 paged
# varlen kernel compiles and passes the audit (tests/test_varlen_kernels.py) but has not run on
# a B200: there such a batch runs once per sequence.
PAGED_VARLEN_ARCHS: tuple[str, ...] = ("sm90",)


def forward_varlen(call, arch: str, tables: dict | None = None):
    """out (total_q, heads_q, dv), lse ((heads_q, total_q) or None) of the `arch` varlen kernel
    on checked `call` (in the kernel's form) of packed tensors, whose `lengths` are
    `fa4lab.varlen.check_varlen`'s:
    one launch over the batch's real tiles (Note [varlen tile table] in
    fa4lab.kernels.device.scheduler), with no device-to-host copy (Note [reading the lengths]
    in fa4lab.varlen): the tile table is built on the GPU in one launch
    (`fa4lab.kernels.tile_table`, Note [one CTA builds the table]; the rows of
    `fa4lab.varlen_tiles.launch_tile_rows`, Note [launch tile table]), sized
    by `max_tile_rows`, and the key counts go to the kernel as seqused_k. With `page_table`,
    k and v are a paged cache read in place (Note [paged key blocks] in
    fa4lab.kernels.device.paged: no cu_seqlens_k, each sequence's keys its lengths.keys).
    `tables` (a scheduler metadata's, Note [scheduler metadata] in fa4lab.varlen_metadata)
    keeps the launch's lengths and tile table per tiling across calls."""
    import torch

    from fa4lab.kernels.tile_table import build_launch_tables
    from fa4lab.varlen_tiles import max_tile_rows

    key = call.key(arch)
    if call.page_table is not None:
        check_paged_call(key, None)
    fn = kernel_for(key)
    cta_m, _, _ = cta_tiles(key)
    q, k, v, lengths = call.q, call.k, call.v, call.lengths
    causal, window_size, return_lse = call.spec.causal, call.window_size, call.spec.return_lse
    total_q, hq = q.shape[0], q.shape[1]
    out = torch.empty((total_q, hq, v.shape[-1]), dtype=q.dtype, device=q.device)
    lse = (torch.empty((hq, total_q), dtype=torch.float32, device=q.device) if return_lse
           else None)
    if total_q == 0:      # every sequence is empty: nothing to launch
        return out, lse
    tiling = (cta_m, causal, tuple(window_size))
    made = None if tables is None else tables.get(tiling)
    if made is None:
        made = build_launch_tables(lengths, max_tile_rows(total_q, lengths.batch, cta_m),
                                   m_block=cta_m, causal=causal, window_size=window_size)
        if tables is not None:
            tables[tiling] = made
    cu_q, cu_k, keys, table = made
    if k.shape[0] == 0:     # no key at all: one zero row, so TMA has a tensor to describe
        k, v = k.new_zeros((1, *k.shape[1:])), v.new_zeros((1, *v.shape[1:]))
    fn(*KernelArgs.of(call, out, lse, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                      seqused_k=keys, tile_table=table))
    return out, lse


def compile_plan(plan, example):
    """Compile exactly `plan`'s kernel (its own tiles) for this GPU and return (runner, compile
    seconds); runner(q, k, v, causal, softmax_scale, window_size=None, learnable_sink=None) ->
    out refuses another causal flag, or other window sides or sink presence, than the plan's
    (window_size None: the plan's own window). `example` (q, k, v) is checked as any call's
    inputs are, in the kernel's form; each run's call by `check_call`."""
    import torch

    from fa4lab.kernels import cache
    from fa4lab.kernels.compile import compile_plan as compile_kernel
    from fa4lab.plan.key import config_name

    spec = plan.spec
    check_call(*example, arch=plan.arch)
    fn, _, seconds = cache.load_or_compile(cache.plan_key(plan), lambda: compile_kernel(plan)[1],
                                           config_name(spec, plan.arch + "a") + " (custom)")

    def run(q, k, v, causal, softmax_scale, window_size=None, learnable_sink=None):
        window = spec.window_size if window_size is None else window_size
        call = check_call(q, k, v, causal=causal, softmax_scale=softmax_scale,
                          window_size=window, softcap=spec.softcap,
                          learnable_sink=learnable_sink, return_lse=spec.return_lse)
        if call.spec.causal != spec.causal:
            raise InputError(f"this kernel was compiled for causal={spec.causal}; got "
                             f"causal={causal} with window_size={window}")
        if ([side is None for side in call.window_size]
                != [side is None for side in spec.window_size]
                or (learnable_sink is None) == spec.learnable_sink):
            raise InputError(f"this kernel was compiled for window_size={spec.window_size} "
                             f"(its sides; their sizes may change) and learnable_sink="
                             f"{spec.learnable_sink}; got window_size={window_size}, "
                             f"learnable_sink {'None' if learnable_sink is None else 'given'}")
        b, sq, hq, _ = q.shape
        out = torch.empty((b, sq, hq, v.shape[3]), dtype=q.dtype, device=q.device)
        lse = (torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
               if spec.return_lse else None)
        fn(*KernelArgs.of(call, out, lse))
        return out

    return run, seconds


def check_paged_call(key: KernelKey, mods) -> None:
    """Before a paged launch (key's page size not None): no mods (their block table and key
    indices assume contiguous K/V) and a page size the kernel's key blocks take
    (`fa4lab.kernels.device.paged.check_page_size`: a PlanError naming the sizes that fit; a
    cp.async producer reads any page, Note [cp.async pages])."""
    from fa4lab.kernels.device.paged import check_page_size
    from fa4lab.limits import min_page, page_loader

    if mods:
        raise InputError("score_mod / mask_mod do not take a paged K/V cache yet: gather the "
                         "sequences' K/V (fa4lab.varlen.gather_paged) and call fa4lab.attention "
                         "on contiguous tensors")
    n_block = cta_tiles(key)[1]
    if page_loader(key.arch, key.page_size, n_block) == "tma":   # cp.async reads any page
        check_page_size(key.page_size, n_block, min_page(key.arch, key.head_dim,
                                                         key.head_dim_v))


GPU_NAMES = {"sm90": "a compute-capability-9.0 GPU (H100/H200)",
             "sm100": "a compute-capability-10 GPU (B200/GB200)"}
OTHER_KERNEL = {"sm90": "fa4lab.kernels.launch.attention_sm100 on a B200",
                "sm100": "fa4lab.kernels.launch.attention_sm90 on Hopper (H100/H200)"}


def attention_on(arch: str, q, k, v, *, causal=False, softmax_scale=None, return_lse=False,
                 pack_gqa=None, softcap=0.0, window_size=(None, None), learnable_sink=None,
                 score_mod=None, mask_mod=None, aux_tensors=None, persistent=None,
                 num_splits=None, page_table=None):
    """The `arch` kernel and nothing else (no reference fallback, no padded head dims or
    copied layouts: `fa4lab.call.Call.for_kernel` without padding): out, or (out, lse).
    `persistent` None: the plan's choice for the shape; True / False force it (PlanError where
    the plan cannot be persistent). num_splits as in `fa4lab.attention` (split-KV). With
    `page_table`, k and v are a paged cache."""
    import torch

    call = check_call(q, k, v, causal=causal, softmax_scale=softmax_scale,
                      window_size=window_size, softcap=softcap, learnable_sink=learnable_sink,
                      return_lse=return_lse, pack_gqa=pack_gqa, persistent=persistent,
                      num_splits=num_splits, score_mod=score_mod, mask_mod=mask_mod,
                      aux_tensors=aux_tensors, page_table=page_table)
    on_gpu = isinstance(q, torch.Tensor) and q.is_cuda
    have = device_arch(q.device.index) if on_gpu else None
    if have != arch:
        where = (f"{q.device} has compute capability "
                 f"{torch.cuda.get_device_capability(q.device)}" if on_gpu
                 else f"q is on {getattr(q, 'device', type(q).__name__)}, not on a CUDA GPU")
        raise UnsupportedArchError(
            f"the {arch} kernel runs only on {GPU_NAMES[arch]}; {where}. Use "
            f"{OTHER_KERNEL[arch]}, fa4lab.attention (which picks the kernel for the GPU it "
            f"finds) or fa4lab.reference.attention_reference (float64, any device)")
    out, lse = forward(call.for_kernel(arch, pad=False), arch)
    return (out, lse) if return_lse else out


def attention_sm100(q, k, v, *, causal=False, softmax_scale=None, return_lse=False,
                    pack_gqa=None, softcap=0.0, window_size=(None, None), learnable_sink=None,
                    score_mod=None, mask_mod=None, aux_tensors=None, num_splits=1,
                    page_table=None):
    """Run the sm100 kernel on torch CUDA tensors of a B200-class GPU: out, or (out, lse).

    q (batch, seqlen_q, heads_q, head_dim), k (batch, seqlen_k, heads_kv, head_dim), v (batch,
    seqlen_k, heads_kv, head_dim_v), bf16 or fp16, (head_dim, head_dim_v) one of
    `fa4lab.limits.KERNEL_HEAD_DIMS["sm100"]`; lse is (batch, heads_q, seqlen_q) float32,
    natural log.
    `pack_gqa=True` lets one CTA serve every query head of a KV head (Note [sm100 pack-GQA
    kernel] in fa4lab.kernels.fwd_sm100); it needs qhead_per_kvhead to divide 128 (else
    PlanError) and changes nothing when heads_q == heads_kv. `window_size`, `learnable_sink` and
    the mods (score_mod, mask_mod, aux_tensors: `fa4lab.mods`; compiled and audited, not yet run
    on a B200) and `page_table` (a paged K/V cache, Note [paged key blocks] in
    fa4lab.kernels.device.paged; pages of a multiple of the key block, or of half of it, so far;
    compiled and audited only) as in `fa4lab.attention`. num_splits > 1: split-KV
    (`fa4lab.kernels.device.split`; compiled and audited, not yet run on a B200); 1 (the
    default) no split; None chooses 1 here until it has run (`AUTO_SPLIT_ARCHS`).
    """
    return attention_on("sm100", q, k, v, causal=causal, softmax_scale=softmax_scale,
                        return_lse=return_lse, pack_gqa=pack_gqa, softcap=softcap,
                        window_size=window_size, learnable_sink=learnable_sink,
                        score_mod=score_mod, mask_mod=mask_mod, aux_tensors=aux_tensors,
                        num_splits=num_splits, page_table=page_table)


def attention_sm90(q, k, v, *, causal=False, softmax_scale=None, return_lse=False,
                   pack_gqa=None, softcap=0.0, window_size=(None, None), learnable_sink=None,
                   score_mod=None, mask_mod=None, aux_tensors=None, persistent=None,
                   num_splits=1, page_table=None):
    """Run the sm90 kernel on torch CUDA tensors: out, or (out, lse) when return_lse.

    `pack_gqa=True` lets one CTA serve every query head of a KV head (Note [sm90 pack-GQA
    kernel] in fa4lab.kernels.fwd_sm90); it needs qhead_per_kvhead to divide 64 (else
    PlanError) and changes nothing when heads_q == heads_kv. `window_size`, `learnable_sink`
    and the mods (score_mod, mask_mod, aux_tensors: `fa4lab.mods`) as in `fa4lab.attention`.
    `persistent` None: the plan's choice for the shape (Note [sm90 persistent CTAs] in
    fa4lab.plan.sm90); True / False force it. num_splits: split-KV as in `fa4lab.attention`,
    but 1 (no split) by default: this runs the kernel as asked; None chooses for the shape as
    `fa4lab.attention` does. `page_table` makes k, v a paged cache (Note [paged key blocks] in
    fa4lab.kernels.device.paged), as in `fa4lab.attention`.
    """
    return attention_on("sm90", q, k, v, causal=causal, softmax_scale=softmax_scale,
                        return_lse=return_lse, pack_gqa=pack_gqa, softcap=softcap,
                        window_size=window_size, learnable_sink=learnable_sink,
                        score_mod=score_mod, mask_mod=mask_mod, aux_tensors=aux_tensors,
                        persistent=persistent, num_splits=num_splits, page_table=page_table)
