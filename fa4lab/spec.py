"""`AttentionSpec`: the math semantics of one attention forward call, validated once.

Every entry point (the reference, the online-softmax lesson, the planner, the kernels and
`fa4lab.attention`) describes its problem with an `AttentionSpec` and shares the input checks
below, so a bad shape gets the same clear message wherever it enters.

The math contract (see notebook 01):
  q: (batch, seqlen_q, heads_q, head_dim); k: (batch, seqlen_k, heads_kv, head_dim);
  v: (batch, seqlen_k, heads_kv, head_dim_v). heads_q % heads_kv == 0 and query head h reads
  kv head h // (heads_q // heads_kv). softmax_scale defaults to 1/sqrt(head_dim). causal is
  bottom-right aligned: query i sees key j iff j <= i + seqlen_k - seqlen_q. A row that sees no
  key gives output 0 and lse = -inf.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

_DTYPE_ALIASES = {
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
}


def normalize_dtype(dtype: Any) -> str:
    """'bf16' or 'fp16' from a string or a torch dtype; anything else is a clear TypeError."""
    key = str(dtype).lower()
    if key not in _DTYPE_ALIASES:
        raise TypeError(
            f"dtype {dtype!r} is not supported: the kernels take bf16 or fp16 "
            f"(cast with .to(torch.bfloat16) or .half())"
        )
    return _DTYPE_ALIASES[key]


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


@dataclass(frozen=True)
class AttentionSpec:
    """The problem, not the implementation: shapes, dtype, masking, scale, outputs."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    head_dim_v: int | None = None
    dtype: str = "bf16"
    causal: bool = False
    softmax_scale: float | None = None
    return_lse: bool = False
    # filled in by __post_init__
    qhead_per_kvhead: int = field(init=False)

    def __post_init__(self):
        for name in ("batch", "seqlen_q", "seqlen_k", "heads_q", "heads_kv", "head_dim"):
            object.__setattr__(self, name, _positive_int(name, getattr(self, name)))
        hdv = self.head_dim_v
        hdv = self.head_dim if hdv is None else _positive_int("head_dim_v", hdv)
        object.__setattr__(self, "head_dim_v", hdv)
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        object.__setattr__(self, "causal", bool(self.causal))
        object.__setattr__(self, "return_lse", bool(self.return_lse))
        if self.heads_q % self.heads_kv:
            raise ValueError(
                f"heads_q={self.heads_q} is not a multiple of heads_kv={self.heads_kv}: with GQA "
                f"each KV head serves heads_q // heads_kv query heads; choose heads_kv among "
                f"{[d for d in range(1, self.heads_q + 1) if self.heads_q % d == 0]}"
            )
        if self.softmax_scale is not None:
            s = float(self.softmax_scale)
            if not math.isfinite(s) or s <= 0:
                raise ValueError(f"softmax_scale must be a positive finite number, got {s}")
            object.__setattr__(self, "softmax_scale", s)
        object.__setattr__(self, "qhead_per_kvhead", self.heads_q // self.heads_kv)

    # ---- derived quantities (computed, never stored twice) ----
    @property
    def scale(self) -> float:
        """softmax_scale, defaulting to 1/sqrt(head_dim)."""
        if self.softmax_scale is not None:
            return self.softmax_scale
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def scale_log2(self) -> float:
        """scale * log2(e): the kernels work in base 2. See Note [exp2 and scale_log2]."""
        return self.scale * math.log2(math.e)

    @property
    def gqa_ratio(self) -> int:
        return self.qhead_per_kvhead

    @property
    def element_bytes(self) -> int:
        """Bytes per element of q, k, v and the output (fa4lab.limits.ELEMENT_BYTES)."""
        from fa4lab.limits import ELEMENT_BYTES

        return ELEMENT_BYTES[self.dtype]

    def flops(self) -> float:
        """Forward FLOPs as benchmarks count them: 4*B*H*Sq*Sk*D, halved for causal."""
        f = 2.0 * self.batch * self.heads_q * self.seqlen_q * self.seqlen_k * (
            self.head_dim + self.head_dim_v)
        return f / 2 if self.causal else f

    def with_(self, **changes) -> AttentionSpec:
        return replace(self, **changes)

    @classmethod
    def from_tensors(cls, q, k, v, *, causal=False, softmax_scale=None, return_lse=False,
                     dtype=None) -> AttentionSpec:
        """Build a spec from q, k, v (numpy arrays or torch tensors), checking their shapes."""
        check_qkv_shapes(q, k, v)
        b, sq, hq, d = (int(x) for x in q.shape)
        _, sk, hkv, _ = (int(x) for x in k.shape)
        dv = int(v.shape[-1])
        if dtype is None:
            dtype = q.dtype if "float16" in str(q.dtype) else "bf16"
        return cls(b, sq, sk, hq, hkv, d, dv, dtype=dtype, causal=causal,
                   softmax_scale=softmax_scale, return_lse=return_lse)


def check_qkv_shapes(q, k, v) -> None:
    """Shape checks shared by every entry point; raises ValueError naming the problem."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not hasattr(t, "shape"):
            raise TypeError(f"{name} must be a numpy array or torch tensor, got {type(t).__name__}")
        if len(t.shape) != 4:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}: expected 4 dims "
                f"(batch, seqlen, heads, head_dim); add a batch dim with {name}[None] if needed"
            )
    b, sq, hq, d = q.shape
    bk, sk, hkv, dk = k.shape
    bv, sv, hv, dv = v.shape
    if not (b == bk == bv):
        raise ValueError(f"batch differs: q {b}, k {bk}, v {bv}")
    if sk != sv:
        raise ValueError(f"k and v must have the same seqlen_k: k {sk}, v {sv}")
    if hkv != hv:
        raise ValueError(f"k and v must have the same number of heads: k {hkv}, v {hv}")
    if d != dk:
        raise ValueError(f"q and k must have the same head_dim: q {d}, k {dk}")
    if min(b, sq, hq, d, sk, hkv, dv) < 1:
        raise ValueError(
            f"empty dimension in q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if hq % hkv:
        raise ValueError(
            f"heads_q={hq} is not a multiple of heads_kv={hkv}: with GQA query head h reads kv "
            f"head h // (heads_q // heads_kv), so heads_kv must divide heads_q"
        )


def check_inputs(q, k, v, *, softmax_scale=None, arch: str | None = None) -> None:
    """The one input check of `fa4lab.attention` and the kernels' launch path, called once per
    call: torch tensors, shapes (`check_qkv_shapes`), one floating dtype, one device, a positive
    finite scale; and with `arch` ("sm90"/"sm100", the kernel that will run), what that kernel
    needs besides the math: bf16/fp16, a head dim it builds, head_dim_v == head_dim, CUDA
    tensors, the last dim contiguous and 16-byte aligned rows (TMA). Raises TypeError or
    ValueError saying what is wrong and what to do."""
    import torch

    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}; wrap numpy "
                            f"arrays with torch.from_numpy({name})")
    check_qkv_shapes(q, k, v)
    if not q.is_floating_point():
        raise TypeError(f"q has dtype {q.dtype}: attention needs floating point inputs; cast "
                        f"with q.to(torch.bfloat16)")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}; "
                        f"cast them, e.g. k.to(q.dtype)")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v are on different devices ({q.device}, {k.device}, "
                         f"{v.device}); move them to one device with .to(q.device)")
    if softmax_scale is not None:
        s = float(softmax_scale)
        if not s > 0 or s == math.inf:
            raise ValueError(f"softmax_scale must be a positive finite number, got {s}")
    if arch is None:
        return
    from fa4lab.limits import head_dims_for

    if q.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"the GPU kernels take bfloat16 or float16, got {q.dtype}; cast with "
                        f"q.to(torch.bfloat16) (or run on CPU tensors for the reference)")
    d, dv, dims = q.shape[3], v.shape[3], head_dims_for(arch)
    if d not in dims:
        raise ValueError(f"head_dim {d} is not supported by the {arch} kernel: use one of "
                         f"{dims} (pad q and k with zeros to the next one)")
    if dv != d:
        raise ValueError(f"head_dim_v {dv} != head_dim {d}: the kernels need them equal")
    for name, t in (("q", q), ("k", k), ("v", v)):
        stride = t.stride()
        if stride[3] != 1:
            raise ValueError(f"{name} has strides {tuple(stride)}: the last dim must be "
                             f"contiguous (stride 1); pass {name}.contiguous()")
        if t.data_ptr() % 16 or stride[0] % 8 or stride[1] % 8 or stride[2] % 8:
            raise ValueError(f"{name} is not 16-byte aligned (data_ptr or strides {stride}): "
                             f"TMA needs 16-byte aligned rows; pass {name}.contiguous() (or "
                             f"clone it)")
    if not q.is_cuda:
        raise ValueError(f"q is on {q.device}: the {arch} kernel needs CUDA tensors; move them "
                         f"with .cuda()")
