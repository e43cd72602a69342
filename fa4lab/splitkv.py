"""Split-KV (flash-decoding): K/V cut across CTAs, partial results merged by a combine step.

A decode step has one (or a few) query rows per sequence: batch * heads_kv CTAs (pack-GQA folds
the query heads of a KV head into one tile's rows) cannot fill a GPU's SMs, while each CTA
walks a long K/V. Split-KV gives every (batch, head, m_block) tile `num_splits` CTAs, each
walking one contiguous range of its key blocks (`split_blocks`) and writing a partial output,
normalised over its own keys, and that range's LSE. A combine step merges the splits with the
rule of notebook 01 (`fa4lab.online_softmax.merge_out_lse`, Note [merge rule]): it is the same
merge as two online-softmax states over disjoint key sets, applied num_splits - 1 times.

What is here (CPU or GPU tensors):
- `split_blocks` / `split_range`: each split's half-open key-block range, balanced (the one
  rule, for ints and the kernels' Int32);
- `partial_attention_reference`: the float64 partial outputs and LSEs a split kernel must write;
- `combine`: the N-way merge in torch (any float dtype in, float32 math, float64 kept as
  float64); `fa4lab.kernels.combine.combine` hands float32 partials on an sm90 / sm100 GPU to
  the combine kernel;
- `choose_num_splits`: how many splits a decode shape gets (Note [choosing num_splits]).

An empty split (more splits than blocks, or a window that hides its whole range) writes out 0
and LSE -inf and weighs exactly 0 in the merge. A learnable sink is not a split's business: it
enters once, in `combine`, as one more partial with out 0 and LSE sink[h].

    from fa4lab.splitkv import partial_attention_reference, combine
    out_p, lse_p = partial_attention_reference(q, k, v, num_splits=4, n_block_size=128)
    out, lse = combine(out_p, lse_p)      # == attention_reference(q, k, v), lse (b, sq, hq)
"""

from __future__ import annotations

import math

from fa4lab.errors import InputError, InputTypeError, check_same_device
from fa4lab.tiling import ceil_div, num_m_blocks, num_n_blocks

__all__ = ["MAX_SPLITS", "MIN_BLOCKS_PER_SPLIT", "SPLIT_EFFICIENCY_SLACK", "SPLIT_FILL_FRACTION",
           "check_num_splits", "check_partials", "choose_num_splits", "combine",
           "merge_partials", "partial_attention_reference", "split_blocks", "split_range",
           "wave_efficiency"]

# Tuning knobs of `choose_num_splits` (Note [choosing num_splits]).
SPLIT_FILL_FRACTION = 0.8       # a grid with this share of a wave of CTAs is not split
SPLIT_EFFICIENCY_SLACK = 0.85   # take the fewest splits within this factor of the best waves
MIN_BLOCKS_PER_SPLIT = 2        # key blocks each split keeps, to pay its Q load and its partial
MAX_SPLITS = 128                # the combine reads at most this many partials per row


def _count(name: str, value, lowest: int) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__") or int(value) < lowest:
        raise InputError(f"{name} must be an int >= {lowest}, got {value!r}")
    return int(value)


def check_num_splits(num_splits) -> int | None:
    """A call's num_splits: None (choose: `choose_num_splits`), 1 (no split) or n > 1 splits
    of the key blocks (more splits than blocks leave the last ones empty)."""
    if num_splits is None:
        return None
    if isinstance(num_splits, bool) or not hasattr(num_splits, "__index__"):
        raise InputTypeError(f"num_splits must be None (choose for the shape) or an int >= 1, "
                             f"got {type(num_splits).__name__} {num_splits!r}")
    if int(num_splits) < 1:
        raise InputError(f"num_splits must be >= 1 (1: no split-KV), got {int(num_splits)}; "
                         f"pass None to let fa4lab choose for the shape")
    return int(num_splits)


def split_range(n_blocks, num_splits, split, *, imin=min):
    """Split `split`'s HALF-OPEN key-block range (lo, hi) of [0, n_blocks): THE rule of
    `split_blocks`, for ints or the kernels' DSL Int32 (`imin`: the DSL's min), so the split
    kernels and the reference cut the key axis with the same arithmetic.

    Split s starts after s whole shares of n_blocks // num_splits blocks and after one extra
    block for each earlier split among the first n_blocks % num_splits."""
    base = n_blocks // num_splits
    extra = n_blocks - base * num_splits
    return (split * base + imin(split, extra),
            (split + 1) * base + imin(split + 1, extra))


def split_blocks(n_blocks: int, num_splits: int) -> tuple[tuple[int, int], ...]:
    """Each split's HALF-OPEN key-block range [lo, hi), in order, covering [0, n_blocks)
    (`split_range` of each split).

    Balanced: the first n_blocks % num_splits splits take one block more than the others, so
    no split is longer than ceil(n_blocks / num_splits) (upstream cuts ceil-sized chunks and
    leaves the short ones at the end; the longest split, which sets the time, is the same).
    With num_splits > n_blocks the last splits are empty (lo == hi)."""
    n_blocks = _count("n_blocks", n_blocks, 0)
    num_splits = _count("num_splits", num_splits, 1)
    return tuple(split_range(n_blocks, num_splits, s) for s in range(num_splits))


def _keys_between(first: int, end: int):
    """A mask_mod that shows keys [first, end) only: one split's keys."""
    def in_split(b, h, q_idx, kv_idx):
        return (kv_idx >= first) & (kv_idx < end)

    return in_split


def partial_attention_reference(q, k, v, *, num_splits: int, n_block_size: int,
                                causal: bool = False, softmax_scale: float | None = None,
                                window_size=(None, None), softcap: float = 0.0):
    """The float64 partial results of split-KV: (out_partial, lse_partial).

    q, k, v as `fa4lab.reference.attention_reference` takes them (dense, batch-first, torch).
    Split s attends to the keys of its blocks `split_blocks(ceil(seqlen_k / n_block_size),
    num_splits)[s]`, with the call's mask on the whole sequence's positions (bottom-right
    causal, window): out_partial[s] (batch, seqlen_q, heads_q, head_dim_v) is normalised over
    those keys alone, lse_partial[s] (batch, seqlen_q, heads_q) their log-sum-exp (natural
    log; -inf and out 0 where the split sees no key). The LSE is laid out like out without its
    last dim, as `combine` takes it (the reference's lse is (batch, heads_q, seqlen_q))."""
    import torch

    from fa4lab.reference import attention_reference

    n_block_size = _count("n_block_size", n_block_size, 1)
    ranges = split_blocks(num_n_blocks(int(k.shape[1]), n_block_size), num_splits)
    outs, lses = [], []
    for lo, hi in ranges:
        out, lse = attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                       window_size=window_size, softcap=softcap,
                                       mask_mod=_keys_between(lo * n_block_size,
                                                              hi * n_block_size),
                                       return_lse=True)
        outs.append(out)
        lses.append(lse.transpose(1, 2))
    return torch.stack(outs), torch.stack(lses)


def combine(out_partial, lse_partial, *, learnable_sink=None, out_dtype=None):
    """Merge split-KV partials: (out, lse) over the union of the splits' keys.

    out_partial (num_splits, ..., head_dim_v), each split normalised over its own keys;
    lse_partial (num_splits, ...) their natural-log LSEs, shaped like out_partial without its
    last dim. Any floating dtypes; the math runs in float32 (float64 when either input is
    float64). out comes back in out_dtype (default: out_partial's dtype), lse in the math dtype;
    a row no split saw gives out 0 and lse -inf, never NaN. The merge is `merge_out_lse` folded
    over the splits (Note [merge rule]). learnable_sink (heads_q,) (lse_partial's LAST axis is
    the head axis) joins as one more partial with out 0 and lse sink[h]: a sink is a key with no
    value. This is the merge in torch, on the partials' device; `fa4lab.kernels.combine.combine`
    is the same call that hands float32 partials laid out as the split kernels write them
    (num_splits, batch, seqlen_q, heads, head_dim_v) on an sm90 / sm100 GPU to the combine
    kernel (the same rule in device form).
    """
    out_dtype = check_partials(out_partial, lse_partial, learnable_sink, out_dtype)
    return merge_partials(out_partial, lse_partial, learnable_sink, out_dtype)


def check_partials(out_partial, lse_partial, learnable_sink, out_dtype):
    """The checks of `combine`'s arguments; returns the out dtype (out_partial's by default)."""
    import torch

    for name, t in (("out_partial", out_partial), ("lse_partial", lse_partial)):
        if not isinstance(t, torch.Tensor):
            raise InputTypeError(f"{name} must be a torch tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise InputTypeError(f"{name} has dtype {t.dtype}: partial outputs and LSEs are "
                                 f"floating point")
    if out_partial.dim() < 2 or tuple(lse_partial.shape) != tuple(out_partial.shape[:-1]) \
            or out_partial.shape[0] < 1:
        raise InputError(f"combine needs out_partial (num_splits >= 1, ..., head_dim_v) and "
                         f"lse_partial (num_splits, ...) of the same leading shape; got "
                         f"{tuple(out_partial.shape)} and {tuple(lse_partial.shape)}")
    check_same_device("lse_partial", lse_partial.device, "out_partial",
                      out_partial.device)
    if learnable_sink is not None:
        heads = lse_partial.shape[-1]
        if not isinstance(learnable_sink, torch.Tensor) or tuple(learnable_sink.shape) != (
                heads,):
            raise InputError(f"learnable_sink must be a torch tensor (heads_q,) = ({heads},) "
                             f"for lse_partial {tuple(lse_partial.shape)} (heads last)")
    out_dtype = out_partial.dtype if out_dtype is None else out_dtype
    if not isinstance(out_dtype, torch.dtype) or not out_dtype.is_floating_point:
        raise InputTypeError(f"out_dtype must be a floating torch dtype, got {out_dtype!r}")
    return out_dtype


def merge_partials(out_partial, lse_partial, learnable_sink, out_dtype):
    """`combine`'s merge in torch, of arguments `check_partials` has checked."""
    import torch

    from fa4lab.online_softmax import merge_out_lse

    wide = torch.float64 in (out_partial.dtype, lse_partial.dtype)
    math_dtype = torch.float64 if wide else torch.float32
    outs = out_partial.to(math_dtype)
    lses = lse_partial.to(math_dtype)
    if learnable_sink is not None:
        sink = learnable_sink.to(device=lses.device, dtype=math_dtype).expand(lses.shape[1:])
        outs = torch.cat([outs, torch.zeros_like(outs[:1])])
        lses = torch.cat([lses, sink[None]])
    # From the empty state (no key: out 0, lse -inf), so one split is merged like several: a
    # row it did not see comes out 0, whatever its partial holds.
    out, lse = torch.zeros_like(outs[0]), torch.full_like(lses[0], -math.inf)
    for s in range(outs.shape[0]):
        out, lse = merge_out_lse(out, lse, outs[s], lses[s])
    return out.to(out_dtype), lse


# Note [choosing num_splits]
# A split-KV launch runs ctas * num_splits CTAs, ctas = batch * heads_kv * ceil(seqlen_q_rows /
# m_block) (decode packs a KV head's query heads into M, so seqlen_q_rows = seqlen_q *
# heads_q / heads_kv). Splitting pays twice: each split loads Q and writes a partial O and LSE
# in float32, and the combine reads them all back; so split only what cannot fill the GPU.
# The rule follows upstream FlashAttention's split heuristic (FA2/FA3's flash-decoding):
#   - a grid with at least SPLIT_FILL_FRACTION of a wave of CTAs (one CTA per SM) is not split;
#   - otherwise each candidate s gets its WAVE EFFICIENCY, waves / ceil(waves) with waves =
#     ctas * s / num_sms: the share of the SM slots of its last wave that do work (1.0 when the
#     CTAs fill whole waves). Only candidates that shorten the longest split count: s is
#     skipped when ceil(n_blocks / s) == ceil(n_blocks / (s - 1)), since s - 1 splits finish as
#     early and combine less;
#   - the answer is the FEWEST splits whose efficiency is within SPLIT_EFFICIENCY_SLACK of the
#     best candidate's: near-best occupancy for the least combine traffic.
# Candidates stop at MAX_SPLITS, at num_sms (more splits than SMs only queue) and at
# n_blocks // MIN_BLOCKS_PER_SPLIT, so every split walks at least that many key blocks and its
# fixed cost (Q load, partial store: a tile's overhead in Note [tile cost model]) stays small
# beside its work. A short K (fewer than 2 * MIN_BLOCKS_PER_SPLIT blocks) is never split.
# With a paged K/V cache seqlen_k is the page table's capacity, pages_per_seq * page_size: each
# sequence's own count (seqused_k) is on the GPU, and reading it would stall the host on every
# call. The kernel cuts each sequence's own key blocks into the splits, so a sequence shorter
# than the capacity leaves its last splits empty (Note [empty splits] in
# fa4lab.kernels.device.split): a CTA each that stores 0 and -inf, which the combine weighs 0.


def wave_efficiency(ctas: int, num_splits: int, num_sms: int) -> float:
    """waves / ceil(waves), waves = ctas * num_splits / num_sms: the share of the SM slots of
    the launch's last wave that hold a CTA (Note [choosing num_splits])."""
    waves = ctas * num_splits / num_sms
    return waves / math.ceil(waves)


def choose_num_splits(batch: int, heads_kv: int, seqlen_q_rows: int, seqlen_k: int,
                      n_block: int, num_sms: int, *, m_block: int = 128,
                      max_splits: int = MAX_SPLITS) -> int:
    """How many splits of the key blocks a forward call gets; 1 = no split-KV.

    seqlen_q_rows: the M rows per (batch, KV head), seqlen_q * heads_q // heads_kv with
    pack-GQA; n_block / m_block: the kernel's tile; num_sms: the GPU's SMs
    (`fa4lab.hardware`). The rule and what it trades: Note [choosing num_splits]."""
    for name, x in (("batch", batch), ("heads_kv", heads_kv), ("seqlen_q_rows", seqlen_q_rows),
                    ("seqlen_k", seqlen_k), ("n_block", n_block), ("num_sms", num_sms),
                    ("m_block", m_block), ("max_splits", max_splits)):
        _count(name, x, 1)
    ctas = batch * heads_kv * num_m_blocks(seqlen_q_rows, m_block)
    n_blocks = num_n_blocks(seqlen_k, n_block)
    most = min(max_splits, num_sms, n_blocks // MIN_BLOCKS_PER_SPLIT)
    if ctas >= SPLIT_FILL_FRACTION * num_sms or most < 2:
        return 1
    candidates = [s for s in range(1, most + 1)
                  if s == 1 or ceil_div(n_blocks, s) != ceil_div(n_blocks, s - 1)]
    efficiency = {s: wave_efficiency(ctas, s, num_sms) for s in candidates}
    best = max(efficiency.values())
    return next(s for s in candidates if efficiency[s] >= SPLIT_EFFICIENCY_SLACK * best)
