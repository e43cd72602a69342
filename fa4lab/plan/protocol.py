"""The barrier protocol table: every barrier, and each role's ordered program of barrier ops.

One table per arch (`fa4lab.plan.protocol_sm100.build_protocol`, `fa4lab.plan.sm90.build_protocol`),
carried by the plan as `plan.protocol`. Everything that speaks of barriers reads it:

  * the kernels: their SharedStorage declares the barrier arrays in this order with these
    stages, and every wait / arrive goes through `fa4lab.kernels.protocol`, by barrier name,
    checked at trace time against this table's sites;
  * the simulator: `expand` turns a program into the steps `fa4lab.plan.simulate` runs
    (`fa4lab.plan.steps`: Wait, Arrive, Commit, Issue, Work) for a CTA's T work tiles of N K/V
    blocks each;
  * the audit: `sites` is the static list of code sites (loops once, Q stages unrolled) that
    the compiled PTX must show, in order, role by role.

A program is a tuple of nodes:

    Op(kind, barrier, stage)    kind: wait | arrive | expect_tx | commit | cp_async_arrive |
                                sync | named_arrive (cp_async_arrive: each thread's
                                cp.async.mbarrier.arrive.noinc, an arrival once the thread's
                                cp.async copies landed)
    Step(what, stage)           work or an async issue between ops; the arch module's catalogue
                                turns it into simulator ops (costs, TMEM / SMEM regions, label)
    Loop(trips, body, tag)      a runtime loop; each trip is one K/V block step (j += 1)
    Unroll(var, count, body)    a compile-time repetition (range_constexpr): per Q stage, ...
    If(cond, body)              a condition (compile-time or runtime; the code is there either way)
    TileLoop(body)              a persistent CTA's runtime loop over its work tiles (T trips; j
                                starts at 0 in each): Note [persistent CTAs] in fa4lab.plan.sm100

Expressions (trips, cond, count, barrier names with {braces}) use: N K/V blocks of the tile,
M masked blocks, q the Q stages, i the Q stage, c a consumer's index, j the block step (of the
work tile), T the CTA's work tiles, t the work tile.
Stages: "i" (the Q stage), a number, an expression of the block step j ("j % 2": the S buffer of
the sm100 ping-pong plan, known at run time only), or a ring slot "K", "V", "K+1", "V-1" (the K
or V buffer of block step j + d; see Note [ring slots]).

Note [ring slots]
K/V buffers are used in load order. On sm100 K and V share one ring (slot 2j is K of step j,
2j + 1 its V: `ring == "kv"`); on sm90 K and V have a ring each (slot j: `ring == "k"`/"v").
A slot g is stage g % stages, used for the (g // stages)-th time. Block step j is the j-th
block a CTA visits; the kernels visit K/V blocks from the last (N - 1) down to 0, so step j is
block N - 1 - j, and the masked blocks (the highest) come first.
The sm100 ping-pong plan (one Q tile, Note [S ping-pong] in fa4lab.plan.sm100) issues the score
MMA of step j + 1 before the value MMA of step j, so its loads run one K ahead
(`ring == "kv_ahead"`): K_0, K_1, V_0, K_2, V_1, ..., K_N-1, V_N-2, V_N-1. Slot of K_s: 0 for
s = 0, else 2s - 1; of V_s: 2s + 2, but 2N - 1 for the last.

Note [phases from the table]
The k-th wait of a role on a barrier stage waits for that stage's k-th phase completion; a
barrier that starts released (an "empty" side) lets the first wait pass, so its k-th wait waits
for completion k - 1. The simulator derives every phase this way; the kernels keep the same
parities in their pipeline states.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

OP_KINDS = ("wait", "arrive", "expect_tx", "commit", "cp_async_arrive", "sync", "named_arrive")
MBARRIER_OPS = ("wait", "arrive", "expect_tx", "commit", "cp_async_arrive")
NAMED_OPS = ("sync", "named_arrive")


@dataclass(frozen=True)
class Op:
    kind: str
    barrier: str            # a name, or a template: "mma_turn{c}", "mma_turn{(c + 1) % q}"
    stage: str = "0"
    one: bool = False       # one elected thread arrives (else every thread of the role)

    def __post_init__(self):
        if self.kind not in OP_KINDS:
            raise ValueError(f"op kind {self.kind!r}: use one of {OP_KINDS}")


@dataclass(frozen=True)
class Step:
    what: str
    stage: str = ""


@dataclass(frozen=True)
class Loop:
    trips: str
    body: tuple
    tag: str = ""           # "masked" / "unmasked": what the catalogue costs a step at


@dataclass(frozen=True)
class Unroll:
    var: str
    count: str
    body: tuple


@dataclass(frozen=True)
class If:
    cond: str
    body: tuple


@dataclass(frozen=True)
class TileLoop:
    body: tuple


def per_stage(*body) -> Unroll:
    return Unroll("i", "q", tuple(body))


@dataclass(frozen=True)
class Program:
    """The code one or more roles run. `var` binds each role's index (softmax0 -> i = 0).

    `shared_code`: the kernel runs one code path for all `roles`, the index being a runtime
    value (sm90's consumers); otherwise each role has its own copy of the code (sm100's
    softmax warpgroups, unrolled at compile time).
    """

    name: str
    roles: tuple[str, ...]
    body: tuple
    var: str = ""
    shared_code: bool = False

    def index(self, role: str) -> int:
        return self.roles.index(role)


@dataclass(frozen=True)
class Site:
    """One barrier op in the code: what the binary must show, in this order, for `path`."""

    path: str               # the code path (a role, or the shared consumer code)
    kind: str
    barrier: str
    stage: int | None       # None: a ring slot, known at run time only
    loop: str | None        # the enclosing runtime loop ("load/loop0"), None outside loops

    def __str__(self) -> str:
        st = "ring" if self.stage is None else self.stage
        return f"{self.kind} {self.barrier}[{st}]"


@dataclass(frozen=True)
class Protocol:
    barriers: object                   # fa4lab.plan.barriers.BarrierGraph
    programs: tuple[Program, ...]

    def program(self, role: str) -> Program:
        for p in self.programs:
            if role in p.roles or role == p.name:
                return p
        raise KeyError(f"no program for role {role!r}; have {[p.name for p in self.programs]}")

    def roles(self) -> tuple[str, ...]:
        return tuple(r for p in self.programs for r in p.roles)

    def paths(self) -> tuple[str, ...]:
        """The code paths the binary has: a shared program once, else one per role."""
        return tuple(x for p in self.programs for x in ((p.name,) if p.shared_code else p.roles))

    @property
    def persistent(self) -> bool:
        """Whether the roles loop over work tiles (a persistent CTA runs several)."""
        return any(isinstance(n, TileLoop) for p in self.programs for n in p.body)

    def with_barriers(self, barriers) -> Protocol:
        return Protocol(barriers, self.programs)

    # ---- static: the code sites ----
    def sites(self, path: str, q: int, folded: bool = False) -> list[Site]:
        """The barrier ops of one code path in program order (each loop body once).

        `folded=False`: the code as the kernel writes it (what its trace walks); True: as the
        compiler leaves it, a condition `c == k` fixing c inside its body, so branches on c
        that cannot be taken there are gone (what the binary shows).
        """
        prog = self.program(path)
        env = {"q": q}
        if not prog.shared_code and prog.var:
            env[prog.var] = prog.index(path)
        out: list[Site] = []
        counter = [0]
        _static(self, path, prog.body, env, None, out, counter, folded)
        return out

    def first_use_only(self, q: int) -> set[str]:
        """Barriers every wait of which is a first wait on a released stage outside any loop:
        they never block (they would order work tiles, and the table runs one per CTA)."""
        waits: dict[str, list[Site]] = {}
        for path in self.paths():
            for s in self.sites(path, q):
                if s.kind in ("wait", "sync"):
                    waits.setdefault(s.barrier, []).append(s)
        out = set()
        for b in self.barriers.barriers:
            ws = waits.get(b.name, [])
            if b.starts_released and ws and all(s.loop is None for s in ws):
                stages = [(s.path, s.stage) for s in ws]
                if len(stages) == len(set(stages)):
                    out.add(b.name)
        return out

    # ---- JSON ----
    def to_dict(self) -> dict:
        return {"barriers": to_plain(self.barriers),
                "programs": [{"name": p.name, "roles": list(p.roles), "var": p.var,
                              "shared_code": p.shared_code, "body": _nodes_to_plain(p.body)}
                             for p in self.programs]}

    @classmethod
    def from_dict(cls, d: dict) -> Protocol:
        from fa4lab.plan.barriers import Barrier, BarrierGraph

        return cls(BarrierGraph(tuple(Barrier(**b) for b in d["barriers"]["barriers"])),
                   tuple(Program(p["name"], tuple(p["roles"]), _nodes_from_plain(p["body"]),
                                 p["var"], p["shared_code"]) for p in d["programs"]))


_NODES = {"Op": Op, "Step": Step, "Loop": Loop, "Unroll": Unroll, "If": If,
          "TileLoop": TileLoop}


def to_plain(x):
    """Dataclasses, dicts, lists and tuples as plain dicts and lists, for JSON."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: to_plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, dict):
        return {k: to_plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [to_plain(v) for v in x]
    return x


def _nodes_to_plain(body) -> list:
    out = []
    for n in body:
        d = {"node": type(n).__name__}
        for k, v in n.__dict__.items():
            d[k] = _nodes_to_plain(v) if k == "body" else v
        out.append(d)
    return out


def _nodes_from_plain(body) -> tuple:
    out = []
    for d in body:
        kw = {k: (_nodes_from_plain(v) if k == "body" else v) for k, v in d.items()
              if k != "node"}
        out.append(_NODES[d["node"]](**kw))
    return tuple(out)


# ---- expressions ----
_NAME = re.compile(r"[A-Za-z_]\w*")


def _names(expr: str) -> set[str]:
    return set(_NAME.findall(expr)) - {"max", "min", "and", "or", "not"}


def evaluate(expr: str, env: dict):
    return eval(expr, {"__builtins__": {}, "max": max, "min": min}, dict(env))  # noqa: S307


def barrier_name(template: str, env: dict) -> str:
    """The barrier a template names in `env`; the template itself where a name is unknown
    there (sm90's shared consumer code: `epilogue{c}` with c a runtime value)."""
    def sub(m):
        return str(evaluate(m.group(1), env)) if _names(m.group(1)) <= set(env) else m.group(0)

    return re.sub(r"\{([^}]*)\}", sub, template)


def ring_slot(barrier, stage: str, j: int, n_blocks: int | None = None,
              tile: int = 0) -> tuple[int, int]:
    """(stage index, use) of ring slot `stage` ("K", "V+1", ...) at block step j of work tile
    `tile` of n_blocks (Note [ring slots]; only the "kv_ahead" order and tiles after the first
    need n_blocks): the ring runs on across a persistent CTA's tiles, 2N slots per tile with K
    and V in one ring, else N."""
    m = re.fullmatch(r"([KV])([+-]\d+)?", stage)
    step = j + int(m.group(2) or 0)
    is_v = m.group(1) == "V"
    if barrier.ring == "kv":
        g = 2 * step + is_v
    elif barrier.ring == "kv_ahead":
        if n_blocks is None:
            raise ValueError("a kv_ahead ring slot needs the tile's block count")
        g = (2 * step + 2 if step < n_blocks - 1 else 2 * step + 1) if is_v else max(
            2 * step - 1, 0)
    else:
        g = step
    if tile:
        g += tile * n_blocks * (2 if barrier.ring in ("kv", "kv_ahead") else 1)
    return g % barrier.stages, g // barrier.stages


def _static(proto, path, body, env, loop, out, counter, folded=False) -> None:
    for n in body:
        if isinstance(n, Op):
            name = barrier_name(n.barrier, env)
            if n.stage[:1] in ("K", "V") or not _names(n.stage) <= set(env):
                stage = None    # a ring slot, or a stage of the block step: run time only
            else:
                stage = int(evaluate(n.stage, env))
            out.append(Site(path, n.kind, name, stage, loop))
        elif isinstance(n, (Loop, TileLoop)):
            counter[0] += 1
            _static(proto, path, n.body, env, f"{path}/loop{counter[0] - 1}", out, counter,
                    folded)
        elif isinstance(n, Unroll):
            for k in range(int(evaluate(n.count, env))):
                _static(proto, path, n.body, {**env, n.var: k}, loop, out, counter, folded)
        elif isinstance(n, If):
            # A condition the compiler decides (over q and the unrolled indices) removes code;
            # a runtime one (N, M, j, a shared consumer's c) keeps it in the binary.
            if _names(n.cond) <= set(env) and not evaluate(n.cond, env):
                continue
            inner = dict(env)
            m = re.fullmatch(r"\s*(\w+)\s*==\s*(.+)", n.cond)
            if folded and m and m.group(1) not in env and _names(m.group(2)) <= set(env):
                inner[m.group(1)] = evaluate(m.group(2), env)
            _static(proto, path, n.body, inner, loop, out, counter, folded)


# ---- dynamic: a CTA's work tiles, for the simulator ----
@dataclass
class _Expansion:
    proto: Protocol
    role: str
    threads: int
    catalogue: object          # callable(step: Step, env: dict, stage: int | None) -> list
    waits: dict = field(default_factory=dict)
    ops: list = field(default_factory=list)


def expand(proto: Protocol, role: str, threads: int, n_blocks: int, masked_blocks: int,
           q: int, catalogue, n_tiles: int = 1) -> list:
    """`role`'s program as simulator ops (see Note [phases from the table]) over `n_tiles`
    work tiles of `n_blocks` K/V blocks (a TileLoop's trips; a table without one runs one).

    `catalogue(step, env, stage)` gives the simulator ops of a Step; env holds N, M, q, j, the
    block index `block` (N - 1 - j), the loop's `tag`, i / c, and t, the work tile.
    """
    prog = proto.program(role)
    if n_tiles != 1 and not proto.persistent:
        raise ValueError(f"n_tiles={n_tiles}: this protocol runs one work tile per CTA")
    env = {"N": n_blocks, "M": masked_blocks, "q": q, "j": 0, "tag": "", "T": n_tiles, "t": 0}
    if prog.var:
        env[prog.var] = prog.index(role)
    ex = _Expansion(proto, role, threads, catalogue)
    _dynamic(ex, prog.body, env)
    return ex.ops


def _stage(ex, b, stage: str, env) -> int:
    if stage[:1] in ("K", "V"):
        return ring_slot(b, stage, env["j"], env["N"], env["t"])[0]
    return int(evaluate(stage, env))


def _dynamic(ex: _Expansion, body, env) -> None:
    from fa4lab.plan.steps import Arrive, Commit, Wait

    for n in body:
        if isinstance(n, Op):
            b = ex.proto.barriers.barrier(barrier_name(n.barrier, env))
            s = _stage(ex, b, n.stage, env)
            count = 1 if n.one else ex.threads
            if n.kind in ("wait", "sync"):
                if n.kind == "sync":
                    ex.ops.append(Arrive(b.name, s, count))
                u = ex.waits.get((b.name, s), 0)
                ex.waits[(b.name, s)] = u + 1
                ex.ops.append(Wait(b.name, s, u - 1 if b.starts_released else u))
            elif n.kind in ("arrive", "named_arrive"):
                ex.ops.append(Arrive(b.name, s, count))
            elif n.kind == "expect_tx":
                ex.ops.append(Arrive(b.name, s, 1, expect_tx=b.slot_tx_bytes(n.stage)))
            elif n.kind == "cp_async_arrive":
                ex.ops.append(Commit("cpasync", b.name, s, 1 if n.one else ex.threads))
            else:
                ex.ops.append(Commit("tensor", b.name, s))
        elif isinstance(n, Step):
            stage = None
            if n.stage:
                stage = n.stage if n.stage[:1] in ("K", "V") else int(evaluate(n.stage, env))
            ex.ops += ex.catalogue(n, {**env, "block": env["N"] - 1 - env["j"]}, stage)
        elif isinstance(n, Loop):
            for _ in range(int(evaluate(n.trips, env))):
                _dynamic(ex, n.body, {**env, "tag": n.tag})
                env["j"] += 1
        elif isinstance(n, TileLoop):
            for t in range(env["T"]):
                _dynamic(ex, n.body, {**env, "t": t, "j": 0})
        elif isinstance(n, Unroll):
            for k in range(int(evaluate(n.count, env))):
                inner = {**env, n.var: k}
                _dynamic(ex, n.body, inner)
                env["j"] = inner["j"]
        elif isinstance(n, If):
            if evaluate(n.cond, env):
                inner = dict(env)
                _dynamic(ex, n.body, inner)
                env["j"] = inner["j"]
