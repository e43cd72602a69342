"""Upstream FA4's other forms of a varlen call, as the packed batch `fa4lab.varlen` describes.

`flash_attn_varlen_func` also takes q (or k, v) as a dense (batch, seqlen, heads, d) batch
with its cu_seqlens None, and `seqused_q`, the query rows each sequence uses. fa4lab runs
each as a packed varlen batch built on the device from the caller's tensors (a handful of
small torch ops, no device-to-host read), so both kernels, the reference and the custom op
see the one layout they know (Note [upstream varlen forms]):

* `dense_q` / `dense_kv`: a dense batch as packed rows and their cu_seqlens;
* `with_seqused_q`: a batch whose sequence i uses min(seqused_q[i], its rows) queries as a
  batch of twice as many sequences (Note [seqused_q as phantom sequences]);
* `VarlenForm.restore`: the packed answer back in the caller's form.
"""

from __future__ import annotations

from typing import NamedTuple

from fa4lab.errors import InputError, InputTypeError

# Note [upstream varlen forms]
# A dense q (batch, seqlen_q, heads_q, d) with cu_seqlens_q None is the packed batch
# q.reshape(batch * seqlen_q, ...) with cu_seqlens_q = seqlen_q * arange(batch + 1); out comes
# back as (batch, seqlen_q, heads_q, dv) and lse as (batch, heads_q, seqlen_q), upstream's
# shapes. A dense k, v (batch, seqlen_k, heads_kv, d) with cu_seqlens_k None and no page table
# is packed the same way (seqused_k, if given, still caps each sequence's keys). Nothing is
# copied but the reshape of a non-contiguous view (`fa4lab.canonical` copies such views in any
# case).

# Note [seqused_q as phantom sequences]
# seqused_q[i] says sequence i's first u_i = min(seqused_q[i], its rows) query rows are real;
# its causal diagonal and windows are aligned on u_i, as if the sequence had u_i queries
# (upstream's rule). fa4lab runs that as a batch of 2 * batch sequences: sequence 2i is rows
# [cu_q[i], cu_q[i] + u_i) with sequence i's keys; sequence 2i + 1, a phantom, is the unused
# rows [cu_q[i] + u_i, cu_q[i + 1]) with no key (packed keys: the empty range at cu_k[i + 1];
# paged: sequence i's page-table row, seqused_k 0). The phantom rows come back as a row with no
# key does (out 0, lse -inf, or the sink's: Note [empty calls] in fa4lab.canonical), where
# upstream leaves them unwritten. A seqused_q below 0 or above its sequence's rows is clamped
# (0 real rows, or all of them), so the form cannot read outside q. The cost: the phantom rows'
# tiles, each one fully masked key block.


class VarlenForm(NamedTuple):
    """A varlen call in packed form, and how to give its answer back in the caller's."""

    q: object
    k: object
    v: object
    cu_seqlens_q: object
    cu_seqlens_k: object
    max_seqlen_q: int | None
    max_seqlen_k: int | None
    seqused_k: object
    page_table: object
    dense_q: tuple | None     # (batch, seqlen_q) of a dense q, else None

    def restore(self, out, lse):
        """out (total_q, heads_q, dv) and lse (heads_q, total_q) or None, in the caller's form
        of q (Note [upstream varlen forms])."""
        if self.dense_q is None:
            return out, lse
        batch, seqlen_q = self.dense_q
        out = out.view(batch, seqlen_q, *out.shape[1:])
        if lse is not None:
            lse = lse.view(lse.shape[0], batch, seqlen_q).transpose(0, 1)
        return out, lse


def _arange_cu(batch: int, seqlen: int, like):
    import torch

    return torch.arange(batch + 1, dtype=torch.int32, device=like.device) * seqlen


def dense_q(q, cu_seqlens_q, max_seqlen_q):
    """(q packed, cu_seqlens_q, max_seqlen_q, (batch, seqlen_q) or None): a 4-D q with
    cu_seqlens_q None as packed rows (Note [upstream varlen forms]); other calls unchanged."""
    if cu_seqlens_q is not None or getattr(q, "ndim", None) != 4:
        return q, cu_seqlens_q, max_seqlen_q, None
    batch, seqlen_q = int(q.shape[0]), int(q.shape[1])
    packed = q.reshape(batch * seqlen_q, *q.shape[2:])
    return packed, _arange_cu(batch, seqlen_q, q), seqlen_q, (batch, seqlen_q)


def dense_kv(k, v, cu_seqlens_k, max_seqlen_k, page_table):
    """(k, v packed, cu_seqlens_k, max_seqlen_k): 4-D k, v with cu_seqlens_k and page_table
    None as packed keys (Note [upstream varlen forms]); other calls unchanged."""
    if cu_seqlens_k is not None or page_table is not None or getattr(k, "ndim", None) != 4:
        return k, v, cu_seqlens_k, max_seqlen_k
    if getattr(v, "ndim", None) != 4 or tuple(v.shape[:3]) != tuple(k.shape[:3]):
        raise InputError(f"dense k {tuple(k.shape)} and v {tuple(getattr(v, 'shape', ()))} "
                         f"(cu_seqlens_k None, no page_table) must both be (batch, seqlen_k, "
                         f"heads_kv, d)")
    batch, seqlen_k = int(k.shape[0]), int(k.shape[1])
    k = k.reshape(batch * seqlen_k, *k.shape[2:])
    v = v.reshape(batch * seqlen_k, *v.shape[2:])
    return k, v, _arange_cu(batch, seqlen_k, k), seqlen_k if max_seqlen_k is None else max_seqlen_k


def _interleave(a, b):
    import torch

    return torch.stack((a, b), dim=1).reshape(-1)


def with_seqused_q(q, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table,
                   page_size: int | None):
    """(cu_seqlens_q, cu_seqlens_k, seqused_k, page_table) of the phantom-sequence batch that
    answers `seqused_q` (Note [seqused_q as phantom sequences]); the caller's tensors, checked
    as `fa4lab.varlen.check_varlen` checks them, are assumed."""
    import torch

    batch = int(cu_seqlens_q.shape[0]) - 1
    if not isinstance(seqused_q, torch.Tensor) or seqused_q.dtype != torch.int32:
        raise InputTypeError(f"seqused_q must be an int32 torch.Tensor (batch,), got "
                             f"{getattr(seqused_q, 'dtype', type(seqused_q).__name__)}: convert "
                             f"with .to(torch.int32)")
    if tuple(seqused_q.shape) != (batch,) or seqused_q.device != q.device:
        raise InputError(f"seqused_q must be (batch,) = ({batch},) on {q.device}, got "
                         f"{tuple(seqused_q.shape)} on {seqused_q.device}: one query count "
                         f"per sequence")
    starts, stops = cu_seqlens_q[:-1], cu_seqlens_q[1:]
    used = torch.minimum(torch.clamp(seqused_q, min=0), stops - starts)
    cu_q = torch.cat((_interleave(starts, starts + used), cu_seqlens_q[-1:]))
    zero = torch.zeros_like(used)
    if page_table is not None:
        keys = seqused_k if seqused_k is not None else torch.full_like(
            used, page_size * int(page_table.shape[1]))
        return cu_q, None, _interleave(keys, zero), page_table.repeat_interleave(2, dim=0)
    cu_k = torch.cat((_interleave(cu_seqlens_k[:-1], cu_seqlens_k[1:]), cu_seqlens_k[-1:]))
    return cu_q, cu_k, None if seqused_k is None else _interleave(seqused_k, zero), None


def varlen_form(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                seqused_k, page_table) -> VarlenForm:
    """The call in packed form (Note [upstream varlen forms]) before `with_seqused_q`."""
    q, cu_seqlens_q, max_seqlen_q, dense = dense_q(q, cu_seqlens_q, max_seqlen_q)
    k, v, cu_seqlens_k, max_seqlen_k = dense_kv(k, v, cu_seqlens_k, max_seqlen_k, page_table)
    return VarlenForm(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      seqused_k, page_table, dense)
