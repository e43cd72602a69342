"""Read a compiled kernel's binary back: pip's CUDA tools, and parsers for PTX, SASS and
cuobjdump text. No DSL, no plan: `fa4lab.kernels.audit` (fa4lab's kernels against their plan)
and `fa4lab.kernels.peer_sm100` (upstream FA4's kernel, shown beside it) both build on it.

    from fa4lab.kernels import binary
    text = binary.sass(cubin_path)                      # cuobjdump -sass
    binary.count_prefix(binary.sass_opcodes(text), "MUFU.EX2")
    binary.resource_usage(cubin_path)                   # registers, stack, static SMEM, local

The CUDA tools come from pip's nvidia packages (nvidia-cuda-nvcc, -cuobjdump, -nvdisasm, pinned in
pyproject.toml): the DSL emits PTX ISA 9.4, which ptxas reads from CUDA 13.4 on (a system ptxas
13.0 rejects it). FA4LAB_CUDA_BIN overrides the folder.
`Audit` and `AuditRow` are the table every audit prints.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from fa4lab.limits import EXP2_POLY3


# ---------------------------------------------------------------- the table
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


def describe(spec) -> str:
    """The configuration a compiled kernel bakes in, for an audit's title."""
    return (f"head_dim {spec.head_dim}, {spec.dtype}, {'causal' if spec.causal else 'non-causal'},"
            f" GQA {spec.qhead_per_kvhead}, LSE {'on' if spec.return_lse else 'off'}")


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
        f"nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm (or set FA4LAB_CUDA_BIN to the bin folder "
        f"of a CUDA 13.4 or newer: the DSL writes PTX ISA 9.4)")


def run_tool(tool: str, *args) -> str:
    """Run one of pip's CUDA tools; its stdout and stderr, or a RuntimeError naming the call."""
    out = subprocess.run([str(cuda_tool(tool)), *map(str, args)], capture_output=True,
                         text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{tool} {' '.join(map(str, args))} failed: {out.stderr.strip()}")
    return out.stdout + out.stderr


def resource_usage(cubin: Path) -> dict:
    """cuobjdump -res-usage: REG, STACK, SHARED (static), LOCAL for the (single) kernel."""
    text = run_tool("cuobjdump", "-res-usage", cubin)
    m = re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)", text)
    if not m:
        raise RuntimeError(f"no resource line in cuobjdump -res-usage output:\n{text[:500]}")
    return dict(zip(("registers", "stack", "static_shared", "local"), map(int, m.groups())))


def sass(cubin: Path) -> str:
    return run_tool("cuobjdump", "-sass", cubin)


def ptxas_report(ptx: Path, arch: str) -> dict:
    """pip's ptxas -v on the PTX: registers and spill bytes (slow: a full second assembly)."""
    text = run_tool("ptxas", f"-arch=sm_{arch.removeprefix('sm')}", "-v", ptx, "-o", os.devnull)
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
# The polynomial exp2 is the FFMA whose immediate is its c2 (SASS prints it in full decimal).
SM100_MARKERS = {
    "setup: mbarriers": (r"mbarrier\.init\.", r"SYNCS\.EXCH"),
    "setup: TMEM alloc, register budgets": (r"tcgen05\.alloc", r"USETMAXREG"),
    "load: TMA of Q/K/V": (r"cp\.async\.bulk\.tensor\.\dd\.shared", r"UTMALDG"),
    "mma: S = Q K^T and O += P V": (r"tcgen05\.mma\.", r"UTCHMMA"),
    "mma: commit to an mbarrier": (r"tcgen05\.commit\.", r"UTCBAR"),
    "softmax: S from TMEM": (r"tcgen05\.ld\.sync\.aligned\.32x32b\.x32", r"LDTM"),
    "softmax: exp2 on MUFU": (r"ex2\.approx", r"MUFU\.EX2"),
    "softmax: exp2 polynomial on FMA": (r"add\.rm\.ftz\.f32",
                                        r"FFMA\.FTZ.*" + re.escape(f"{EXP2_POLY3[2]:.4f}")),
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
