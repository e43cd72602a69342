"""`fa4lab bench`: forward-attention throughput of fa4lab beside its peers, in one process.

What it measures: the standard sweep (total tokens 16384, hidden 2048, so
heads = hidden / head_dim and batch = total_tokens / seqlen; bf16; head_dim 64/128/256;
seqlen 1k..16k; causal and not), for each provider:

    fa4lab       `fa4lab.attention` (the sm90 kernel on Hopper, the sm100 kernel on B200)
    sdpa-flash   torch SDPA restricted to SDPBackend.FLASH_ATTENTION
    sdpa-cudnn   torch SDPA restricted to SDPBackend.CUDNN_ATTENTION
    fa4          upstream FlashAttention-4 (`flash_attn.cute.interface.flash_attn_func`,
                 pip package flash-attn-4), when installed

plus the device's dense bf16 GEMM rate (8192^3 torch.matmul) as the ceiling.
TFLOP/s = AttentionSpec.flops() / time = 4*B*H*Sq*Sk*D, halved for causal.

Constraints: timing needs a CUDA GPU (and triton for `triton.testing.do_bench`; without it a
CUDA-event timer with the same cold-L2 rule is used and the record says so). On a CPU the
command prints what it would run and the latest recorded results from `benchmarks/`, and
exits 0. Every provider's output is checked against the float64 reference before it is timed;
a provider that fails the check is reported as "failed" and not timed; one that raises is
reported as "error" with its message; one that is not installed is reported as "missing".
The sweep always continues.

How to run:

    fa4lab bench                       # the standard sweep, record saved in benchmarks/
    fa4lab bench --quick               # hd128, seqlen 4096 and 8192 only
    fa4lab bench --head-dim 128 --seqlen 4096 --causal true --plot out.png

Records (JSON) are described in benchmarks/README.md; `load_records()` reads them.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import itertools
import json
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from fa4lab.spec import AttentionSpec, normalize_dtype

# ---- the standard sweep ---------------------------------------------------------------------
TOTAL_TOKENS = 16384
HIDDEN = 2048
HEAD_DIMS = (64, 128, 256)
SEQLENS = (1024, 2048, 4096, 8192, 16384)
QUICK_HEAD_DIMS = (128,)
QUICK_SEQLENS = (4096, 8192)
# The head dims the kernels (and upstream FA4's tuned paths) are built for.
SUPPORTED_HEAD_DIMS = (64, 128, 256)

OURS = "fa4lab"
PEERS = ("sdpa-flash", "sdpa-cudnn", "fa4")
PROVIDERS = (OURS,) + PEERS
PROVIDER_LABELS = {
    OURS: "fa4lab",
    "sdpa-flash": "PyTorch SDPA (flash)",
    "sdpa-cudnn": "PyTorch SDPA (cuDNN)",
    "fa4": "upstream FA4 (flash-attn-4)",
}

# Status of one (provider, shape) cell.
OK, FAILED, ERROR, MISSING = "ok", "failed", "error", "missing"
STATUSES = (OK, FAILED, ERROR, MISSING)

SCHEMA = "fa4lab.bench/1"
RECORD_KINDS = ("measured", "reference-peers")
GEMM_SIZE = 8192
# Hopper's L2: 50 MB enabled on H100/H200 products, 60 MB on the full GH100 die; the larger is
# used so the rotation rule (see Note [cold L2]) errs on the safe side.
L2_BYTES = 60 * 1024 * 1024

# Timing knobs (triton's defaults; the standard sweep finishes in a few minutes with them).
WARMUP_MS = 25
REP_MS = 100
SPIN_UP_S = 0.3  # see Note [clock ramp]

BENCHMARKS_DIR = Path(__file__).resolve().parents[1] / "benchmarks"


# ---- shapes ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class BenchShape:
    """One point of the sweep: q, k, v are (batch, seqlen, heads, head_dim); Sq == Sk."""

    head_dim: int
    seqlen: int
    causal: bool
    batch: int
    heads: int
    dtype: str = "bf16"

    @property
    def spec(self) -> AttentionSpec:
        return AttentionSpec(self.batch, self.seqlen, self.seqlen, self.heads, self.heads,
                             self.head_dim, dtype=self.dtype, causal=self.causal)

    @property
    def flops(self) -> float:
        return self.spec.flops()

    @property
    def key(self) -> tuple[int, bool, int]:
        return (self.head_dim, self.causal, self.seqlen)

    def label(self) -> str:
        mask = "causal" if self.causal else "full"
        return f"hd{self.head_dim} {mask} s{self.seqlen} (b{self.batch} h{self.heads})"


def parse_causal(value: str) -> tuple[bool, ...]:
    """'both' -> (False, True); 'true'/'false' -> one of them."""
    v = str(value).strip().lower()
    table = {"both": (False, True), "true": (True,), "false": (False,), "yes": (True,),
             "no": (False,), "1": (True,), "0": (False,)}
    if v not in table:
        raise ValueError(f"--causal {value!r}: use 'both', 'true' or 'false'")
    return table[v]


def sweep(head_dims: Iterable[int] = HEAD_DIMS, seqlens: Iterable[int] = SEQLENS,
          causal: Iterable[bool] = (False, True), *, total_tokens: int = TOTAL_TOKENS,
          hidden: int = HIDDEN, dtype: str = "bf16") -> list[BenchShape]:
    """The shapes of a sweep, ordered head_dim, causal, seqlen.

    heads = hidden // head_dim and batch = total_tokens // seqlen, so every point moves the same
    number of tokens and the same hidden size; a head_dim or seqlen that does not divide them
    is an error that says which values would.
    """
    dtype = normalize_dtype(dtype)
    head_dims, seqlens, causal = list(head_dims), list(seqlens), list(causal)
    if not head_dims or not seqlens or not causal:
        raise ValueError("empty sweep: give at least one --head-dim, one --seqlen and --causal")
    for name, value in (("total_tokens", total_tokens), ("hidden", hidden)):
        if int(value) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    shapes = []
    for d in head_dims:
        if d not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"--head-dim {d} is not supported: the kernels and peers are built "
                             f"for head_dim in {SUPPORTED_HEAD_DIMS}")
        if hidden % d:
            raise ValueError(f"--head-dim {d} does not divide --hidden {hidden} (heads = hidden /"
                             f" head_dim): choose a head_dim in "
                             f"{[x for x in SUPPORTED_HEAD_DIMS if hidden % x == 0]}")
        for c in causal:
            for s in seqlens:
                if s < 1 or total_tokens % s:
                    ok = [x for x in SEQLENS if total_tokens % x == 0]
                    raise ValueError(
                        f"--seqlen {s} does not divide --total-tokens {total_tokens} "
                        f"(batch = total_tokens / seqlen): choose a divisor such as {ok}, or "
                        f"change --total-tokens")
                shapes.append(BenchShape(d, s, bool(c), total_tokens // s, hidden // d, dtype))
    return shapes


# ---- results and records ----------------------------------------------------------------------
@dataclass
class Result:
    """One provider on one shape. tflops/ms are None unless status == 'ok'."""

    provider: str
    head_dim: int
    seqlen: int
    causal: bool
    batch: int
    heads: int
    dtype: str = "bf16"
    status: str = OK
    tflops: float | None = None
    ms: float | None = None
    max_err: float | None = None     # max |out - reference| on the checked slice
    tol: float | None = None         # the tolerance it was held to
    first_call_s: float | None = None  # wall time of the first call (includes any compile)
    note: str = ""

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r} is not one of {STATUSES}")

    @property
    def key(self) -> tuple[int, bool, int]:
        return (self.head_dim, self.causal, self.seqlen)

    @classmethod
    def for_shape(cls, provider: str, shape: BenchShape, **kw) -> Result:
        return cls(provider, shape.head_dim, shape.seqlen, shape.causal, shape.batch,
                   shape.heads, shape.dtype, **kw)

    @classmethod
    def from_dict(cls, d: dict) -> Result:
        names = {f.name for f in fields(cls)}
        missing = [n for n in ("provider", "head_dim", "seqlen", "causal", "batch", "heads",
                               "status") if n not in d]
        if missing:
            raise ValueError(f"result {d} lacks {missing}")
        return cls(**{k: v for k, v in d.items() if k in names})


REQUIRED_RECORD_KEYS = ("schema", "kind", "label", "date", "gpu", "commit", "versions", "command",
                        "config", "gemm_tflops", "results")


def validate_record(record: dict) -> dict:
    """Check a record's keys and values; return it. A bad record is a ValueError naming why."""
    if not isinstance(record, dict):
        raise ValueError(f"a bench record is a JSON object, got {type(record).__name__}")
    missing = [k for k in REQUIRED_RECORD_KEYS if k not in record]
    if missing:
        raise ValueError(f"bench record lacks {missing} (see benchmarks/README.md, 'Record "
                         f"format')")
    if record["schema"] != SCHEMA:
        raise ValueError(f"bench record schema {record['schema']!r}; this fa4lab reads {SCHEMA!r}")
    if record["kind"] not in RECORD_KINDS:
        raise ValueError(f"bench record kind {record['kind']!r} is not one of {RECORD_KINDS}")
    for r in record["results"]:
        res = Result.from_dict(r)
        if res.status == OK and (res.tflops is None or not res.tflops > 0):
            raise ValueError(f"result {r} has status ok but no positive tflops")
    return record


def results_of(record: dict) -> list[Result]:
    return [Result.from_dict(r) for r in record["results"]]


def save_record(record: dict, path: str | os.PathLike) -> Path:
    validate_record(record)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, sort_keys=False) + "\n")
    return path


def load_record(path: str | os.PathLike) -> dict:
    path = Path(path)
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path.name} is not valid JSON: {err}") from None
    try:
        validate_record(record)
    except ValueError as err:
        raise ValueError(f"{path.name}: {err}") from None
    record.setdefault("path", str(path))
    return record


def load_records(directory: str | os.PathLike | None = None) -> list[dict]:
    """Every `*.json` record in `directory` (default: the repository's benchmarks/), oldest
    first (by date, time of day where recorded, file name). An unreadable record is an error
    naming the file."""
    directory = BENCHMARKS_DIR if directory is None else Path(directory)
    if not directory.is_dir():
        return []
    records = [load_record(p) for p in sorted(directory.glob("*.json"))]
    return sorted(records, key=lambda r: (r["date"], r.get("time_utc") or "",
                                          Path(r["path"]).name))


def recorded_tflops(record: dict | None, key: tuple[int, bool, int]) -> dict[str, float]:
    """{provider: TFLOP/s} of the record's 'ok' results at key = (head_dim, causal, seqlen)."""
    if not record:
        return {}
    return {r.provider: r.tflops for r in results_of(record) if r.key == key and r.status == OK}


def latest_record(records: Sequence[dict], *, gpu: str | None = None,
                  provider: str | None = None) -> dict | None:
    """The newest record whose GPU name contains `gpu` and, if given, that has at least one
    'ok' result for `provider`."""
    for rec in reversed(list(records)):
        if gpu and gpu.lower() not in str(rec["gpu"]).lower():
            continue
        if provider and not any(r.provider == provider and r.status == OK
                                for r in results_of(rec)):
            continue
        return rec
    return None


# ---- tables and ratios -------------------------------------------------------------------------
def providers_in(results: Iterable[Result]) -> list[str]:
    seen = []
    for r in results:
        if r.provider not in seen:
            seen.append(r.provider)
    order = {p: i for i, p in enumerate(PROVIDERS)}
    return sorted(seen, key=lambda p: order.get(p, len(order)))


@dataclass
class TableRow:
    head_dim: int
    causal: bool
    seqlen: int
    cells: dict[str, Result] = field(default_factory=dict)
    ratios: dict[str, float | None] = field(default_factory=dict)   # ours / peer


def ratio_table(results: Sequence[Result], *, ours: str = OURS) -> list[TableRow]:
    """One row per shape (head_dim, causal, seqlen) with each provider's result and the ratio of
    `ours` to every other provider (None where either side has no measurement)."""
    rows: dict[tuple, TableRow] = {}
    for r in results:
        row = rows.setdefault(r.key, TableRow(r.head_dim, r.causal, r.seqlen))
        row.cells[r.provider] = r
    peers = [p for p in providers_in(results) if p != ours]
    for row in rows.values():
        mine = row.cells.get(ours)
        for p in peers:
            other = row.cells.get(p)
            ok = (mine is not None and other is not None and mine.status == OK
                  and other.status == OK and other.tflops)
            row.ratios[p] = mine.tflops / other.tflops if ok else None
    return [rows[k] for k in sorted(rows)]


def geomean_ratios(rows: Sequence[TableRow]) -> dict[str, float | None]:
    """Geometric mean of ours/peer over the shapes where both were measured."""
    peers = sorted({p for row in rows for p in row.ratios})
    out = {}
    for p in peers:
        vals = [row.ratios[p] for row in rows if row.ratios.get(p)]
        out[p] = math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None
    return out


def _cell(r: Result | None) -> str:
    if r is None:
        return "-"
    if r.status == OK:
        return f"{r.tflops:.0f}" if r.tflops >= 10 else f"{r.tflops:.3g}"
    return r.status


def format_table(results: Sequence[Result], *, ours: str = OURS,
                 gemm_tflops: float | None = None) -> str:
    """A markdown table: TFLOP/s per provider (or its status) and ours/peer ratios."""
    rows = ratio_table(results, ours=ours)
    provs = providers_in(results)
    peers = [p for p in provs if p != ours]
    has_ours = ours in provs
    head = ["head_dim", "causal", "seqlen"] + provs
    if has_ours:
        head += [f"{ours}/{p}" for p in peers]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [str(row.head_dim), "yes" if row.causal else "no", str(row.seqlen)]
        cells += [_cell(row.cells.get(p)) for p in provs]
        if has_ours:
            cells += ["-" if row.ratios.get(p) is None else f"{row.ratios[p]:.2f}" for p in peers]
        lines.append("| " + " | ".join(cells) + " |")
    if has_ours and rows:
        gm = geomean_ratios(rows)
        parts = [f"{ours}/{p} {gm[p]:.2f}" if gm.get(p) else f"{ours}/{p} -" for p in peers]
        lines.append("")
        lines.append("geometric mean over shapes measured by both: " + ", ".join(parts))
    if gemm_tflops:
        lines.append(f"dense bf16 GEMM {GEMM_SIZE}^3 (ceiling), same run: {gemm_tflops:.0f} "
                     f"TFLOP/s")
    notes = [f"- {r.provider} {'causal' if r.causal else 'full'} hd{r.head_dim} s{r.seqlen}: "
             f"{r.status}: {r.note}" for r in results if r.status != OK and r.note]
    if notes:
        lines += ["", "not measured:"] + _dedupe_notes(notes)
    return "\n".join(lines)


def _dedupe_notes(notes: list[str], limit: int = 12) -> list[str]:
    # A missing provider repeats the same note on every shape: say it once.
    seen, out = set(), []
    for n in notes:
        prov, _, rest = n.partition(" ")
        reason = rest.split(": ", 2)[-1]
        if (prov, reason) in seen:
            continue
        seen.add((prov, reason))
        out.append(n)
    return out[:limit] + ([f"- ... {len(out) - limit} more"] if len(out) > limit else [])


# ---- providers -------------------------------------------------------------------------------
# A runner takes (q, k, v, causal, softmax_scale) with q/k/v (batch, seqlen, heads, head_dim)
# and returns the output in the same layout.
Runner = Callable[..., Any]


@dataclass(frozen=True)
class Provider:
    """A name and a runner, or the reason it is missing. `prepare(q, k, v)` (optional) turns
    the sweep's (batch, seqlen, heads, head_dim) inputs into the provider's native layout once,
    outside the timed region; the runner then takes those and still returns the output as
    (batch, seqlen, heads, head_dim) (a view is enough)."""

    name: str
    runner: Runner | None      # None: missing
    why_missing: str = ""
    prepare: Callable | None = None

    @property
    def missing(self) -> bool:
        return self.runner is None


# Note [SDPA layout]
# SDPA takes (batch, heads, seqlen, head_dim). The bench gives it its own contiguous copies in
# that layout, made once per shape outside the timed region (`to_bhsd`), so no backend pays
# for a layout it would not see in a model, and none can refuse the strides of a transposed
# view. seqlen_q == seqlen_k in the sweep, so SDPA's is_causal=True (top-left aligned) is the
# same mask as fa4lab's bottom-right rule.
def to_bhsd(q, k, v):
    """(batch, seqlen, heads, d) -> contiguous (batch, heads, seqlen, d) copies, for SDPA."""
    return tuple(t.transpose(1, 2).contiguous() for t in (q, k, v))


def sdpa_runner(backend_name: str, *, layout: str = "bshd") -> Runner:
    """torch SDPA restricted to one backend ("FLASH_ATTENTION", "CUDNN_ATTENTION", "MATH").

    layout "bshd": takes (batch, seqlen, heads, d) and passes transposed views; "bhsd": takes
    SDPA's own layout (see `to_bhsd`). Either way the output comes back as (b, s, h, d).
    """
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)
    if layout not in ("bshd", "bhsd"):
        raise ValueError(f"layout {layout!r}: 'bshd' or 'bhsd'")
    views = layout == "bshd"

    def run(q, k, v, causal, softmax_scale):
        if views:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        with sdpa_kernel([backend]):
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                 scale=softmax_scale)
        return o.transpose(1, 2)

    return run


def _fa4lab_runner(arch: str | None) -> Runner:
    """`fa4lab.attention`, refusing its float64 fallback: where no kernel runs, `attention`
    computes the reference (with a SlowReferenceWarning), which must never be timed as fa4lab.
    The warning is an error on the first call (the check call); later calls take the same
    dispatch, so they pay no extra cost."""
    import warnings

    from fa4lab.api import SlowReferenceWarning, attention

    first = [True]

    def run(q, k, v, causal, softmax_scale):
        if first[0]:
            with warnings.catch_warnings():
                warnings.simplefilter("error", SlowReferenceWarning)
                out = attention(q, k, v, causal=causal, softmax_scale=softmax_scale)
            first[0] = False
        else:
            out = attention(q, k, v, causal=causal, softmax_scale=softmax_scale)
        return out[0] if isinstance(out, tuple) else out

    return run


def _fa4_runner() -> Runner:
    try:
        from flash_attn.cute.interface import flash_attn_func
    except ImportError as err:
        if _version("flash-attn-4") is None:
            raise RuntimeError("flash-attn-4 is not installed (pip install flash-attn-4)") \
                from None
        raise RuntimeError(f"flash-attn-4 {_version('flash-attn-4')} is installed but "
                           f"flash_attn.cute does not import: {_short(err)}") from None

    def run(q, k, v, causal, softmax_scale):
        out = flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal)
        return out[0] if isinstance(out, tuple) else out

    return run


def _version(dist: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:
        return None


def resolve_providers(names: Sequence[str], *, arch: str | None = None,
                      include_ours: bool = True) -> list[Provider]:
    """Providers by name, each with a runner or the reason it is missing (never dropped)."""
    unknown = [n for n in names if n not in PROVIDERS]
    if unknown:
        raise ValueError(f"unknown provider(s) {unknown}: choose from {list(PEERS)} "
                         f"(fa4lab itself is always measured)")
    names = ([OURS] if include_ours else []) + [n for n in names if n != OURS]
    from fa4lab.environment import gpu

    has_gpu = gpu() is not None
    out = []
    for name in names:
        try:
            if name in ("sdpa-flash", "sdpa-cudnn") and not has_gpu:
                raise RuntimeError("no CUDA GPU visible")
            if name == "sdpa-flash":
                runner = sdpa_runner("FLASH_ATTENTION", layout="bhsd")
            elif name == "sdpa-cudnn":
                import torch

                if not torch.backends.cudnn.is_available():
                    raise RuntimeError("this torch build has no cuDNN")
                runner = sdpa_runner("CUDNN_ATTENTION", layout="bhsd")
            elif name == "fa4":
                runner = _fa4_runner()
            else:
                runner = _fa4lab_runner(arch)
            prepare = to_bhsd if name.startswith("sdpa-") else None
            out.append(Provider(name, runner, prepare=prepare))
        except Exception as err:   # a peer that cannot be imported is reported, not dropped
            out.append(Provider(name, None, f"{type(err).__name__}: {_short(err)}"))
    return out


def _short(err: BaseException, limit: int = 300) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= limit else text[:limit] + " ..."


# ---- correctness check -------------------------------------------------------------------------
# Note [the check before timing]
# Each provider runs once on the full input (that first call also compiles, where the provider
# compiles) and its output for batch element 0, heads 0..1, all rows, is compared with the
# float64 reference of the same slice (`fa4lab.reference.attention_reference`, on the GPU).
# The tolerance is FA4's rule: at most twice the error of a plain PyTorch attention computed in
# the input dtype (scores rounded to bf16, softmax in fp32, P rounded to bf16: what a correct
# flash kernel also does), plus ATOL for the final rounding of the output. A provider whose
# error is above that, or whose output has a NaN or the wrong shape, is "failed" and not timed.
CHECK_HEADS = 2
ATOL = {"bf16": 2.0**-9, "fp16": 2.0**-12}


def _same_dtype_attention(q, k, v, causal: bool, scale: float):
    """(b, s, h, d) -> (b, s, h, d) in q.dtype, one head at a time; the baseline of the rule."""
    import torch

    outs = []
    for h in range(q.shape[2]):
        qh, kh, vh = q[:, :, h], k[:, :, h], v[:, :, h]
        s = torch.matmul(qh, kh.transpose(-1, -2)).float() * scale
        if causal:
            sq, sk = s.shape[-2], s.shape[-1]
            i = torch.arange(sq, device=s.device)[:, None]
            j = torch.arange(sk, device=s.device)[None, :]
            s = s.masked_fill(j > i + (sk - sq), -math.inf)
        p = torch.softmax(s, dim=-1).to(q.dtype)
        outs.append(torch.matmul(p, vh))
    return torch.stack(outs, dim=2)


@dataclass
class CheckSlice:
    """The reference for one shape's checked slice (computed once, shared by every provider)."""

    ref: Any            # float64 (1, seqlen, CHECK_HEADS, head_dim)
    tol: float
    baseline_err: float


def reference_slice(q, k, v, shape: BenchShape) -> CheckSlice:
    from fa4lab.reference import attention_reference

    hs = slice(0, min(CHECK_HEADS, shape.heads))
    qs, ks, vs = q[:1, :, hs], k[:1, :, hs], v[:1, :, hs]
    scale = shape.spec.scale
    ref = attention_reference(qs, ks, vs, causal=shape.causal, softmax_scale=scale)
    base = _same_dtype_attention(qs, ks, vs, shape.causal, scale).double()
    baseline_err = float((base - ref).abs().max())
    return CheckSlice(ref, 2.0 * baseline_err + ATOL[shape.dtype], baseline_err)


def check_output(out, check: CheckSlice, shape: BenchShape) -> tuple[bool, float, str]:
    """(passed, max_err, note) for a provider's full output against the checked slice."""
    expect = (shape.batch, shape.seqlen, shape.heads, shape.head_dim)
    if tuple(out.shape) != expect:
        return False, math.inf, f"output shape {tuple(out.shape)}, expected {expect}"
    got = out[:1, :, : check.ref.shape[2]].double()
    if not bool(got.isfinite().all()):
        return False, math.inf, "output has NaN or inf on the checked slice"
    err = float((got - check.ref).abs().max())
    if err > check.tol:
        return False, err, (f"max error {err:.2e} > tolerance {check.tol:.2e} (2 x same-dtype "
                            f"PyTorch error {check.baseline_err:.2e} + {ATOL[shape.dtype]:.1e})")
    return True, err, ""


# ---- timing ----------------------------------------------------------------------------------
# Note [cold L2]
# One call of the standard sweep reads q, k, v and writes o: 4 x 64 MiB = 256 MiB, four times
# or more the L2 (50 MB on an H100/H200), so the inputs are not rotated among copies: nothing a
# call leaves in L2 is a meaningful head start for the next. On top of that
# `triton.testing.do_bench` writes a 256 MB buffer before every timed call (outside the timed
# region), so every call starts with a cold L2; the CUDA-event fallback below does the same.
# For custom shapes smaller than 2 x L2 (--total-tokens/--hidden), `measure_shape` makes enough
# copies (`_rotation_copies`) and each timed call takes the next one.
def timer_name() -> str:
    try:
        import triton  # noqa: F401

        return "triton.testing.do_bench (median, warm-up excluded, L2 flushed per call)"
    except ImportError:
        return "cuda events (median, warm-up excluded, L2 flushed per call; triton missing)"


def time_ms(fn: Callable[[], Any], *, warmup_ms: float = WARMUP_MS, rep_ms: float = REP_MS,
            device: str = "cuda") -> float:
    """Median milliseconds of fn() (warm-up excluded)."""
    if device != "cuda":
        return _time_cpu(fn, rep_ms)
    try:
        from triton.testing import do_bench
    except ImportError:
        return _time_cuda_events(fn, warmup_ms, rep_ms)
    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def _time_cuda_events(fn, warmup_ms, rep_ms) -> float:
    import torch

    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    est = max((time.perf_counter() - t0) * 1e3, 1e-3)
    for _ in range(max(1, int(warmup_ms / est))):
        fn()
    n = max(5, int(rep_ms / est))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for s, e in zip(starts, ends):
        flush.zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def _time_cpu(fn, rep_ms) -> float:
    fn()
    times = []
    deadline = time.perf_counter() + rep_ms / 1e3
    while len(times) < 3 or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def gemm_tflops(*, size: int = GEMM_SIZE, warmup_ms: float = WARMUP_MS,
                rep_ms: float = REP_MS) -> float:
    """Dense bf16 matmul rate (size^3), the ceiling the attention numbers are read against."""
    import torch

    a = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    ms = time_ms(lambda: torch.matmul(a, b), warmup_ms=warmup_ms, rep_ms=rep_ms)
    return 2.0 * size**3 / (ms * 1e-3) / 1e12


def make_inputs(shape: BenchShape, device: str, seed: int = 0):
    """q, k, v (batch, seqlen, heads, head_dim), standard normal, in the shape's dtype."""
    import torch

    dt = torch.bfloat16 if shape.dtype == "bf16" else torch.float16
    gen = torch.Generator(device=device).manual_seed(seed + shape.seqlen + shape.head_dim)
    dims = (shape.batch, shape.seqlen, shape.heads, shape.head_dim)
    return tuple(torch.randn(dims, generator=gen, device=device, dtype=torch.float32).to(dt)
                 for _ in range(3))


def _rotation_copies(shape: BenchShape) -> int:
    # See Note [cold L2].
    bytes_per_call = 4 * shape.batch * shape.seqlen * shape.heads * shape.head_dim * 2
    return max(1, min(8, math.ceil(2 * L2_BYTES / bytes_per_call)))


# ---- the sweep -------------------------------------------------------------------------------
def measure_shape(shape: BenchShape, providers: Sequence[Provider], *, device: str = "cuda",
                  warmup_ms: float = WARMUP_MS, rep_ms: float = REP_MS,
                  on_result: Callable[[Result], None] | None = None) -> list[Result]:
    """Check, then time, every provider on one shape. Never raises for a provider's failure."""
    results = []

    def done(r: Result):
        results.append(r)
        if on_result:
            on_result(r)

    sync = _sync(device)
    try:
        q, k, v = make_inputs(shape, device)
        check = reference_slice(q, k, v, shape)
    except Exception as err:
        for p in providers:
            if p.missing:
                done(Result.for_shape(p.name, shape, status=MISSING, note=p.why_missing))
            else:
                done(Result.for_shape(p.name, shape, status=ERROR,
                                      note=f"inputs/reference: {type(err).__name__}: "
                                           f"{_short(err)}"))
        return results
    copies = [(q, k, v)] + [tuple(t.clone() for t in (q, k, v))
                            for _ in range(_rotation_copies(shape) - 1)]
    scale = shape.spec.scale
    # fa4lab last: if its kernel ever poisons the CUDA context, the peers of this shape are
    # already measured (everything after it then reports the error and the sweep still ends).
    for p in sorted(providers, key=lambda p: p.name == OURS):
        if p.missing:
            done(Result.for_shape(p.name, shape, status=MISSING, note=p.why_missing))
            continue
        try:
            mine = [p.prepare(*c) for c in copies] if p.prepare else copies
            sync()
            t0 = time.perf_counter()
            out = p.runner(*mine[0], shape.causal, scale)
            sync()
            first = time.perf_counter() - t0
            passed, err, note = check_output(out, check, shape)
            del out
            if not passed:
                done(Result.for_shape(p.name, shape, status=FAILED, max_err=_finite(err),
                                      tol=check.tol, first_call_s=first, note=note))
                continue
            call = _rotating_call(p.runner, mine, shape.causal, scale)
            if device == "cuda":
                _spin_up(call, sync)
            ms = time_ms(call, warmup_ms=warmup_ms, rep_ms=rep_ms, device=device)
            done(Result.for_shape(p.name, shape, status=OK, ms=ms,
                                  tflops=shape.flops / (ms * 1e-3) / 1e12, max_err=err,
                                  tol=check.tol, first_call_s=first))
        except Exception as err:
            done(Result.for_shape(p.name, shape, status=ERROR,
                                  note=f"{type(err).__name__}: {_short(err)}"))
    return results


def _rotating_call(runner: Runner, copies: list, causal: bool, scale: float):
    """A no-argument call that takes the next (q, k, v) copy each time. See Note [cold L2]."""
    turns = itertools.cycle(copies)

    def call():
        q, k, v = next(turns)
        return runner(q, k, v, causal, scale)

    return call


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


# Note [clock ramp]
# A provider's first call on a shape may compile for seconds (fa4lab, upstream FA4), with the
# GPU idle; its clocks fall meanwhile, and do_bench's 25 ms warm-up does not bring them back:
# in the records before this note, the first shape of a (head_dim, causal) group, where
# fa4lab compiled, measured as low as 57 % of a repeat run. Every provider therefore runs
# back to back for SPIN_UP_S before its timing starts, compiled or not, so all are treated
# alike. It has not removed every dip: short shapes right after a compile still measured low
# in both sweeps since, and at parity when timed again (benchmarks/README.md).
def _spin_up(call: Callable[[], Any], sync: Callable[[], None], seconds: float = SPIN_UP_S):
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for _ in range(4):
            call()
        sync()


def _sync(device: str) -> Callable[[], None]:
    if device == "cuda":
        import torch

        return torch.cuda.synchronize
    return lambda: None


class _PlainBar:
    """Where tqdm is not installed: one line per finished run on stderr."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.n, self.enabled, self.where = total, 0, enabled, ""

    def set_postfix_str(self, text: str) -> None:
        self.where = text

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.enabled:
            print(f"bench {self.n}/{self.total} {self.where}", file=sys.stderr, flush=True)

    def write(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


def _progress_bar(total: int, enabled: bool):
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _PlainBar(total, enabled)
    return tqdm(total=total, desc="bench", unit="run", disable=not enabled, file=sys.stderr,
                dynamic_ncols=True)


def _tick(bar, r: Result) -> None:
    bar.update(1)
    if r.status not in (OK, MISSING):
        mask = "causal" if r.causal else "full"
        bar.write(f"{r.provider} hd{r.head_dim} {mask} s{r.seqlen}: {r.status}: {r.note}")


def run_sweep(shapes: Sequence[BenchShape], providers: Sequence[Provider], *,
              device: str = "cuda", warmup_ms: float = WARMUP_MS, rep_ms: float = REP_MS,
              progress: bool = True) -> list[Result]:
    """Every provider on every shape, in one process, with a tqdm bar over (shape, provider)."""
    results: list[Result] = []
    bar = _progress_bar(len(shapes) * len(providers), progress)
    try:
        for shape in shapes:
            bar.set_postfix_str(shape.label())
            results += measure_shape(shape, providers, device=device, warmup_ms=warmup_ms,
                                     rep_ms=rep_ms, on_result=lambda r: _tick(bar, r))
            if device == "cuda":
                import torch

                torch.cuda.empty_cache()
    finally:
        bar.close()
    return results


# ---- one plan: simulated (any machine) and measured (GPU) -------------------------------------
def simulated_tflops(shapes: Iterable[BenchShape], arch: str = "sm90",
                     **overrides) -> dict[tuple[int, bool, int], float]:
    """The planner's predicted TFLOP/s for each shape (`fa4lab.plan.simulate.predict` of
    `plan_forward(shape.spec, arch, **overrides)`), keyed like Result.key."""
    from fa4lab.plan import plan_forward
    from fa4lab.plan.simulate import predict

    return {s.key: predict(plan_forward(s.spec, arch, **overrides)).tflops for s in shapes}


def shape_for(head_dim: int, seqlen: int, causal: bool, *, total_tokens: int = TOTAL_TOKENS,
              hidden: int = HIDDEN, dtype: str = "bf16") -> BenchShape:
    """The standard-sweep shape at (head_dim, seqlen, causal)."""
    (shape,) = sweep([head_dim], [seqlen], [causal], total_tokens=total_tokens, hidden=hidden,
                     dtype=dtype)
    return shape


def compile_anywhere(plan) -> tuple[float | None, str]:
    """Compile `plan`'s kernel for its arch with fake tensors (`fa4lab.kernels.compile`; no GPU
    needed). Returns (seconds, a one-line report); a failure is reported, not raised, so a
    widget can show it beside the plan."""
    try:
        from fa4lab.kernels.compile import compile_forward

        cf = compile_forward(plan, plan.arch + "a")
    except Exception as err:
        return None, f"compile for {plan.arch}a failed: {type(err).__name__}: {_short(err)}"
    return cf.seconds, (f"compiled for {plan.arch}a in {cf.seconds:.1f} s; the kernel's "
                        f"dynamic SMEM {cf.smem_bytes} B")


def _kernel_class(arch: str):
    if arch == "sm90":
        from fa4lab.kernels.fwd_sm90 import FlashForwardSm90

        return FlashForwardSm90
    from fa4lab.kernels.fwd_sm100 import FlashForwardSm100

    return FlashForwardSm100


def compile_plan(plan, example) -> tuple[Runner, float]:
    """Compile `plan`'s kernel for this GPU with the tensors of `example` (q, k, v) and return
    (runner, compile seconds). Unlike `fa4lab.attention`, whose cache is keyed by the spec and
    always uses the default tiles, this builds exactly the tiles of `plan` (notebook 07)."""
    import cutlass.cute as cute
    import torch

    from fa4lab.kernels import runtime

    spec = plan.spec
    kernel = _kernel_class(plan.arch)(plan)

    def args_for(q, k, v):
        b, sq, hq, _ = q.shape
        out = torch.empty(b, sq, hq, v.shape[-1], dtype=q.dtype, device=q.device)
        lse = (torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)
               if spec.return_lse else None)
        args = [runtime.to_cute(x) for x in (q, k, v, out)]
        args.append(runtime.to_cute(lse, assumed_align=4) if lse is not None else None)
        args.append(runtime.current_stream())
        return out, args

    q, k, v = example
    runtime.check_cuda_inputs(q, k, v)
    _, args = args_for(q, k, v)
    t0 = time.perf_counter()
    compiled = cute.compile(kernel, *args)
    compile_s = time.perf_counter() - t0

    def run(q, k, v, causal, softmax_scale):
        if bool(causal) != spec.causal or not math.isclose(softmax_scale, spec.scale):
            raise ValueError(f"this kernel was compiled for causal={spec.causal}, scale "
                             f"{spec.scale:.4g}; got causal={causal}, scale {softmax_scale:.4g}")
        out, call_args = args_for(q, k, v)
        compiled(*call_args)
        return out

    return run, compile_s


@dataclass
class PlanMeasurement:
    """What notebook 07's GPU widget shows: compile time, and every provider on one shape."""

    shape: BenchShape
    compile_s: float | None
    results: list[Result]
    error: str = ""


def measure_plan(plan, peers: Sequence[str] = PEERS, *, warmup_ms: float = WARMUP_MS,
                 rep_ms: float = REP_MS) -> PlanMeasurement:
    """Compile `plan` (an sm90/sm100 Plan of a standard-sweep spec), check it against the
    reference and time it beside `peers` on the plan's shape. Needs a CUDA GPU of the plan's
    arch; a compile failure is reported in `.error` with fa4lab's result as 'error'."""
    spec = plan.spec
    shape = BenchShape(spec.head_dim, spec.seqlen_q, spec.causal, spec.batch, spec.heads_q,
                       spec.dtype)
    if spec.seqlen_q != spec.seqlen_k or spec.heads_q != spec.heads_kv:
        raise ValueError("measure_plan takes the sweep's shapes: seqlen_q == seqlen_k, no GQA")
    others = resolve_providers(peers, include_ours=False)
    try:
        example = make_inputs(shape, "cuda")
        runner, compile_s = compile_plan(plan, example)
        del example
        ours = Provider(OURS, runner)
    except Exception as err:
        note = f"compile: {type(err).__name__}: {_short(err)}"
        results = measure_shape(shape, others, warmup_ms=warmup_ms, rep_ms=rep_ms)
        return PlanMeasurement(shape, None,
                               [Result.for_shape(OURS, shape, status=ERROR, note=note)] + results,
                               note)
    results = measure_shape(shape, [ours] + others, warmup_ms=warmup_ms, rep_ms=rep_ms)
    return PlanMeasurement(shape, compile_s, results)


# ---- record metadata -------------------------------------------------------------------------
def git_commit(repo: Path | None = None) -> str | None:
    """`git rev-parse HEAD` of the repository fa4lab runs from ('+dirty' when it has changes).

    FA4LAB_COMMIT, when set, names the commit instead: a copy shipped to a GPU host may carry
    a stale or no git directory, and whoever copied it knows what it is. Otherwise None."""
    repo = repo or Path(__file__).resolve().parents[1]
    fallback = os.environ.get("FA4LAB_COMMIT") or None
    if fallback:
        return fallback
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True,
                              text=True, timeout=10)
        if head.returncode:
            return fallback
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=repo, capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return fallback


def versions() -> dict[str, str | None]:
    v = {"python": platform.python_version(), "torch": _version("torch"),
         "triton": _version("triton"), "cutlass-dsl": _version("nvidia-cutlass-dsl"),
         "flash-attn-4": _version("flash-attn-4"), "fa4lab": _version("fa4lab")}
    try:
        import torch

        v["cuda"] = torch.version.cuda
        v["cudnn"] = str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() \
            else None
    except Exception:
        pass
    return v


def make_record(results: Sequence[Result], *, gemm: float | None, gpu_name: str,
                arch: str | None, command: str, config: dict, label: str | None = None,
                kind: str = "measured", notes: str = "") -> dict:
    now = _dt.datetime.now(_dt.timezone.utc)
    record = {
        "schema": SCHEMA,
        "kind": kind,
        "label": label or f"fa4lab bench on {gpu_name}",
        "date": now.strftime("%Y-%m-%d"),
        "time_utc": now.strftime("%H:%M:%S"),
        "gpu": gpu_name,
        "arch": arch,
        "commit": git_commit(),
        "versions": versions(),
        "command": command,
        "config": config,
        "gemm_tflops": gemm,
        "results": [asdict(r) for r in results],
        "notes": notes,
    }
    return validate_record(record)


def default_record_path(record: dict) -> Path:
    """benchmarks/<date>_<gpu>_<commit>_<time>.json: sorts by date, never overwrites."""
    gpu = re.sub(r"[^a-z0-9]+", "-", str(record["gpu"]).lower()).strip("-") or "gpu"
    commit = (record.get("commit") or "nocommit")[:7]
    stamp = str(record.get("time_utc", "")).replace(":", "")
    return BENCHMARKS_DIR / f"{record['date']}_{gpu}_{commit}_{stamp}.json"


# ---- the command -----------------------------------------------------------------------------
def add_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "bench", help="throughput of fa4lab beside PyTorch SDPA and upstream FA4 (GPU)",
        description="Check every provider against the float64 reference, then time it with "
                    "triton.testing.do_bench; print a table with fa4lab/peer ratios, save a "
                    "JSON record and optionally a plot. On a CPU: say so, print the plan of the "
                    "run and the latest recorded results, exit 0.")
    p.add_argument("--arch", default="auto", choices=("auto", "sm90", "sm100"),
                   help="the fa4lab kernel to run; auto = the GPU's (default)")
    p.add_argument("--head-dim", type=int, nargs="+", default=list(HEAD_DIMS), metavar="D")
    p.add_argument("--seqlen", type=int, nargs="+", default=list(SEQLENS), metavar="S")
    p.add_argument("--causal", default="both", help="both (default), true or false")
    p.add_argument("--peers", default=",".join(PEERS),
                   help=f"comma-separated, from {','.join(PEERS)} (default: all)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    p.add_argument("--total-tokens", type=int, default=TOTAL_TOKENS,
                   help="batch * seqlen for every point (default 16384)")
    p.add_argument("--hidden", type=int, default=HIDDEN,
                   help="heads * head_dim for every point (default 2048)")
    p.add_argument("--quick", action="store_true",
                   help="hd128, seqlen 4096 and 8192 only (overrides --head-dim/--seqlen)")
    p.add_argument("--json", default=None, metavar="OUT.json",
                   help="where to save the record (default: benchmarks/<date>_<gpu>_<commit>.json)")
    p.add_argument("--no-save", action="store_true", help="do not write a JSON record")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="save the throughput plot")
    p.add_argument("--label", default=None, help="a label stored in the record")
    p.add_argument("--warmup-ms", type=float, default=WARMUP_MS)
    p.add_argument("--rep-ms", type=float, default=REP_MS)
    p.add_argument("--no-gemm", action="store_true", help="skip the GEMM ceiling")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 when an installed provider errors or fails its check")
    p.add_argument("--records", default=None, metavar="DIR",
                   help="where recorded results are read from on a CPU (default: benchmarks/)")
    p.set_defaults(func=main_args)


def _peers_from(arg: str) -> list[str]:
    names = [x.strip() for x in str(arg).split(",") if x.strip()]
    unknown = [n for n in names if n not in PEERS and n != OURS]
    if unknown:
        raise ValueError(f"--peers: unknown {unknown}; choose from {','.join(PEERS)}")
    return names


def plan_of_run(args) -> tuple[list[BenchShape], list[str]]:
    """The shapes and provider names a command line asks for (errors are ValueError)."""
    head_dims, seqlens = args.head_dim, args.seqlen
    if args.quick:
        head_dims, seqlens = list(QUICK_HEAD_DIMS), list(QUICK_SEQLENS)
    shapes = sweep(head_dims, seqlens, parse_causal(args.causal),
                   total_tokens=args.total_tokens, hidden=args.hidden, dtype=args.dtype)
    return shapes, [OURS] + [p for p in _peers_from(args.peers) if p != OURS]


def describe_run(shapes: Sequence[BenchShape], providers: Sequence[Provider]) -> str:
    lines = [f"{len(shapes)} shapes x {len(providers)} providers "
             f"({shapes[0].dtype}; batch * seqlen = {shapes[0].batch * shapes[0].seqlen}, "
             f"heads * head_dim = {shapes[0].heads * shapes[0].head_dim}):"]
    lines += [f"  {s.label()}  {s.flops / 1e12:.2f} TFLOP" for s in shapes]
    lines.append("providers:")
    for p in providers:
        state = f"missing ({p.why_missing})" if p.missing else "available"
        lines.append(f"  {p.name:<11} {PROVIDER_LABELS.get(p.name, p.name)}: {state}")
    lines.append(f"plus the dense bf16 GEMM ceiling ({GEMM_SIZE}^3 torch.matmul); "
                 f"timer: {timer_name()}")
    return "\n".join(lines)


def recorded_summary(directory=None, *, gpu: str = "H200") -> str:
    """The latest recorded results for `gpu` as text (what the CPU path prints)."""
    try:
        records = load_records(directory)
    except ValueError as err:
        return f"could not read the recorded results: {err}"
    rec = latest_record(records, gpu=gpu)
    if rec is None:
        return f"no recorded {gpu} results in {directory or 'benchmarks/'}"
    text = [f"latest recorded {gpu} results: {Path(rec['path']).name}",
            f"  {rec['label']} ({rec['kind']}, {rec['date']}, {rec['gpu']})"]
    if rec.get("notes"):
        text.append("  " + rec["notes"])
    if not any(r.provider == OURS and r.status == OK for r in results_of(rec)):
        text.append("  (no fa4lab numbers in this record)")
    text += ["", format_table(results_of(rec), gemm_tflops=rec.get("gemm_tflops"))]
    return "\n".join(text)


def main_args(args) -> int:
    try:
        shapes, names = plan_of_run(args)
    except (ValueError, TypeError) as err:
        print(f"fa4lab bench: {err}", file=sys.stderr)
        return 2
    from fa4lab.environment import gpu

    g = gpu()
    command = "fa4lab bench " + " ".join(shlex.quote(a) for a in getattr(args, "argv", []) or
                                         sys.argv[2:])
    if g is None:
        providers = resolve_providers(names[1:], include_ours=True, arch=None)
        print("fa4lab bench: no CUDA GPU visible, so nothing is measured here.")
        print("On a GPU this command would run:")
        print(describe_run(shapes, providers))
        print()
        print(recorded_summary(args.records))
        return 0

    arch = g.arch if args.arch == "auto" else args.arch
    if g.arch is None or arch != g.arch:
        print(f"fa4lab bench: the GPU is {g.name} (compute capability "
              f"{g.capability[0]}.{g.capability[1]}); fa4lab's kernels run on sm90 (Hopper) "
              f"and sm100 (B200){'' if args.arch == 'auto' else f', not --arch {args.arch}'}; "
              f"the peers are still measured.", file=sys.stderr)
    providers = resolve_providers(names[1:], include_ours=True, arch=arch)
    if g.arch is None or arch != g.arch:
        providers[0] = Provider(OURS, None, f"no fa4lab kernel for {g.name} with --arch {arch}")
    print(f"fa4lab bench on {g.name}")
    print(describe_run(shapes, providers))
    started = time.perf_counter()
    gemm = None
    if not args.no_gemm:
        try:
            gemm = gemm_tflops(warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
        except Exception as err:
            print(f"GEMM ceiling not measured: {type(err).__name__}: {_short(err)}",
                  file=sys.stderr)
    results = run_sweep(shapes, providers, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
    wall_s = time.perf_counter() - started
    print()
    firsts = {p: sum(r.first_call_s or 0 for r in results if r.provider == p)
              for p in providers_in(results)}
    print(f"measured in {wall_s:.0f} s; first calls (compiles included): "
          + ", ".join(f"{p} {t:.0f} s" for p, t in firsts.items()))
    print(format_table(results, gemm_tflops=gemm))
    config = {"total_tokens": args.total_tokens, "hidden": args.hidden, "dtype": args.dtype,
              "timer": timer_name(), "warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms,
              "spin_up_s": SPIN_UP_S,
              "check": f"batch 0, heads 0..{CHECK_HEADS - 1}, float64 reference, tol = 2 x "
                       f"same-dtype PyTorch error + {ATOL[args.dtype]:.1e}",
              "providers": {p.name: PROVIDER_LABELS.get(p.name, p.name) for p in providers},
              "wall_s": round(wall_s, 1)}
    record = make_record(results, gemm=gemm, gpu_name=g.name, arch=arch, command=command,
                         config=config, label=args.label)
    if not args.no_save:
        path = Path(args.json) if args.json else default_record_path(record)
        save_record(record, path)
        print(f"record saved: {path}")
    if args.plot:
        try:
            from fa4lab.viz.bench import plot_throughput

            fig = plot_throughput(record)
            fig.savefig(args.plot, dpi=110, bbox_inches="tight")
            print(f"plot saved: {args.plot}")
        except Exception as err:   # the record is saved; a plot can be drawn from it later
            print(f"plot not saved: {type(err).__name__}: {_short(err)}", file=sys.stderr)
    bad = [r for r in results if r.status in (FAILED, ERROR)]
    if bad:
        print(f"{len(bad)} runs failed their check or raised (see 'not measured' above).")
    return 1 if (args.strict and bad) else 0


def main(argv: list[str] | None = None) -> int:
    """`python -m fa4lab.bench ...` (the same as `fa4lab bench ...`)."""
    parser = argparse.ArgumentParser(prog="fa4lab")
    add_cli(parser.add_subparsers(dest="command", required=True))
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(["bench"] + argv)
    args.argv = argv
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "BenchShape", "PlanMeasurement", "Provider", "Result", "TableRow", "compile_anywhere",
    "compile_plan",
    "format_table", "gemm_tflops", "geomean_ratios", "latest_record", "load_record",
    "load_records", "make_record", "measure_plan", "measure_shape", "ratio_table",
    "recorded_tflops", "resolve_providers", "run_sweep", "save_record", "sdpa_runner",
    "shape_for", "simulated_tflops", "sweep", "validate_record",
]
