"""score_mod and mask_mod: user functions of the scores, FlexAttention style, in the reference
and compiled into both forward kernels.

    score_mod(score, b, h, q_idx, kv_idx[, aux]) -> new score
    mask_mod(b, h, q_idx, kv_idx[, aux])         -> bool, True = the key is visible

`score` is the scaled score s = softmax_scale * q.k (with a softcap, the capped score
softcap * tanh(s / softcap): see Note [order of score transforms]); `b` the batch index, `h` the
QUERY head, `q_idx` / `kv_idx` absolute positions in q and k; `aux` the tuple `aux_tensors` the
caller passed (torch tensors the mod may read: ALiBi slopes `aux[0][h]`, document ids
`aux[0][q_idx] == aux[0][kv_idx]`). The last parameter is optional: a mod that reads no tensor
leaves it out.

    out = fa4lab.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s - abs(qi - ki) / 64)
    score_mod, aux = fa4lab.mods.alibi(slopes)            # ready-made: alibi, relative_bias,
    out = fa4lab.attention(q, k, v, causal=True,           # document_mask, prefix_lm
                           score_mod=score_mod, aux_tensors=aux)

Note [one body, two worlds]
    The same function body runs in two places. The float64 reference
    (`fa4lab.reference.attention_reference`) calls it ONCE per chunk of the (b, h, q, k) grid,
    with torch tensors: float64 scores and int64 index tensors shaped to broadcast over the
    grid. The kernels call it once PER SCORE while they are traced by the CuTe DSL, with Float32
    / Int32 values, and `aux` holds cute.Tensors in global memory. So a mod may use:
      * the operators + - * / // % and comparisons; & | ~ (not `and` / `or` / `not`) on
        booleans; indexing an aux tensor with ALL its coordinates at once, `aux[0][b, q_idx]`
        (in the kernel `t[i]` on a 2-D tensor is a flat index, not a row);
      * the functions below, which dispatch on the type of their arguments: `where`, `abs`,
        `minimum`, `maximum`, `tanh`, `exp2`, `log2` (torch / numpy on the host, a select or
        cute.math on the device);
      * Python values captured from an enclosing scope (compile-time constants of the kernel).
    It may not branch on a value (`if q_idx > kv_idx:` cannot be traced; use `where`), call
    torch or numpy functions, or use tensor methods (`.clamp`, `.float()`). Integer `//` and
    `%` truncate toward zero in the kernel and floor in torch: use them on non-negative values
    only. Aux tensors are float32 or int32, on q's device. `check_mods` tries every mod once on
    tiny meta tensors before anything runs, so most mistakes surface as a clear error there; a
    mod that the kernel cannot trace raises `ModCompileError`, naming the function.

Note [order of score transforms]
    Per score, in this order: the raw q.k is scaled by softmax_scale; a softcap (if any) caps
    it; score_mod rewrites it; then every mask applies -- the key-length bound, causal / window,
    and mask_mod, ANDed. FlexAttention likewise gives score_mod the scaled score and masks last
    (a mask applied first would hand score_mod -inf scores). Rows left with no visible key give
    O = 0 and LSE = -inf, as for any mask. Learnable sinks are added to the denominator
    unmodified: score_mod sees only the scores of real keys.

Note [mods in the kernels]
    A mod is part of the compiled kernel: the kernel calls it at each score, so a new mod is a
    new compile (seconds). The in-process launch cache keys a mod by what its code does:
    (code object, defaults, closure values) for a Python function (`mod_key`), so a lambda
    re-created on every call is the same kernel while the values it captures stay equal;
    a captured value that is not hashable is keyed by its identity (a fresh list per call
    recompiles every call: capture tuples or numbers, or pass tensors in aux_tensors). A
    captured module global is read at compile time and is not part of the key. Kernels with
    mods are never written to the disk cache (a function is not a stable name across
    processes). `fa4lab.attention` runs them through the launch path directly, not through the
    torch custom op (a callable cannot be an op argument), so torch.compile graph-breaks at a
    call with mods. Kernel side: `fa4lab.kernels.device.mods`. A mask_mod is also evaluated
    once on the host, into a block table that lets each CTA skip the key blocks it hides and
    visit those it shows whole without calling it (`fa4lab.mods_blocks`, cached per mod, aux
    tensors and shapes: Note [block table cache] there).
"""

from __future__ import annotations

import builtins
import functools
import inspect
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from fa4lab.errors import Fa4labError, InputError, InputTypeError, check_same_device

__all__ = ["BoundMod", "KernelMods", "ModCompileError", "abs", "alibi", "check_mods",
           "describe", "document_mask", "exp2", "kernel_mods", "log2", "maximum", "minimum",
           "mod_key", "prefix_lm", "relative_bias", "tanh", "where"]

# dtypes an aux tensor may have: what the kernel loads as Float32 / Int32.
AUX_DTYPES = ("float32", "int32")


class ModCompileError(Fa4labError, TypeError):
    """A score_mod / mask_mod that cannot be compiled into the kernel (Note [one body, two
    worlds]); the message names the function and says why."""


# ---- functions that dispatch on the type of their arguments --------------------------------

def _kind(*xs) -> str:
    """"torch", "numpy", "dsl" (a CuTe DSL value) or "python" for plain numbers and bools."""
    import torch

    # isinstance first: torch.compile (FlexAttention traces its score_mod / mask_mod with it)
    # cannot trace the str methods below. A kernel's values never mix with torch tensors.
    if any(isinstance(x, torch.Tensor) for x in xs):
        return "torch"
    kinds = set()
    for x in xs:
        mod = type(x).__module__
        if mod.startswith("torch"):
            kinds.add("torch")
        elif mod.startswith("numpy"):
            kinds.add("numpy")
        elif mod.startswith("cutlass"):
            kinds.add("dsl")
    for kind in ("dsl", "torch", "numpy"):
        if kind in kinds:
            return kind
    return "python"


def _dsl_type(*xs):
    """The DSL type of a result mixing `xs`: Float32 if any is floating, else Int32, else
    Boolean (the kernels' score and index types)."""
    from cutlass import Boolean, Float32, Int32
    from cutlass.base_dsl.typing import Float, Integer

    if any(isinstance(x, (Float, float)) for x in xs):
        return Float32
    if any(isinstance(x, Integer) and not isinstance(x, Boolean) or
           (isinstance(x, int) and not isinstance(x, bool)) for x in xs):
        return Int32
    return Boolean


def where(cond, a, b):
    """a where cond holds, else b (elementwise): torch.where / np.where on the host, a select
    in the kernel."""
    kind = _kind(cond, a, b)
    if kind == "torch":
        import torch

        return torch.where(cond, a, b)
    if kind == "numpy":
        import numpy as np

        return np.where(cond, a, b)
    if kind == "dsl":
        from cutlass import select_
        from cutlass.base_dsl.typing import Numeric

        if not isinstance(cond, Numeric):         # a Python bool: decided at trace time
            return a if cond else b
        t = _dsl_type(a, b)
        return t(select_(cond, t(a), t(b)))
    return a if cond else b


def abs(x):  # noqa: A001 -- the name users know; builtins.abs works on every kind
    """|x| (torch, numpy, DSL Float32 / Int32 and Python numbers all implement abs)."""
    return builtins.abs(x)


def _binary(name: str, a, b):
    kind = _kind(a, b)
    if kind == "torch":
        import torch

        ta = a if isinstance(a, torch.Tensor) else None
        tb = b if isinstance(b, torch.Tensor) else None
        ref = ta if ta is not None else tb
        a = ta if ta is not None else torch.as_tensor(a, device=ref.device)
        b = tb if tb is not None else torch.as_tensor(b, device=ref.device)
        return getattr(torch, name)(a, b)
    if kind == "numpy":
        import numpy as np

        return getattr(np, name)(a, b)
    if kind == "dsl":
        import cutlass

        t = _dsl_type(a, b)
        return (cutlass.min if name == "minimum" else cutlass.max)(t(a), t(b))
    return (builtins.min if name == "minimum" else builtins.max)(a, b)


def minimum(a, b):
    """Elementwise min (torch.minimum / np.minimum / cutlass.min)."""
    return _binary("minimum", a, b)


def maximum(a, b):
    """Elementwise max (torch.maximum / np.maximum / cutlass.max)."""
    return _binary("maximum", a, b)


def _unary(name: str, x):
    kind = _kind(x)
    if kind == "torch":
        import torch

        return getattr(torch, name)(x if x.is_floating_point() else x.double())
    if kind == "numpy":
        import numpy as np

        return getattr(np, name)(x)
    if kind == "dsl":
        import cutlass.cute as cute
        from cutlass import Float32

        return getattr(cute.math, name)(Float32(x), fastmath=True)
    return {"tanh": math.tanh, "exp2": lambda v: 2.0 ** v, "log2": math.log2}[name](x)


def tanh(x):
    """tanh(x) (the kernel's is the fast hardware approximation, as for softcap)."""
    return _unary("tanh", x)


def exp2(x):
    """2 ** x (MUFU.EX2 in the kernel)."""
    return _unary("exp2", x)


def log2(x):
    """log2(x) (MUFU.LG2 in the kernel)."""
    return _unary("log2", x)


# ---- identity, arity and validation --------------------------------------------------------

def describe(fn) -> str:
    """"qualname (file:line)" of a mod, for error messages."""
    target = inspect.unwrap(fn) if callable(fn) else fn
    while isinstance(target, functools.partial):
        target = target.func
    name = getattr(target, "__qualname__", None) or type(target).__qualname__
    code = getattr(target, "__code__", None)
    if code is None:
        code = getattr(type(target).__call__, "__code__", None) if callable(target) else None
    where_ = f"{code.co_filename}:{code.co_firstlineno}" if code is not None else "unknown file"
    return f"{name} ({where_})"


class _Identity:
    """A key part that compares by identity and keeps its object alive (so its id is never
    reused while a kernel is cached under it)."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __hash__(self):
        return id(self.obj)

    def __eq__(self, other):
        return isinstance(other, _Identity) and other.obj is self.obj


def _hashable(value):
    try:
        hash(value)
    except TypeError:
        return _Identity(value)
    if callable(value) and hasattr(value, "__code__"):
        return mod_key(value)            # a captured helper function: by its code, too
    return value


def mod_key(fn) -> tuple | None:
    """What identifies a mod's kernel code: Note [mods in the kernels]. None for None."""
    if fn is None:
        return None
    code = getattr(fn, "__code__", None)
    if code is None:                     # a callable object, functools.partial, ...
        return ("object", _hashable(fn))
    cells = tuple(_hashable(c.cell_contents) for c in (fn.__closure__ or ()))
    defaults = tuple(_hashable(d) for d in (fn.__defaults__ or ()))
    kwdefaults = tuple(sorted((k, _hashable(v)) for k, v in (fn.__kwdefaults__ or {}).items()))
    return ("function", code, cells, defaults, kwdefaults)


def _takes_aux(fn, name: str, n_args: int) -> bool:
    """Whether `fn` takes the optional aux argument after its n_args required ones; raises when
    it is not a callable of n_args or n_args + 1 positional arguments."""
    if not callable(fn):
        raise InputTypeError(f"{name} must be a callable {_SIGNATURES[name]}, got "
                             f"{type(fn).__name__} {fn!r}")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        raise InputTypeError(f"{name} {describe(fn)}: its signature cannot be read; pass a Python "
                             f"function {_SIGNATURES[name]}") from None
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
    kw_required = [p.name for p in params if p.kind == p.KEYWORD_ONLY and p.default is p.empty]
    if len(required) > n_args + 1 or (len(positional) < n_args and not varargs) or kw_required:
        raise InputTypeError(f"{name} {describe(fn)} takes ({', '.join(p.name for p in params)}): "
                             f"it must be {_SIGNATURES[name]}, with aux optional")
    return varargs or len(positional) > n_args


_SIGNATURES = {"score_mod": "score_mod(score, b, h, q_idx, kv_idx[, aux]) -> score",
               "mask_mod": "mask_mod(b, h, q_idx, kv_idx[, aux]) -> bool"}


def call_mod(fn, takes_aux: bool, args: tuple, aux: tuple):
    """fn(*args, aux) or fn(*args): how every caller calls a mod."""
    return fn(*args, aux) if takes_aux else fn(*args)


def _check_aux(aux_tensors, device) -> tuple:
    """aux_tensors as a tuple of float32 / int32 torch tensors on `device` (None -> ())."""
    import torch

    if aux_tensors is None:
        return ()
    device = torch.device(device)
    if isinstance(aux_tensors, torch.Tensor) or not isinstance(aux_tensors, Sequence):
        raise InputTypeError(f"aux_tensors must be a tuple or list of torch tensors, got "
                             f"{type(aux_tensors).__name__}; wrap one tensor as (t,)")
    aux = tuple(aux_tensors)
    for i, t in enumerate(aux):
        if not isinstance(t, torch.Tensor):
            raise InputTypeError(f"aux_tensors[{i}] is a {type(t).__name__}, not a torch tensor; "
                                 f"convert it with torch.as_tensor(x, device=q.device)")
        if str(t.dtype).removeprefix("torch.") not in AUX_DTYPES:
            raise InputTypeError(f"aux_tensors[{i}] has dtype {t.dtype}: the kernels read "
                                 f"float32 or int32 aux tensors; cast with .float() or .int()")
        check_same_device(f"aux_tensors[{i}]", t.device, "q", device)
        if t.dim() < 1:
            raise InputError(f"aux_tensors[{i}] is 0-dimensional: give it shape (1,) and read "
                             f"aux[{i}][0]")
    return aux


@dataclass(frozen=True)
class KernelMods:
    """The mods of one call, as the kernel bakes them in: the functions, whether each takes
    aux, and the aux tensors' (dtype, ndim) -- the kernel's parameters. `key` is the launch
    cache's part for them (Note [mods in the kernels])."""

    score_mod: Callable | None
    mask_mod: Callable | None
    score_takes_aux: bool
    mask_takes_aux: bool
    aux_signature: tuple[tuple[str, int], ...]

    @property
    def key(self) -> tuple:
        return (mod_key(self.score_mod), mod_key(self.mask_mod), self.aux_signature)

    def score(self, score, b, h, q_idx, kv_idx, aux: tuple):
        return call_mod(self.score_mod, self.score_takes_aux, (score, b, h, q_idx, kv_idx), aux)

    def mask(self, b, h, q_idx, kv_idx, aux: tuple):
        return call_mod(self.mask_mod, self.mask_takes_aux, (b, h, q_idx, kv_idx), aux)

    def __bool__(self) -> bool:
        return self.score_mod is not None or self.mask_mod is not None


_probed: set = set()


def _probe(mods: KernelMods, aux: tuple) -> None:
    """Run each mod once on meta tensors of a 2 x 2 x 2 x 2 grid (the kernel's dtypes: float32
    score, int32 indices): result kind, dtype and shape. Costs no device work; cached."""
    import torch

    key = (mods.key, tuple((str(t.dtype), tuple(t.shape)) for t in aux))
    if key in _probed:
        return
    meta = dict(device="meta")
    b = torch.empty((2, 1, 1, 1), dtype=torch.int32, **meta)
    h = torch.empty((1, 2, 1, 1), dtype=torch.int32, **meta)
    qi = torch.empty((1, 1, 2, 1), dtype=torch.int32, **meta)
    ki = torch.empty((1, 1, 1, 2), dtype=torch.int32, **meta)
    score = torch.empty((2, 2, 2, 2), dtype=torch.float32, **meta)
    maux = tuple(t.to("meta") for t in aux)
    for name, fn, call, want in (
            ("score_mod", mods.score_mod, lambda: mods.score(score, b, h, qi, ki, maux),
             "a floating tensor"),
            ("mask_mod", mods.mask_mod, lambda: mods.mask(b, h, qi, ki, maux),
             "a bool tensor")):
        if fn is None:
            continue
        try:
            out = call()
        except Exception as err:
            raise ModCompileError(
                f"{name} {describe(fn)} failed on probe tensors: {type(err).__name__}: "
                f"{one_line(err)}. A mod is one body for torch and the kernel: see Note [one "
                f"body, two worlds] in fa4lab.mods (no `if` on values, use fa4lab.mods.where; "
                f"no torch functions or tensor methods)") from err
        if not isinstance(out, torch.Tensor):
            raise InputTypeError(f"{name} {describe(fn)} returned {type(out).__name__}, not a "
                                 f"tensor: it must compute {want} from its arguments")
        ok = out.is_floating_point() if name == "score_mod" else out.dtype == torch.bool
        if not ok:
            raise InputTypeError(f"{name} {describe(fn)} returned dtype {out.dtype}; it must "
                                 f"return {want}"
                                 + (" (compare, e.g. q_idx >= kv_idx)" if name == "mask_mod"
                                   else " (e.g. score + 1.0 * bias)"))
        try:
            shape = torch.broadcast_shapes(out.shape, score.shape)
        except RuntimeError:
            shape = None
        if shape != score.shape:
            raise InputError(f"{name} {describe(fn)} returned shape {tuple(out.shape)} for a "
                             f"(2, 2, 2, 2) grid of (b, h, q_idx, kv_idx): it must broadcast to "
                             f"the grid (index multi-dim aux tensors with all coordinates, "
                             f"aux[i][b, q_idx])")
    _probed.add(key)


def one_line(err: BaseException) -> str:
    """An exception's message without terminal colour codes, on one line."""
    return " ".join(re.sub(r"\x1b\[[0-9;]*m", "", str(err)).split())


def kernel_mods(score_mod, mask_mod, aux: tuple) -> KernelMods:
    """KernelMods of checked functions and a checked aux tuple (`check_mods` does both)."""
    score_aux = score_mod is not None and _takes_aux(score_mod, "score_mod", 5)
    mask_aux = mask_mod is not None and _takes_aux(mask_mod, "mask_mod", 4)
    sig = tuple((str(t.dtype).removeprefix("torch."), t.dim()) for t in aux)
    return KernelMods(score_mod, mask_mod, bool(score_aux), bool(mask_aux), sig)


def refuse_split_with_mods(splits: bool, has_mods: bool, num_splits: int | None = None) -> None:
    """The one rule, at the API and in both kernels: the split-KV kernel takes no score_mod /
    mask_mod yet (InputError, a ValueError, naming num_splits when the call gave one)."""
    if splits and has_mods:
        asked = f"num_splits={num_splits}: " if num_splits is not None else ""
        raise InputError(f"{asked}split-KV does not take a score_mod / mask_mod yet; pass "
                         f"num_splits=None or 1 with mods")


def check_mods(score_mod, mask_mod, aux_tensors, device) -> tuple[KernelMods, tuple]:
    """The one check of mods and aux tensors, before anything runs: callables of the right
    arity, aux_tensors a sequence of float32 / int32 tensors on `device` (q's), each mod tried
    once on meta tensors (`_probe`). Returns (KernelMods, aux tuple)."""
    if aux_tensors is not None and score_mod is None and mask_mod is None:
        raise InputError("aux_tensors were given without a score_mod or mask_mod to read them")
    aux = _check_aux(aux_tensors, device)
    mods = kernel_mods(score_mod, mask_mod, aux)
    if mods:
        _probe(mods, aux)
    return mods, aux


# ---- ready-made mods -----------------------------------------------------------------------

class BoundMod(NamedTuple):
    """A ready-made mod and the aux tensors it reads: `mod, aux = alibi(slopes)`. Its mod reads
    aux[aux_index]; to combine two, give the second aux_index=1 and pass aux1 + aux2."""

    mod: Callable
    aux_tensors: tuple


def _tensor(x, name: str, dtype: str):
    import torch

    if not isinstance(x, torch.Tensor):
        raise InputTypeError(f"{name} must be a torch tensor, got {type(x).__name__}")
    if str(x.dtype).removeprefix("torch.") != dtype:
        raise InputTypeError(f"{name} has dtype {x.dtype}; pass a {dtype} tensor "
                             f"(.{'float' if dtype == 'float32' else 'int'}())")
    return x


def alibi(slopes, *, aux_index: int = 0) -> BoundMod:
    """ALiBi (Press et al.): score + slopes[h] * (kv_idx - q_idx), FlexAttention's form.

    slopes: float32 (heads_q,) on q's device, e.g. 2 ** (-8 * (h + 1) / heads_q)."""
    slopes = _tensor(slopes, "slopes", "float32")
    if slopes.dim() != 1:
        raise InputError(f"slopes has shape {tuple(slopes.shape)}: expected (heads_q,)")
    i = aux_index

    def alibi_mod(score, b, h, q_idx, kv_idx, aux):
        return score + aux[i][h] * (kv_idx - q_idx)

    return BoundMod(alibi_mod, (slopes,))


def relative_bias(table, *, aux_index: int = 0) -> BoundMod:
    """A learned relative-position bias: score + table[..., clip(kv_idx - q_idx, -R, R) + R].

    table: float32 (2R + 1,) shared by all heads, or (heads_q, 2R + 1) per query head; offsets
    beyond +-R reuse the edge entries (as T5's buckets saturate)."""
    table = _tensor(table, "table", "float32")
    if table.dim() not in (1, 2) or table.shape[-1] % 2 != 1:
        raise InputError(f"table has shape {tuple(table.shape)}: expected (2R + 1,) or "
                         f"(heads_q, 2R + 1), an odd number of offsets -R..R")
    radius, i = (table.shape[-1] - 1) // 2, aux_index

    def offset(q_idx, kv_idx):
        return minimum(maximum(kv_idx - q_idx, -radius), radius) + radius

    if table.dim() == 1:
        def relative_bias_mod(score, b, h, q_idx, kv_idx, aux):
            return score + aux[i][offset(q_idx, kv_idx)]
    else:
        def relative_bias_mod(score, b, h, q_idx, kv_idx, aux):
            return score + aux[i][h, offset(q_idx, kv_idx)]

    return BoundMod(relative_bias_mod, (table,))


def document_mask(doc_ids, *, aux_index: int = 0) -> BoundMod:
    """Packed documents: query i sees key j only inside its own document,
    doc_ids[q_idx] == doc_ids[kv_idx] (AND causal for causal packing).

    doc_ids: int32 (seqlen,) -- one packed sequence for every batch row; its length must cover
    seqlen_q and seqlen_k -- or (batch, seqlen) per batch row."""
    doc_ids = _tensor(doc_ids, "doc_ids", "int32")
    if doc_ids.dim() not in (1, 2):
        raise InputError(f"doc_ids has shape {tuple(doc_ids.shape)}: expected (seqlen,) or "
                         f"(batch, seqlen)")
    i = aux_index
    if doc_ids.dim() == 1:
        def document_mod(b, h, q_idx, kv_idx, aux):
            return aux[i][q_idx] == aux[i][kv_idx]
    else:
        def document_mod(b, h, q_idx, kv_idx, aux):
            return aux[i][b, q_idx] == aux[i][b, kv_idx]

    return BoundMod(document_mod, (doc_ids,))


def prefix_lm(prefix_len, *, aux_index: int = 0) -> BoundMod:
    """Prefix LM: every query sees the first prefix_len keys, and the rest causally
    (kv_idx < prefix_len | kv_idx <= q_idx; top-left positions, as FlexAttention writes it).

    prefix_len: an int (a constant of the kernel: each value compiles once) or an int32
    (batch,) tensor of per-row prefix lengths (read at run time)."""
    if isinstance(prefix_len, int) and not isinstance(prefix_len, bool):
        if prefix_len < 0:
            raise InputError(f"prefix_len must be >= 0, got {prefix_len}")
        n = prefix_len

        def prefix_lm_mod(b, h, q_idx, kv_idx):
            return (kv_idx < n) | (kv_idx <= q_idx)

        return BoundMod(prefix_lm_mod, ())
    lengths = _tensor(prefix_len, "prefix_len", "int32")
    if lengths.dim() != 1:
        raise InputError(f"prefix_len has shape {tuple(lengths.shape)}: expected (batch,)")
    i = aux_index

    def prefix_lm_batch_mod(b, h, q_idx, kv_idx, aux):
        return (kv_idx < aux[i][b]) | (kv_idx <= q_idx)

    return BoundMod(prefix_lm_batch_mod, (lengths,))
