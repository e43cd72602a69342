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
`Audit` and `AuditRow` are the table every audit prints. The PTX's control flow (its loops, an
order of its lines that follows it) is `fa4lab.kernels.ptx_flow`.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path


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


def audit_row(name, expected, found, ok=None, note="") -> AuditRow:
    """A row that holds when `found == expected`, or as `ok` says."""
    return AuditRow(name, expected, found, expected == found if ok is None else bool(ok), note)


def describe(spec) -> str:
    """The configuration a compiled kernel bakes in, for an audit's title."""
    hd = f"{spec.head_dim}" + (f" (head_dim_v {spec.head_dim_v})"
                               if spec.head_dim_v != spec.head_dim else "")
    return (f"head_dim {hd}, {spec.dtype}, {'causal' if spec.causal else 'non-causal'},"
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
    """Address range [start, end] of the kernel's last innermost loop that issues MMAs (HGMMA /
    UTCHMMA).

    A loop is a conditional backward branch (the unconditional ones jump back from the
    out-of-line retry stubs of barrier waits); in the sm90 kernel the last loop with MMAs in
    its body and no such loop inside it is the FULL-block loop, where the time goes (a
    persistent kernel's tile loop holds it, and is not it).
    """
    insts = sass_instructions(text)
    loops = []
    for addr, op, args in insts:
        if not (op.startswith("@") and op.endswith(" BRA")):
            continue
        target = re.search(r"0x([0-9a-f]+)", args)
        if not target or int(target.group(1), 16) >= addr:
            continue
        start = int(target.group(1), 16)
        if any(start <= a <= addr and o.split()[-1].startswith(("HGMMA", "UTCHMMA"))
               for a, o, _ in insts):
            loops.append((start, addr))
    inner = [x for x in loops
             if not any(y != x and x[0] <= y[0] and y[1] <= x[1] for y in loops)]
    return max(inner, key=lambda x: x[1], default=None)


def spills_in(text: str, span: tuple[int, int] | None) -> int:
    """STL/LDL instructions inside the address range `span` (0 for None)."""
    if span is None:
        return 0
    return sum(1 for a, o, _ in sass_instructions(text)
               if span[0] <= a <= span[1] and o.split()[-1].split(".")[0] in ("STL", "LDL"))


def count_prefix(ops: Counter, prefix: str, modifier: str | None = None) -> int:
    """Instructions whose opcode is `prefix` (any modifiers), only those with `modifier` among
    their modifiers when given ("FADD2", "RM" counts FADD2.RM and FADD2.FTZ.RM)."""
    return sum(n for op, n in ops.items()
               if (op == prefix or op.startswith(prefix + "."))
               and (modifier is None or modifier in op.split(".")[1:]))


def ptx_count(ptx: str, pattern: str) -> int:
    return len(re.findall(pattern, ptx))


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
# The polynomial exp2 starts with the round-down add of its range reduction, one per pair (Note
# [packed exp2] in fa4lab.kernels.device.exp2).
SM100_MARKERS = {
    "setup: mbarriers": (r"mbarrier\.init\.", r"SYNCS\.EXCH"),
    "setup: TMEM alloc, register budgets": (r"tcgen05\.alloc", r"USETMAXREG"),
    "load: TMA of Q/K/V": (r"cp\.async\.bulk\.tensor\.\dd\.shared", r"UTMALDG"),
    "mma: S = Q K^T and O += P V": (r"tcgen05\.mma\.", r"UTCHMMA"),
    "mma: commit to an mbarrier": (r"tcgen05\.commit\.", r"UTCBAR"),
    "softmax: S from TMEM": (r"tcgen05\.ld\.sync\.aligned\.32x32b\.x32", r"LDTM"),
    "softmax: exp2 on MUFU": (r"ex2\.approx", r"MUFU\.EX2"),
    "softmax: exp2 polynomial on FMA": (r"add\.rm\.ftz\.f32x2", r"FADD2\.FTZ\.RM"),
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


# ---------------------------------------------------------------- barrier protocol in the PTX
# See Note [protocol markers] in fa4lab.kernels.protocol: every barrier op of fa4lab's kernels
# is announced by a comment "// fa4lab-proto <path> <kind> <barrier>[<stage>]" right before it.
_MARKER = re.compile(r"//\s*fa4lab-proto\s+(\S+)\s+(\S+)\s+(\S+)\[(\w+)\]")
_BARRIER_OP = re.compile(
    r"^\s*(?:@!?%\w+\s+)?(mbarrier\.try_wait\S*|mbarrier\.test_wait\S*|mbarrier\.arrive\S*|"
    r"cp\.async\.mbarrier\.arrive\S*|"
    r"tcgen05\.commit\S*|bar\.sync|bar\.arrive|barrier\.sync\S*|barrier\.arrive\S*|"
    r"bar\.red\S*|barrier\.red\S*)\s+([^;]*);")
_DEF = re.compile(r"^\s*(?:@!?%\w+\s+)?([a-z][\w.:]*)\s+(%\w+),\s*([^;]*);")


@dataclass(frozen=True)
class BarrierOp:
    """One barrier instruction (or a protocol marker) of the PTX, where it is."""

    line: int               # 0-based line in the PTX text
    kind: str               # wait | arrive | expect_tx | commit | cp_async_arrive | sync |
                            # named_arrive | marker
    opcode: str
    offset: int | None = None    # mbarrier: constant byte offset from the dynamic SMEM base
    dynamic: bool = False        # mbarrier: plus a run-time index (a ring stage)
    named_id: int | None = None  # named barrier id (None: a register)
    named_operand: str = ""      # named barrier: the id operand as written ("4", "%r28")
    threads: int | None = None
    marker: tuple | None = None  # (path, kind, barrier, stage) of a marker


def _op_kind(opcode: str) -> str:
    if opcode.startswith(("mbarrier.try_wait", "mbarrier.test_wait")):
        return "wait"
    if opcode.startswith("mbarrier.arrive.expect_tx"):
        return "expect_tx"
    if opcode.startswith("mbarrier.arrive"):
        return "arrive"
    if opcode.startswith("cp.async.mbarrier.arrive"):
        return "cp_async_arrive"
    if opcode.startswith("tcgen05.commit"):
        return "commit"
    if opcode in ("bar.sync",) or opcode.startswith("barrier.sync"):
        return "sync"
    return "named_arrive"


class SmemAddresses:
    """Resolve a PTX register to (constant offset from the dynamic SMEM base, dynamic?)."""

    def __init__(self, ptx: str):
        self.defs: dict[str, list[tuple[str, str]]] = {}
        for ln in ptx.splitlines():
            m = _DEF.match(ln)
            if m:
                self.defs.setdefault(m.group(2), []).append((m.group(1), m.group(3)))

    def resolve(self, reg: str, depth: int = 0):
        """(offset, dynamic) or None when `reg` is not an address in the dynamic SMEM."""
        defs = self.defs.get(reg, [])
        if depth > 40 or not defs:
            return None
        found = {self._one(op, args, depth) for op, args in defs}
        if len(found) == 1:
            return found.pop()
        found.discard(None)
        if not found:
            return None
        return (min(off for off, _ in found), True)

    def _one(self, op: str, args: str, depth: int):
        parts = [a.strip() for a in args.split(",")]
        if op.startswith("mov") and "__dynamic_shmem" in args:
            return (0, False)
        if op.startswith(("mov", "cvt")) and len(parts) == 1 and parts[0].startswith("%"):
            return self.resolve(parts[0], depth + 1)
        if op.startswith("shfl.sync.idx"):
            return self.resolve(parts[0], depth + 1)
        if op.startswith("add") and len(parts) == 2:
            a = self.resolve(parts[0], depth + 1) if parts[0].startswith("%") else None
            if parts[1].lstrip("-").isdigit():
                return None if a is None else (a[0] + int(parts[1]), a[1])
            b = self.resolve(parts[1], depth + 1) if parts[1].startswith("%") else None
            if a is not None and b is None:
                return (a[0] + self.floor(parts[1]), True)
            if b is not None and a is None:
                return (b[0] + self.floor(parts[0]), True)
        return None

    def floor(self, reg: str) -> int:
        """A lower bound of the integer `reg` added to an address (0, the dynamic part's,
        unless its definitions say more): a loop's offset set by mov from an immediate and
        stepped by adds of non-negative immediates (a strength-reduced slice of a stage, as a
        paged gather's pieces are) is at least its start."""
        starts = []
        for op, args in self.defs.get(reg, []):
            parts = [a.strip() for a in args.split(",")]
            if op.startswith("mov") and len(parts) == 1 and parts[0].isdigit():
                starts.append(int(parts[0]))
            elif not (op.startswith("add") and len(parts) == 2 and parts[0] == reg
                      and parts[1].isdigit()):
                return 0
        return min(starts, default=0)

    def operand(self, text: str):
        """An address operand "[%r8+231432]" / "[%r9]" -> (offset, dynamic) or None."""
        m = re.match(r"\[(%\w+)(?:\+(-?\d+))?\]", text.strip())
        if not m:
            return None
        base = self.resolve(m.group(1))
        return None if base is None else (base[0] + int(m.group(2) or 0), base[1])

    def value(self, text: str) -> int | None:
        """An immediate or a register set from one immediate by mov."""
        text = text.strip()
        if text.lstrip("-").isdigit():
            return int(text)
        defs = self.defs.get(text, [])
        if len(defs) == 1 and defs[0][0].startswith("mov") and defs[0][1].strip().isdigit():
            return int(defs[0][1])
        return None


# Note [values per thread]
# A named barrier's id may be computed at run time: the sm90 consumers share one epilogue, and
# each syncs on its own barrier, the table's base id plus its warpgroup index, which the
# compiler folds to `%tid.x / 32 / 4` (`shr` of the warp index). `ThreadValues` evaluates such a
# register for a given thread: it follows the register's one definition back through integer
# arithmetic to immediates and %tid.x, and a warp shuffle (`shfl.sync.idx`, lane L) to lane
# L's value. Anything else (a load, a select, a register defined twice, as a loop's or a
# branch's value is) leaves the value unknown (None): the audit then reports the id as
# unresolved rather than guessing.
_TYPED_DEF = re.compile(r"^\s*(@!?%\w+\s+)?([a-z][\w.:]*)\s+(%\w+),\s*([^;]*);")
_INT_OPS = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
            "shl": lambda a, b: a << b, "shr": lambda a, b: a >> b, "and": lambda a, b: a & b,
            "or": lambda a, b: a | b, "xor": lambda a, b: a ^ b, "min": min, "max": max}
_INT_SYMBOLS = {"add": "+", "sub": "-", "mul": "*", "shl": "<<", "shr": ">>", "and": "&",
                "or": "|", "xor": "^"}


class ThreadValues:
    """An integer register's value in one thread of a one-dimensional CTA (Note [values per
    thread]): `value("%r28", tid)`, and `formula("%r28")` to show how it is computed."""

    def __init__(self, ptx: str):
        self.defs: dict[str, list[tuple[bool, str, list[str]]]] = {}
        for ln in ptx.splitlines():
            m = _TYPED_DEF.match(ln)
            # barrier.sync %r28, 128 reads its first operand
            if m and not m.group(2).startswith(("bar.", "barrier.")):
                args = [a.strip() for a in m.group(4).split(",")]
                self.defs.setdefault(m.group(3), []).append((bool(m.group(1)), m.group(2), args))

    def _def(self, reg: str):
        defs = self.defs.get(reg, [])
        return defs[0] if len(defs) == 1 and not defs[0][0] else None

    def value(self, text: str, tid: int, depth: int = 0) -> int | None:
        text = text.strip()
        if re.fullmatch(r"-?\d+", text):
            return int(text)
        if text == "%tid.x":
            return tid
        d = self._def(text)
        if d is None or depth > 40:
            return None
        _, op, args = d
        parts = op.split(".")
        if op.startswith("shfl.sync.idx") and len(args) == 4:
            lane = self.value(args[1], tid, depth + 1)
            if lane is None or self.value(args[2], tid, depth + 1) != 31:
                return None
            return self.value(args[0], tid - tid % 32 + lane % 32, depth + 1)
        if parts[0] in ("mov", "cvt") and len(args) == 1:
            return self.value(args[0], tid, depth + 1)
        if parts[0] in _INT_OPS and len(args) == 2 and parts[1] in ("", "lo", "s32", "u32",
                                                                     "b32", "s64", "u64", "b64"):
            a, b = (self.value(x, tid, depth + 1) for x in args)
            if a is None or b is None:
                return None
            return _wrap(_INT_OPS[parts[0]](_wrap(a, parts[-1]), b), parts[-1])
        return None

    def formula(self, text: str, depth: int = 0) -> str:
        """`text` as an expression of immediates and %tid.x (registers it cannot follow stay
        as they are); moves, conversions and warp shuffles are left out."""
        text = text.strip()
        d = None if text == "%tid.x" or not text.startswith("%") else self._def(text)
        if d is None or depth > 40:
            return text
        _, op, args = d
        name = op.split(".")[0]
        if op.startswith("shfl.sync.idx") or (name in ("mov", "cvt") and len(args) == 1):
            return self.formula(args[0], depth + 1)
        if name in _INT_SYMBOLS and len(args) == 2:
            a, b = (self.formula(x, depth + 1) for x in args)
            expr = f"{a} {_INT_SYMBOLS[name]} {b}"
            return expr if depth == 0 else f"({expr})"
        return text


def _wrap(x: int, ptx_type: str) -> int:
    """x as a value of the PTX integer type ("s32", "u32", "b64", ...)."""
    bits = 64 if ptx_type.endswith("64") else 32
    x &= (1 << bits) - 1
    if ptx_type.startswith("s") and x >> (bits - 1):
        x -= 1 << bits
    return x


def barrier_ops(ptx: str) -> list[BarrierOp]:
    """Every protocol marker and barrier instruction of the PTX, in text order."""
    addr = SmemAddresses(ptx)
    out = []
    for i, ln in enumerate(ptx.splitlines()):
        m = _MARKER.search(ln)
        if m:
            out.append(BarrierOp(i, "marker", "", marker=m.groups()))
            continue
        m = _BARRIER_OP.match(ln)
        if not m or m.group(1).startswith(("bar.red", "barrier.red")):
            continue
        opcode, operands = m.group(1), m.group(2)
        kind = _op_kind(opcode)
        ops = [o.strip() for o in re.split(r",(?![^\[]*\])", operands)]
        if kind in ("sync", "named_arrive"):
            out.append(BarrierOp(i, kind, opcode, named_id=addr.value(ops[0]),
                                 named_operand=ops[0],
                                 threads=addr.value(ops[1]) if len(ops) > 1 else None))
            continue
        where = next((addr.operand(o) for o in ops if o.startswith("[")), None)
        out.append(BarrierOp(i, kind, opcode, offset=None if where is None else where[0],
                             dynamic=bool(where and where[1])))
    return out


def mbarrier_inits(ptx: str) -> list[tuple[int | None, int | None]]:
    """(offset from the SMEM base, arrival count) of every mbarrier.init."""
    addr = SmemAddresses(ptx)
    out = []
    for m in re.finditer(r"mbarrier\.init\S*\s+(\[[^\]]*\]),\s*([^;]+);", ptx):
        where = addr.operand(m.group(1))
        out.append((None if where is None else where[0], addr.value(m.group(2))))
    return out


def smem_operand_offsets(ptx: str, pattern: str, operand: int) -> list[tuple[int, bool]]:
    """Resolved SMEM addresses of operand `operand` (0-based, bracketed operands only) of each
    instruction matching `pattern` (a TMA copy's destination, a tcgen05.alloc's target)."""
    addr = SmemAddresses(ptx)
    out = []
    for m in re.finditer(rf"^\s*(?:@!?%\w+\s+)?{pattern}\S*\s+([^;]*);", ptx, re.M):
        brackets = re.findall(r"\[[^\]]*\]", m.group(1))
        if len(brackets) > operand:
            r = addr.operand(brackets[operand])
            if r is not None:
                out.append(r)
    return out


def smem_accesses(ptx: str) -> list[tuple[int, str, int, bool]]:
    """(line, "ld" | "st", offset from the dynamic SMEM base, plus a run-time index?) of every
    ld.shared / st.shared whose address resolves into the dynamic SMEM."""
    addr = SmemAddresses(ptx)
    out = []
    for i, ln in enumerate(ptx.splitlines()):
        m = re.match(r"\s*(?:@!?%\w+\s+)?(ld|st)\.shared(?:::cta)?\.\S+\s+([^;]*);", ln)
        if not m:
            continue
        where = next((addr.operand(b) for b in re.findall(r"\[[^\]]*\]", m.group(2))), None)
        if where is not None:
            out.append((i, m.group(1), where[0], where[1]))
    return out
