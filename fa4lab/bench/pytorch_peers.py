"""The same computation in PyTorch, for `fa4lab bench --features`: SDPA and FlexAttention.

Each runner takes one feature's call (a `fa4lab.bench.features.FeatureCall`: the spec with its
causal / window / softcap, the sink, the score_mod / mask_mod of `fa4lab.mods` and their aux
tensors) and computes what `fa4lab.attention` computes with those options, the PyTorch way
(Note [the same computation in PyTorch]). Both take and return (batch, seqlen, heads, head_dim)
like every bench runner; what they build once (masks, biases, block masks, the compiled
FlexAttention) is built on the first call, the check call, outside the timed region.
"""

from __future__ import annotations

import math
import warnings

from fa4lab.bench.providers import Provider, Runner, to_bhsd
from fa4lab.bench.serving_peers import _gqa_or_repeated

SDPA, FLEX = "sdpa", "flex"
# Key columns SDPA gets for a sink: the sink's own, then masked padding that keeps the key
# length a multiple of 16, so the mask needs no padding inside the timed call.
SINK_COLUMNS = 16
# torch.compile recompiles flex_attention for each feature's score_mod and block mask; its
# default limit of 8 would send the later features to the slow eager path.
FLEX_RECOMPILE_LIMIT = 64

# Note [the same computation in PyTorch]
# SDPA (`torch.nn.functional.scaled_dot_product_attention`, with torch's own backend choice):
#   no option: no mask; causal alone: is_causal=True (seqlen_q == seqlen_k, so its top-left
#   alignment is fa4lab's bottom-right one). A window, mask_mod or both: an additive mask in
#   the input dtype, (1, 1, seqlen_q, seqlen_k), -inf where `fa4lab.reference.visible_mask`
#   ANDed with the mask_mod (evaluated on the whole grid) hides the key, else 0 (a bool mask
#   would be converted to that on every call, inside the timed region). A score_mod: an
#   additive bias in the input dtype, (1, heads, seqlen_q, seqlen_k), score_mod(0, b, h,
#   q_idx, kv_idx) with -inf where the masks hide the key: exact for additive mods (ALiBi,
#   relative bias; a mod that is not additive fails its check). With GQA (the model features)
#   enable_gqa=True, or K/V heads repeated (once, then kept) where the backend refuses it
#   (`fa4lab.bench.serving_peers._gqa_or_repeated`); Flex gets enable_gqa=True. A
#   sink: one more key with k = 0 and v = 0 whose bias is sink[h] (its score is then exactly
#   the sink logit and it adds e^sink[h] to the denominator and nothing to the numerator),
#   plus SINK_COLUMNS - 1 masked keys; exact. Softcap: SDPA cannot apply tanh to the scores
#   inside its kernel, so that row is skipped.
# FlexAttention (`torch.nn.attention.flex_attention.flex_attention` under torch.compile):
#   softcap and score_mod as one score_mod (softcap first: Note [order of score transforms]
#   in `fa4lab.mods`; the score it gets is already scaled), the window and mask_mod as one
#   mask_mod given to `create_block_mask` (B = H = None: the bench's masks do not depend on
#   the batch or the head), so fully hidden blocks are skipped. The fa4lab mods themselves are
#   called (one body for torch and the kernel: Note [one body, two worlds]). A sink: Flex
#   returns the LSE of the real keys, and out * sigmoid(lse - sink[h]) = out * e^lse /
#   (e^lse + e^sink[h]) is exactly the output with the sink in the denominator; that rescale
#   is part of the timed call.
# Building masks, biases and block masks and compiling Flex happen in the first call (counted
# in first_call_s), never in the timed region; the SDPA inputs with the sink's key columns are
# made with the (b, h, s, d) copies, before the first call.


def _grid(call, device):
    """Index tensors (b, h, q_idx, kv_idx) that broadcast over one (batch, head) pair's
    (seqlen_q, seqlen_k) grid, b = h = 0: the bench's masks do not depend on them."""
    import torch

    spec = call.spec
    zero = torch.zeros((1, 1, 1, 1), dtype=torch.int64, device=device)
    q_idx = torch.arange(spec.seqlen_q, device=device)[None, None, :, None]
    kv_idx = torch.arange(spec.seqlen_k, device=device)[None, None, None, :]
    return zero, zero, q_idx, kv_idx


def dense_visible(call, device):
    """Bool (1, 1, seqlen_q, seqlen_k): the causal / window mask of the call's spec
    (`fa4lab.reference.visible_mask`) AND its mask_mod on every (q_idx, kv_idx)."""
    import torch

    from fa4lab.reference import visible_mask

    spec = call.spec
    mask = torch.as_tensor(visible_mask(spec.seqlen_q, spec.seqlen_k, spec.causal,
                                        window_size=spec.window_size), device=device)[None, None]
    if call.mask_mod is not None:
        b, h, q_idx, kv_idx = _grid(call, device)
        mask = mask & call.mods.mask(b, h, q_idx, kv_idx, call.aux)
    return mask


def _sdpa_mask(call, device, dtype):
    """SDPA's attn_mask for the call (Note [the same computation in PyTorch]), or None."""
    import torch

    spec = call.spec
    left, right = spec.effective_window
    windowed = left is not None or (right is not None and not spec.causal)
    if call.score_mod is None and call.sink is None:
        if call.mask_mod is None and not windowed:
            return None                         # no option, or causal alone: is_causal
        visible = dense_visible(call, device)
        return torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill(~visible,
                                                                                -math.inf)
    visible = dense_visible(call, device)[0, 0]
    heads = spec.heads_q
    columns = spec.seqlen_k + (SINK_COLUMNS if call.sink is not None else 0)
    bias = torch.full((1, heads, spec.seqlen_q, columns), -math.inf, dtype=dtype,
                      device=device)
    b, _, q_idx, kv_idx = _grid(call, device)
    zero = torch.zeros((), dtype=torch.float32, device=device)
    for h in range(heads):                       # one head at a time: a float32 grid each
        if call.score_mod is not None:
            hi = torch.full((1, 1, 1, 1), h, dtype=torch.int64, device=device)
            add = call.mods.score(zero, b, hi, q_idx, kv_idx, call.aux)[0, 0]
        else:
            add = torch.zeros((), dtype=torch.float32, device=device)
        bias[0, h, :, :spec.seqlen_k] = torch.where(visible, add, -math.inf).to(dtype)
        if call.sink is not None:
            bias[0, h, :, spec.seqlen_k] = call.sink[h].to(dtype)
    return bias


def sdpa_runner(call) -> tuple[Runner, callable]:
    """(runner, prepare) for SDPA on the call: prepare makes SDPA's (b, h, s, d) copies (with
    the sink's key columns), the runner builds its mask on the first call."""
    import torch
    import torch.nn.functional as F

    state: dict = {}
    sink = call.sink is not None

    def prepare(q, k, v):
        q, k, v = to_bhsd(q, k, v)
        if sink:
            k, v = (torch.cat([t, t.new_zeros((*t.shape[:2], SINK_COLUMNS, t.shape[3]))],
                              dim=2) for t in (k, v))
        return q, k, v

    def run(q, k, v, causal, softmax_scale):
        if "mask" not in state:
            state["mask"] = _sdpa_mask(call, q.device, q.dtype)
        mask = state["mask"]
        kw = {"attn_mask": mask, "is_causal": bool(causal) and mask is None,
              "scale": softmax_scale}
        if q.shape[1] == k.shape[1]:
            o = F.scaled_dot_product_attention(q, k, v, **kw)
        else:                                 # GQA: enable_gqa, or K/V heads repeated
            o = _gqa_or_repeated(F.scaled_dot_product_attention, q, k, v, state, **kw)
        return o.transpose(1, 2)

    return run, prepare


_compiled: dict = {}


def _flex_function(compile: bool):
    """flex_attention, compiled once per process (eager when compile is False: CPU tests)."""
    from torch.nn.attention.flex_attention import flex_attention

    if not compile:
        return flex_attention
    if "flex" not in _compiled:
        import torch
        import torch._dynamo.config as dynamo_config

        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo_config, name):
                setattr(dynamo_config, name, max(getattr(dynamo_config, name),
                                                 FLEX_RECOMPILE_LIMIT))
        _compiled["flex"] = torch.compile(flex_attention, dynamic=False)
    return _compiled["flex"]


def window_mask_mod(spec):
    """The spec's causal / window rule as a FlexAttention mask_mod (None when it hides
    nothing): query i sees key j iff i + d - left <= j <= i + d + right, d = seqlen_k -
    seqlen_q (Note [window and causal] in `fa4lab.spec`; the check before timing holds it to
    the reference's `visible_mask`)."""
    left, right = spec.effective_window
    if left is None and right is None:
        return None
    d = spec.seqlen_k - spec.seqlen_q

    def window(b, h, q_idx, kv_idx):
        seen = (kv_idx <= q_idx + d + right) if right is not None else (kv_idx >= 0)
        if left is not None:
            seen = seen & (kv_idx >= q_idx + d - left)
        return seen

    return window


def _flex_mods(call):
    """(score_mod, mask_mod) for flex_attention: softcap then the call's score_mod; the
    window AND the call's mask_mod. Either may be None."""
    import torch

    spec, mods, aux = call.spec, call.mods, call.aux
    cap = spec.softcap
    score = None
    if cap or call.score_mod is not None:
        def score(s, b, h, q_idx, kv_idx):
            if cap:
                s = cap * torch.tanh(s / cap)
            if call.score_mod is not None:
                s = mods.score(s, b, h, q_idx, kv_idx, aux)
            return s

    window = window_mask_mod(spec)
    mask = window
    if call.mask_mod is not None:
        def mask(b, h, q_idx, kv_idx):
            seen = mods.mask(b, h, q_idx, kv_idx, aux)
            return seen & window(b, h, q_idx, kv_idx) if window is not None else seen

    return score, mask


def flex_runner(call, *, compile: bool = True) -> tuple[Runner, callable]:
    """(runner, prepare) for FlexAttention on the call: prepare makes (b, h, s, d) copies, the
    runner builds its block mask and compiles on the first call."""
    import torch

    state: dict = {}
    spec = call.spec

    def run(q, k, v, causal, softmax_scale):
        if not state:
            from torch.nn.attention.flex_attention import create_block_mask

            score, mask = _flex_mods(call)
            block = None if mask is None else create_block_mask(
                mask, None, None, spec.seqlen_q, spec.seqlen_k, device=q.device)
            state.update(fn=_flex_function(compile), score=score, block=block,
                         lse=_lse_request() if call.sink is not None else {})
        gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flex_attention.*")
            got = state["fn"](q, k, v, score_mod=state["score"], block_mask=state["block"],
                              scale=softmax_scale, **gqa, **state["lse"])
        if call.sink is None:
            return got.transpose(1, 2)
        out, lse = got[0], (got[1].lse if hasattr(got[1], "lse") else got[1])
        keep = torch.sigmoid(lse.float() - call.sink.float()[None, :, None])
        return (out.float() * keep[..., None]).to(q.dtype).transpose(1, 2)

    return run, to_bhsd


def _lse_request() -> dict:
    """flex_attention's argument that returns the LSE: return_aux=AuxRequest(lse=True) where
    torch has it, else return_lse=True."""
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:
        return {"return_lse": True}
    return {"return_aux": AuxRequest(lse=True)}


def pytorch_provider(name: str, call, *, flex_compile: bool = True) -> Provider:
    """The SDPA or Flex provider of one feature's call."""
    if name == SDPA:
        run, prepare = sdpa_runner(call)
    elif name == FLEX:
        run, prepare = flex_runner(call, compile=flex_compile)
    else:
        raise ValueError(f"unknown PyTorch peer {name!r}: {SDPA!r} or {FLEX!r}")
    return Provider(name, run, prepare=prepare)
