"""The one launch path: torch tensors in, the compiled kernel of their configuration launched.

`forward` is what `fa4lab.attention` runs on a GPU with a kernel. Per call it builds a small
key from the tensors and the flags, finds the compiled function in a dict, allocates out (and
lse) and calls the function with the torch tensors themselves (Note [TVM-FFI launch] in
`fa4lab.kernels.compile`: no DLPack conversion or stream query in Python). The inputs were
checked once, by `fa4lab.spec.check_inputs`, before this is reached.

On a miss the kernel comes from the disk cache (`fa4lab.kernels.cache`, milliseconds) or is
compiled (seconds) from `plan_forward` of a canonical spec of the key: the plan, hence the
kernel, depends on what the key holds -- arch, head dims, dtype, causal, GQA ratio, LSE,
pack-GQA, whether scores are capped, which sides a window has, whether a learnable sink comes,
the page size of a paged K/V cache -- and never on batch, sequence lengths, head counts, the
softmax scale, the cap's value, the window's sizes, the sink's values or the page table, which
are runtime values (Note [runtime scale] and Note [runtime window] in
`fa4lab.kernels.compile`).

With a score_mod / mask_mod (`fa4lab.mods`) the key also holds the mods' identity, and the
kernel is compiled in this process, never read from or written to disk (Note [mods in the
kernels] in `fa4lab.mods`); a mask_mod comes with its block table (`mask_blocks_for`, cached:
Note [block table cache] in `fa4lab.mods_blocks`).

`compile_plan(plan, example)` builds the kernel of any plan (other tiles than the default, as
notebook 07's widget asks) and returns a runner for the bench.
"""

from __future__ import annotations

import threading
from collections import Counter
from functools import cache

# Loaded with the API rather than by the first call: every cached kernel is a TVM-FFI module,
# and importing tvm_ffi takes longer than loading a kernel (tens of milliseconds).
import tvm_ffi  # noqa: F401

from fa4lab.kernels.compile import scale_args, window_args
from fa4lab.limits import arch_of_capability, pack_gqa_default
from fa4lab.spec import AttentionSpec, normalize_dtype, normalize_mask

_lock = threading.Lock()
_kernels: dict[tuple, object] = {}
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


@cache
def device_arch(index: int) -> str | None:
    """The kernel arch ("sm90"/"sm100") of CUDA device `index`, or None: asked once per device."""
    import torch

    return arch_of_capability(torch.cuda.get_device_capability(index))


def key_of(q, k, v, arch: str, causal: bool, return_lse: bool, pack_gqa: bool | None,
           softcap: float = 0.0, window_size=(None, None), learnable_sink=None,
           persistent: bool | None = None, page_table=None) -> tuple:
    """The configuration's key; pack_gqa None is resolved here (`limits.pack_gqa_default`), and
    on sm90 persistent None too, from the call's shape (`fa4lab.plan.sm90.persistent_default`:
    the canonical spec of the key has no shape). causal and window_size in
    `fa4lab.spec.normalize_mask`'s form: the key holds which sides the window has, not their
    sizes (Note [runtime window]). With a page_table, k and v are the paged cache and the key
    ends with its page size (None without)."""
    g = q.shape[2] // k.shape[2]
    page_size = None if page_table is None else k.shape[1]
    packed = pack_gqa_default(arch, g, q.shape[1]) if pack_gqa is None else pack_gqa and g > 1
    sides = (window_size[0] is not None, window_size[1] is not None)
    if persistent is None and arch == "sm90":
        from fa4lab.plan.sm90 import persistent_default

        persistent = persistent_default(q.shape[3], v.shape[3], causal, q.shape[1],
                                        _seqlen_k(k, page_table))
    return (arch, q.shape[3], v.shape[3], q.dtype, causal, g, return_lse, bool(softcap), sides,
            learnable_sink is not None, persistent, packed, page_size)


def _seqlen_k(k, page_table) -> int:
    """Keys per sequence: k's, or a paged cache's (`fa4lab.varlen.paged_seqlen_k`)."""
    if page_table is None:
        return k.shape[1]
    from fa4lab.varlen import paged_seqlen_k

    return paged_seqlen_k(k, page_table)


def spec_of_key(key: tuple) -> AttentionSpec:
    """A canonical spec of `key`: one batch, one KV head, 128 rows; sizes the plan ignores
    (a window side's size included)."""
    _, d, dv, dtype, causal, g, lse, capped, (left, right), sink, _, _, page_size = key
    window = (0 if left else None, 1 if right else None)
    return AttentionSpec(1, 128, 128, g, 1, d, dv, dtype=normalize_dtype(dtype), causal=causal,
                         return_lse=lse, softcap=1.0 if capped else 0.0, window_size=window,
                         learnable_sink=sink, page_size=page_size)


def plan_of_key(key: tuple):
    """The plan of the kernel of `key`: its canonical spec with the key's switches."""
    from fa4lab.plan import plan_forward

    arch, persistent, packed = key[0], key[10], key[11]
    return plan_forward(spec_of_key(key), arch=arch, pack_gqa=packed, persistent=persistent)


def _build(key: tuple):
    from fa4lab.kernels import cache
    from fa4lab.kernels.compile import compile_plan, config_name

    arch, persistent, packed = key[0], key[10], key[11]

    def compile_default_plan():
        return compile_plan(plan_of_key(key))[1]

    # The plan is a function of the key and of the sources the cache's fingerprint hashes, so
    # a disk hit needs neither the planner nor the DSL.
    what = (config_name(spec_of_key(key), arch + "a") + ("-packgqa" if packed else "")
            + {None: "", True: "-persistent", False: "-onetile"}[persistent])
    disk_key = "fwd-" + cache.digest(what)
    fn, how, _ = cache.load_or_compile(disk_key, compile_default_plan, what)
    _stats[how] += 1
    return fn


def _build_with_mods(key: tuple, mods):
    """The kernel of `key` with `mods` compiled in: in this process only, never on disk
    (Note [mods in the kernels] in fa4lab.mods)."""
    from fa4lab.kernels.compile import compile_plan

    fn = compile_plan(plan_of_key(key), mods=mods)[1]
    _stats["compiled"] += 1
    return fn


@cache
def cta_tiles(key: tuple) -> tuple[int, int, int]:
    """(cta_m, n_block, pack) of the kernel of `key`: the tiles a mask_mod's block table is
    made for (`fa4lab.mods_blocks.block_table`)."""
    plan = plan_of_key(key)
    t = plan.tiles
    pack = plan.spec.qhead_per_kvhead if getattr(t, "pack_gqa", False) else 1
    return t.m_block * t.q_stage, t.n_block, pack


def mask_blocks_for(key: tuple, mods, aux: tuple, q, k):
    """The block table of `mods`' mask_mod for the kernel of `key` (Note [mask_mod block
    table] in fa4lab.tiling), or None without a mask_mod."""
    if mods is None or mods.mask_mod is None:
        return None
    from fa4lab.mods_blocks import block_table

    cta_m, n_block, pack = cta_tiles(key)
    return block_table(mods, aux, batch=q.shape[0], heads_q=q.shape[2], seqlen_q=q.shape[1],
                       seqlen_k=k.shape[1], cta_m=cta_m, n_block=n_block, pack=pack,
                       device=q.device)


def kernel_for(key: tuple, mods=None):
    """The compiled function of `key` (and of `mods`, a `fa4lab.mods.KernelMods`, by
    `mods.key`), built on the first miss."""
    full = key + (mods.key,) if mods else key
    fn = _kernels.get(full)
    if fn is None:
        with _lock:
            fn = _kernels.get(full)
            if fn is None:
                fn = _kernels[full] = _build_with_mods(key, mods) if mods else _build(key)
    return fn


def forward(q, k, v, arch: str, causal: bool, softmax_scale, return_lse: bool,
            pack_gqa: bool | None, softcap: float = 0.0, window_size=(None, None),
            learnable_sink=None, mods=None, aux: tuple = (), persistent: bool | None = None,
            page_table=None):
    """out, lse (None unless return_lse) of the `arch` kernel on checked CUDA tensors; causal
    and window_size in `fa4lab.spec.normalize_mask`'s form; `mods` and `aux` from
    `fa4lab.mods.check_mods` (or None and ()); k, v a paged cache with `page_table`."""
    import torch

    key = key_of(q, k, v, arch, causal, return_lse, pack_gqa, softcap, window_size,
                 learnable_sink, persistent, page_table)
    if page_table is not None:
        check_paged_call(key, mods)
    fn = kernel_for(key, mods)
    b, sq, hq, d = q.shape
    out = torch.empty((b, sq, hq, v.shape[3]), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device) if return_lse else None
    score_mod = mods is not None and mods.score_mod is not None
    fn(q, k, v, out, lse, learnable_sink, *scale_args(softmax_scale, d, softcap, score_mod),
       *window_args(window_size, sq, _seqlen_k(k, page_table)), aux or None,
       mask_blocks_for(key, mods, aux, q, k), page_table)
    return out, lse


def compile_plan(plan, example):
    """Compile exactly `plan`'s kernel (its own tiles) for this GPU and return (runner, compile
    seconds); runner(q, k, v, causal, softmax_scale, window_size=None, learnable_sink=None) ->
    out refuses another causal flag, or other window sides or sink presence, than the plan's
    (window_size None: the plan's own window). `example` (q, k, v) is checked as any call's
    inputs are."""
    import torch

    from fa4lab.kernels import cache
    from fa4lab.kernels.compile import compile_plan as compile_kernel
    from fa4lab.kernels.compile import config_name
    from fa4lab.spec import check_inputs

    spec = plan.spec
    check_inputs(*example, arch=plan.arch)
    fn, _, seconds = cache.load_or_compile(cache.plan_key(plan), lambda: compile_kernel(plan)[1],
                                           config_name(spec, plan.arch + "a") + " (custom)")

    def run(q, k, v, causal, softmax_scale, window_size=None, learnable_sink=None):
        window = spec.window_size if window_size is None else window_size
        if normalize_mask(causal, window)[0] != spec.causal:
            raise ValueError(f"this kernel was compiled for causal={spec.causal}; got "
                             f"causal={causal} with window_size={window}")
        window = normalize_mask(causal, window)[1]
        if ([side is None for side in window] != [side is None for side in spec.window_size]
                or (learnable_sink is None) == spec.learnable_sink):
            raise ValueError(f"this kernel was compiled for window_size={spec.window_size} "
                             f"(its sides; their sizes may change) and learnable_sink="
                             f"{spec.learnable_sink}; got window_size={window_size}, "
                             f"learnable_sink {'None' if learnable_sink is None else 'given'}")
        b, sq, hq, _ = q.shape
        out = torch.empty((b, sq, hq, v.shape[3]), dtype=q.dtype, device=q.device)
        lse = (torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
               if spec.return_lse else None)
        fn(q, k, v, out, lse, learnable_sink, *scale_args(softmax_scale, q.shape[3], spec.softcap),
           *window_args(window, sq, k.shape[1]), None, None, None)
        return out

    return run, seconds


def check_paged_call(key: tuple, mods) -> None:
    """Before a paged launch (key's page size not None): no mods (their block table and key
    indices assume contiguous K/V) and a page size the kernel's key blocks take
    (`fa4lab.kernels.device.paged.check_page_size`: a PlanError naming the sizes that fit)."""
    from fa4lab.errors import InputError
    from fa4lab.kernels.device.paged import check_page_size

    if mods:
        raise InputError("score_mod / mask_mod do not take a paged K/V cache yet: gather the "
                         "sequences' K/V (fa4lab.varlen.gather_paged) and call fa4lab.attention "
                         "on contiguous tensors")
    check_page_size(key[12], cta_tiles(key)[1])


GPU_NAMES = {"sm90": "a compute-capability-9.0 GPU (H100/H200)",
             "sm100": "a compute-capability-10 GPU (B200/GB200)"}
OTHER_KERNEL = {"sm90": "fa4lab.kernels.fwd_sm100.attention_sm100 on a B200",
                "sm100": "fa4lab.kernels.fwd_sm90.attention_sm90 on Hopper (H100/H200)"}


def attention_on(arch: str, q, k, v, *, causal=False, softmax_scale=None, return_lse=False,
                 pack_gqa=None, softcap=0.0, window_size=(None, None), learnable_sink=None,
                 score_mod=None, mask_mod=None, aux_tensors=None, persistent=None,
                 page_table=None):
    """The `arch` kernel and nothing else (no reference fallback): out, or (out, lse).
    `persistent` None: the plan's choice for the shape; True / False force it (PlanError where
    the plan cannot be persistent). With `page_table`, k and v are a paged cache."""
    import torch

    from fa4lab.errors import UnsupportedArchError
    from fa4lab.spec import check_inputs

    for name, value in (("pack_gqa", pack_gqa), ("persistent", persistent)):
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{name} must be None (choose), True or False, got {value!r}")
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
    causal, window_size = normalize_mask(causal, window_size)
    check_inputs(q, k, v, softmax_scale=softmax_scale, arch=arch, softcap=softcap,
                 window_size=window_size, learnable_sink=learnable_sink, page_table=page_table)
    from fa4lab.mods import check_mods

    mods, aux = check_mods(score_mod, mask_mod, aux_tensors, q.device)
    out, lse = forward(q, k, v, arch, causal, softmax_scale, bool(return_lse), pack_gqa,
                       float(softcap), window_size, learnable_sink, mods if mods else None, aux,
                       persistent, page_table)
    return (out, lse) if return_lse else out
