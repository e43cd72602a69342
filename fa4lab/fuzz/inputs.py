"""The tensors of a fuzz case and the call they go to.

`case_inputs(case, device)` makes q, k, v (dense, packed or a paged cache), the index tensors,
the sink and the mods of a `fa4lab.fuzz.cases.Case`, every value from the case's data seed
(a torch generator on `device` and a numpy generator), laid out as the case's layout says
(`lay_out`): the same values in other storage. `call(case, inputs)` runs the case's entry point
on them and returns (out, lse or None).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fa4lab import mods
from fa4lab.fuzz.cases import ODDS

__all__ = ["CaseInputs", "call", "case_inputs", "case_mods", "lay_out"]

# Sink logits a case may hold besides normal ones: far above and below any score, and -inf
# (no sink on that head).
SPECIAL_SINKS = (30.0, -30.0, 1e3, -1e3, -float("inf"))


@dataclass
class CaseInputs:
    """What a case's call takes. Dense entries: q (batch, seqlen_q, heads_q, d); varlen ones:
    packed q (total_q, heads_q, d); k and v packed keys, dense keys, or a paged cache
    (num_pages, page_size, heads_kv, d) with `page_table`."""

    q: object
    k: object
    v: object
    cu_seqlens_q: object = None
    cu_seqlens_k: object = None
    seqused_k: object = None
    seqused_q: object = None
    page_table: object = None
    max_seqlen_q: int | None = None
    max_seqlen_k: int | None = None
    learnable_sink: object = None
    score_mod: object = None
    mask_mod: object = None
    aux_tensors: tuple | None = None


# ---- mods ------------------------------------------------------------------------------------
# Module functions, so one mod is one kernel per process (Note [mods in the kernels]).

def distance_penalty(score, b, h, q_idx, kv_idx):
    """A score_mod of the positions: far keys weigh less."""
    return score - abs(q_idx - kv_idx) / 64.0


def head_and_position(b, h, q_idx, kv_idx):
    """A mask_mod of the query head and both positions (a packed row's head and q_idx must be
    right); leaves the top rows of heads >= 1 without a key."""
    return (kv_idx <= q_idx - h) | (h == 3)


def case_mods(case, batch: int, seqlen: int, device, gen):
    """(score_mod, mask_mod, aux_tensors) of `case.mod` for `batch` rows of `seqlen` positions
    (at least seqlen_q and seqlen_k), aux values from the torch generator `gen`."""
    import torch

    if case.mod is None:
        return None, None, None
    hq = case.heads_q

    def doc_ids():
        bounds = torch.randint(0, seqlen, (5,), device=device, generator=gen)
        return (torch.arange(seqlen, device=device)[:, None] >= bounds[None]).sum(1).int()

    slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / hq) for h in range(hq)], device=device)
    if case.mod == "alibi":
        score_mod, aux = mods.alibi(slopes)
        return score_mod, None, aux
    if case.mod == "relative_bias":
        score_mod, aux = mods.relative_bias(torch.randn(81, device=device, generator=gen) * 2)
        return score_mod, None, aux
    if case.mod == "document":
        mask_mod, aux = mods.document_mask(doc_ids())
        return None, mask_mod, aux
    if case.mod == "prefix_lm":
        lengths = torch.randint(0, seqlen + 1, (batch,), device=device, generator=gen).int()
        mask_mod, aux = mods.prefix_lm(lengths)
        return None, mask_mod, aux
    if case.mod == "distance":
        return distance_penalty, None, None
    if case.mod == "head_position":
        return None, head_and_position, None
    if case.mod == "alibi+document":
        score_mod, aux = mods.alibi(slopes)
        mask_mod, aux2 = mods.document_mask(doc_ids(), aux_index=1)
        return score_mod, mask_mod, aux + aux2
    raise ValueError(f"unknown mod {case.mod!r}")


# ---- layouts ---------------------------------------------------------------------------------

def _packed(q, k, v) -> tuple:
    """Views of one buffer: q, k, v side by side along heads when they share the token axes and
    head dims; else k and v along heads (equal head dims) or along the last dim."""
    import torch

    if q.dim() == k.dim() and q.shape[:-2] == k.shape[:-2] and \
            q.shape[-1] == k.shape[-1] == v.shape[-1]:
        return torch.cat([q, k, v], dim=-2).split([q.shape[-2], k.shape[-2], v.shape[-2]], -2)
    if k.shape[-1] == v.shape[-1]:
        return (q, *torch.cat([k, v], dim=-2).split([k.shape[-2], v.shape[-2]], -2))
    return (q, *torch.cat([k, v], dim=-1).split([k.shape[-1], v.shape[-1]], -1))


def _one(x, layout: str, rng):
    """x's values in `layout`'s storage (a view of it)."""
    if layout == "transposed":         # (.., heads, tokens, d) storage
        return x.transpose(-3, -2).contiguous().transpose(-3, -2)
    if layout == "padded":
        if rng.random() < 0.5:
            extra = int(rng.choice([8, 16, 64]))
            out = x.new_zeros((*x.shape[:-1], x.shape[-1] + extra))[..., :x.shape[-1]]
        else:
            extra = int(rng.integers(1, 4))
            out = x.new_zeros((*x.shape[:-2], x.shape[-2] + extra, x.shape[-1]))[
                ..., :x.shape[-2], :]
        return out.copy_(x)
    if layout == "misaligned":         # data_ptr one element past 16-byte alignment
        return x.new_zeros(x.numel() + 1)[1:].view(x.shape).copy_(x)
    if layout == "strided_last":
        return x.new_zeros((*x.shape[:-1], 2 * x.shape[-1]))[..., ::2].copy_(x)
    return x


def lay_out(q, k, v, layout: str, on, rng) -> tuple:
    """(q, k, v) with the same values in `layout` (`fa4lab.fuzz.cases.LAYOUTS`) for the tensors
    named in `on`; "packed" lays out all three."""
    if layout == "packed":
        return _packed(q, k, v)
    named = dict(q=q, k=k, v=v)
    return tuple(_one(t, layout, rng) if name in on else t for name, t in named.items())


# ---- the inputs ------------------------------------------------------------------------------

def _page_table(case, num_pages: int, device, gen, rng):
    import torch

    batch, pages = case.batch, case.pages_per_seq
    if rng.random() < ODDS["shared_pages"]:
        table = torch.randint(0, num_pages, (batch, pages), device=device, generator=gen)
    else:
        table = torch.randperm(num_pages, device=device, generator=gen)[
            :batch * pages].view(batch, pages)
    table = table.to(torch.int32)
    if case.seqused_k is not None and rng.random() < ODDS["padded_table"]:
        # Slots past a sequence's last used page are never read: serving stacks pad with -1.
        for b, n in enumerate(case.seqused_k):
            table[b, -(-n // case.page_size):] = -1
    return table


def case_inputs(case, device="cuda") -> CaseInputs:
    """The tensors of `case` on `device` (values from case.data_seed)."""
    import torch

    from fa4lab.spec import normalize_dtype

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[normalize_dtype(case.dtype)]
    gen = torch.Generator(device=device).manual_seed(case.data_seed)
    rng = np.random.default_rng(case.data_seed)
    hq, hkv, d, dv = case.heads_q, case.heads_kv, case.head_dim, case.head_dim_v

    def randn(*shape, scale=1.0):
        x = torch.randn(shape, device=device, generator=gen)
        return (x * scale if scale != 1.0 else x).to(dtype)

    def int32(values):
        return torch.tensor(list(values), dtype=torch.int32, device=device)

    def cu(lengths):
        return int32(np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]))

    batch, lq = case.batch, case.seqlens_q
    got = CaseInputs(None, None, None)
    if case.entry in ("dense", "paged", "paged_split"):
        q = randn(batch, lq[0], hq, d, scale=case.q_scale)
    else:
        q = randn(sum(lq), hq, d, scale=case.q_scale)
        got.cu_seqlens_q = cu(lq)
    if case.page_size is None:
        shape = (batch, case.seqlens_k[0]) if case.entry == "dense" else (sum(case.seqlens_k),)
        k, v = randn(*shape, hkv, d), randn(*shape, hkv, dv)
        if case.entry == "varlen":
            got.cu_seqlens_k = cu(case.seqlens_k)
    else:
        num_pages = batch * case.pages_per_seq + int(rng.integers(0, 5))
        k = randn(num_pages, case.page_size, hkv, d)
        v = randn(num_pages, case.page_size, hkv, dv)
        got.page_table = _page_table(case, num_pages, device, gen, rng)
    if case.seqused_k is not None:
        got.seqused_k = int32(case.seqused_k)
    if case.seqused_q is not None:
        got.seqused_q = int32(case.seqused_q)
    if case.entry in ("varlen", "paged_varlen", "chunked_prefill"):
        extra = {"exact": 0, "larger": int(rng.integers(1, 100))}.get(case.max_seqlen)
        if extra is not None:
            got.max_seqlen_q = max(lq) + extra
            got.max_seqlen_k = max(case.keys) + extra
    got.q, got.k, got.v = lay_out(q, k, v, case.layout, case.layout_on, rng)
    if case.learnable_sink:
        sink = torch.randn(hq, device=device, generator=gen) * 2
        if rng.random() < ODDS["special_sinks"]:
            for h in rng.choice(hq, size=min(hq, 3), replace=False):
                sink[int(h)] = float(rng.choice(SPECIAL_SINKS))
        got.learnable_sink = sink
    got.score_mod, got.mask_mod, got.aux_tensors = case_mods(
        case, batch, max(max(lq), max(case.seqlens_k), 1), device, gen)
    return got


def call(case, inputs: CaseInputs):
    """(out, lse or None): the case's entry point on its inputs."""
    import fa4lab

    options = dict(causal=case.causal, softmax_scale=case.softmax_scale,
                   window_size=tuple(case.window_size), softcap=case.softcap,
                   learnable_sink=inputs.learnable_sink, return_lse=case.return_lse)
    if case.entry in ("dense", "paged", "paged_split"):
        got = fa4lab.attention(inputs.q, inputs.k, inputs.v, num_splits=case.num_splits,
                               pack_gqa=case.pack_gqa, score_mod=inputs.score_mod,
                               mask_mod=inputs.mask_mod, aux_tensors=inputs.aux_tensors,
                               page_table=inputs.page_table, **options)
    else:
        got = fa4lab.attention_varlen(inputs.q, inputs.k, inputs.v, inputs.cu_seqlens_q,
                                      inputs.cu_seqlens_k, inputs.max_seqlen_q,
                                      inputs.max_seqlen_k, seqused_k=inputs.seqused_k,
                                      seqused_q=inputs.seqused_q, page_table=inputs.page_table,
                                      check_indices=case.check_indices, **options)
    return got if case.return_lse else (got, None)
