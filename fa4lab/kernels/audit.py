"""Read a compiled kernel back and check it against its plan: `fa4lab audit`.

    fa4lab audit --arch sm100a --head-dim 128 --causal          # markdown table
    fa4lab audit --arch sm90a --format json

What is checked (each an `AuditRow(name, expected, found, ok)`; any `ok=False` is a failure):
  * registers per thread and spills (cuobjdump -res-usage on the cubin; STL/LDL in the SASS;
    `--ptxas` also runs pip's `ptxas -arch=... -v` on the PTX for its spill report): spills 0;
  * dynamic shared memory = the kernel's shared-storage struct (not in the cubin) vs
    plan.smem.total_bytes;
  * sm100a: TMEM columns in `tcgen05.alloc` vs plan.tmem.alloc_cols; tcgen05.mma count vs the
    plan's MMA shapes; mbarrier.init count vs plan.barriers.mbarrier_count; setmaxnreg values vs
    the plan's role registers; MUFU.EX2 vs polynomial exp2 (SASS) vs
    plan.exp2_emulation_fraction; tcgen05.ld / st / commit counts (shown);
  * sm90a: wgmma count, setmaxnreg, mbarrier inits, registers, spills, SMEM.
For sm100a, where flash-attn-4 imports, its sm100 forward compiled the same way is audited side
by side (`--no-peer` skips it); otherwise the audit says "flash-attn-4 not installed".

The CUDA tools come from pip's nvidia packages (nvidia-cuda-nvcc, -cuobjdump, -nvdisasm): the DSL
emits PTX ISA 9.4, which a system ptxas 13.0 rejects. FA4LAB_CUDA_BIN overrides the folder.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class AuditRow:
    name: str
    expected: object
    found: object
    ok: bool
    note: str = ""


@dataclass(frozen=True)
class Audit:
    title: str
    rows: tuple[AuditRow, ...]

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    def failures(self) -> list[AuditRow]:
        return [r for r in self.rows if not r.ok]

    def row(self, name: str) -> AuditRow:
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(f"no audit row {name!r}; rows: {[r.name for r in self.rows]}")

    def to_dict(self) -> dict:
        return {"title": self.title, "ok": self.ok, "rows": [asdict(r) for r in self.rows]}

    def to_markdown(self) -> str:
        lines = [f"### {self.title}", "", "| check | expected | found | ok | note |",
                 "|---|---|---|---|---|"]
        for r in self.rows:
            lines.append(f"| {r.name} | {r.expected} | {r.found} | "
                         f"{'yes' if r.ok else '**NO**'} | {r.note} |")
        return "\n".join(lines)


# ---------------------------------------------------------------- tools
def cuda_tool(name: str) -> Path:
    """pip's ptxas / cuobjdump / nvdisasm, found through the installed `nvidia` packages."""
    override = os.environ.get("FA4LAB_CUDA_BIN")
    candidates = [Path(override) / name] if override else []
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        root = Path(root)
        candidates += sorted(root.glob(f"*/bin/{name}"))
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    raise FileNotFoundError(
        f"{name} not found in pip's nvidia packages: pip install nvidia-cuda-nvcc "
        f"nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm (or set FA4LAB_CUDA_BIN to a CUDA 13.1+ "
        f"bin folder)")


def _run(tool: str, *args) -> str:
    out = subprocess.run([str(cuda_tool(tool)), *map(str, args)], capture_output=True,
                         text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{tool} {' '.join(map(str, args))} failed: {out.stderr.strip()}")
    return out.stdout + out.stderr


def resource_usage(cubin: Path) -> dict:
    """cuobjdump -res-usage: REG, STACK, SHARED (static), LOCAL for the (single) kernel."""
    text = _run("cuobjdump", "-res-usage", cubin)
    m = re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)", text)
    if not m:
        raise RuntimeError(f"no resource line in cuobjdump -res-usage output:\n{text[:500]}")
    return dict(zip(("registers", "stack", "static_shared", "local"), map(int, m.groups())))


def sass(cubin: Path) -> str:
    return _run("cuobjdump", "-sass", cubin)


def ptxas_report(ptx: Path, arch: str) -> dict:
    """pip's ptxas -v on the PTX: registers and spill bytes (slow: a full second assembly)."""
    text = _run("ptxas", f"-arch=sm_{arch.removeprefix('sm')}", "-v", ptx, "-o", os.devnull)
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return {"registers": int(regs.group(1)) if regs else -1,
            "spill_stores": int(spill.group(1)) if spill else 0,
            "spill_loads": int(spill.group(2)) if spill else 0}


# ---------------------------------------------------------------- counting
def sass_opcodes(text: str) -> Counter:
    """Opcode (with modifiers) of every SASS instruction, predicates stripped."""
    ops = Counter()
    for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", text):
        ops[m.group(1)] += 1
    return ops


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def sass_instructions(text: str) -> list[tuple[int, str, str]]:
    """(address, opcode, operands) of every SASS instruction, in address order; a guarded
    instruction's opcode keeps its predicate in front ("@P0 BRA")."""
    return [(int(m.group(1), 16), (m.group(2) or "") + m.group(3), m.group(4).strip())
            for m in _SASS_LINE.finditer(text)]


def steady_loop(text: str) -> tuple[int, int] | None:
    """Address range [start, end] of the kernel's last loop that issues MMAs (HGMMA / UTCHMMA).

    A loop is a conditional backward branch (the unconditional ones jump back from the
    out-of-line retry stubs of barrier waits); in the sm90 kernel the last loop with MMAs in
    its body is the FULL-block loop, where the time goes.
    """
    insts = sass_instructions(text)
    best = None
    for addr, op, args in insts:
        if not (op.startswith("@") and op.endswith(" BRA")):
            continue
        target = re.search(r"0x([0-9a-f]+)", args)
        if not target or int(target.group(1), 16) >= addr:
            continue
        start = int(target.group(1), 16)
        if any(start <= a <= addr and o.split()[-1].startswith(("HGMMA", "UTCHMMA"))
               for a, o, _ in insts):
            best = (start, addr) if best is None or addr > best[1] else best
    return best


def spills_in(text: str, span: tuple[int, int] | None) -> int:
    """STL/LDL instructions inside the address range `span` (0 for None)."""
    if span is None:
        return 0
    return sum(1 for a, o, _ in sass_instructions(text)
               if span[0] <= a <= span[1] and o.split()[-1].split(".")[0] in ("STL", "LDL"))


def count_prefix(ops: Counter, prefix: str) -> int:
    return sum(n for op, n in ops.items() if op == prefix or op.startswith(prefix + "."))


def ptx_count(ptx: str, pattern: str) -> int:
    return len(re.findall(pattern, ptx))


def count_ffma_immediate(sass_text: str, value: float) -> int:
    """FFMA instructions with `value` (compared as float32) among their immediates."""
    import numpy as np

    target = np.float32(value)
    n = 0
    for line in sass_text.splitlines():
        if "FFMA" not in line:
            continue
        imms = re.findall(r"(?<![\w.])(-?\d+\.\d+(?:e[+-]?\d+)?)", line.split(";")[0])
        n += any(np.float32(float(x)) == target for x in imms)
    return n


def tmem_alloc_columns(ptx: str) -> list[int]:
    """Column counts of every tcgen05.alloc (an immediate or a register set by mov)."""
    cols = []
    for m in re.finditer(r"tcgen05\.alloc[^\n]*?,\s*(%r\d+|\d+);", ptx):
        arg = m.group(1)
        if arg.startswith("%"):
            mov = re.findall(rf"mov\.b32\s+{re.escape(arg)},\s*(\d+);", ptx[: m.start()])
            cols.append(int(mov[-1]) if mov else -1)
        else:
            cols.append(int(arg))
    return cols


def setmaxnreg_values(ptx: str) -> list[int]:
    return sorted(int(v) for v in re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)",
                                             ptx))


# Where each sm100 role shows up in the binary: (PTX regex, SASS regex), for notebook excerpts.
SM100_MARKERS = {
    "setup: mbarriers": (r"mbarrier\.init\.", r"SYNCS\.EXCH"),
    "setup: TMEM alloc, register budgets": (r"tcgen05\.alloc", r"USETMAXREG"),
    "load: TMA of Q/K/V": (r"cp\.async\.bulk\.tensor\.\dd\.shared", r"UTMALDG"),
    "mma: S = Q K^T and O += P V": (r"tcgen05\.mma\.", r"UTCHMMA"),
    "mma: commit to an mbarrier": (r"tcgen05\.commit\.", r"UTCBAR"),
    "softmax: S from TMEM": (r"tcgen05\.ld\.sync\.aligned\.32x32b\.x32", r"LDTM"),
    "softmax: exp2 on MUFU": (r"ex2\.approx", r"MUFU\.EX2"),
    "softmax: exp2 polynomial on FMA": (r"add\.rm\.ftz\.f32", r"FFMA\.FTZ.*0\.2276"),
    "softmax: P to TMEM": (r"tcgen05\.st\.sync\.aligned\.32x32b\.x16", r"STTM"),
    "correction: rescale O_i in TMEM": (r"tcgen05\.ld\.sync\.aligned\.32x32b\.x16",
                                        r"LDTM\.x16"),
    "correction: O_i / row_sum into sO": (r"st\.shared\.v4", r"STS\.128"),
    "epilogue: TMA store of O": (r"cp\.async\.bulk\.tensor\.\dd\.global", r"UTMASTG"),
}


def excerpt(text: str, pattern: str, before: int = 2, after: int = 4, max_width: int = 110,
            occurrence: int = 0) -> str:
    """The lines around the `occurrence`-th line matching `pattern` (blank lines dropped)."""
    lines = [re.sub(r"\s*/\* 0x[0-9a-f]+ \*/", "", ln).strip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln]
    hits = [i for i, ln in enumerate(lines) if re.search(pattern, ln)]
    if len(hits) <= occurrence:
        return f"(no line matches {pattern!r})"
    i = hits[occurrence]
    out = [ln if len(ln) <= max_width else ln[: max_width - 3] + "..."
           for ln in lines[max(i - before, 0): i + after + 1]]
    return "\n".join(out)


def _row(name, expected, found, ok=None, note=""):
    return AuditRow(name, expected, found, expected == found if ok is None else bool(ok), note)


def smem_gap_is_alignment(plan, struct_bytes: int) -> bool:
    """True when the struct is exactly plan.smem.total_bytes rounded up to the largest region
    alignment: a struct's size, like C's sizeof, is a multiple of its alignment."""
    align = max(r.align for r in plan.smem.regions)
    rounded = -(-plan.smem.total_bytes // align) * align
    return struct_bytes != plan.smem.total_bytes and struct_bytes == rounded


# ---------------------------------------------------------------- audits
def _common_rows(cf, ops: Counter, use_ptxas: bool, sass_text: str) -> list[AuditRow]:
    plan = cf.plan
    res = resource_usage(cf.cubin_path)
    budget = plan.hardware.registers_per_sm // plan.threads_per_cta
    spill_instr = count_prefix(ops, "STL") + count_prefix(ops, "LDL")
    loop = steady_loop(sass_text)
    rows = [
        AuditRow("compile seconds", "-", round(cf.seconds, 1), True, "cute.compile, fake tensors"),
        _row("registers per thread (launch)", f"<= {budget}", res["registers"],
             res["registers"] <= budget,
             f"{plan.hardware.registers_per_sm} / {plan.threads_per_cta} threads; roles then "
             f"rebalance with setmaxnreg"),
        _row("spill instructions (STL/LDL)", 0, spill_instr),
        _row("spills in the steady-state loop", 0, spills_in(sass_text, loop),
             spills_in(sass_text, loop) == 0,
             f"SASS {loop[0]:#x}-{loop[1]:#x}: the last loop with MMAs" if loop
             else "no conditional loop around the MMAs (the whole kernel is counted above)"),
        _row("stack frame bytes", 0, res["stack"]),
        _row("dynamic SMEM bytes", plan.smem.total_bytes, cf.smem_bytes,
             note="SharedStorage struct size (not in the cubin)"
             + ("; the plan's total lacks the struct's round-up to its largest alignment"
                if smem_gap_is_alignment(plan, cf.smem_bytes) else "")),
        _row("mbarrier.init", plan.barriers.mbarrier_count,
             ptx_count(cf.ptx, r"\bmbarrier\.init\.")),
    ]
    found_nreg = setmaxnreg_values(cf.ptx)
    if cf.arch == "sm100a":  # the sm100 kernel has one setmaxnreg per role branch
        rows.append(_row("setmaxnreg values", sorted(r.registers for r in plan.roles),
                         found_nreg, note="one per role branch"))
    else:  # the sm90 kernel's consumer warpgroups share one branch
        rows.append(_row("setmaxnreg values (distinct)",
                         sorted({r.registers for r in plan.roles}), sorted(set(found_nreg))))
    if use_ptxas:
        rep = ptxas_report(cf.ptx_path, cf.arch)
        spilled = rep["spill_stores"] + rep["spill_loads"]
        rows.append(_row("ptxas spill bytes (stores + loads)", 0, spilled, note="ptxas -v"))
    return rows


def audit_sm100(cf, *, use_ptxas: bool = False) -> Audit:
    from fa4lab.kernels.exp2_sm100 import EXP2_POLY3

    plan, kernel = cf.plan, cf.kernel
    text = sass(cf.cubin_path)
    ops = sass_opcodes(text)
    rows = _common_rows(cf, ops, use_ptxas, text)
    allocs = tmem_alloc_columns(cf.ptx)
    rows.append(_row("TMEM columns (tcgen05.alloc)", [plan.tmem.alloc_cols], allocs))
    # MMA instructions: each MMA of the plan is k/16 tcgen05.mma (16-bit inputs: K = 16 per
    # instruction), issued at kernel.mma_sites[name] places in the code.
    k_step = 16
    mma_expected = sum(kernel.mma_sites[m.name] * (m.k // k_step) for m in plan.mmas)
    rows.append(_row("tcgen05.mma (PTX)", mma_expected,
                     ptx_count(cf.ptx, r"\btcgen05\.mma\.cta_group"),
                     note=" + ".join(f"{kernel.mma_sites[m.name]} sites x {m.k // k_step} "
                                     f"({m.name})" for m in plan.mmas)))
    rows.append(_row("UTCHMMA (SASS)", mma_expected, count_prefix(ops, "UTCHMMA")))
    for name, pattern in (("tcgen05.ld", r"\btcgen05\.ld\."), ("tcgen05.st", r"\btcgen05\.st\."),
                          ("tcgen05.commit", r"\btcgen05\.commit\.")):
        n = ptx_count(cf.ptx, pattern)
        rows.append(AuditRow(f"{name} (PTX)", "> 0", n, n > 0, "static count, shown"))
    # exp2: each polynomial has one FFMA whose immediate is c2 (its first Horner step).
    poly = count_ffma_immediate(text, EXP2_POLY3[2])
    steps = kernel.softmax_step_sites
    emu_expected = steps * 2 * sum(kernel.emulated)
    mufu_p = steps * (plan.tiles.n_block - 2 * sum(kernel.emulated))
    mufu = count_prefix(ops, "MUFU.EX2")
    rows.append(_row("exp2 on FMA (polynomial)", emu_expected, poly,
                     note=f"{steps} softmax-step sites x {2 * sum(kernel.emulated)} of "
                          f"{plan.tiles.n_block} (fraction {plan.exp2_emulation_fraction})"))
    rows.append(_row("MUFU.EX2", f"{mufu_p}..{mufu_p + steps}", mufu,
                     mufu_p <= mufu <= mufu_p + steps,
                     note="P on MUFU, plus at most one row-scale exp2 per site"))
    rows.append(AuditRow("FFMA2 (SASS)", "-", ops["FFMA2"], True, "packed FMAs, shown"))
    found_fraction = poly / max(poly + mufu, 1)
    rows.append(AuditRow("emulated exp2 fraction", plan.exp2_emulation_fraction,
                         round(found_fraction, 4),
                         abs(found_fraction - plan.exp2_emulation_fraction)
                         <= 1.5 / plan.tiles.n_block,
                         "FMA polynomials / all exp2"))
    return Audit(f"sm100a audit: {_describe(plan.spec)}", tuple(rows))


def audit_sm90(cf, *, use_ptxas: bool = False) -> Audit:
    plan = cf.plan
    text = sass(cf.cubin_path)
    ops = sass_opcodes(text)
    rows = _common_rows(cf, ops, use_ptxas, text)
    n = ptx_count(cf.ptx, r"\bwgmma\.mma_async\.")
    rows.append(AuditRow("wgmma.mma_async (PTX)", "> 0", n, n > 0, "static count, shown"))
    rows.append(AuditRow("HGMMA (SASS)", "> 0", count_prefix(ops, "HGMMA"),
                         count_prefix(ops, "HGMMA") > 0, "static count, shown"))
    return Audit(f"sm90a audit: {_describe(plan.spec)}", tuple(rows))


def _describe(spec) -> str:
    return (f"head_dim {spec.head_dim}, {spec.dtype}, {'causal' if spec.causal else 'non-causal'},"
            f" GQA {spec.qhead_per_kvhead}, LSE {'on' if spec.return_lse else 'off'}")


def audit_compiled(cf, *, use_ptxas: bool = False) -> Audit:
    return (audit_sm100 if cf.arch == "sm100a" else audit_sm90)(cf, use_ptxas=use_ptxas)


def audit(spec_or_plan, arch: str = "sm100a", *, keep_dir=None, use_ptxas: bool = False
          ) -> Audit:
    """Compile (fake tensors, any machine) and audit against the plan."""
    from fa4lab.kernels.compile import compile_forward

    return audit_compiled(compile_forward(spec_or_plan, arch=arch, keep_dir=keep_dir),
                          use_ptxas=use_ptxas)


# ---------------------------------------------------------------- CLI
def _spec_from_args(args):
    from fa4lab.spec import AttentionSpec

    heads_q = 8
    return AttentionSpec(batch=1, seqlen_q=4096, seqlen_k=4096, heads_q=heads_q,
                         heads_kv=heads_q // args.gqa, head_dim=args.head_dim, dtype=args.dtype,
                         causal=args.causal, return_lse=args.lse)


def _main(args) -> int:
    from fa4lab.errors import Fa4labError

    try:
        spec = _spec_from_args(args)
        result = audit(spec, args.arch, keep_dir=args.keep_dir, use_ptxas=args.ptxas)
    except (Fa4labError, ValueError, FileNotFoundError) as exc:
        print(f"fa4lab audit: {exc}")
        return 2
    audits = [result]
    peer_note = None
    if args.peer and args.arch == "sm100a":
        from fa4lab.kernels import peer_sm100

        try:
            audits.append(peer_sm100.audit_flash_attn4(spec, keep_dir=args.keep_dir))
        except peer_sm100.PeerUnavailable as exc:
            peer_note = str(exc)
    if args.format == "json":
        print(json.dumps({"audits": [a.to_dict() for a in audits], "peer": peer_note},
                         indent=2, default=str))
    else:
        print("\n\n".join(a.to_markdown() for a in audits))
        if peer_note:
            print(f"\npeer: {peer_note}")
    return 0 if result.ok else 1


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("audit", help="compile a kernel on CPU and check it against the plan",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", choices=("sm100a", "sm90a"), default="sm100a")
    p.add_argument("--head-dim", type=int, default=128, choices=(64, 128, 256),
                   help="64 or 128 (sm100a); 64, 128 or 256 (sm90a)")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--gqa", type=int, default=1, help="query heads per KV head (1, 2, 4, 8)")
    p.add_argument("--lse", action="store_true", help="also write the log-sum-exp")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--format", choices=("md", "json"), default="md")
    p.add_argument("--ptxas", action="store_true", help="also run ptxas -v on the PTX (slow)")
    p.add_argument("--no-peer", dest="peer", action="store_false",
                   help="skip the side-by-side with flash-attn-4's sm100 forward (compiled "
                        "the same way when it is installed)")
    p.add_argument("--keep-dir", default=None, help="where PTX and cubin are kept")
    p.set_defaults(func=_main)


def _parse(argv=None):
    parser = argparse.ArgumentParser(prog="fa4lab audit")
    sub = parser.add_subparsers(dest="command", required=True)
    add_cli(sub)
    return parser.parse_args(["audit", *(argv or [])])
