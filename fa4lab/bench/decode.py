"""`fa4lab bench --decode`: GQA decode and a GQA prefill beside the peers, against the HBM floor.

Users decode with GQA: one new query token per sequence reads a long K/V cache that several
query heads share. Such a call does almost no arithmetic, so the question is how close it
comes to moving its bytes at the memory's speed. This mode measures, in one process:

    decode    batch 32, seqlen_q 1, seqlen_k 8192, heads 32 / 8 (GQA 4), head_dim 128, bf16,
              non-causal (each dimension can be changed on the command line)
    prefill   batch 1, seqlen 8192, the same heads and head_dim, causal (`--prefill-seqlen 0`
              leaves it out)

for fa4lab with its default (pack_gqa=None: it packs the query heads of a KV head into one
tile when GQA allows), fa4lab with pack_gqa=False (`fa4lab-unpacked`), upstream FA4
(`flash_attn_func`, its defaults) and PyTorch SDPA (flash and cuDNN backends, enable_gqa=True),
each checked against the float64 reference before it is timed (Note [the check before timing]).

Reported per (shape, provider): median microseconds (the sweep's timer), the time as a multiple
of the shape's HBM floor, the bytes per second that implies, and TFLOP/s. See Note [HBM floor].

    fa4lab bench --decode                          # table, record saved in benchmarks/
    fa4lab bench --decode --batch 8 --seqlen-k 32768 --prefill-seqlen 0

`measure_gqa_shape` takes any providers and a device string, so it runs (and is tested) on a
CPU; the command itself needs a CUDA GPU.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fa4lab.bench.check import ATOL, CHECK_HEADS, reference_slice
from fa4lab.bench.measure import RunGuard, check_then_time, make_inputs, run_with_progress
from fa4lab.bench.providers import Provider, provider_lines, short_error
from fa4lab.bench.records import (
    DECODE,
    OK,
    DecodeResult,
    make_floor_record,
)
from fa4lab.bench.sweep import (
    ONE_TILE,
    OURS,
    PEERS,
    PERSISTENT,
    PROVIDER_LABELS,
    PROVIDERS,
    SUPPORTED_HEAD_DIMS,
    UNPACKED,
)
from fa4lab.bench.timing import (
    REP_MS,
    WARMUP_MS,
    hbm_bytes,
    spin_up,
    sync_for,
    time_ms,
    timer_name,
    timing_config,
)
from fa4lab.spec import AttentionSpec, normalize_dtype

# ---- the shapes --------------------------------------------------------------------------------
DECODE_BATCH = 32
DECODE_SEQLEN_Q = 1
DECODE_SEQLEN_K = 8192
HEADS_Q = 32
HEADS_KV = 8
HEAD_DIM = 128
PREFILL_SEQLEN = 8192      # the GQA prefill: batch 1, causal, the decode's heads and head_dim
PREFILL_BATCH = 1

# The device-to-device copy the bandwidth is measured with (Note [HBM floor]).
COPY_BYTES = 1 << 30

DECODE_PROVIDERS = (OURS, UNPACKED) + PEERS   # and VARIANTS when asked for (--peers)
DECODE_LABELS = {
    PERSISTENT: "fa4lab's kernel, its plan with persistent=True",
    ONE_TILE: "fa4lab's kernel, its plan with persistent=False",
    OURS: "fa4lab.attention, pack_gqa=None (its default: packs GQA groups where it can)",
    UNPACKED: "fa4lab.attention, pack_gqa=False",
    "sdpa-flash": "PyTorch SDPA (flash), enable_gqa=True, (b, h, s, d) inputs",
    "sdpa-cudnn": "PyTorch SDPA (cuDNN), enable_gqa=True, (b, h, s, d) inputs",
    "fa4": "upstream FA4 flash_attn_func (flash-attn-4), its defaults",
}
# The check covers the first and the last batch element (Note [the check before timing]).
CHECK_BATCHES = (0, -1)

# Note [HBM floor]
# A call must read K and V once and read q and write out once; nothing else has to touch HBM.
# Its floor is those bytes,
#     hbm_bytes = element_bytes * (batch * seqlen_k * heads_kv * (head_dim + head_dim_v)
#                                  + batch * seqlen_q * heads_q * (head_dim + head_dim_v)),
# at the bandwidth measured in the same run: a device-to-device `torch.Tensor.copy_` of
# COPY_BYTES (1 GiB, far above the L2), timed with the bench's timer (median, L2 flushed before
# each call), counted as read + write: hbm_gbps = 2 * COPY_BYTES / time. floor_us = hbm_bytes /
# hbm_gbps; x_floor = us / floor_us. At the decode shape the floor is all but K/V (1 GiB of
# 1.0005 GiB); a kernel that reads K/V once per query head instead of once per KV head moves
# heads_q / heads_kv times more and shows it. A copy interleaves reads and writes; a kernel
# that mostly reads can go a little faster than a copy, so x_floor slightly below 1 is possible
# and not an error. At the prefill shape the floor is far below the compute time: read its
# TFLOP/s there.


def floor_us(nbytes: int, gbps: float | None) -> float | None:
    """Microseconds to move `nbytes` at `gbps` GB/s (1e9 bytes per second); None without one."""
    if not gbps or not gbps > 0:
        return None
    return nbytes / (gbps * 1e9) * 1e6


@dataclass(frozen=True)
class GqaShape:
    """One shape of the decode mode: q (batch, seqlen_q, heads_q, head_dim), k and v
    (batch, seqlen_k, heads_kv, head_dim). `name` says which ("decode" or "prefill")."""

    name: str
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    causal: bool = False
    dtype: str = "bf16"

    @property
    def spec(self) -> AttentionSpec:
        return AttentionSpec(self.batch, self.seqlen_q, self.seqlen_k, self.heads_q,
                             self.heads_kv, self.head_dim, dtype=self.dtype, causal=self.causal)

    @property
    def flops(self) -> float:
        return self.spec.flops()

    @property
    def hbm_bytes(self) -> int:
        return hbm_bytes(self.spec)

    @property
    def key(self) -> tuple:
        return (self.name, self.batch, self.seqlen_q, self.seqlen_k, self.heads_q,
                self.heads_kv, self.head_dim, self.causal, self.dtype)

    def label(self) -> str:
        mask = "causal" if self.causal else "full"
        return (f"{self.name} b{self.batch} sq{self.seqlen_q} sk{self.seqlen_k} "
                f"h{self.heads_q}/{self.heads_kv} hd{self.head_dim} {mask}")


def gqa_shapes(*, batch: int = DECODE_BATCH, seqlen_q: int = DECODE_SEQLEN_Q,
               seqlen_k: int = DECODE_SEQLEN_K, heads_q: int = HEADS_Q,
               heads_kv: int = HEADS_KV, head_dim: int = HEAD_DIM,
               prefill_seqlen: int = PREFILL_SEQLEN, dtype: str = "bf16") -> list[GqaShape]:
    """The decode shape (non-causal) and, unless prefill_seqlen is 0, the GQA prefill (batch 1,
    seqlen_q = seqlen_k = prefill_seqlen, causal) with the same heads and head_dim. Bad values
    are a ValueError that says which and why."""
    dtype = normalize_dtype(dtype)
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"--head-dim {head_dim} is not supported: the kernels and peers are "
                         f"built for head_dim in {SUPPORTED_HEAD_DIMS}")
    for name, value in (("batch", batch), ("seqlen-q", seqlen_q), ("seqlen-k", seqlen_k),
                        ("heads-q", heads_q), ("heads-kv", heads_kv)):
        if int(value) < 1:
            raise ValueError(f"--{name} must be >= 1, got {value}")
    if heads_q % heads_kv:
        raise ValueError(f"--heads-q {heads_q} is not a multiple of --heads-kv {heads_kv}: "
                         f"with GQA each KV head serves heads_q / heads_kv query heads")
    if int(prefill_seqlen) < 0:
        raise ValueError(f"--prefill-seqlen must be >= 0 (0 leaves the prefill out), got "
                         f"{prefill_seqlen}")
    shapes = [GqaShape("decode", batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim,
                       False, dtype)]
    if prefill_seqlen:
        shapes.append(GqaShape("prefill", PREFILL_BATCH, prefill_seqlen, prefill_seqlen,
                               heads_q, heads_kv, head_dim, True, dtype))
    for s in shapes:
        _ = s.spec   # AttentionSpec's own checks
    return shapes


# Note [LLM prefill shapes]
# Four causal bf16 prefills as models run them, beside the sweep's square shapes (`--decode
# --llm-shapes`): they decide whether the sm90 kernel's CTAs are persistent (Note [sm90
# persistent CTAs] in fa4lab.plan.sm90), since they stress what persistence changes: many short
# tiles (hd64, 2048), a ragged last tile (seqlen 3000), and a chunked prefill, whose 512 new
# queries see the 8192 keys before and among them (bottom-right causal), so every tile is long.
LLM_SHAPES = (
    GqaShape("llm-4k", 4, 4096, 4096, 32, 8, 128, True),
    GqaShape("llm-3000", 2, 3000, 3000, 28, 4, 128, True),
    GqaShape("chunked-512", 4, 512, 8192, 32, 8, 128, True),
    GqaShape("llm-hd64", 8, 2048, 2048, 32, 2, 64, True),
)


def llm_shapes(dtype: str = "bf16") -> list[GqaShape]:
    """LLM_SHAPES in `dtype` (Note [LLM prefill shapes])."""
    from dataclasses import replace

    return [replace(s, dtype=normalize_dtype(dtype)) for s in LLM_SHAPES]


# The decode shapes' inputs are the sweep's: `make_inputs` takes any shape with a `.spec`.
make_gqa_inputs = make_inputs


# ---- the memory bandwidth ----------------------------------------------------------------------
@dataclass
class CopyBandwidth:
    """The device-to-device copy the floor is computed from (Note [HBM floor])."""

    nbytes: int      # bytes of the source (the copy reads them and writes as many)
    ms: float        # median time of one copy
    gbps: float      # 2 * nbytes / time, GB/s (1e9 bytes per second)


def copy_bandwidth(nbytes: int = COPY_BYTES, *, device: str = "cuda",
                   warmup_ms: float = WARMUP_MS, rep_ms: float = REP_MS) -> CopyBandwidth:
    """Read + write bytes per second of `dst.copy_(src)` for `nbytes`-byte tensors, timed with
    the bench's timer (`time_ms`)."""
    import torch

    if nbytes < 1:
        raise ValueError(f"nbytes must be >= 1, got {nbytes}")
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    call = lambda: dst.copy_(src)
    sync = sync_for(device)
    if device == "cuda":
        spin_up(call, sync)
    ms = time_ms(call, warmup_ms=warmup_ms, rep_ms=rep_ms, device=device)
    return CopyBandwidth(nbytes, ms, 2 * nbytes / (ms * 1e-3) / 1e9)


def announce_copy_bandwidth(*, warmup_ms: float = WARMUP_MS, rep_ms: float = REP_MS):
    """`copy_bandwidth` for a command line: prints it, or (on any failure) why there is no HBM
    floor, and returns the CopyBandwidth or None."""
    try:
        copy = copy_bandwidth(warmup_ms=warmup_ms, rep_ms=rep_ms)
    except Exception as err:
        print(f"memory bandwidth not measured, no HBM floor: {type(err).__name__}: "
              f"{short_error(err)}", file=sys.stderr)
        return None
    print(f"memory bandwidth (device-to-device copy_ of {copy.nbytes / 2**30:g} GiB, read + "
          f"write): {copy.gbps:.0f} GB/s")
    return copy


# ---- measuring ---------------------------------------------------------------------------------
def _result(provider: str, shape: GqaShape, hbm_gbps: float | None, **kw) -> DecodeResult:
    return DecodeResult(provider, shape.name, shape.batch, shape.seqlen_q, shape.seqlen_k,
                        shape.heads_q, shape.heads_kv, shape.head_dim, shape.causal,
                        shape.dtype, hbm_bytes=shape.hbm_bytes,
                        floor_us=floor_us(shape.hbm_bytes, hbm_gbps), **kw)


def measure_gqa_shape(shape: GqaShape, providers: Sequence[Provider], *,
                      hbm_gbps: float | None = None, device: str = "cuda",
                      warmup_ms: float = WARMUP_MS, rep_ms: float = REP_MS,
                      on_result: Callable[[DecodeResult], None] | None = None,
                      guard: RunGuard | None = None) -> list[DecodeResult]:
    """Check, then time, every provider on one GQA shape (`check_then_time`, the sweep's
    loop), the check on the first and the last batch element. Never raises for a provider's
    failure: "failed", "error" and "missing" are reported and the others still measured."""
    results = []
    floor = floor_us(shape.hbm_bytes, hbm_gbps)
    check = lambda q, k, v: reference_slice(q, k, v, shape, batches=CHECK_BATCHES)
    for m in check_then_time(shape, providers, check=check, device=device,
                             warmup_ms=warmup_ms, rep_ms=rep_ms, guard=guard):
        timed = {}
        if m.status == OK:
            us = m.ms * 1e3
            timed = {"us": us, "x_floor": us / floor if floor else None,
                     "gbps": shape.hbm_bytes / (us * 1e-6) / 1e9,
                     "tflops": shape.flops / (us * 1e-6) / 1e12}
        r = _result(m.provider, shape, hbm_gbps, **timed, **m.checked())
        results.append(r)
        if on_result:
            on_result(r)
    return results


def run_decode(shapes: Sequence[GqaShape], providers: Sequence[Provider], *,
               hbm_gbps: float | None = None, device: str = "cuda",
               warmup_ms: float = WARMUP_MS, rep_ms: float = REP_MS,
               progress: bool = True, guard: RunGuard | None = None) -> list[DecodeResult]:
    """Every provider on every shape, in one process, with a tqdm bar over (shape, provider)."""
    return run_with_progress(
        shapes, len(providers),
        lambda shape, tick: measure_gqa_shape(shape, providers, hbm_gbps=hbm_gbps,
                                              device=device, warmup_ms=warmup_ms,
                                              rep_ms=rep_ms, on_result=tick, guard=guard),
        desc="bench --decode", device=device, progress=progress)


# ---- record and table --------------------------------------------------------------------------
FLOOR_RULE = ("hbm_bytes = element_bytes x (batch x seqlen_k x heads_kv x (head_dim + "
              "head_dim_v) + batch x seqlen_q x heads_q x (head_dim + head_dim_v)): K and V "
              "read once, q read and out written once; floor_us = hbm_bytes / hbm_gbps; "
              "x_floor = us / floor_us")


def decode_config(shapes: Sequence[GqaShape], providers: Sequence[str], *,
                  copy: CopyBandwidth | None, warmup_ms: float = WARMUP_MS,
                  rep_ms: float = REP_MS, wall_s: float | None = None) -> dict:
    gbps = copy.gbps if copy else None
    config = {
        "shapes": [{"name": s.name, "batch": s.batch, "seqlen_q": s.seqlen_q,
                    "seqlen_k": s.seqlen_k, "heads_q": s.heads_q, "heads_kv": s.heads_kv,
                    "head_dim": s.head_dim, "causal": s.causal, "dtype": s.dtype,
                    "hbm_bytes": s.hbm_bytes, "flops": s.flops,
                    "floor_us": floor_us(s.hbm_bytes, gbps)} for s in shapes],
        "hbm_copy": ({"bytes": copy.nbytes, "ms": copy.ms, "gbps": copy.gbps} if copy
                     else None),
        "hbm_rule": ("device-to-device torch.Tensor.copy_ of a uint8 tensor, timed like the "
                     "providers; hbm_gbps = 2 x bytes (read + write) / median time"),
        "floor": FLOOR_RULE,
        **timing_config(warmup_ms, rep_ms),
        "check": (f"the first and the last batch element, KV heads 0..{CHECK_HEADS - 1} and "
                  f"the query heads that read them, float64 reference, tol = 2 x same-dtype "
                  f"PyTorch error + {ATOL[shapes[0].dtype] if shapes else ATOL['bf16']:.1e}"),
        "providers": {p: DECODE_LABELS.get(p, PROVIDER_LABELS.get(p, p)) for p in providers},
    }
    if wall_s is not None:
        config["wall_s"] = round(wall_s, 1)
    return config


def make_decode_record(results: Sequence[DecodeResult], *, hbm_gbps: float | None,
                       gpu_name: str, arch: str | None, command: str, config: dict,
                       label: str | None = None, notes: str = "") -> dict:
    """A validated "decode" record of `results` (`records.make_floor_record`)."""
    return make_floor_record(DECODE, results, hbm_gbps=hbm_gbps, gpu_name=gpu_name, arch=arch,
                             command=command, config=config,
                             label=label or f"fa4lab GQA decode on {gpu_name}", notes=notes)


def _shape_label(r: DecodeResult) -> str:
    mask = "causal" if r.causal else "full"
    return (f"{r.shape} b{r.batch} sq{r.seqlen_q} sk{r.seqlen_k} h{r.heads_q}/{r.heads_kv} "
            f"hd{r.head_dim} {mask}")


def _num(x: float | None, small: str = ".2f", big: str = ".0f", at: float = 100.0) -> str:
    if x is None:
        return "-"
    return format(x, big if abs(x) >= at else small)


def format_decode_table(results: Sequence[DecodeResult], *, hbm_gbps: float | None = None,
                        ours: str = OURS) -> str:
    """A markdown table: per shape and provider, us per call, the multiple of the HBM floor,
    GB/s, TFLOP/s, and fa4lab's speed over each provider (its time / fa4lab's; > 1: fa4lab is
    faster). Then the floors and the providers not measured."""
    order = {p: i for i, p in enumerate(PROVIDERS)}
    shapes: dict[str, list[DecodeResult]] = {}
    for r in results:
        shapes.setdefault(_shape_label(r), []).append(r)
    lines = ["| shape | provider | us | x HBM floor | GB/s | TFLOP/s | fa4lab/this |",
             "|---|---|---|---|---|---|---|"]
    floors = []
    for label, rows in shapes.items():
        rows = sorted(rows, key=lambda r: order.get(r.provider, len(order)))
        mine = next((r for r in rows if r.provider == ours and r.status == OK), None)
        for r in rows:
            if r.status != OK:
                lines.append(f"| {label} | {r.provider} | {r.status} | - | - | - | - |")
                continue
            ratio = f"{r.us / mine.us:.2f}" if mine else "-"
            lines.append(f"| {label} | {r.provider} | {_num(r.us, '.1f', '.1f')} | "
                         f"{_num(r.x_floor)} | {r.gbps:.0f} | {_num(r.tflops, '.1f')} | "
                         f"{ratio} |")
        first = rows[0]
        floor = floor_us(first.hbm_bytes, hbm_gbps) if hbm_gbps else first.floor_us
        floors.append(f"{first.shape} {(first.hbm_bytes or 0) / 1e9:.3f} GB"
                      + (f" = {floor:.1f} us" if floor else ""))
    if hbm_gbps:
        lines += ["", f"HBM floor (K and V once, q and out once) at {hbm_gbps:.0f} GB/s, the "
                      f"device-to-device copy of this run (read + write): " + "; ".join(floors)]
    else:
        lines += ["", "HBM floor not measured (no bandwidth): " + "; ".join(floors)]
    notes = []
    for r in results:
        if r.status != OK and r.note:
            n = f"- {r.provider} {r.shape}: {r.status}: {r.note}"
            if n not in notes:
                notes.append(n)
    if notes:
        lines += ["", "not measured:"] + notes
    return "\n".join(lines)


def describe_decode_run(shapes: Sequence[GqaShape], providers: Sequence[Provider],
                        hbm_gbps_hint: float | None = None) -> str:
    """What the mode runs: the shapes with their bytes, FLOPs and floor, the providers, how the
    floor is measured. `hbm_gbps_hint` (a datasheet figure) shows what the floor would be."""
    lines = [f"{len(shapes)} GQA shapes x {len(providers)} providers ({shapes[0].dtype}):"]
    for s in shapes:
        hint = floor_us(s.hbm_bytes, hbm_gbps_hint)
        lines.append(f"  {s.label()}  {s.hbm_bytes / 1e9:.3f} GB to move, "
                     f"{s.flops / 1e9:.1f} GFLOP"
                     + (f", floor {hint:.0f} us at {hbm_gbps_hint:.0f} GB/s" if hint else ""))
    lines += provider_lines(providers, DECODE_LABELS, 15)
    lines.append(f"HBM floor: bytes / the bandwidth of a {COPY_BYTES / 2**30:g} GiB "
                 f"device-to-device copy_ in the same run (read + write); timer: {timer_name()}")
    return "\n".join(lines)
