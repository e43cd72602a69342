"""The binary readers of PTX / SASS / cuobjdump text (fa4lab.kernels.binary), on small
hand-written samples, and the audit's CLI and tables (CPU)."""

from __future__ import annotations

import json

import pytest

from fa4lab.kernels import audit as A
from fa4lab.kernels import binary as B

PTX = """
    mbarrier.init.shared.b64 	[%r5389], %r118;
    mbarrier.init.shared.b64 	[%r5389+8], %r118;
    fence.mbarrier_init.release.cluster;
    setmaxnreg.dec.sync.aligned.u32 	48;
    setmaxnreg.inc.sync.aligned.u32 	192;
    setmaxnreg.dec.sync.aligned.u32 	80;
    mov.b32 	%r77, 256;
    mov.b32 	%r5382, 512;
    tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 	[%r5389+208], %r5382;
    tcgen05.mma.cta_group::1.kind::f16 	[%r1], %rd2, %rd3, %r4, %p5;
"""

SASS = """
        /*3360*/                   MUFU.EX2 R72, R72 ;
        /*3370*/              @!P0 MUFU.EX2 R73, R73 ;
        /*2c80*/                   FFMA.FTZ R134, R143, R70.reuse, 0.22764569520950317383 ;
        /*2ce0*/                   FFMA.FTZ R56, R143, R134, 0.69511663913726806641 ;
        /*2cf0*/                   FFMA2 R56, R143, R134, R2 ;
        /*2d20*/                   FADD2.FTZ.RM R10, R12.F32x2.HI_LO, R14.F32 ;
        /*2d30*/                   FADD2.FTZ R10, R12.F32x2.HI_LO, -R14.F32 ;
        /*2d40*/                   FADD2 R16, R18.F32x2.HI_LO, R20.F32x2.HI_LO ;
        /*2d00*/              @UP1 UTCHMMA gdesc[UR4], gdesc[UR6], tmem[UR8], tmem[UR10] ;
        /*2d10*/                   STL [R1], R0 ;
"""


def test_ptx_readers():
    assert B.ptx_count(PTX, r"\bmbarrier\.init\.") == 2  # the fence does not count
    assert B.setmaxnreg_values(PTX) == [48, 80, 192]
    assert B.tmem_alloc_columns(PTX) == [512]
    assert B.tmem_alloc_columns("tcgen05.alloc.cta_group::1.sync.aligned.b32 [%r1], 128;") == [128]


def test_sass_readers():
    ops = B.sass_opcodes(SASS)
    assert B.count_prefix(ops, "MUFU.EX2") == 2          # predicated one included
    assert B.count_prefix(ops, "FFMA") == 2 and ops["FFMA2"] == 1  # FFMA2 is its own opcode
    assert B.count_prefix(ops, "UTCHMMA") == 1
    assert B.count_prefix(ops, "STL") == 1
    assert B.count_prefix(ops, "FADD2") == 3 and B.count_prefix(ops, "FADD") == 0
    assert B.count_prefix(ops, "FADD2", "RM") == 1       # a modifier, not a prefix of one
    assert B.count_prefix(ops, "FADD2", "FTZ") == 2 and B.count_prefix(ops, "FFMA", "RM") == 0


def test_sm100_markers_find_each_role():
    import re

    assert re.search(B.SM100_MARKERS["softmax: exp2 polynomial on FMA"][1], SASS)
    assert re.search(B.SM100_MARKERS["softmax: exp2 on MUFU"][1], SASS)
    assert "MUFU.EX2 R72" in B.excerpt(SASS, r"MUFU\.EX2", 0, 0)
    assert B.excerpt(SASS, "HGMMA").startswith("(no line matches")


def test_audit_imports_form_a_dag():
    """binary <- peer_sm100 <- audit and binary <- audit: no cycle, even through the imports
    made inside functions."""
    import ast
    import inspect

    from fa4lab.kernels import peer_sm100

    def imported(module) -> set[str]:
        names = set()
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if isinstance(node, ast.ImportFrom) and node.module:
                names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
        return names

    assert not {"fa4lab.kernels.audit", "fa4lab.kernels.peer_sm100"} & imported(B)
    assert "fa4lab.kernels.audit" not in imported(peer_sm100)
    assert not any("compile._" in name for name in imported(peer_sm100))  # no private helpers


def test_tables_show_both_numbers():
    audit = B.Audit("t", (B.AuditRow("x", 1, 1, True), B.AuditRow("smem", 100, 124, False)))
    assert not audit.ok and [r.name for r in audit.failures()] == ["smem"]
    md = audit.to_markdown()
    assert "| smem | 100 | 124 | **NO** |" in md
    assert json.loads(json.dumps(audit.to_dict()))["rows"][1]["found"] == 124
    with pytest.raises(KeyError, match="smem"):
        audit.row("nope")


@pytest.mark.parametrize("tool", ["ptxas", "cuobjdump", "nvdisasm"])
def test_tools_come_from_pip(tool):
    path = B.cuda_tool(tool)
    assert path.is_file() and "nvidia" in path.parts


def test_cli_arguments():
    args = A._parse(["--arch", "sm90a", "--head-dim", "64", "--causal", "--gqa", "4", "--lse",
                     "--dtype", "fp16", "--format", "json"])
    spec = A._spec_from_args(args)
    assert (args.arch, spec.head_dim, spec.causal, spec.qhead_per_kvhead, spec.return_lse,
            spec.dtype, args.format) == ("sm90a", 64, True, 4, True, "fp16", "json")


def test_smem_alignment_diagnosis():
    from types import SimpleNamespace as NS

    plan = NS(smem=NS(total_bytes=231636, regions=(NS(align=1024), NS(align=8))))
    assert A.smem_gap_is_alignment(plan, 232448)
    assert not A.smem_gap_is_alignment(plan, 231636)
    assert not A.smem_gap_is_alignment(plan, 233472)


def test_peer_says_not_installed(monkeypatch):
    import importlib.metadata as md

    from fa4lab.kernels import peer_sm100

    def missing(name):
        raise md.PackageNotFoundError(name)

    monkeypatch.setattr(md, "version", missing)
    with pytest.raises(peer_sm100.PeerUnavailable, match="flash-attn-4 not installed"):
        peer_sm100._import_fa4()


@pytest.mark.slow
@pytest.mark.compile
def test_cli_json_end_to_end(capsys, tmp_path, monkeypatch):
    """The audit from the command line, then the same again from the cache (the same rows,
    no compile: it says so on stderr)."""
    pytest.importorskip("cutlass")
    from fa4lab.cli import main

    monkeypatch.setenv("FA4LAB_CACHE_DIR", str(tmp_path / "kernels"))
    monkeypatch.setenv("FA4LAB_CACHE", "1")
    argv = ["audit", "--arch", "sm100a", "--head-dim", "64", "--gqa", "2", "--lse",
            "--format", "json", "--no-peer"]
    assert main(argv) == 0
    first = capsys.readouterr()
    assert "compiling on the CPU" in first.err and "from the cache" not in first.err
    assert main(argv) == 0
    again = capsys.readouterr()
    assert "from the cache" in again.err
    assert json.loads(again.out) == json.loads(first.out)
    rc = main(argv[:-1])
    out = json.loads(capsys.readouterr().out)
    mine = out["audits"][0]
    assert rc == 0 and mine["ok"], [r for r in mine["rows"] if not r["ok"]]
    assert "head_dim 64" in mine["title"] and "GQA 2" in mine["title"]
    # the peer: its table where flash-attn-4 imports, else a note saying why not
    assert len(out["audits"]) == 2 or "flash-attn-4" in out["peer"]
