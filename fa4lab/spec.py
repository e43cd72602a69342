"""`AttentionSpec`: the math semantics of one attention forward call, validated once.

Every entry point (the reference, the online-softmax lesson, the planner, the kernels and
`fa4lab.attention`) describes its problem with an `AttentionSpec` and shares the input checks
below, so a bad shape gets the same clear message wherever it enters; a call's tensors and
options are checked once, by `fa4lab.call.check_call`, which describes the call by a sized
spec.

The math contract (see notebook 01):
  q: (batch, seqlen_q, heads_q, head_dim); k: (batch, seqlen_k, heads_kv, head_dim);
  v: (batch, seqlen_k, heads_kv, head_dim_v). heads_q % heads_kv == 0 and query head h reads
  kv head h // (heads_q // heads_kv). softmax_scale defaults to 1/sqrt(head_dim). causal is
  bottom-right aligned: query i sees key j iff j <= i + seqlen_k - seqlen_q. A row that sees no
  key gives output 0 and lse = -inf.

Three options of upstream FlashAttention-4's `flash_attn_func`, with its semantics:
  window_size=(left, right), a sliding window on the same bottom-right diagonal (None = that side
  unbounded): with d = seqlen_k - seqlen_q, query i sees key j < seqlen_k iff
  i + d - left <= j <= i + d + right. causal=True is right = 0. See Note [window and causal].
  softcap > 0 (Gemma 2): each score s = softmax_scale * q.k becomes softcap * tanh(s / softcap)
  before the softmax; 0 turns it off.
  learnable_sink (GPT-OSS): one extra logit sink[h] per query head in the softmax denominator,
  in the units of the (scaled, capped) scores and with no value:
      out_i = sum_j e^{s_ij} v_j / (sum_j e^{s_ij} + e^{sink_h}),
      lse_i = log(sum_j e^{s_ij} + e^{sink_h}),
  so a row that sees no key gives out 0 and lse = sink_h. The sink is neither scaled nor capped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from fa4lab.errors import InputError, InputTypeError

LOG2E = math.log2(math.e)  # the kernels work in base 2: Note [exp2 and scale_log2]
LN2 = math.log(2.0)        # and turn base-2 log-sum-exps back into natural logs


def resolve_scale(softmax_scale: Any, head_dim: int) -> float:
    """softmax_scale, defaulting to 1/sqrt(head_dim); must be a positive finite number."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    try:
        scale = float(softmax_scale)
    except (TypeError, ValueError):
        raise InputTypeError(f"softmax_scale must be a number, got {softmax_scale!r}") from None
    if not math.isfinite(scale) or scale <= 0:
        raise InputError(f"softmax_scale must be a positive finite number, got {scale}")
    return scale

_DTYPE_ALIASES = {
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
}


def normalize_dtype(dtype: Any) -> str:
    """'bf16' or 'fp16' from a string or a torch dtype; anything else is a clear TypeError."""
    key = str(dtype).lower()
    if key not in _DTYPE_ALIASES:
        raise InputTypeError(
                 f"dtype {dtype!r} is not supported: the kernels take bf16 or fp16 "
                 f"(cast with .to(torch.bfloat16) or .half())"
             )
    return _DTYPE_ALIASES[key]


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise InputTypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < 1:
        raise InputError(f"{name} must be >= 1, got {value}")
    return value


# Note [window and causal]
# A window is (left, right), each an int or None (unbounded on that side), around the
# bottom-right diagonal: query i sees key j < seqlen_k iff j >= i + d - left (when left is not
# None) and j <= i + d + right (when right is not None), d = seqlen_k - seqlen_q. (0, 0) keeps
# only the diagonal key; (None, None) is no window. A negative side moves its edge past the
# diagonal, as in upstream FA4 (whose tests draw them): (None, -r) sees only keys at least r
# before the diagonal, (-l, None) only keys at least l after it, and a row whose edges cross
# sees no key (output 0, LSE -inf). Both sides negative is FA2's "no window" ((-1, -1)) and
# means (None, None), as upstream's interface reads it; one negative side is NOT FA2's
# unbounded side: (-1, 0) hides every key (pass causal=True for FA2's (-1, 0)).
# causal=True IS right = 0, so a window and causal combine as follows (the same as upstream
# FA4's interface where it gives an answer):
#     causal=True,  window (left, None) or (left, 0)  -> the causal window (left, 0);
#     causal=True,  window (left, right != 0)         -> an error: the two disagree;
#     causal=False, window (left, 0)                  -> the causal window (left, 0).
# Every description of one mask is stored in one form, `normalize_mask`'s: causal=True whenever
# the right side is 0, and then window_size=(left, None), so causal=True with no window is
# (True, (None, None)), as before windows existed, and equal specs mean equal masks.
# `effective_window` gives back (left, right) with right = 0 under causal. The block formulas
# (Note [sliding window tiles] in fa4lab.tiling) hold for either sign: each row's visible keys
# stay one interval whose two edges move one key per row.


def check_window_size(window_size: Any) -> tuple[int | None, int | None]:
    """(left, right) from a window_size pair (tuple or list) of ints or None, checked; both
    sides negative (FA2's (-1, -1)) is (None, None).

    Raises TypeError when it is not a pair of int/None. See Note [window and causal]."""
    if isinstance(window_size, (str, bytes)) or not hasattr(window_size, "__len__") or len(
            window_size) != 2:
        raise InputTypeError(f"window_size must be a pair (left, right) of ints or None, got "
                             f"{window_size!r}; e.g. window_size=(256, 0) for a causal sliding "
                             f"window of 256 keys to the left, (None, None) for no window")
    sides = []
    for name, value in zip(("left", "right"), window_size):
        if value is None:
            sides.append(None)
            continue
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise InputTypeError(f"window_size={tuple(window_size)!r}: {name} must be an int "
                                 f"or None (unbounded), got {type(value).__name__} {value!r}")
        sides.append(int(value))
    if sides[0] is not None and sides[1] is not None and sides[0] < 0 and sides[1] < 0:
        return None, None
    return sides[0], sides[1]


def normalize_mask(causal: Any, window_size: Any = (None, None)
                   ) -> tuple[bool, tuple[int | None, int | None]]:
    """(causal, window_size) in the one stored form of their mask: causal=True whenever the
    right side is 0, and then window_size = (left, None). Raises ValueError for causal=True
    with right != 0. See Note [window and causal]."""
    left, right = check_window_size(window_size)
    causal = bool(causal)
    if causal and right is not None and right != 0:
        seen = f"see {right} keys past" if right > 0 else f"stop {-right} keys before"
        raise InputError(f"causal=True with window_size=({left}, {right}): causal means "
                         f"right = 0, so the two disagree; pass causal=False to let queries "
                         f"{seen} the diagonal, or window_size=({left}, 0)")
    if right == 0:
        causal, right = True, None
    return causal, (left, None if causal else right)


def effective_window(causal: Any, window_size: Any = (None, None)
                     ) -> tuple[int | None, int | None]:
    """The (left, right) window in effect, right = 0 under causal; None = unbounded.
    See Note [window and causal]."""
    causal, (left, right) = normalize_mask(causal, window_size)
    return left, 0 if causal else right


def visible_key_counts(seqlen_q: int, seqlen_k: int,
                       window: tuple[int | None, int | None]) -> np.ndarray:
    """How many keys each query sees, int64 (seqlen_q,), under the effective (left, right)
    `window` (`effective_window`): row i sees keys max(0, i + d - left) .. min(seqlen_k - 1,
    i + d + right), d = seqlen_k - seqlen_q, or none."""
    left, right = window
    i = np.arange(int(seqlen_q), dtype=np.int64)
    d = int(seqlen_k) - int(seqlen_q)
    hi = np.full_like(i, seqlen_k) if right is None else np.minimum(i + d + right + 1, seqlen_k)
    lo = np.zeros_like(i) if left is None else np.maximum(i + d - left, 0)
    return np.maximum(hi - lo, 0)


def check_softcap(softcap: Any) -> float:
    """softcap as a float: 0.0 (off) or a positive finite number; TypeError/ValueError else."""
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, (int, float, np.integer,
                                                                           np.floating)):
        raise InputTypeError(f"softcap must be a number (0.0 = off), got {type(softcap).__name__} "
                             f"{softcap!r}")
    value = float(softcap)
    if value == 0.0:
        return 0.0
    if not math.isfinite(value) or value < 0:
        raise InputError(f"softcap must be 0.0 (off) or a positive finite number, got {value}; "
                         f"scores become softcap * tanh(score / softcap), e.g. softcap=50.0 "
                         f"as in Gemma 2")
    return value


@dataclass(frozen=True)
class AttentionSpec:
    """The problem, not the implementation: shapes, dtype, masking, scale, outputs.

    causal and window_size are stored in one form per mask (see Note [window and causal]):
    `effective_window` is the (left, right) in effect and `has_mask` says whether it hides any
    key. learnable_sink says whether a (heads_q,) float32 sink tensor comes with the call.
    varlen: a variable-length batch (`fa4lab.varlen`'s packed layout: q (total_q, heads_q, d),
    k / v (total_k, heads_kv, d) with int32 cu_seqlens); `batch` is then the number of
    sequences and seqlen_q / seqlen_k the longest ones (max_seqlen_q / max_seqlen_k), the sizes
    a plan is made for.
    split_kv: the kernel writes each split's partial output and LSE (float32) for a combine
    step instead of the output (`fa4lab.splitkv`: the split count is a runtime value, and a
    split kernel leaves the sink to the combine).
    page_size P says K/V come as a paged cache of P-token pages with a page table (seqlen_k is
    then the keys of each sequence); None: contiguous (batch, seqlen_k, heads_kv, d) K/V.
    """

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
    window_size: tuple[int | None, int | None] = (None, None)
    softcap: float = 0.0
    learnable_sink: bool = False
    varlen: bool = False
    # Tokens per page of a paged K/V cache (`fa4lab.varlen`'s layout), None for contiguous K/V.
    page_size: int | None = None
    split_kv: bool = False
    # filled in by __post_init__
    qhead_per_kvhead: int = field(init=False)

    def __post_init__(self):
        for name in ("batch", "seqlen_q", "seqlen_k", "heads_q", "heads_kv", "head_dim"):
            object.__setattr__(self, name, _positive_int(name, getattr(self, name)))
        hdv = self.head_dim_v
        hdv = self.head_dim if hdv is None else _positive_int("head_dim_v", hdv)
        object.__setattr__(self, "head_dim_v", hdv)
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        causal, window = normalize_mask(self.causal, self.window_size)
        object.__setattr__(self, "causal", causal)
        object.__setattr__(self, "window_size", window)
        object.__setattr__(self, "softcap", check_softcap(self.softcap))
        if not isinstance(self.learnable_sink, (bool, np.bool_)):
            raise InputTypeError(f"learnable_sink is a flag in AttentionSpec, got "
                                 f"{type(self.learnable_sink).__name__}: pass True when a "
                                 f"(heads_q,) float32 sink tensor comes with the call (the tensor "
                                 f"itself goes to the call, or to AttentionSpec.from_tensors)")
        object.__setattr__(self, "learnable_sink", bool(self.learnable_sink))
        if not isinstance(self.split_kv, (bool, np.bool_)):
            raise InputTypeError(f"split_kv is a flag in AttentionSpec, got "
                                 f"{type(self.split_kv).__name__}: True for the split-KV kernel "
                                 f"(the split count is a call's num_splits)")
        object.__setattr__(self, "split_kv", bool(self.split_kv))
        object.__setattr__(self, "return_lse", bool(self.return_lse))
        if self.page_size is not None:
            object.__setattr__(self, "page_size", _positive_int("page_size", self.page_size))
        if not isinstance(self.varlen, (bool, np.bool_)):
            raise InputTypeError(f"varlen is a flag in AttentionSpec, got {self.varlen!r}")
        object.__setattr__(self, "varlen", bool(self.varlen))
        if self.heads_q % self.heads_kv:
            raise InputError(
                f"heads_q={self.heads_q} is not a multiple of heads_kv={self.heads_kv}: with GQA "
                f"each KV head serves heads_q // heads_kv query heads; choose heads_kv among "
                f"{[d for d in range(1, self.heads_q + 1) if self.heads_q % d == 0]}"
            )
        if self.softmax_scale is not None:
            object.__setattr__(self, "softmax_scale",
                               resolve_scale(self.softmax_scale, self.head_dim))
        object.__setattr__(self, "qhead_per_kvhead", self.heads_q // self.heads_kv)

    # ---- derived quantities (computed, never stored twice) ----
    @property
    def scale(self) -> float:
        """softmax_scale, defaulting to 1/sqrt(head_dim) (`resolve_scale`)."""
        return resolve_scale(self.softmax_scale, self.head_dim)

    @property
    def scale_log2(self) -> float:
        """scale * log2(e): the kernels work in base 2. See Note [exp2 and scale_log2]."""
        return self.scale * LOG2E

    @property
    def effective_window(self) -> tuple[int | None, int | None]:
        """(left, right) in effect: right = 0 under causal; None = unbounded on that side.
        Query i sees key j < seqlen_k iff i + d - left <= j <= i + d + right, d = seqlen_k -
        seqlen_q. See Note [window and causal]."""
        left, right = self.window_size
        return left, 0 if self.causal else right

    @property
    def has_mask(self) -> bool:
        """True when causal or the window hides some key j < seqlen_k from some query of THIS
        problem (so a kernel needs a mask besides the seqlen_k bound); exact, so causal with
        seqlen_q == 1 has none. The left side hides a key iff left < seqlen_k - 1, the right
        side iff right < seqlen_q - 1."""
        left, right = self.effective_window
        return ((left is not None and left < self.seqlen_k - 1)
                or (right is not None and right < self.seqlen_q - 1))

    def visible_pairs(self) -> int:
        """Visible (query, key) pairs of one (batch, head): seqlen_q * seqlen_k without a mask."""
        return int(visible_key_counts(self.seqlen_q, self.seqlen_k, self.effective_window).sum())

    @property
    def gqa_ratio(self) -> int:
        return self.qhead_per_kvhead

    @property
    def element_bytes(self) -> int:
        """Bytes per element of q, k, v and the output (fa4lab.limits.ELEMENT_BYTES)."""
        from fa4lab.limits import ELEMENT_BYTES

        return ELEMENT_BYTES[self.dtype]

    def flops(self) -> float:
        """Forward FLOPs as benchmarks count them: 4*B*H*Sq*Sk*D, halved for causal.

        With a window that hides more than causal does (a left side < seqlen_k - 1, or a right
        side < seqlen_q - 1 without causal), 4*B*H*D times the visible (query, key) pairs
        (`visible_pairs`), as upstream's benchmarks count sliding windows."""
        f = 2.0 * self.batch * self.heads_q * self.seqlen_q * self.seqlen_k * (
            self.head_dim + self.head_dim_v)
        left, right = self.effective_window
        if left is None or left >= self.seqlen_k - 1:      # the left side hides nothing
            if self.causal:
                return f / 2
            if right is None or right >= self.seqlen_q - 1:
                return f
        return 2.0 * self.batch * self.heads_q * self.visible_pairs() * (
            self.head_dim + self.head_dim_v)

    def with_(self, **changes) -> AttentionSpec:
        """This spec with `changes`, checked as a new one (`spec_of`: the same object again
        for the same fields)."""
        d = self.__dict__
        return spec_of(**{**{name: d[name] for name in _INIT_FIELDS}, **changes})

    @classmethod
    def from_tensors(cls, q, k, v, *, causal=False, softmax_scale=None, return_lse=False,
                     dtype=None, window_size=(None, None), softcap=0.0,
                     learnable_sink=None) -> AttentionSpec:
        """Build a spec from q, k, v (numpy arrays or torch tensors), checking their shapes.

        learnable_sink is the call's sink tensor (heads_q,) or None, as in `flash_attn_func`;
        only its presence (and shape) goes into the spec."""
        check_qkv_shapes(q, k, v)
        b, sq, hq, d = (int(x) for x in q.shape)
        _, sk, hkv, _ = (int(x) for x in k.shape)
        dv = int(v.shape[-1])
        if dtype is None:
            dtype = q.dtype if "float16" in str(q.dtype) else "bf16"
        if learnable_sink is not None:
            check_sink_shape(learnable_sink, hq)
        return cls(b, sq, sk, hq, hkv, d, dv, dtype=dtype, causal=causal,
                   softmax_scale=softmax_scale, return_lse=return_lse, window_size=window_size,
                   softcap=softcap, learnable_sink=learnable_sink is not None)


def check_qkv_shapes(q, k, v) -> None:
    """Shape checks shared by every entry point; raises ValueError naming the problem."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not hasattr(t, "shape"):
            raise InputTypeError(f"{name} must be a numpy array or torch tensor, got "
                                 f"{type(t).__name__}")
        if len(t.shape) != 4:
            raise InputError(
                f"{name} has shape {tuple(t.shape)}: expected 4 dims "
                f"(batch, seqlen, heads, head_dim); add a batch dim with {name}[None] if needed"
            )
    b, sq, hq, d = q.shape
    bk, sk, hkv, dk = k.shape
    bv, sv, hv, dv = v.shape
    if not (b == bk == bv):
        raise InputError(f"batch differs: q {b}, k {bk}, v {bv}")
    if sk != sv:
        raise InputError(f"k and v must have the same seqlen_k: k {sk}, v {sv}")
    if hkv != hv:
        raise InputError(f"k and v must have the same number of heads: k {hkv}, v {hv}")
    if d != dk:
        raise InputError(f"q and k must have the same head_dim: q {d}, k {dk}")
    if min(hq, d, hkv, dv) < 1:
        raise InputError(
            f"empty heads or head_dim in q {tuple(q.shape)}, k {tuple(k.shape)}, v "
            f"{tuple(v.shape)}: attention needs at least one head and head_dim >= 1 (an empty "
            f"batch or sequence is fine: Note [empty calls] in fa4lab.canonical)"
        )
    if hq % hkv:
        raise InputError(
            f"heads_q={hq} is not a multiple of heads_kv={hkv}: with GQA query head h reads kv "
            f"head h // (heads_q // heads_kv), so heads_kv must divide heads_q"
        )


def check_sink_shape(learnable_sink, heads_q: int) -> None:
    """learnable_sink must be a numpy array or torch tensor of shape (heads_q,)."""
    if not hasattr(learnable_sink, "shape"):
        raise InputTypeError(f"learnable_sink must be a tensor of shape (heads_q,) = ({heads_q},), "
                             f"got {type(learnable_sink).__name__}; build it with torch.zeros("
                             f"{heads_q}, dtype=torch.float32, device=q.device)")
    if tuple(int(x) for x in learnable_sink.shape) != (heads_q,):
        raise InputError(f"learnable_sink has shape {tuple(learnable_sink.shape)}: expected "
                         f"(heads_q,) = ({heads_q},), one sink logit per query head")


def check_kernel_layout(**tensors) -> None:
    """What TMA needs of each 16-bit tensor given by name, of any rank (dense, packed varlen,
    a paged cache): the last dim contiguous, and 16-byte aligned data and strides (8
    elements). The kernels' argument contract declares the same (`KernelArgs.fake` in
    fa4lab.kernels.device.arguments); checked before launch (`fa4lab.call.Call.for_kernel`) so
    that a misaligned view fails naming the tensor and the fix, not inside the launch's
    argument check."""
    for name, t in tensors.items():
        stride = t.stride()
        if stride[-1] != 1:
            raise InputError(f"{name} has strides {tuple(stride)}: the last dim must be "
                             f"contiguous (stride 1); pass {name}.contiguous()")
        if t.data_ptr() % 16 or any(s % 8 for s in stride[:-1]):
            raise InputError(f"{name} is not 16-byte aligned (data_ptr or strides {stride}): "
                             f"TMA needs 16-byte aligned rows; pass {name}.contiguous() (or "
                             f"clone it)")


def check_tensors(q, k, v) -> None:
    """q, k, v are torch tensors: `fa4lab.call.check_call`'s first check (and a paged call's,
    in `fa4lab.varlen.check_paged`)."""
    import torch

    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InputTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}; wrap "
                                 f"numpy arrays with torch.from_numpy({name})")


# Note [spec cache]
# A serving loop makes the same spec on every call (`fa4lab.call.check_call`, then the paged
# decode's view of it): its checks took 11-21 us of host time a spec on a busy 2-core machine, a
# kept spec 6-7 us to find. `spec_of` keeps the specs it made by their fields, each field's type
# in the key (so 1 and 1.0, or True and 1, are not one key: the check sees what was passed), and
# returns the same frozen object for the same fields. A field of another type (a tensor, a list)
# is not kept: that spec is made and checked afresh. A spec that fails its checks is never kept,
# so the error is raised again each time.

# The field types a key holds (torch.dtype joins at its first use: this module does not import
# torch); a tuple only as the window's pair of those.
_KEYED = {int, float, bool, str, type(None), tuple}
_INIT_FIELDS = tuple(f.name for f in fields(AttentionSpec) if f.init)
_SPECS: dict = {}
_SPECS_KEPT = 1024


def _keyed(types) -> bool:
    if _KEYED.issuperset(types):
        return True
    if all(t in _KEYED or (t.__module__, t.__name__) == ("torch", "dtype") for t in types):
        _KEYED.update(types)
        return True
    return False


def spec_of(**fields_) -> AttentionSpec:
    """AttentionSpec(**fields_), the same object for the same fields (Note [spec cache])."""
    values = tuple(fields_.values())
    types = tuple(map(type, values))
    window = fields_.get("window_size", ())
    sides = tuple(map(type, window)) if type(window) is tuple else ()
    if not (_keyed(types) and _keyed(sides)) or tuple in sides:
        return AttentionSpec(**fields_)
    key = (tuple(fields_), values, types, sides)
    spec = _SPECS.get(key)
    if spec is None:
        spec = AttentionSpec(**fields_)
        if len(_SPECS) >= _SPECS_KEPT:
            _SPECS.clear()
        _SPECS[key] = spec
    return spec
