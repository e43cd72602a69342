"""`fa4lab.scheduler_metadata`: a batch's index work done once (Note [scheduler metadata] in
fa4lab.varlen_metadata). Calls that take it give bit for bit the answer of calls that do not,
on the reference path here and on the kernels with a GPU; the contract's checks raise."""

from __future__ import annotations

import warnings

import pytest
import torch

import fa4lab
from fa4lab.api import SlowReferenceWarning
from fa4lab.errors import InputError, InputTypeError

GPU = torch.cuda.is_available() and fa4lab.kernels.launch.device_arch(0) is not None


def _batch(device, dtype, paged=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens_q, lens_k = [5, 0, 33, 17], [40, 9, 33, 64]
    t = (lambda x: torch.tensor(x, dtype=torch.int32, device=device))
    make = (lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype))
    q = make(sum(lens_q), 8, 64)
    cu_q = t([0, 5, 5, 38, 55])
    if not paged:
        k, v = make(sum(lens_k), 2, 64), make(sum(lens_k), 2, 64)
        return q, k, v, dict(cu_seqlens_q=cu_q, cu_seqlens_k=t([0, 40, 49, 82, 146]),
                             max_seqlen_q=33, max_seqlen_k=64)
    k, v = make(4 * 16, 4, 2, 64), make(4 * 16, 4, 2, 64)
    table = torch.randperm(64, generator=g).view(4, 16).to(device=device, dtype=torch.int32)
    return q, k, v, dict(cu_seqlens_q=cu_q, cu_seqlens_k=None, max_seqlen_q=33,
                         max_seqlen_k=64, seqused_k=t(lens_k), page_table=table)


def _varlen(*a, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowReferenceWarning)
        return fa4lab.attention_varlen(*a, return_lse=True, **kw)


def _equal_with_and_without(q, k, v, index, **opts):
    meta = fa4lab.scheduler_metadata(q, k, v, **index)
    want = _varlen(q, k, v, **index, **opts)
    for layer in range(3):          # the same metadata serves every layer
        qq, kk, vv = (x * (1 + layer) for x in (q, k, v))
        got = _varlen(qq, kk, vv, **index, scheduler_metadata=meta, **opts)
        ref = want if layer == 0 else _varlen(qq, kk, vv, **index, **opts)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    return meta


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("opts", [dict(causal=True), dict(window_size=(7, 3)), dict()])
def test_metadata_gives_the_same_answer(paged, opts):
    q, k, v, index = _batch("cpu", torch.float32, paged)
    _equal_with_and_without(q, k, v, index, **opts)


def test_metadata_of_upstream_forms_and_seqused_q():
    """Dense q (cu_seqlens_q None) with seqused_q, as `attention_varlen` takes it."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(3, 20, h, 64, generator=g) for h in (4, 2, 2))
    used = torch.tensor([20, 3, 0], dtype=torch.int32)
    index = dict(max_seqlen_q=20, max_seqlen_k=20, seqused_q=used, seqused_k=used)
    meta = _equal_with_and_without(q, k, v, index, causal=True)
    assert meta.dense_q == (3, 20)


def test_the_contract_is_checked():
    q, k, v, index = _batch("cpu", torch.float32)
    meta = fa4lab.scheduler_metadata(q, k, v, **index)
    other = dict(index, cu_seqlens_q=index["cu_seqlens_q"].clone())
    with pytest.raises(InputError, match="made for another cu_seqlens_q"):
        _varlen(q, k, v, **other, scheduler_metadata=meta)
    with pytest.raises(InputError, match="made for q, k, v of shapes"):
        _varlen(q, k[:-1], v[:-1], **index, scheduler_metadata=meta)
    with pytest.raises(InputTypeError, match="fa4lab.scheduler_metadata"):
        _varlen(q, k, v, **index, scheduler_metadata=torch.zeros(4, dtype=torch.int32))
    bad = dict(index, cu_seqlens_k=torch.tensor([0, 40, 30, 82, 146], dtype=torch.int32))
    with pytest.raises(InputError, match="cu_seqlens_k decreases at index 2"):
        fa4lab.scheduler_metadata(q, k, v, **bad, check_indices=True)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs an H100/H200 or B200 GPU (the kernels)")
@pytest.mark.parametrize("paged", [False, True])
def test_metadata_on_the_kernels_builds_one_table(paged, monkeypatch):
    """On the kernels: the same bits with and without, and one tile table for all layers."""
    from fa4lab import varlen_tiles

    q, k, v, index = _batch("cuda", torch.bfloat16, paged)
    index["max_seqlen_q"] = 33
    built = []
    real = varlen_tiles.launch_tile_rows
    monkeypatch.setattr(varlen_tiles, "launch_tile_rows", lambda *a, **kw: built.append(1) or
                        real(*a, **kw))
    meta = _equal_with_and_without(q, k, v, index, causal=True)
    assert len(meta.launch) <= 1
    before = len(built)
    _varlen(q, k, v, **index, causal=True, scheduler_metadata=meta)
    assert len(built) == before, "a call with metadata built its tile table again"
