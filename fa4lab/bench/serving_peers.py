"""PyTorch in the nearest form it has to a serving call, for `fa4lab bench --serving`.

`sdpa_nested_provider`: SDPA over nested jagged tensors for a packed varlen batch (the packed
q, k, v wrapped as (batch, heads, jagged, d) views, no copy); `sdpa_padded_provider`: SDPA on
a paged cache's K/V gathered into a padded dense layout with a key-padding mask (the gather
outside the timed call, the padding inside). Both fall back to K/V heads repeated to the query
heads where `enable_gqa` is refused (`_gqa_or_repeated`), and say so in their row's note.
Their labels are `fa4lab.bench.serving.SERVING_LABELS`; `args` is the case's `VarlenArgs`
(filled by `fa4lab.bench.serving.serving_inputs`), read when called.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from fa4lab.bench.providers import Provider, short_error

SDPA_NESTED, SDPA_PADDED = "sdpa-nested", "sdpa-padded"


@dataclass
class VarlenArgs:
    """What a varlen or paged call takes besides q, k, v, under upstream's (and fa4lab's) names;
    filled by `fa4lab.bench.serving.serving_inputs`, read by the runners at call time (None:
    not used)."""

    cu_seqlens_q: object = None
    cu_seqlens_k: object = None
    max_seqlen_q: int | None = None
    max_seqlen_k: int | None = None
    seqused_k: object = None
    page_table: object = None

    def kwargs(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _repeat_heads(t, group: int):
    """(b, h, s, d) -> (b, h * group, s, d), each head repeated `group` times in place (query
    head i reads KV head i // group); a nested jagged tensor through its packed values."""
    import torch

    if not t.is_nested:
        return t.repeat_interleave(group, dim=1)
    values = t.transpose(1, 2).values().repeat_interleave(group, dim=1)
    return torch.nested.nested_tensor_from_jagged(values, t.offsets()).transpose(1, 2)


def _gqa_or_repeated(sdpa, q, k, v, state: dict, **kw):
    """sdpa(q, k, v, enable_gqa=True) or, once that has raised, sdpa on K/V with their heads
    repeated to q's (`_repeat_heads`, once per K/V copy and kept, so the timed calls do not pay
    for it); state["note"] says so."""
    if state.get("gqa", True):
        try:
            out = sdpa(q, k, v, enable_gqa=True, **kw)
            state["gqa"] = True
            return out
        except Exception as err:
            if state.get("gqa"):      # it ran before: this is a real failure
                raise
            state["gqa"] = False
            state["note"] = (f"K/V heads repeated to {q.shape[1]} (enable_gqa refused: "
                             f"{type(err).__name__}: {short_error(err, 120)})")
    reps = state.setdefault("repeated", {})
    if id(k) not in reps:
        group = q.shape[1] // k.shape[1]
        reps[id(k)] = (k, v, *(_repeat_heads(t, group) for t in (k, v)))
    return sdpa(q, *reps[id(k)][2:], **kw)


def sdpa_nested_provider(args: VarlenArgs, how: dict) -> Provider:
    """SDPA over nested jagged tensors (SERVING_LABELS): prepare wraps the packed q, k, v as
    (batch, heads, jagged, d) views sharing cu_seqlens_q (no copy)."""
    import torch
    import torch.nn.functional as F

    def prepare(q, k, v):
        off = args.cu_seqlens_q.long()
        return tuple(torch.nested.nested_tensor_from_jagged(t, off).transpose(1, 2)
                     for t in (q, k, v))

    state = how.setdefault(SDPA_NESTED, {})

    def run(q, k, v, causal, softmax_scale):
        out = _gqa_or_repeated(F.scaled_dot_product_attention, q, k, v, state,
                               is_causal=causal, scale=softmax_scale)
        return out.transpose(1, 2).values()[None]

    return Provider(SDPA_NESTED, run, prepare=prepare)


# SDPA's padded key length is a multiple of this, so no backend pads the mask inside the call.
MASK_ALIGN = 16


def sdpa_padded_provider(args: VarlenArgs, how: dict) -> Provider:
    """SDPA on the paged K/V gathered into a padded dense layout (SERVING_LABELS): prepare does
    the gather and builds the additive mask (-inf past seqused_k), outside the timed call."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fa4lab.varlen import gather_paged, pad

    def prepare(q, k, v):
        lens = args.seqused_k.tolist()
        width = math.ceil(max(lens) / MASK_ALIGN) * MASK_ALIGN
        cu = [0, *[sum(lens[:b + 1]) for b in range(len(lens))]]
        dense = [pad(torch.cat(gather_paged(t, args.page_table, lens)), cu, width)
                 .transpose(1, 2).contiguous() for t in (k, v)]          # (b, h, width, d)
        seen = torch.arange(width, device=q.device)[None, :] < args.seqused_k[:, None]
        mask = torch.zeros(seen.shape, dtype=q.dtype, device=q.device).masked_fill(
            ~seen, -math.inf)[:, None, None, :]
        return q[:, :, None, :], (dense[0], mask), dense[1]     # q (b, h, 1, d)

    state = how.setdefault(SDPA_PADDED, {})
    backends = [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                SDPBackend.FLASH_ATTENTION]

    def run(q, k_mask, v, causal, softmax_scale):
        k, mask = k_mask
        with sdpa_kernel(backends):
            out = _gqa_or_repeated(F.scaled_dot_product_attention, q, k, v, state,
                                   attn_mask=mask, scale=softmax_scale)
        return out[None, :, :, 0]                               # (1, b, h, d)

    return Provider(SDPA_PADDED, run, prepare=prepare)
