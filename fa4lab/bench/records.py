"""Bench records: one JSON file per run in `benchmarks/`, its schema, and what it says.

Five families of record share the header (schema, kind, label, date, gpu, commit, versions,
command, config): throughput records ("measured", "reference-peers") hold one `Result` per
(provider, shape) and the GEMM ceiling; "host-overhead" records hold one `HostResult` per
provider; "decode" records (`fa4lab bench --decode`) hold one `DecodeResult` per (provider,
shape) and the memory bandwidth the HBM floor was computed from; "features" records
(`fa4lab bench --features`) hold one `FeatureResult` per (feature, provider); "neighbours"
records (`fa4lab bench --neighbours`) one `NeighbourResult` per plan of one shape; "serving"
records (`fa4lab bench --serving`) one `ServingResult` per (case, provider) and the memory
bandwidth, as "decode" records do; "training" records (`fa4lab bench --training`) one
`TrainingResult` (a loss curve) per attention and the verdict that compares them. The format is
described in benchmarks/README.md.

This module imports nothing heavier than the standard library (and no `fa4lab.plan`): the
bench hands what it reads to the planner (`sweep_figures`, `fa4lab.bench.calibration`).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import re
import subprocess
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import fa4lab

# Status of one (provider, shape) cell. "skipped": the provider is here but was not run, and
# the note says why (it cannot express the feature, or the run's time budget was spent).
OK, FAILED, ERROR, MISSING, SKIPPED = "ok", "failed", "error", "missing", "skipped"
STATUSES = (OK, FAILED, ERROR, MISSING, SKIPPED)

SCHEMA = "fa4lab.bench/1"
HOST_OVERHEAD = "host-overhead"
DECODE = "decode"
FEATURES = "features"
NEIGHBOURS = "neighbours"
SERVING = "serving"
TRAINING = "training"
THROUGHPUT_KINDS = ("measured", "reference-peers")
RECORD_KINDS = THROUGHPUT_KINDS + (HOST_OVERHEAD, DECODE, FEATURES, NEIGHBOURS, SERVING,
                                   TRAINING)

from fa4lab.paths import BENCHMARKS_DIR  # noqa: E402  (re-exported: records live there)

_REPO = BENCHMARKS_DIR.parent


class _Row:
    """A row of a record: its status is one of STATUSES."""

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r} is not one of {STATUSES}")


@dataclass
class Result(_Row):
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

    @property
    def key(self) -> tuple[int, bool, int]:
        return (self.head_dim, self.causal, self.seqlen)

    @classmethod
    def for_shape(cls, provider: str, shape, **kw) -> Result:
        """The result of `provider` on a `BenchShape`."""
        return cls(provider, shape.head_dim, shape.seqlen, shape.causal, shape.batch,
                   shape.heads, shape.dtype, **kw)

    @classmethod
    def from_dict(cls, d: dict) -> Result:
        return _from_dict(cls, d, ("provider", "head_dim", "seqlen", "causal", "batch", "heads",
                                   "status"))


@dataclass
class HostResult(_Row):
    """One provider's host time per call on one case (`fa4lab bench --host-overhead`: a dense
    call, or a varlen / paged call at one batch). The times are None unless status == 'ok'."""

    provider: str
    status: str = OK
    mean_us: float | None = None      # all timed calls: issue time / (calls x repeats)
    median_us: float | None = None    # median over the repeats of each repeat's mean
    repeats_us: list[float] = field(default_factory=list)   # each repeat's mean
    note: str = ""
    case: str = "dense"               # "dense", "varlen b32", "paged b256" (HostCase.name)
    shape: str = ""                   # the case's shape, as the table shows it

    @classmethod
    def from_dict(cls, d: dict) -> HostResult:
        return _from_dict(cls, d, ("provider", "status"))


@dataclass
class DecodeResult(_Row):
    """One provider on one GQA shape of `fa4lab bench --decode`. The times and rates are None
    unless status == 'ok'; x_floor also when no bandwidth was measured."""

    provider: str
    shape: str              # "decode" or "prefill": which of the mode's shapes
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    causal: bool
    dtype: str = "bf16"
    status: str = OK
    us: float | None = None          # median microseconds per call
    x_floor: float | None = None     # us / floor_us: 1.0 is the HBM floor
    floor_us: float | None = None    # hbm_bytes at the run's measured bandwidth
    hbm_bytes: int | None = None     # bytes the call must move: K and V once, q and out
    gbps: float | None = None        # hbm_bytes / us, GB/s (1e9 bytes)
    tflops: float | None = None      # AttentionSpec.flops() / us
    max_err: float | None = None     # the check before timing, as in Result
    tol: float | None = None
    first_call_s: float | None = None
    note: str = ""

    @classmethod
    def from_dict(cls, d: dict) -> DecodeResult:
        return _from_dict(cls, d, ("provider", "shape", "batch", "seqlen_q", "seqlen_k",
                                   "heads_q", "heads_kv", "head_dim", "causal", "status"))


@dataclass
class ServingResult(_Row):
    """One provider on one case of `fa4lab bench --serving` (a varlen prefill, a paged decode
    at one page size, a split-KV decode at one batch). The times and rates are None unless
    status == 'ok'; x_floor also when no bandwidth was measured. The case's lengths are in the
    record's config."""

    provider: str
    scenario: str           # "varlen-prefill", "paged-decode", "splitkv-decode", "paged-prefill"
    case: str               # e.g. "paged-decode p16", "splitkv-decode b2"
    batch: int              # sequences
    heads_q: int
    heads_kv: int
    head_dim: int
    causal: bool
    total_q: int            # query rows of all sequences
    total_k: int            # keys all sequences attend to (seqused_k applied)
    max_seqlen_k: int
    page_size: int | None = None     # paged-decode only
    dtype: str = "bf16"
    status: str = OK
    us: float | None = None          # median microseconds per call
    x_floor: float | None = None     # us / floor_us: 1.0 is the HBM floor
    floor_us: float | None = None    # hbm_bytes at the run's measured bandwidth
    hbm_bytes: int | None = None     # K/V attended once, q and out once
    gbps: float | None = None        # hbm_bytes / us, GB/s (1e9 bytes)
    tflops: float | None = None      # flops / us
    flops: float | None = None       # 2 x (head_dim + head_dim_v) x visible pairs x heads_q
    max_err: float | None = None     # the check before timing, as in Result
    tol: float | None = None
    first_call_s: float | None = None
    note: str = ""

    @classmethod
    def from_dict(cls, d: dict) -> ServingResult:
        return _from_dict(cls, d, ("provider", "scenario", "case", "batch", "heads_q",
                                   "heads_kv", "head_dim", "causal", "total_q", "total_k",
                                   "max_seqlen_k", "status"))


@dataclass
class FeatureResult(_Row):
    """One provider on one feature of `fa4lab bench --features` (one attention option at the
    mode's shape). us/tflops are None unless status == 'ok'; tflops counts only the visible
    (query, key) pairs (Note [visible FLOPs] in `fa4lab.bench.features`)."""

    provider: str
    feature: str            # e.g. "window-1024-0": `fa4lab.bench.features.ALL_FEATURES` names
    batch: int
    seqlen: int
    heads: int
    head_dim: int
    causal: bool
    dtype: str = "bf16"
    status: str = OK
    us: float | None = None          # median microseconds per call
    tflops: float | None = None      # flops / us
    flops: float | None = None       # 2 (head_dim + head_dim_v) batch heads visible pairs
    max_err: float | None = None     # the check before timing, as in Result
    tol: float | None = None
    first_call_s: float | None = None   # first call: compile, mask/block-mask building, check
    note: str = ""
    heads_kv: int | None = None      # None (records before GQA features): heads
    head_dim_v: int | None = None    # None: head_dim

    def shape_label(self) -> str:
        """e.g. "b4 s4096 h64/8 hd64", "b4 s4096 h16/16 hd(192, 128)"."""
        dv = self.head_dim_v or self.head_dim
        hd = f"hd{self.head_dim}" if dv == self.head_dim else f"hd({self.head_dim}, {dv})"
        return f"b{self.batch} s{self.seqlen} h{self.heads}/{self.heads_kv or self.heads} {hd}"

    @classmethod
    def from_dict(cls, d: dict) -> FeatureResult:
        return _from_dict(cls, d, ("provider", "feature", "batch", "seqlen", "heads",
                                   "head_dim", "causal", "status"))


@dataclass
class NeighbourResult(_Row):
    """One sm90/sm100 plan (tile overrides) on the one shape of `fa4lab bench --neighbours`.
    ms/tflops are None unless status == 'ok'; `default` marks the plan fa4lab ships."""

    n_block: int
    kv_stage: int
    q_stage: int
    default: bool
    head_dim: int
    seqlen: int
    causal: bool
    batch: int
    heads: int
    dtype: str = "bf16"
    provider: str = "fa4lab"
    status: str = OK
    ms: float | None = None
    tflops: float | None = None
    max_err: float | None = None
    tol: float | None = None
    first_call_s: float | None = None   # compile + first call
    note: str = ""

    @property
    def overrides(self) -> dict[str, int]:
        return {"n_block": self.n_block, "kv_stage": self.kv_stage, "q_stage": self.q_stage}

    @classmethod
    def from_dict(cls, d: dict) -> NeighbourResult:
        return _from_dict(cls, d, ("n_block", "kv_stage", "q_stage", "default", "head_dim",
                                   "seqlen", "causal", "batch", "heads", "status"))


@dataclass
class TrainingResult(_Row):
    """One attention's run of `fa4lab bench --training` (`fa4lab.bench.training`): the loss at
    every step. losses and the times are empty / None unless status == 'ok'."""

    provider: str           # "fa4lab", "sdpa", "sdpa-wide" (`fa4lab.bench.training.ATTENTIONS`)
    status: str = OK
    losses: list[float] = field(default_factory=list)   # the training loss of each step
    ms_per_step: float | None = None   # wall time of the steps after the first, synchronized
    first_step_s: float | None = None  # the first step (compiles included)
    note: str = ""

    @classmethod
    def from_dict(cls, d: dict) -> TrainingResult:
        return _from_dict(cls, d, ("provider", "status"))


def _from_dict(cls, d: dict, required: tuple[str, ...]):
    if not isinstance(d, dict):
        raise ValueError(f"a result is a JSON object, got {d!r}")
    missing = [n for n in required if n not in d]
    if missing:
        raise ValueError(f"result {d} lacks {missing}")
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in names})


REQUIRED_RECORD_KEYS = ("schema", "kind", "label", "date", "gpu", "commit", "versions", "command",
                        "config", "gemm_tflops", "results")
# A host-overhead run measures no GEMM ceiling; a decode run measures the memory bandwidth
# instead (hbm_gbps: GB/s of a device-to-device copy, read + write; null if not measured).
HOST_RECORD_KEYS = tuple(k for k in REQUIRED_RECORD_KEYS if k != "gemm_tflops")
DECODE_RECORD_KEYS = HOST_RECORD_KEYS + ("hbm_gbps",)
# A features run measures neither: its rows are read against each other.
FEATURES_RECORD_KEYS = HOST_RECORD_KEYS
# A training run's rows are loss curves, read through the verdict that compares them.
TRAINING_RECORD_KEYS = HOST_RECORD_KEYS + ("verdict",)
# Each kind's row type and the time it must carry when ok (throughput rows: tflops).
_ROWS = {HOST_OVERHEAD: (HostResult, "mean_us"), DECODE: (DecodeResult, "us"),
         FEATURES: (FeatureResult, "us"), NEIGHBOURS: (NeighbourResult, "ms"),
         SERVING: (ServingResult, "us"), TRAINING: (TrainingResult, "ms_per_step")}
_READERS = {HOST_OVERHEAD: "host_results_of", DECODE: "decode_results_of",
            FEATURES: "feature_results_of", NEIGHBOURS: "neighbour_results_of",
            SERVING: "serving_results_of", TRAINING: "training_results_of"}


def make_floor_record(kind: str, results, *, hbm_gbps: float | None, gpu_name: str,
                      arch: str | None, command: str, config: dict, label: str,
                      notes: str = "") -> dict:
    """A validated record of `kind` ("decode", "serving": rows measured against an HBM floor)
    holding `results` (dataclass rows) and the run's copy bandwidth `hbm_gbps`."""
    record = record_header(kind, gpu_name=gpu_name, arch=arch, command=command, config=config,
                           label=label, notes=notes)
    record["hbm_gbps"] = hbm_gbps
    record["results"] = [asdict(r) for r in results]
    return validate_record(record)


def validate_record(record: dict) -> dict:
    """Check a record's keys and values; return it. A bad record is a ValueError naming why."""
    if not isinstance(record, dict):
        raise ValueError(f"a bench record is a JSON object, got {type(record).__name__}")
    required = {HOST_OVERHEAD: HOST_RECORD_KEYS, DECODE: DECODE_RECORD_KEYS,
                FEATURES: FEATURES_RECORD_KEYS, NEIGHBOURS: FEATURES_RECORD_KEYS,
                SERVING: DECODE_RECORD_KEYS, TRAINING: TRAINING_RECORD_KEYS}.get(
        record.get("kind"), REQUIRED_RECORD_KEYS)
    missing = [k for k in required if k not in record]
    if missing:
        raise ValueError(f"bench record lacks {missing} (see benchmarks/README.md, 'Record "
                         f"format')")
    if record["schema"] != SCHEMA:
        raise ValueError(f"bench record schema {record['schema']!r}; this fa4lab reads {SCHEMA!r}")
    if record["kind"] not in RECORD_KINDS:
        raise ValueError(f"bench record kind {record['kind']!r} is not one of {RECORD_KINDS}")
    row, time_field = _ROWS.get(record["kind"], (Result, "tflops"))
    for r in record["results"]:
        res = row.from_dict(r)
        value = getattr(res, time_field)
        if res.status == OK and (value is None or not value > 0):
            raise ValueError(f"result {r} has status ok but no positive {time_field}")
    if record["kind"] == TRAINING:
        _validate_training(record)
    return record


def _validate_training(record: dict) -> None:
    """Each ok curve holds config.steps finite losses; the verdict says within_noise and why."""
    steps = record["config"].get("steps") if isinstance(record["config"], dict) else None
    for r in map(TrainingResult.from_dict, record["results"]):
        if r.status == OK and (len(r.losses) != steps or not all(
                isinstance(x, (int, float)) and math.isfinite(x) for x in r.losses)):
            raise ValueError(f"{r.provider}'s curve: {len(r.losses)} losses, config.steps = "
                             f"{steps}, each a finite number")
    v = record["verdict"]
    if not (isinstance(v, dict) and isinstance(v.get("within_noise"), bool) and v.get("rule")):
        raise ValueError(f"a training record's verdict says within_noise (true or false) and "
                         f"the rule it applied, got {v!r}")


def _rows_of(record: dict, kind: str | None, reader: str):
    """The rows of `record`, which must be of `kind` (None: a throughput kind)."""
    have = record.get("kind")
    if (have in _ROWS) if kind is None else (have != kind):
        what = {HOST_OVERHEAD: "host times", DECODE: "GQA shapes against the HBM floor",
                FEATURES: "attention features",
                NEIGHBOURS: "neighbouring plans of one shape",
                SERVING: "serving cases against FA4 and the HBM floor",
                TRAINING: "loss curves of one training run per attention"}.get(
                    have, "the throughput sweep")
        right = _READERS.get(have, "results_of")
        raise ValueError(f"a {have!r} record holds {what}, not what {reader} reads: read it "
                         f"with {right}")
    row = _ROWS[kind][0] if kind else Result
    return [row.from_dict(r) for r in record["results"]]


def results_of(record: dict) -> list[Result]:
    """The throughput results of a "measured" or "reference-peers" record."""
    return _rows_of(record, None, "results_of")


def host_results_of(record: dict) -> list[HostResult]:
    """The results of a "host-overhead" record (`fa4lab bench --host-overhead`)."""
    return _rows_of(record, HOST_OVERHEAD, "host_results_of")


def decode_results_of(record: dict) -> list[DecodeResult]:
    """The results of a "decode" record (`fa4lab bench --decode`)."""
    return _rows_of(record, DECODE, "decode_results_of")


def feature_results_of(record: dict) -> list[FeatureResult]:
    """The results of a "features" record (`fa4lab bench --features`)."""
    return _rows_of(record, FEATURES, "feature_results_of")


def neighbour_results_of(record: dict) -> list[NeighbourResult]:
    """The results of a "neighbours" record (`fa4lab bench --neighbours`)."""
    return _rows_of(record, NEIGHBOURS, "neighbour_results_of")


def serving_results_of(record: dict) -> list[ServingResult]:
    """The results of a "serving" record (`fa4lab bench --serving`)."""
    return _rows_of(record, SERVING, "serving_results_of")


def training_results_of(record: dict) -> list[TrainingResult]:
    """The loss curves of a "training" record (`fa4lab bench --training`)."""
    return _rows_of(record, TRAINING, "training_results_of")


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


def load_records(directory: str | os.PathLike | None = None, *,
                 kinds: Sequence[str] | None = THROUGHPUT_KINDS) -> list[dict]:
    """The `*.json` records of the given kinds (default: throughput; None: all) in `directory`
    (default: the repository's benchmarks/), oldest first (by date, time of day where recorded,
    file name). Every file is validated: an unreadable record is an error naming the file."""
    directory = BENCHMARKS_DIR if directory is None else Path(directory)
    if not directory.is_dir():
        return []
    records = [load_record(p) for p in sorted(directory.glob("*.json"))]
    if kinds is not None:
        records = [r for r in records if r["kind"] in kinds]
    return sorted(records, key=lambda r: (r["date"], r.get("time_utc") or "",
                                          Path(r["path"]).name))


def recorded_tflops(record: dict | None, key: tuple[int, bool, int]) -> dict[str, float]:
    """{provider: TFLOP/s} of the record's 'ok' results at key = (head_dim, causal, seqlen)."""
    if not record:
        return {}
    return {r.provider: r.tflops for r in results_of(record) if r.key == key and r.status == OK}


def sweep_figures(plan) -> dict:
    """MEASURED H200 numbers for the benchmark sweep's shape at this plan's (head_dim, causal,
    seqlen), from the newest record: what `fa4lab.plan.report.build_report(recorded=...)`
    shows beside its prediction ({} where no record has the problem)."""
    s = plan.spec
    if plan.arch != "sm90" or s.window_size != (None, None) or s.softcap or s.learnable_sink:
        return {}   # the sweep runs no window, softcap or sink: no record of this problem
    try:
        rec = latest_record(load_records(), gpu="H200")
    except Exception:   # records are optional; a broken one is reported by `fa4lab bench`
        return {}
    if not rec:
        return {}
    found = recorded_tflops(rec, (s.head_dim, s.causal, s.seqlen_q))
    return {"label": f"MEASURED on {rec['gpu']} ({rec['date']}), sweep shape at this seqlen",
            "tflops": found, "gemm_tflops": rec.get("gemm_tflops"),
            "record": rec.get("label", "")}


def latest_record(records: Sequence[dict], *, gpu: str | None = None,
                  provider: str | None = None) -> dict | None:
    """The newest record whose GPU name contains `gpu` and, if given, that has at least one
    'ok' result for `provider`."""
    for rec in reversed(list(records)):
        if gpu and gpu.lower() not in str(rec["gpu"]).lower():
            continue
        if provider and not any(r.provider == provider and r.status == OK
                                for r in _any_results(rec)):
            continue
        return rec
    return None


def latest_summary(kind: str, title: str, body, directory=None) -> str:
    """The newest record of `kind` as text (what each mode prints on a CPU): "latest recorded
    <title>: <file>" and the lines `body(record)` gives; or why there is none."""
    try:
        records = load_records(directory, kinds=(kind,))
    except ValueError as err:
        return f"could not read the recorded results: {err}"
    rec = latest_record(records)
    if rec is None:
        return f"no recorded {kind} results in {directory or 'benchmarks/'}"
    return "\n".join([f"latest recorded {title}: {Path(rec['path']).name}", *body(rec)])


def _any_results(record: dict):
    return _rows_of(record, record["kind"] if record["kind"] in _ROWS else None, "a record")


# ---- record metadata -------------------------------------------------------------------------
def git_commit(repo: Path | None = None) -> str | None:
    """`git rev-parse HEAD` of the repository fa4lab runs from ('+dirty' when it has changes).

    FA4LAB_COMMIT, when set, names the commit instead: a copy shipped to a GPU host may carry
    a stale or no git directory, and whoever copied it knows what it is. Otherwise None."""
    repo = repo or _REPO
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


def package_version(dist: str) -> str | None:
    """The installed version of a distribution, or None."""
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:
        return None


def versions() -> dict[str, str | None]:
    v = {"python": platform.python_version(), "torch": package_version("torch"),
         "triton": package_version("triton"), "cutlass-dsl": package_version("nvidia-cutlass-dsl"),
         "flash-attn-4": package_version("flash-attn-4"), "fa4lab": fa4lab.__version__,
         "apache-tvm-ffi": package_version("apache-tvm-ffi")}
    try:
        import torch

        v["cuda"] = torch.version.cuda
        v["cudnn"] = str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() \
            else None
    except Exception:
        pass
    return v


def record_header(kind: str, *, gpu_name: str, arch: str | None, command: str, config: dict,
                  label: str | None = None, notes: str = "") -> dict:
    """The keys every record has, stamped now; the caller adds "results" (and the GEMM)."""
    now = _dt.datetime.now(_dt.timezone.utc)
    return {
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
        "notes": notes,
    }


def make_record(results: Sequence[Result], *, gemm: float | None, gpu_name: str,
                arch: str | None, command: str, config: dict, label: str | None = None,
                kind: str = "measured", notes: str = "") -> dict:
    """A validated throughput record of `results`."""
    record = record_header(kind, gpu_name=gpu_name, arch=arch, command=command, config=config,
                           label=label, notes=notes)
    record["gemm_tflops"] = gemm
    record["results"] = [asdict(r) for r in results]
    return validate_record(record)


def default_record_path(record: dict) -> Path:
    """benchmarks/<date>_<gpu>_<commit>_<time>[_<kind>].json: sorts by date, never overwrites.
    Throughput records carry no kind in the name; the others end in their kind
    (_host-overhead, _decode, _features, _neighbours, _serving, _training)."""
    gpu = re.sub(r"[^a-z0-9]+", "-", str(record["gpu"]).lower()).strip("-") or "gpu"
    commit = (record.get("commit") or "nocommit")[:7]
    stamp = str(record.get("time_utc", "")).replace(":", "")
    suffix = f"_{record['kind']}" if record["kind"] in _ROWS else ""
    return BENCHMARKS_DIR / f"{record['date']}_{gpu}_{commit}_{stamp}{suffix}.json"
