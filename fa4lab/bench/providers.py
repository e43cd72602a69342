"""The bench's providers: a name and a runner for fa4lab, PyTorch SDPA and upstream FA4.

A runner takes (q, k, v, causal, softmax_scale) with q/k/v (batch, seqlen, heads, head_dim)
and returns the output in the same layout. A provider that cannot run here keeps its name and
says why (`Provider.why_missing`): the sweep reports it instead of dropping it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fa4lab.bench.records import package_version
from fa4lab.bench.sweep import OURS, PEERS, PERSISTENT, PROVIDERS, UNPACKED, VARIANTS

Runner = Callable[..., Any]


@dataclass(frozen=True)
class Provider:
    """A name and a runner, or the reason it is missing. `prepare(q, k, v)` (optional) turns
    the sweep's (batch, seqlen, heads, head_dim) inputs into the provider's native layout once,
    outside the timed region; the runner then takes those and still returns the output as
    (batch, seqlen, heads, head_dim) (a view is enough)."""

    name: str
    runner: Runner | None      # None: missing
    why_missing: str = ""
    prepare: Callable | None = None

    @property
    def missing(self) -> bool:
        return self.runner is None


def short_error(err: BaseException, limit: int = 300) -> str:
    """An exception's message on one line, cut to `limit` characters: a note in a table."""
    text = " ".join(str(err).split())
    return text if len(text) <= limit else text[:limit] + " ..."


# Note [SDPA layout]
# SDPA takes (batch, heads, seqlen, head_dim). The bench gives it its own contiguous copies in
# that layout, made once per shape outside the timed region (`to_bhsd`), so no backend pays
# for a layout it would not see in a model, and none can refuse the strides of a transposed
# view. seqlen_q == seqlen_k in the sweep, so SDPA's is_causal=True (top-left aligned) is the
# same mask as fa4lab's bottom-right rule. With GQA (fewer K/V heads than query heads, as in
# `fa4lab bench --decode`) the runner passes enable_gqa=True, as `fa4lab.api.sdpa_same_dtype`
# does, so K/V stay at their own head count (a backend that cannot take that raises, and the
# bench reports it); K/V are never expanded, which would move more bytes than a model does.
def to_bhsd(q, k, v):
    """(batch, seqlen, heads, d) -> contiguous (batch, heads, seqlen, d) copies, for SDPA."""
    return tuple(t.transpose(1, 2).contiguous() for t in (q, k, v))


def sdpa_runner(backend_name: str, *, layout: str = "bshd") -> Runner:
    """torch SDPA restricted to one backend ("FLASH_ATTENTION", "CUDNN_ATTENTION", "MATH").

    layout "bshd": takes (batch, seqlen, heads, d) and passes transposed views; "bhsd": takes
    SDPA's own layout (see `to_bhsd`). Either way the output comes back as (b, s, h, d).
    """
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)
    if layout not in ("bshd", "bhsd"):
        raise ValueError(f"layout {layout!r}: 'bshd' or 'bhsd'")
    views = layout == "bshd"

    sdpa = torch.nn.functional.scaled_dot_product_attention

    def run(q, k, v, causal, softmax_scale):
        if views:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if causal and q.shape[2] != k.shape[2]:
            raise ValueError("SDPA's is_causal is top-left aligned: with seqlen_q != seqlen_k "
                             "it is not fa4lab's bottom-right causal mask")
        # enable_gqa only where heads differ: the sweep's calls stay as they were
        gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
        with sdpa_kernel([backend]):
            o = sdpa(q, k, v, is_causal=causal, scale=softmax_scale, **gqa)
        return o.transpose(1, 2)

    return run


def fa4lab_runner(pack_gqa: bool | None = None, **options) -> Runner:
    """`fa4lab.attention`, refusing its float64 fallback: where no kernel runs, `attention`
    computes the reference (with a SlowReferenceWarning), which must never be timed as fa4lab.
    The warning is an error on the first call (the check call); later calls take the same
    dispatch, so they pay no extra cost. pack_gqa None: attention's own default (it chooses);
    True / False: passed on (the `fa4lab-unpacked` provider is pack_gqa=False). `options`
    (window_size, softcap, learnable_sink, score_mod, mask_mod, aux_tensors: `fa4lab bench
    --features`) are passed on as they are."""
    import warnings

    from fa4lab.api import SlowReferenceWarning, attention

    first = [True]
    kw = dict(options) if pack_gqa is None else {"pack_gqa": bool(pack_gqa), **options}

    def run(q, k, v, causal, softmax_scale):
        if first[0]:
            with warnings.catch_warnings():
                warnings.simplefilter("error", SlowReferenceWarning)
                out = attention(q, k, v, causal=causal, softmax_scale=softmax_scale, **kw)
            first[0] = False
        else:
            out = attention(q, k, v, causal=causal, softmax_scale=softmax_scale, **kw)
        return out[0] if isinstance(out, tuple) else out

    return run


def fa4lab_plan_runner(**overrides) -> Runner:
    """fa4lab's kernel for each shape's plan with `overrides` (persistent=True / False: the
    VARIANTS providers), pack_gqa as `fa4lab.attention` would choose it; each shape's kernel
    is compiled once (`fa4lab.kernels.launch.compile_plan`), the first call's cost."""
    from fa4lab.call import check_call
    from fa4lab.kernels.launch import compile_plan, device_arch
    from fa4lab.plan import plan_forward
    from fa4lab.spec import AttentionSpec, normalize_dtype

    runners = {}

    def run(q, k, v, causal, softmax_scale):
        key = (tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, bool(causal))
        if key not in runners:
            arch = device_arch(q.device.index)
            b, sq, hq, d = q.shape
            spec = AttentionSpec(b, sq, k.shape[1], hq, k.shape[2], d, v.shape[3],
                                 dtype=normalize_dtype(q.dtype), causal=bool(causal))
            packed = check_call(q, k, v, causal=bool(causal)).key(arch).pack_gqa  # the API's
            plan = plan_forward(spec, arch, pack_gqa=packed, **overrides)
            runners[key] = compile_plan(plan, (q, k, v))[0]
        return runners[key](q, k, v, causal, softmax_scale)

    return run


def fa4_function() -> Callable[..., Any]:
    """Upstream FA4's `flash_attn_func`, or a RuntimeError saying why it does not import."""
    try:
        from flash_attn.cute.interface import flash_attn_func
    except ImportError as err:
        installed = package_version("flash-attn-4")
        if installed is None:
            raise RuntimeError("flash-attn-4 is not installed (pip install flash-attn-4)") \
                from None
        raise RuntimeError(f"flash-attn-4 {installed} is installed but flash_attn.cute does "
                           f"not import: {short_error(err)}") from None
    return flash_attn_func


def fa4_runner(**options) -> Runner:
    """Upstream FA4's `flash_attn_func` with `options` (window_size, softcap, learnable_sink:
    its own names) passed on as they are."""
    flash_attn_func = fa4_function()

    def run(q, k, v, causal, softmax_scale):
        out = flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal, **options)
        return out[0] if isinstance(out, tuple) else out

    return run


def resolve_providers(names: Sequence[str], *, arch: str | None = None,
                      include_ours: bool = True) -> list[Provider]:
    """Providers by name, each with a runner or the reason it is missing (never dropped).
    fa4lab's runner is `fa4lab.attention`, which picks its kernel from the tensors' device
    (`fa4lab-unpacked`: the same with pack_gqa=False); `arch` is accepted for callers that
    know it and changes nothing here."""
    unknown = [n for n in names if n not in PROVIDERS]
    if unknown:
        raise ValueError(f"unknown provider(s) {unknown}: choose from {list(PEERS)}, "
                         f"{UNPACKED!r} or {list(VARIANTS)} (fa4lab itself is always measured)")
    names = ([OURS] if include_ours else []) + [n for n in names if n != OURS]
    from fa4lab.environment import gpu

    has_gpu = gpu() is not None
    out = []
    for name in names:
        try:
            if name in ("sdpa-flash", "sdpa-cudnn") and not has_gpu:
                raise RuntimeError("no CUDA GPU visible")
            if name == "sdpa-flash":
                runner = sdpa_runner("FLASH_ATTENTION", layout="bhsd")
            elif name == "sdpa-cudnn":
                import torch

                if not torch.backends.cudnn.is_available():
                    raise RuntimeError("this torch build has no cuDNN")
                runner = sdpa_runner("CUDNN_ATTENTION", layout="bhsd")
            elif name == "fa4":
                runner = fa4_runner()
            elif name == UNPACKED:
                runner = fa4lab_runner(pack_gqa=False)
            elif name in VARIANTS:
                runner = fa4lab_plan_runner(persistent=name == PERSISTENT)
            else:
                runner = fa4lab_runner()
            prepare = to_bhsd if name.startswith("sdpa-") else None
            out.append(Provider(name, runner, prepare=prepare))
        except Exception as err:   # a peer that cannot be imported is reported, not dropped
            out.append(Provider(name, None, f"{type(err).__name__}: {short_error(err)}"))
    return out


def provider_lines(providers: Sequence[Provider], labels: Mapping[str, str],
                   width: int) -> list[str]:
    """What a mode's description says of its providers: "providers:", then each one's name in
    `width` columns, its label (its name where `labels` has none), and "available" or why it is
    missing."""
    lines = ["providers:"]
    for p in providers:
        state = f"missing ({p.why_missing})" if p.missing else "available"
        lines.append(f"  {p.name:<{width}} {labels.get(p.name, p.name)}: {state}")
    return lines
