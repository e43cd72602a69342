"""Bench records: one JSON file per run in `benchmarks/`, its schema, and what it says.

Six families of record share the header (schema, kind, label, date, gpu, commit, versions,
command, config): throughput records ("measured", "reference-peers") hold one `Result` per
(provider, shape) and the GEMM ceiling; "host-overhead" records hold one `HostResult` per
provider; "decode" records (`fa4lab bench --decode`) hold one `DecodeResult` per (provider,
shape) and the memory bandwidth the HBM floor was computed from; "features" records
(`fa4lab bench --features`) hold one `FeatureResult` per (feature, provider); "neighbours"
records (`fa4lab bench --neighbours`) one `NeighbourResult` per plan of one shape; "serving"
records (`fa4lab bench --serving`) one `ServingResult` per (case, provider) and the memory
bandwidth, as "decode" records do; "backward" records (`fa4lab bench --backward`) one `Result`
per (provider, shape), as throughput records, TFLOP/s of the backward and no GEMM ceiling;
"training" records (`fa4lab bench --training`) one `TrainingResult` (a loss curve) per attention
and the verdict that compares them. The format is described in benchmarks/README.md.

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
from dataclasses import asdict
from pathlib import Path

import fa4lab
from fa4lab.bench.results import (  # noqa: F401  (re-exported: the rows of a record)
    ERROR,
    FAILED,
    MISSING,
    OK,
    SKIPPED,
    STATUSES,
    DecodeResult,
    FeatureResult,
    HostResult,
    NeighbourResult,
    Result,
    ServingResult,
    TrainingResult,
)

SCHEMA = "fa4lab.bench/1"
HOST_OVERHEAD = "host-overhead"
DECODE = "decode"
FEATURES = "features"
NEIGHBOURS = "neighbours"
SERVING = "serving"
BACKWARD = "backward"
TRAINING = "training"
THROUGHPUT_KINDS = ("measured", "reference-peers")
RECORD_KINDS = THROUGHPUT_KINDS + (HOST_OVERHEAD, DECODE, FEATURES, NEIGHBOURS, SERVING,
                                   BACKWARD, TRAINING)

from fa4lab.paths import BENCHMARKS_DIR  # noqa: E402  (re-exported: records live there)

_REPO = BENCHMARKS_DIR.parent


REQUIRED_RECORD_KEYS = ("schema", "kind", "label", "date", "gpu", "commit", "versions", "command",
                        "config", "gemm_tflops", "results")
# A host-overhead run measures no GEMM ceiling; a decode run measures the memory bandwidth
# instead (hbm_gbps: GB/s of a device-to-device copy, read + write; null if not measured).
HOST_RECORD_KEYS = tuple(k for k in REQUIRED_RECORD_KEYS if k != "gemm_tflops")
DECODE_RECORD_KEYS = HOST_RECORD_KEYS + ("hbm_gbps",)
# A features run measures neither: its rows are read against each other; nor does a backward run.
FEATURES_RECORD_KEYS = HOST_RECORD_KEYS
# A training run's rows are loss curves, read through the verdict that compares them.
TRAINING_RECORD_KEYS = HOST_RECORD_KEYS + ("verdict",)
# Each kind's row type and the time it must carry when ok (throughput rows: tflops).
_ROWS = {HOST_OVERHEAD: (HostResult, "mean_us"), DECODE: (DecodeResult, "us"),
         FEATURES: (FeatureResult, "us"), NEIGHBOURS: (NeighbourResult, "ms"),
         SERVING: (ServingResult, "us"), BACKWARD: (Result, "tflops"),
         TRAINING: (TrainingResult, "ms_per_step")}
_READERS = {HOST_OVERHEAD: "host_results_of", DECODE: "decode_results_of",
            FEATURES: "feature_results_of", NEIGHBOURS: "neighbour_results_of",
            SERVING: "serving_results_of", BACKWARD: "backward_results_of",
            TRAINING: "training_results_of"}


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
                SERVING: DECODE_RECORD_KEYS, BACKWARD: FEATURES_RECORD_KEYS,
                TRAINING: TRAINING_RECORD_KEYS}.get(
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
                BACKWARD: "the attention backward's throughput",
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


def backward_results_of(record: dict) -> list[Result]:
    """The results of a "backward" record (`fa4lab bench --backward`): TFLOP/s of the backward."""
    return _rows_of(record, BACKWARD, "backward_results_of")


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
    (_host-overhead, _decode, _features, _neighbours, _serving, _backward, _training)."""
    gpu = re.sub(r"[^a-z0-9]+", "-", str(record["gpu"]).lower()).strip("-") or "gpu"
    commit = (record.get("commit") or "nocommit")[:7]
    stamp = str(record.get("time_utc", "")).replace(":", "")
    suffix = f"_{record['kind']}" if record["kind"] in _ROWS else ""
    return BENCHMARKS_DIR / f"{record['date']}_{gpu}_{commit}_{stamp}{suffix}.json"
