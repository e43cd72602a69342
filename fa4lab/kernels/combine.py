"""The split-KV combine kernel: merge num_splits partial outputs and LSEs into out (and lse).

Split-KV decode (`fa4lab.splitkv`) gives each (batch, head, row tile) num_splits CTAs; each
writes out_partial[s] (normalised over its own keys) and lse_partial[s] in float32. This kernel
merges them with the rule of notebook 01 (`fa4lab.online_softmax.merge_out_lse`, written once
in device form in `fa4lab.kernels.device.merge`):

    out_partial  (num_splits, batch, seqlen_q, heads, head_dim_v)  float32
    lse_partial  (num_splits, batch, seqlen_q, heads)              float32, natural log
    ->  out      (batch, seqlen_q, heads, head_dim_v)               bf16 / fp16 / float32
        lse      (batch, heads, seqlen_q)                           float32 (optional)

out has the partials' layout minus the split axis; lse is laid out like the forward kernels'
(`fa4lab.kernels.launch.forward`). One CTA per tile of `CombinePlan.tile_rows` rows of one batch
(a row is one (query position, head)): first each warp reads its rows' split LSEs and keeps the
weights in SMEM (Note [combine in two passes]), then every thread streams 16-byte pieces of the
partial outputs of its rows. Batch, sequence length, heads and num_splits (up to the plan's
num_splits_max) are runtime values: one compile per `CombinePlan` (head_dim_v, out dtype, lse
or not, num_splits_max, sink or not) and arch. Plain loads and stores only (no TMA, no MMA), so
the same code compiles for sm_90a and sm_100a. A learnable sink joins here, once (Note [sinks in
the combine]).

`combine` is `fa4lab.splitkv.combine` with this kernel where it takes the partials (the
split-KV launch's merge).

    from fa4lab.kernels.combine import combine_cuda, compile_combine
    out, lse = combine_cuda(out_partial, lse_partial, out_dtype=torch.bfloat16, return_lse=True)
    cc = compile_combine(head_dim_v=128, dtype="bf16", arch="sm90a")   # on a CPU: cc.cubin_path
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from fa4lab.errors import (
    InputError,
    InputTypeError,
    PlanError,
    UnsupportedArchError,
    check_same_device,
)
from fa4lab.kernels.device.merge import merge_basis, merge_finish, merge_weight
from fa4lab.splitkv import MAX_SPLITS, check_partials, merge_partials

# Tuning knobs (Note [combine in two passes]).
COMBINE_THREADS = 128      # four warps per CTA
COMBINE_VEC = 4            # float32 per thread and load: 16 bytes
COMBINE_MIN_ROWS = 8       # rows per CTA at least: the LSE pass gives each warp two rows
COMBINE_SMEM_LIMIT = 48 * 1024   # dynamic SMEM bytes a launch gets without opting in
OUT_DTYPES = ("bf16", "fp16", "fp32")
WARP = 32

# Note [combine in two passes]
# A row's weights need the max of all its split LSEs before any partial output is read, so the
# kernel makes two passes. Pass 1 (LSE): warp w takes rows w, w + 4, ...; its lanes read the
# splits lane, lane + 32, ... of a row (num_splits <= 128: at most four loads per lane), keep
# them in SMEM, reduce the max over the warp, turn each into its weight (`merge_weight`) in
# place and reduce the sum; lane 0 keeps the row's factor 1 / sum and writes the LSE. Pass 2 (O):
# head_dim_v / 4 threads share a row, each owning 4 columns; a thread walks the splits in order
# and adds w_s * out_partial[s] (one 16-byte load) into four float32 registers, then scales by
# the factor and stores 4 elements. A split of weight 0 (empty) adds 0 by a select, not by a
# product, so whatever an empty split left in its bytes cannot turn into a NaN; the loads stay
# unconditional, so the unrolled loop keeps several in flight instead of one per branch. The
# weight table is (tile_rows, num_splits_max + 1) float32: the pad puts the rows of one warp's
# pass-2 reads in different banks. A row past the end of the problem reads and writes nothing.

# Note [sinks in the combine]
# A learnable sink is not a split's business (`fa4lab.splitkv`): it enters once, here, as one
# more partial with out 0 and LSE sink[head] (Note [sinks] in fa4lab.kernels.device.softmax).
# In pass 1 every lane starts its max from the sink and lane 0 adds the sink's weight to the
# sum; pass 2 has nothing to add for it (its out is 0), so only the factor and the LSE change.


@dataclass(frozen=True)
class CombinePlan:
    """Every number of one combine kernel, checked here (`fa4lab.kernels.combine`)."""

    head_dim_v: int
    dtype: str                     # the output's: "bf16" | "fp16" | "fp32"
    return_lse: bool = True
    num_splits_max: int = MAX_SPLITS
    learnable_sink: bool = False   # Note [sinks in the combine]

    def __post_init__(self):
        if self.dtype not in OUT_DTYPES:
            raise PlanError(f"the combine writes out as one of {OUT_DTYPES}, not {self.dtype!r}")
        dv = self.head_dim_v
        if isinstance(dv, bool) or not isinstance(dv, int) or dv < COMBINE_VEC \
                or dv % COMBINE_VEC or dv // COMBINE_VEC > COMBINE_THREADS:
            raise PlanError(f"the combine takes head_dim_v a multiple of {COMBINE_VEC} up to "
                            f"{COMBINE_VEC * COMBINE_THREADS}, got {dv!r}")
        n = self.num_splits_max
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SPLITS:
            raise PlanError(f"num_splits_max must be an int in [1, {MAX_SPLITS}] "
                            f"(fa4lab.splitkv.MAX_SPLITS), got {n!r}")
        if self.smem_bytes > COMBINE_SMEM_LIMIT:
            raise PlanError(f"head_dim_v {dv} puts {self.tile_rows} rows in a CTA, whose weight "
                            f"table needs {self.smem_bytes} bytes of shared memory (more than "
                            f"{COMBINE_SMEM_LIMIT}); lower num_splits_max or use a wider "
                            f"head_dim_v")

    @property
    def threads_per_row(self) -> int:
        return self.head_dim_v // COMBINE_VEC

    @property
    def rows_per_pass(self) -> int:
        """Rows the CTA's threads cover at once in pass 2 (Note [combine in two passes])."""
        return COMBINE_THREADS // self.threads_per_row

    @property
    def passes(self) -> int:
        return -(-COMBINE_MIN_ROWS // self.rows_per_pass)

    @property
    def tile_rows(self) -> int:
        return self.rows_per_pass * self.passes

    @property
    def weight_stride(self) -> int:
        return self.num_splits_max + 1

    @property
    def smem_bytes(self) -> int:
        """The weight table and the rows' factors, float32."""
        return 4 * (self.tile_rows * self.weight_stride + self.tile_rows)

    def name(self, arch: str) -> str:
        """e.g. "combine-sm90a-dv128-bf16-lse-s128": what one compiled kernel bakes in."""
        return (f"combine-{arch}-dv{self.head_dim_v}-{self.dtype}-"
                f"{'lse' if self.return_lse else 'nolse'}-s{self.num_splits_max}"
                + ("-sink" if self.learnable_sink else ""))


class SplitKVCombine:
    """The combine kernel of one `CombinePlan` (Note [combine in two passes])."""

    def __init__(self, plan: CombinePlan):
        self.plan = plan
        self.tile_rows = plan.tile_rows
        self.rows_per_pass = plan.rows_per_pass
        self.passes = plan.passes
        self.tpr = plan.threads_per_row
        self.splits_max = plan.num_splits_max
        self.weight_stride = plan.weight_stride

    @cute.jit
    def __call__(
        self,
        mOp: cute.Tensor,           # (num_splits, batch, seqlen_q, heads, head_dim_v) fp32
        mLSEp: cute.Tensor,         # (num_splits, batch, seqlen_q, heads) fp32
        mO: cute.Tensor,            # (batch, seqlen_q, heads, head_dim_v) bf16 / fp16 / fp32
        mLSE: cute.Tensor | None,   # (batch, heads, seqlen_q) fp32, or None
        mSink: cute.Tensor | None,  # (heads,) fp32 learnable sink logits, or None
        stream,
    ):
        if const_expr(self.plan.return_lse != (mLSE is not None)):
            raise ValueError("a combine kernel with return_lse takes an lse tensor, and only it")
        if const_expr(self.plan.learnable_sink != (mSink is not None)):
            raise ValueError("a combine kernel with learnable_sink takes a sink tensor, and only "
                             "it")
        rows = cute.size(mO.shape[1]) * cute.size(mO.shape[2])
        grid = [(rows + self.tile_rows - 1) // self.tile_rows, cute.size(mO.shape[0]), 1]
        self.kernel(mOp, mLSEp, mO, mLSE, mSink).launch(
            grid=grid, block=[COMBINE_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mOp: cute.Tensor, mLSEp: cute.Tensor, mO: cute.Tensor,
               mLSE: cute.Tensor | None, mSink: cute.Tensor | None):
        tile, batch, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        sW = smem.allocate_tensor(Float32, cute.make_layout(
            (self.tile_rows, self.splits_max), stride=(self.weight_stride, 1)), 16)
        sFactor = smem.allocate_tensor(Float32, cute.make_layout(self.tile_rows), 16)
        self.lse_pass(mLSEp, mLSE, mSink, sW, sFactor, tile, batch)
        cute.arch.sync_threads()
        self.out_pass(mOp, mO, sW, sFactor, tile, batch)

    @cute.jit
    def row_coords(self, tile, r, heads, rows):
        """(valid, position, head) of tile row r: rows run over (seqlen_q, heads), heads fastest."""
        row = tile * self.tile_rows + r
        pos = row // heads
        return row < rows, pos, row - pos * heads

    # ---- pass 1: each row's LSEs -> weights (SMEM), factor and LSE ----------------------------
    @cute.jit
    def lse_pass(self, mLSEp: cute.Tensor, mLSE: cute.Tensor | None, mSink: cute.Tensor | None,
                 sW: cute.Tensor, sFactor: cute.Tensor, tile, batch):
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        num_splits = cute.size(mLSEp.shape[0])
        heads = cute.size(mLSEp.shape[3])
        rows = cute.size(mLSEp.shape[2]) * heads
        warps = COMBINE_THREADS // WARP
        for i in cutlass.range_constexpr(-(-self.tile_rows // warps)):
            r = warp + i * warps
            if r < self.tile_rows:
                valid, pos, head = self.row_coords(tile, r, heads, rows)
                lse_max = -Float32.inf
                sink = -Float32.inf
                if valid:
                    if const_expr(mSink is not None):
                        sink = mSink[head]
                        lse_max = sink
                    for s in cutlass.range(lane, num_splits, WARP):
                        x = mLSEp[s, batch, pos, head]
                        sW[r, s] = x
                        lse_max = cute.arch.fmax(lse_max, x)
                lse_max = cute.arch.warp_reduction_max(lse_max)
                basis = merge_basis(lse_max)
                total = Float32(0.0)
                if const_expr(mSink is not None):
                    if lane == 0:
                        total = merge_weight(sink, basis)
                if valid:
                    for s in cutlass.range(lane, num_splits, WARP):
                        w = merge_weight(sW[r, s], basis)
                        sW[r, s] = w
                        total = total + w
                total = cute.arch.warp_reduction_sum(total)
                factor, lse = merge_finish(basis, total)
                if lane == 0:
                    sFactor[r] = factor
                    if const_expr(mLSE is not None):
                        if valid:
                            mLSE[batch, head, pos] = lse

    # ---- pass 2: out = factor * sum_s w_s out_partial[s] ----------------------------------------
    @cute.jit
    def out_pass(self, mOp: cute.Tensor, mO: cute.Tensor, sW: cute.Tensor, sFactor: cute.Tensor,
                 tile, batch):
        tidx, _, _ = cute.arch.thread_idx()
        num_splits = cute.size(mOp.shape[0])
        heads = cute.size(mO.shape[2])
        rows = cute.size(mO.shape[1]) * heads
        row_in_pass = tidx // self.tpr
        col = tidx - row_in_pass * self.tpr
        acc = cute.make_rmem_tensor(COMBINE_VEC, Float32)
        part = cute.make_rmem_tensor(COMBINE_VEC, Float32)
        if row_in_pass < self.rows_per_pass:
            for p in cutlass.range_constexpr(self.passes):
                r = p * self.rows_per_pass + row_in_pass
                valid, pos, head = self.row_coords(tile, r, heads, rows)
                if valid:
                    acc.fill(0.0)
                    for s in cutlass.range(num_splits):
                        w = sW[r, s]
                        part.store(cute.local_tile(mOp[s, batch, pos, head, None],
                                                   (COMBINE_VEC,), (col,)).load())
                        for j in cutlass.range_constexpr(COMBINE_VEC):
                            acc[j] = acc[j] + (part[j] * w if w > Float32(0.0)
                                               else Float32(0.0))
                    gO = cute.local_tile(mO[batch, pos, head, None], (COMBINE_VEC,), (col,))
                    gO.store((acc.load() * sFactor[r]).to(mO.element_type))


# ---- compile -----------------------------------------------------------------------------------
def _dsl_dtype(dtype: str):
    return {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp32": cutlass.Float32}[dtype]


def fake_args(plan: CombinePlan):
    """Fake out_partial, lse_partial, out, lse (None without return_lse), sink (None without a
    learnable sink) and the stream: the kernel's contract. num_splits, batch, seqlen_q and heads
    are symbolic 32-bit values, strides symbolic 64-bit; the last dims have stride 1, and
    out_partial and out have strides divisible by 4 elements and 16- (out: 4 * element size-)
    byte alignment, so each thread's 4 columns are one vector load or store (TVM-FFI checks this
    on every call: Note [TVM-FFI launch] in fa4lab.kernels.compile)."""
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    ns, b, sq, h = (cute.sym_int() for _ in range(4))
    out_type = _dsl_dtype(plan.dtype)

    def strides(n, divisibility=1):
        return tuple(cute.sym_int64(divisibility=divisibility) for _ in range(n))

    out_p = make_fake_tensor(Float32, (ns, b, sq, h, plan.head_dim_v),
                             (*strides(4, COMBINE_VEC), 1), assumed_align=4 * COMBINE_VEC)
    lse_p = make_fake_tensor(Float32, (ns, b, sq, h), (*strides(3), 1), assumed_align=4)
    out = make_fake_tensor(out_type, (b, sq, h, plan.head_dim_v), (*strides(3, COMBINE_VEC), 1),
                           assumed_align=out_type.width // 8 * COMBINE_VEC)
    lse = (make_fake_tensor(Float32, (b, h, sq), strides(3), assumed_align=4)
           if plan.return_lse else None)
    sink = (make_fake_tensor(Float32, (h,), strides(1), assumed_align=4)
            if plan.learnable_sink else None)
    return [out_p, lse_p, out, lse, sink, make_fake_stream(use_tvm_ffi_env_stream=True)]


def _compile(plan: CombinePlan, arch: str, options: str = ""):
    """(compiled function, seconds) of `plan`'s kernel for "sm90a" / "sm100a"."""
    from fa4lab.kernels.compile import target_arch

    args = fake_args(plan)
    with target_arch("sm_" + arch.removeprefix("sm")):
        t0 = time.perf_counter()
        compiled = cute.compile(SplitKVCombine(plan), *args,
                                options=" ".join(("--enable-tvm-ffi", options)))
    return compiled, time.perf_counter() - t0


@dataclass(frozen=True)
class CompiledCombine:
    """One compiled combine kernel and where its artifacts are."""

    arch: str             # "sm100a" | "sm90a"
    plan: CombinePlan
    compiled: object      # on a GPU of that arch: (out_partial, lse_partial, out, lse, sink)
    seconds: float        # wall time of cute.compile
    keep_dir: Path
    ptx_path: Path
    cubin_path: Path


def compile_combine(num_splits_max: int = MAX_SPLITS, *, head_dim_v: int, dtype: str = "bf16",
                    arch: str = "sm100a", return_lse: bool = True, learnable_sink: bool = False,
                    keep_dir=None) -> CompiledCombine:
    """Compile the combine kernel for `arch` with fake tensors (no GPU needed); PTX and cubin are
    kept in keep_dir/<name>/ (a fresh temporary directory by default) for `fa4lab.kernels.binary`.
    dtype is out's ("bf16", "fp16", "fp32")."""
    from fa4lab.kernels.compile import compile_kept, normalize_arch

    arch = normalize_arch(arch)
    plan = CombinePlan(head_dim_v, dtype, return_lse, num_splits_max, learnable_sink)
    return CompiledCombine(arch, plan, *compile_kept(
        plan.name(arch), lambda options: _compile(plan, arch, options), keep_dir))


# ---- launch ------------------------------------------------------------------------------------
def _kernel(plan: CombinePlan, arch: str):
    """The compiled function of (plan, arch): this process's, else the disk cache's
    (`fa4lab.kernels.cache.memo_kernel`), else a compile."""
    from fa4lab.kernels import cache

    return cache.memo_kernel("combine", plan.name(arch), lambda: _compile(plan, arch)[0])


_TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def combine_plan_for(out_partial, lse_partial, *, out_dtype, return_lse: bool,
                     learnable_sink, num_splits_max: int = MAX_SPLITS) -> tuple[CombinePlan, str]:
    """(plan, arch) of the kernel that merges these partials, or a clear error before any
    launch: what `combine_cuda` takes (float32 CUDA partials of the split kernels' shapes, a
    head_dim_v and out dtype the plan builds, 16-byte rows, an sm90 / sm100 GPU)."""
    import torch

    from fa4lab.kernels.compile import device_arch

    for name, t in (("out_partial", out_partial), ("lse_partial", lse_partial)):
        if not isinstance(t, torch.Tensor):
            raise InputTypeError(f"{name} must be a torch tensor, got {type(t).__name__}")
        if t.dtype != torch.float32:
            raise InputTypeError(f"{name} has dtype {t.dtype}; the combine kernel reads float32 "
                                 f"partials (fa4lab.splitkv.combine merges other dtypes)")
        if not t.is_cuda:
            raise InputError(f"{name} is on {t.device}; combine_cuda runs on a CUDA GPU "
                             f"(fa4lab.splitkv.combine runs anywhere)")
    check_same_device("lse_partial", lse_partial.device, "out_partial",
                      out_partial.device)
    if out_partial.dim() != 5 or tuple(lse_partial.shape) != tuple(out_partial.shape[:-1]):
        raise InputError(f"combine_cuda needs out_partial (num_splits, batch, seqlen_q, heads, "
                         f"head_dim_v) and lse_partial (num_splits, batch, seqlen_q, heads); got "
                         f"{tuple(out_partial.shape)} and {tuple(lse_partial.shape)}")
    num_splits, heads = out_partial.shape[0], out_partial.shape[3]
    if not 1 <= num_splits <= num_splits_max:
        raise InputError(f"combine_cuda merges 1 to num_splits_max={num_splits_max} splits (at "
                         f"most fa4lab.splitkv.MAX_SPLITS = {MAX_SPLITS}), got {num_splits}")
    names = {getattr(torch, v): k for k, v in _TORCH_DTYPES.items()}
    if out_dtype not in names:
        raise InputTypeError(f"out_dtype must be torch.bfloat16, torch.float16 or torch.float32, "
                             f"got {out_dtype}")
    if learnable_sink is not None and (not isinstance(learnable_sink, torch.Tensor)
                                       or tuple(learnable_sink.shape) != (heads,)):
        raise InputError(f"learnable_sink must be a torch tensor (heads,) = ({heads},) for "
                         f"lse_partial {tuple(lse_partial.shape)}")
    try:
        plan = CombinePlan(int(out_partial.shape[-1]), names[out_dtype], bool(return_lse),
                           num_splits_max, learnable_sink is not None)
    except PlanError as err:
        raise InputError(f"{err} (out_partial {tuple(out_partial.shape)})") from None
    if out_partial.stride(-1) != 1 or out_partial.data_ptr() % (4 * COMBINE_VEC) \
            or any(s % COMBINE_VEC for s in out_partial.stride()[:-1]):
        raise InputError(f"out_partial must have stride 1 in its last dim, the others divisible "
                         f"by {COMBINE_VEC}, and a {4 * COMBINE_VEC}-byte aligned start (strides "
                         f"{out_partial.stride()}); pass out_partial.contiguous()")
    if lse_partial.stride(-1) != 1:
        raise InputError(f"lse_partial must have stride 1 in its last dim (strides "
                         f"{lse_partial.stride()}); pass lse_partial.contiguous()")
    arch = device_arch(out_partial.device.index)
    if arch is None:
        raise UnsupportedArchError(
            f"combine_cuda is compiled for sm_90a (H100/H200) and sm_100a (B200); "
            f"{out_partial.device} has compute capability "
            f"{torch.cuda.get_device_capability(out_partial.device)}. Use "
            f"fa4lab.splitkv.combine, which merges in torch there")
    return plan, arch + "a"


def combine_cuda(out_partial, lse_partial, *, out_dtype=None, return_lse: bool = True,
                 learnable_sink=None, num_splits_max: int = MAX_SPLITS):
    """Merge split-KV partials on the GPU: out (batch, seqlen_q, heads, head_dim_v) in out_dtype
    (default torch.bfloat16) and, with return_lse, lse (batch, heads, seqlen_q) float32, else
    None. out_partial (num_splits, batch, seqlen_q, heads, head_dim_v) and lse_partial
    (num_splits, batch, seqlen_q, heads) are float32 CUDA tensors (`fa4lab.splitkv`); a row no
    split saw gives out 0 and lse -inf. learnable_sink (heads,) joins as one more partial with
    out 0 and lse sink[h] (Note [sinks in the combine]). One kernel per `CombinePlan` and arch,
    compiled on first use (`_kernel`); inputs are checked first (`combine_plan_for`)."""
    import torch

    out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
    plan, arch = combine_plan_for(out_partial, lse_partial, out_dtype=out_dtype,
                                  return_lse=return_lse, learnable_sink=learnable_sink,
                                  num_splits_max=num_splits_max)
    _, b, sq, h, dv = out_partial.shape
    device = out_partial.device
    if learnable_sink is not None:
        learnable_sink = learnable_sink.to(device=device, dtype=torch.float32)
    out = torch.empty((b, sq, h, dv), dtype=out_dtype, device=device)
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=device) if return_lse else None
    if out.numel():
        _kernel(plan, arch)(out_partial, lse_partial, out, lse, learnable_sink)
    return out, lse


def combine(out_partial, lse_partial, *, learnable_sink=None, out_dtype=None):
    """`fa4lab.splitkv.combine` (the same arguments, checks and answer: out, lse laid out like
    lse_partial without its split axis), merged by the combine kernel where it takes the
    partials (`kernel_takes`: float32 split-kernel partials on a GPU it is built for), else by
    `fa4lab.splitkv.merge_partials` in torch. The split-KV launch merges with this."""
    out_dtype = check_partials(out_partial, lse_partial, learnable_sink, out_dtype)
    if kernel_takes(out_partial, lse_partial, out_dtype):
        out, lse = combine_cuda(out_partial.contiguous(), lse_partial.contiguous(),
                                out_dtype=out_dtype, learnable_sink=learnable_sink)
        return out, lse.transpose(1, 2)
    return merge_partials(out_partial, lse_partial, learnable_sink, out_dtype)


def kernel_takes(out_partial, lse_partial, out_dtype) -> bool:
    """Whether `combine_cuda` merges these partials: float32 split-kernel partials (rank 5) on a
    GPU the kernels are compiled for, a head_dim_v and a split count its plan takes, and an out
    dtype it writes."""
    import torch

    from fa4lab.kernels.compile import device_arch

    if not (out_partial.is_cuda and out_partial.dim() == 5 and out_partial.shape[0] <= MAX_SPLITS
            and out_partial.dtype == lse_partial.dtype == torch.float32
            and out_dtype in (torch.bfloat16, torch.float16, torch.float32)):
        return False
    try:
        CombinePlan(int(out_partial.shape[-1]), "fp32")
    except PlanError:
        return False
    return device_arch(out_partial.device.index) is not None
