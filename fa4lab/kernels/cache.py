"""Compiled kernels on disk, shared by every process of this user: compile once, load in ms.

    fa4lab cache info       # where, how many kernels, how big, which are stale
    fa4lab cache clear

A kernel is stored under `<root>/<fingerprint>/<key>.so` (`root`: FA4LAB_CACHE_DIR, else
$XDG_CACHE_HOME/fa4lab/kernels, else ~/.cache/fa4lab/kernels). The fingerprint hashes what
every kernel depends on besides its configuration: fa4lab's version and the sources of the
modules that plan and build kernels, the CuTe DSL and TVM-FFI versions, the Python version and
the machine. The key hashes what one kernel bakes in: for `fa4lab.attention`, the call's
`fa4lab.plan.key.KernelKey` (its `disk_key`: arch, head dims, dtype, causal, GQA ratio, LSE,
pack-GQA, softcap on or off, a window's sides, a learnable sink or not, persistence, layout),
from which the sources derive the plan; for any other plan,
the plan itself (`plan_key`). Never the values the kernel takes at run time: sizes, the scale,
the cap, the window's sizes, the sink's logits. Any change to either gives
a new file name, so a stale kernel is never loaded; `fa4lab cache info` lists the folders of
old fingerprints and `clear` removes them.

Concurrent processes are safe: a process that misses takes an exclusive `flock` on the entry's
lock file, looks again (another process may have just written it), compiles, and publishes
with an atomic rename; readers only ever see complete files. FA4LAB_CACHE=0 turns the disk
cache off (every process compiles).

Loading: the exported object is linked into a shared library when a C compiler is present, and
`tvm_ffi.load_module` loads it without importing the CuTe DSL (milliseconds); otherwise the
object file is loaded through the DSL (`cute.runtime.load_module`).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import fa4lab
from fa4lab.digest import digest

# The modules whose source a compiled kernel depends on (relative to the fa4lab package).
SOURCES = ("kernels", "plan", "tiling.py", "scheduling.py", "limits.py", "spec.py", "hardware.py",
           "errors.py", "online_softmax.py", "splitkv.py")
EXPORT_NAME = "fa4lab_fwd"
LOCK_TIMEOUT_S = 600.0   # a compile takes seconds; a holder that long is stuck


def enabled() -> bool:
    return os.environ.get("FA4LAB_CACHE", "1").strip() not in ("0", "off", "false", "no")


def cache_root() -> Path:
    env = os.environ.get("FA4LAB_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "fa4lab" / "kernels"


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "none"


@cache
def fingerprint() -> str:
    """What every cached kernel depends on besides its configuration, hashed (16 hex digits)."""
    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    versions = [f"fa4lab={fa4lab.__version__}", f"cutlass-dsl={_version('nvidia-cutlass-dsl')}",
                f"tvm-ffi={_version('apache-tvm-ffi')}", f"python={sys.version_info[:2]}",
                f"machine={platform.machine()}",
                f"dsl-at={spec.submodule_search_locations[0] if spec else None}"]
    return fingerprint_of(Path(fa4lab.__file__).parent, versions)


def fingerprint_of(package: Path, versions: list[str]) -> str:
    """The hash of `versions` and of the `SOURCES` under `package` (paths and contents)."""
    h = hashlib.sha256("\n".join(versions).encode())
    for name in SOURCES:
        root = package / name
        for src in sorted(root.rglob("*.py")) if root.is_dir() else [root]:
            h.update(src.relative_to(package).as_posix().encode())
            h.update(src.read_bytes())
    return h.hexdigest()[:16]


def plan_key(plan) -> str:
    """The key of `plan`'s kernel: the plan without what the kernel takes at run time (batch,
    sequence lengths, head counts, the softmax scale, the cap's value and the window's sizes:
    Note [runtime scale] and Note [runtime window] in fa4lab.kernels.compile)."""
    d = plan.to_dict()
    spec = d["spec"]
    for size in ("batch", "seqlen_q", "seqlen_k", "heads_q", "heads_kv", "softmax_scale",
                 "softcap", "window_size"):
        spec.pop(size, None)
    spec["qhead_per_kvhead"] = plan.spec.qhead_per_kvhead
    spec["capped"] = bool(plan.spec.softcap)
    spec["window_sides"] = [side is not None for side in plan.spec.window_size]
    d.pop("derived", None)
    return "plan-" + digest(json.dumps(d, sort_keys=True, default=str))


class _FileLock:
    """An exclusive advisory lock on `path` (flock), waiting at most `timeout` seconds."""

    def __init__(self, path: Path, timeout: float = LOCK_TIMEOUT_S):
        self.path, self.timeout, self.fd = path, timeout, -1

    def __enter__(self):
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o666)
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(self.fd)
                    raise TimeoutError(
                        f"waited {self.timeout:.0f} s for {self.path}, held by another process "
                        f"compiling the same kernel; if none is running, delete the file "
                        f"(or run `fa4lab cache clear`)") from None
                time.sleep(0.05)

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _load(path: Path):
    if path.suffix == ".so":
        import tvm_ffi

        return getattr(tvm_ffi.load_module(str(path)), EXPORT_NAME)
    import cutlass.cute as cute

    return getattr(cute.runtime.load_module(str(path), enable_tvm_ffi=True), EXPORT_NAME)


def _link(obj: Path, out: Path) -> bool:
    """Link the exported object into a shared library that finds the DSL's runtime libraries
    itself (rpath), so loading it needs no DSL import. False where no C compiler works."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        return False
    import cutlass.cute as cute

    libs = cute.runtime.find_runtime_libraries(enable_tvm_ffi=True)
    flags = [x for lib in libs for x in (lib, f"-Wl,-rpath,{Path(lib).parent}")]
    try:
        done = subprocess.run([compiler, "-shared", "-o", str(out), str(obj), *flags],
                              capture_output=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0 and out.exists()


def _entry(key: str) -> tuple[Path, list[Path]]:
    folder = cache_root() / fingerprint()
    return folder, [folder / f"{key}.so", folder / f"{key}.o"]


def _try_load(paths: list[Path]):
    for path in paths:
        if path.exists():
            try:
                return _load(path)
            except Exception:
                path.unlink(missing_ok=True)   # unreadable or from a moved install: rebuild
    return None


def load_or_compile(key: str, compile_fn, describe: str = ""):
    """The kernel stored under `key` (a file name: `plan_key`, or the launch path's key of a
    default plan): loaded from disk, or `compile_fn()` -> compiled function, exported and
    published. Returns (callable, "loaded" | "compiled", seconds spent)."""
    t0 = time.perf_counter()
    if not enabled():
        return compile_fn(), "compiled", time.perf_counter() - t0
    folder, paths = _entry(key)
    fn = _try_load(paths)
    if fn is not None:
        return fn, "loaded", time.perf_counter() - t0
    folder.mkdir(parents=True, exist_ok=True)
    with _FileLock(folder / f"{key}.lock"):
        fn = _try_load(paths)            # another process may have published it meanwhile
        if fn is not None:
            return fn, "loaded", time.perf_counter() - t0
        compiled = compile_fn()
        seconds = time.perf_counter() - t0
        _publish(compiled, folder, key, describe, seconds)
    return compiled, "compiled", time.perf_counter() - t0


def _publish(compiled, folder: Path, key: str, describe: str, seconds: float) -> None:
    """Export, link and rename into place: readers see a complete file or none."""
    tmp = f".{key}.{os.getpid()}"
    obj, so, meta = folder / f"{tmp}.o", folder / f"{tmp}.so", folder / f"{tmp}.json"
    try:
        compiled.export_to_c(str(obj), EXPORT_NAME)
        if _link(obj, so):
            os.replace(so, folder / f"{key}.so")
        else:
            os.replace(obj, folder / f"{key}.o")
        meta.write_text(json.dumps({"kernel": describe, "compile_s": round(seconds, 2),
                                    "created": time.strftime("%Y-%m-%d %H:%M:%S")}))
        os.replace(meta, folder / f"{key}.json")
    finally:
        for leftover in (obj, so, meta):
            leftover.unlink(missing_ok=True)


@dataclass(frozen=True)
class CacheInfo:
    root: Path
    fingerprint: str
    kernels: list[dict]          # current fingerprint: {"file", "bytes", "kernel", ...}
    stale_folders: list[Path]    # folders of other fingerprints (old sources or versions)
    total_bytes: int

    def format(self) -> str:
        lines = [f"fa4lab kernel cache: {self.root}",
                 f"  {'on' if enabled() else 'OFF (FA4LAB_CACHE=0)'}; fingerprint "
                 f"{self.fingerprint} (fa4lab {fa4lab.__version__}, CuTe DSL "
                 f"{_version('nvidia-cutlass-dsl')}, TVM-FFI {_version('apache-tvm-ffi')})",
                 f"  {len(self.kernels)} kernel(s) for this fingerprint, "
                 f"{len(self.stale_folders)} stale folder(s), {self.total_bytes / 1e6:.1f} MB "
                 f"in all"]
        for k in self.kernels:
            lines.append(f"    {k['file']:<30} {k['bytes'] / 1e3:7.0f} kB  {k.get('kernel', '')}"
                         f"  (compiled in {k.get('compile_s', '?')} s, {k.get('created', '?')})")
        if self.stale_folders:
            lines.append("  stale (other sources or versions; `fa4lab cache clear` removes them): "
                         + ", ".join(p.name for p in self.stale_folders))
        return "\n".join(lines)


def info() -> CacheInfo:
    root, current = cache_root(), fingerprint()
    kernels, stale, total = [], [], 0
    if root.is_dir():
        for folder in sorted(p for p in root.iterdir() if p.is_dir()):
            size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
            total += size
            if folder.name != current:
                stale.append(folder)
                continue
            for f in sorted(folder.iterdir()):
                if f.suffix in (".so", ".o") and not f.name.startswith("."):
                    meta_path = f.with_suffix(".json")
                    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
                    kernels.append({"file": f.name, "bytes": f.stat().st_size, **meta})
    return CacheInfo(root, current, kernels, stale, total)


def clear() -> int:
    """Remove every cached kernel (all fingerprints); returns the number of files removed."""
    root = cache_root()
    if not root.is_dir():
        return 0
    n = sum(1 for f in root.rglob("*") if f.is_file())
    shutil.rmtree(root)
    return n


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("cache", help="the compiled-kernel cache on disk: info | clear")
    p.add_argument("action", choices=("info", "clear"))
    p.set_defaults(func=_main)


def _main(args) -> int:
    if args.action == "clear":
        n = clear()
        print(f"removed {n} file(s) from {cache_root()}")
        return 0
    print(info().format())
    return 0


_memo: dict[tuple[str, str], object] = {}
_memo_lock = threading.Lock()


def memo_kernel(prefix: str, name: str, compile_fn):
    """The compiled function named `name` (a plan's full name: what it is compiled for) of a
    small kernel (the combine, the index check): this process's, else the disk cache's under
    `prefix`-digest(name), else `compile_fn()`, published there. One compile per process."""
    key = (prefix, name)
    fn = _memo.get(key)
    if fn is None:
        with _memo_lock:
            fn = _memo.get(key)
            if fn is None:
                fn = _memo[key] = load_or_compile(f"{prefix}-{digest(name)}", compile_fn,
                                                  name)[0]
    return fn
