"""The compiled-kernel cache on disk (`fa4lab.kernels.cache`): keys, invalidation, concurrent
processes, damaged files, and `fa4lab cache info|clear`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import fa4lab
from fa4lab.cli import main as fa4lab_main
from fa4lab.kernels import cache
from fa4lab.plan import plan_forward
from fa4lab.spec import AttentionSpec


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FA4LAB_CACHE_DIR", str(tmp_path / "kernels"))
    monkeypatch.setenv("FA4LAB_CACHE", "1")
    return tmp_path / "kernels"


def _plan(**kw):
    args = dict(batch=2, seqlen_q=300, seqlen_k=700, heads_q=8, heads_kv=2, head_dim=128)
    args.update(kw)
    return plan_forward(AttentionSpec(**args), "sm90")


def test_plan_key_ignores_sizes_and_sees_what_the_kernel_bakes_in():
    base = cache.plan_key(_plan())
    assert cache.plan_key(_plan(batch=5, seqlen_q=1, seqlen_k=9000, heads_q=16,
                                heads_kv=4)) == base          # same GQA ratio, other sizes
    assert cache.plan_key(_plan(softmax_scale=0.1)) == base   # the scale is a runtime argument
    for other in (dict(causal=True), dict(dtype="fp16"),
                  dict(return_lse=True), dict(heads_kv=8), dict(head_dim=64),
                  dict(window_size=(64, None)), dict(window_size=(None, 64)),
                  dict(learnable_sink=True)):
        assert cache.plan_key(_plan(**other)) != base, other
    # a window's sizes are runtime arguments, its sides are not (Note [runtime window])
    left = cache.plan_key(_plan(window_size=(64, None)))
    assert cache.plan_key(_plan(window_size=(1000, None))) == left
    assert cache.plan_key(_plan(window_size=(64, 3))) != left
    assert cache.plan_key(plan_forward(_plan().spec, "sm90", n_block=64)) != base
    assert cache.plan_key(plan_forward(_plan().spec, "sm90", pack_gqa=True)) != base


def test_fingerprint_changes_with_any_source_or_version(tmp_path):
    package = Path(fa4lab.__file__).parent
    copy = tmp_path / "fa4lab"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    versions = ["cutlass-dsl=4.8.1", "tvm-ffi=0.1"]
    base = cache.fingerprint_of(copy, versions)
    assert base == cache.fingerprint_of(package, versions)      # contents, not location
    assert cache.fingerprint_of(copy, ["cutlass-dsl=4.8.2", "tvm-ffi=0.1"]) != base
    for source in ("kernels/device/mask.py", "plan/sm90.py", "tiling.py", "limits.py"):
        f = copy / source
        text = f.read_text()
        f.write_text(text + "\n# edited\n")
        assert cache.fingerprint_of(copy, versions) != base, source
        f.write_text(text)
    (copy / "viz" / "plan.py").write_text("# not a kernel source\n")
    assert cache.fingerprint_of(copy, versions) == base


class _FakeCompiled:
    """Stands in for a compiled kernel: counts exports, writes what it is given."""

    def __init__(self, payload=b"not a kernel"):
        self.payload, self.exports = payload, 0

    def export_to_c(self, path, name):
        self.exports += 1
        Path(path).write_bytes(self.payload)


def test_a_damaged_file_is_removed_and_rebuilt(cache_dir, monkeypatch):
    monkeypatch.setattr(cache, "_link", lambda obj, out: False)   # keep the object file
    key = "test-damaged"
    folder = cache_dir / cache.fingerprint()
    folder.mkdir(parents=True)
    (folder / f"{key}.so").write_bytes(b"\x7fELF truncated")
    fake = _FakeCompiled()
    fn, how, _ = cache.load_or_compile(key, lambda: fake, "damaged")
    assert how == "compiled" and fn is fake and fake.exports == 1
    assert not (folder / f"{key}.so").exists()                    # the damaged file is gone
    assert (folder / f"{key}.o").read_bytes() == fake.payload      # the new one is published
    assert json.loads((folder / f"{key}.json").read_text())["kernel"] == "damaged"
    assert not list(folder.glob(".*"))                             # no temporary leftovers


def test_cache_off_compiles_every_time(cache_dir, monkeypatch):
    monkeypatch.setenv("FA4LAB_CACHE", "0")
    fakes = []
    for _ in range(2):
        fn, how, _ = cache.load_or_compile("test-off", lambda: fakes.append(_FakeCompiled())
                                           or fakes[-1])
        assert how == "compiled"
    assert len(fakes) == 2 and not cache_dir.exists()


def test_cli_info_and_clear(cache_dir, monkeypatch, capsys):
    monkeypatch.setattr(cache, "_link", lambda obj, out: False)
    cache.load_or_compile("test-cli", lambda: _FakeCompiled(), "a kernel")
    stale = cache_dir / "0123456789abcdef"
    stale.mkdir()
    (stale / "old.so").write_bytes(b"x" * 10)
    assert fa4lab_main(["cache", "info"]) == 0
    text = capsys.readouterr().out
    assert str(cache_dir) in text and "1 kernel(s)" in text and "1 stale folder(s)" in text
    assert "test-cli.o" in text and "a kernel" in text and "0123456789abcdef" in text
    assert fa4lab_main(["cache", "clear"]) == 0
    assert "removed 4 file(s)" in capsys.readouterr().out and not cache_dir.exists()
    assert fa4lab_main(["cache", "info"]) == 0
    assert "0 kernel(s)" in capsys.readouterr().out


_CHILD = textwrap.dedent("""
    import json, sys
    from fa4lab.kernels import cache
    from fa4lab.plan import plan_forward
    from fa4lab.spec import AttentionSpec

    def compile_it():
        from fa4lab.kernels.compile import compile_plan
        return compile_plan(plan)[1]

    plan = plan_forward(AttentionSpec(1, 128, 128, 2, 1, 64, causal=True), "sm90")
    fn, how, seconds = cache.load_or_compile(cache.plan_key(plan), compile_it, "child")
    print(json.dumps({"how": how, "dsl_imported": "cutlass" in sys.modules,
                      "callable": callable(fn)}))
""")


def _children(n, env):
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(n)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


@pytest.mark.compile
def test_concurrent_processes_compile_once_and_later_ones_load(cache_dir):
    pytest.importorskip("cutlass")
    import os

    env = {**os.environ, "FA4LAB_CACHE_DIR": str(cache_dir), "FA4LAB_CACHE": "1"}
    racing = _children(2, env)
    assert sorted(r["how"] for r in racing) == ["compiled", "loaded"], racing
    (later,) = _children(1, env)
    assert later["how"] == "loaded" and later["callable"]
    assert not later["dsl_imported"], "a cached kernel loads without importing the CuTe DSL"
    names = sorted(p.name for p in (cache_dir / cache.fingerprint()).iterdir())
    kernels = [n for n in names if n.endswith((".so", ".o"))]
    assert len(kernels) == 1 and not [n for n in names if n.startswith(".")], names
