"""The ladder to the B200 kernel: four kernels, each one idea more than the last (notebook 05).

    from fa4lab.kernels.ladder import compile_step, audit_step, measure, STEPS
    cf = compile_step(1)                  # a CompiledForward: PTX, cubin, seconds, plan
    audit_step(1, cf).to_markdown()       # what must be in the binary, found or not
    measure(cf)                           # the numbers of the ladder's table

1. `step1_mma.ScoreTileSm100`: one tcgen05.mma into TMEM and a tcgen05.ld back (S = Q K^T of
   one tile, stored to global memory);
2. `step2_scores.ScoreSoftmaxSm100`: S only -- the score MMA over every key block and an
   online softmax (row max, row sum, LSE); no P, no O; one S buffer;
3. the full kernel with one Q tile (q_stage 1) and two S buffers that alternate over the key
   blocks (`plan_forward(spec, arch="sm100", q_stage=1)`; head_dim 256 plans it by default);
4. the full kernel, two Q tiles per CTA (the default plan).

Steps 1-2 take their numbers (tiles, S's TMEM columns, the barriers' stages, arrivals and TMA
bytes) from the sm100 plan of the same spec; steps 3-4 are `fa4lab.kernels.compile
.compile_forward` of a plan and audited by `fa4lab.kernels.audit` against it. Every step
compiles for sm_100a on any machine (fake tensors, CUTE_DSL_ARCH); running one needs a B200.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from fa4lab.spec import AttentionSpec

__all__ = ["STEPS", "Step", "audit_step", "compile_step", "ladder_spec", "ladder_table",
           "lse_only", "measure", "score_tile", "step_plan"]


@dataclass(frozen=True)
class Step:
    number: int
    title: str
    adds: str          # what this step adds to the one before


STEPS = (
    Step(1, "one MMA", "TMA of Q and K, one tcgen05.mma into TMEM, tcgen05.commit on an mbarrier, "
                       "tcgen05.ld back"),
    Step(2, "S only", "a loop over key blocks: a K ring (kv_full / kv_empty), s_full / p_ready "
                      "around one S buffer, the online softmax and LSE"),
    Step(3, "q_stage 1", "P over S, O += P V, the correction and epilogue roles; two S buffers "
                         "alternate over the key blocks"),
    Step(4, "two Q tiles", "a second Q tile and softmax warpgroup: S_0, S_1, O_0, O_1 in 512 "
                           "TMEM columns"),
)


def ladder_spec(head_dim: int = 128, dtype: str = "bf16") -> AttentionSpec:
    """The problem every step is compiled for: non-causal, LSE out (sizes are symbolic in the
    binary; these only pick the plan)."""
    return AttentionSpec(1, 4096, 4096, 16, 16, head_dim, dtype=dtype, return_lse=True)


def step_plan(n: int, spec: AttentionSpec | None = None):
    """The sm100 plan step `n` is built from: the default plan for steps 1, 2 and 4, the
    q_stage 1 plan for step 3."""
    from fa4lab.plan import plan_forward

    spec = ladder_spec() if spec is None else spec
    if n not in (1, 2, 3, 4):
        raise ValueError(f"the ladder has steps 1-4, not {n!r}")
    return plan_forward(spec, arch="sm100", **({"q_stage": 1} if n == 3 else {}))


_CACHE: dict = {}


def compile_step(n: int, spec: AttentionSpec | None = None, keep_dir=None):
    """Compile step `n` for sm_100a with fake tensors (any machine); a
    `fa4lab.kernels.compile.CompiledForward`. Cached per (step, spec) in this process."""
    spec = ladder_spec() if spec is None else spec
    key = (n, spec)
    if key not in _CACHE:
        plan = step_plan(n, spec)
        if n in (3, 4):
            from fa4lab.kernels.compile import compile_forward

            # A folder per step: compile_forward names its folder after the spec, which steps
            # 3 and 4 share, and the DSL names the artifacts after the kernel class.
            keep = Path(keep_dir) / f"ladder-step{n}" if keep_dir is not None else None
            _CACHE[key] = compile_forward(plan, arch="sm100a", keep_dir=keep)
        else:
            _CACHE[key] = _compile_small(n, plan, keep_dir)
    return _CACHE[key]


def _compile_small(n: int, plan, keep_dir):
    import cutlass.cute as cute

    from fa4lab.kernels.compile import CompiledForward, newest_artifact, target_arch

    module = _small_module(n)
    kernel = module.KERNEL(plan)
    root = Path(keep_dir) if keep_dir is not None else Path(tempfile.mkdtemp(prefix="fa4lab-"))
    keep = root / f"ladder-step{n}-hd{plan.spec.head_dim}-{plan.spec.dtype}"
    keep.mkdir(parents=True, exist_ok=True)
    start_wall = time.time()
    with target_arch("sm_100a"):
        t0 = time.perf_counter()
        compiled = cute.compile(kernel, *module.fake_args(plan), options=(
            f"--enable-tvm-ffi --keep-ptx --keep-cubin --dump-dir={keep}"))
        seconds = time.perf_counter() - t0
    return CompiledForward(
        arch="sm100a", plan=plan, kernel=kernel, compiled=compiled, seconds=seconds,
        keep_dir=keep, ptx_path=newest_artifact(keep, ".ptx", start_wall),
        cubin_path=newest_artifact(keep, ".cubin", start_wall),
        smem_bytes=int(kernel.shared_storage.size_in_bytes()))


def _small_module(n: int):
    if n == 1:
        from fa4lab.kernels.ladder import step1_mma

        return step1_mma
    from fa4lab.kernels.ladder import step2_scores

    return step2_scores


# The binary's tcgen05 and barrier instructions the ladder counts (PTX regexes).
PTX_OPS = {
    "tcgen05.alloc": r"\btcgen05\.alloc\.",
    "tcgen05.mma": r"\btcgen05\.mma\.cta_group",
    "tcgen05.commit": r"\btcgen05\.commit\.",
    "tcgen05.ld": r"\btcgen05\.ld\.",
    "tcgen05.st": r"\btcgen05\.st\.",
    "tcgen05.dealloc": r"\btcgen05\.dealloc\.",
    "mbarrier.init": r"\bmbarrier\.init\.",
    "named barriers": r"\bbarrier\.(?:sync|arrive)\b(?!\.aligned)",
}


def measure(cf) -> dict:
    """The ladder table's numbers of one compiled step: PTX counts of `PTX_OPS`, TMEM columns
    allocated, threads, registers per thread, spills and SASS instructions."""
    from fa4lab.kernels import binary

    sass_text = binary.sass(cf.cubin_path)
    ops = binary.sass_opcodes(sass_text)
    out = {name: binary.ptx_count(cf.ptx, pattern) for name, pattern in PTX_OPS.items()}
    out["TMEM columns"] = sum(binary.tmem_alloc_columns(cf.ptx))
    out["threads"] = cf.kernel.threads_per_cta
    out["registers"] = binary.resource_usage(cf.cubin_path)["registers"]
    out["spills (STL/LDL)"] = binary.count_prefix(ops, "STL") + binary.count_prefix(ops, "LDL")
    out["SASS instructions"] = sum(ops.values())
    out["MUFU.EX2"] = binary.count_prefix(ops, "MUFU.EX2")
    return out


def audit_step(n: int, cf):
    """What must be in step `n`'s binary (an `fa4lab.kernels.binary.Audit`). Steps 1-2: exactly
    the tcgen05 alloc / mma / commit / ld / dealloc and mbarrier inits the kernel issues (its
    `expected`), S's TMEM columns from the plan, 0 spills, and step 2's exp2 (one per score and
    one per block for the rescale). Steps 3-4: the full audit against the plan
    (`fa4lab.kernels.audit`)."""
    from fa4lab.kernels import binary
    from fa4lab.kernels.audit import audit_compiled

    if n in (3, 4):
        return audit_compiled(cf)
    kernel, plan = cf.kernel, cf.plan
    found = measure(cf)
    rows = [binary.AuditRow("compile seconds", "-", round(cf.seconds, 1), True,
                            "cute.compile, fake tensors")]
    for name, want in kernel.expected.items():
        rows.append(binary.AuditRow(f"{name} (PTX)", want, found[name], found[name] == want))
    cols = binary.tmem_alloc_columns(cf.ptx)
    rows.append(binary.AuditRow("TMEM columns (tcgen05.alloc)", [kernel.alloc_cols], cols,
                                cols == [kernel.alloc_cols],
                                f"S_0's {plan.tmem.region('S', 0).columns} fp32 columns"))
    budget = plan.hardware.registers_per_sm // found["threads"]
    rows.append(binary.AuditRow("registers per thread", f"<= {min(budget, 255)}",
                                found["registers"], found["registers"] <= min(budget, 255)))
    rows.append(binary.AuditRow("spill instructions (STL/LDL)", 0, found["spills (STL/LDL)"],
                                found["spills (STL/LDL)"] == 0))
    if n == 2:
        want = plan.tiles.n_block + 1
        rows.append(binary.AuditRow("MUFU.EX2", want, found["MUFU.EX2"],
                                    found["MUFU.EX2"] == want,
                                    f"{plan.tiles.n_block} scores of a row + its rescale"))
    return binary.Audit(f"ladder step {n} ({STEPS[n - 1].title}): "
                        f"{binary.describe(plan.spec)}", tuple(rows))


def ladder_table(measured: dict) -> str:
    """Markdown: one row per compiled step ({step number: `measure(...)`}), what it adds and
    its numbers."""
    cols = ["tcgen05.mma", "tcgen05.ld", "tcgen05.st", "tcgen05.commit", "mbarrier.init",
            "named barriers", "TMEM columns", "threads", "registers", "SASS instructions"]
    lines = ["| step | adds | " + " | ".join(cols) + " |", "|---" * (len(cols) + 2) + "|"]
    for n, m in sorted(measured.items()):
        s = STEPS[n - 1]
        lines.append(f"| {n}. {s.title} | {s.adds} | "
                     + " | ".join(str(m[c]) for c in cols) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------- running steps 1-2 (a B200)
def _check_cuda(name: str, *tensors) -> None:
    import torch

    for t in tensors:
        if not (t.is_cuda and t.dtype in (torch.bfloat16, torch.float16)):
            raise ValueError(f"{name} takes bf16 or fp16 CUDA tensors of a B200-class GPU; got "
                             f"{t.dtype} on {t.device}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: the last dim must be contiguous (call .contiguous())")
    if len({t.dtype for t in tensors}) != 1:
        raise ValueError(f"{name}: q and k must have one dtype, got "
                         f"{[str(t.dtype) for t in tensors]}")


def score_tile(q, k):
    """Step 1 on a GPU: S = q k^T (float32, unscaled) of one tile, q (seqlen_q, d), k (seqlen_k,
    d), seqlen_q <= m_block and seqlen_k <= n_block of the plan."""
    import torch

    _check_cuda("score_tile", q, k)
    if q.dim() != 2 or k.dim() != 2 or q.shape[1] != k.shape[1]:
        raise ValueError(f"score_tile takes q (seqlen_q, d) and k (seqlen_k, d) with one d; got "
                         f"{tuple(q.shape)} and {tuple(k.shape)}")
    dtype = "bf16" if q.dtype == torch.bfloat16 else "fp16"
    spec = ladder_spec(q.shape[1], dtype)
    tiles = step_plan(1, spec).tiles
    if not (1 <= q.shape[0] <= tiles.m_block and 1 <= k.shape[0] <= tiles.n_block):
        raise ValueError(f"score_tile computes one tile: seqlen_q in [1, {tiles.m_block}] and "
                         f"seqlen_k in [1, {tiles.n_block}], got {q.shape[0]} and {k.shape[0]}; "
                         f"step 2 loops over key blocks")
    s = torch.empty(q.shape[0], k.shape[0], device=q.device, dtype=torch.float32)
    compile_step(1, spec).compiled(q, k, s)
    return s


def lse_only(q, k, softmax_scale: float | None = None):
    """Step 2 on a GPU: the LSE (batch, heads_q, seqlen_q) float32 of non-causal attention of q
    (batch, seqlen_q, heads_q, d) and k (batch, seqlen_k, heads_kv, d), GQA allowed."""
    import torch

    from fa4lab.kernels.device.arguments import scale_args

    _check_cuda("lse_only", q, k)
    if q.dim() != 4 or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] \
            or q.shape[2] % k.shape[2]:
        raise ValueError(f"lse_only takes q (batch, seqlen_q, heads_q, d), k (batch, seqlen_k, "
                         f"heads_kv, d), heads_kv dividing heads_q; got {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")
    dtype = "bf16" if q.dtype == torch.bfloat16 else "fp16"
    g = q.shape[2] // k.shape[2]
    spec = AttentionSpec(1, 4096, 4096, g, 1, q.shape[3], dtype=dtype, return_lse=True)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device, dtype=torch.float32)
    scale_log2, _ = scale_args(softmax_scale, q.shape[3])
    compile_step(2, spec).compiled(q, k, lse, scale_log2)
    return lse
