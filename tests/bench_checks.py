"""Stand-ins the bench tests share (tests/test_bench_serving.py, test_bench_host_overhead.py)."""

from __future__ import annotations


def recording_varlen(monkeypatch):
    """fa4lab.attention_varlen replaced by the float64 reference (cast back), recording each
    call's keyword arguments beyond those every runner passes."""
    from fa4lab import api
    from fa4lab.reference import attention_varlen_reference

    seen = []

    def fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
             seqused_k=None, page_table=None, causal=False, softmax_scale=None, **kw):
        seen.append(kw)
        return attention_varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                          seqused_k=seqused_k, page_table=page_table,
                                          causal=causal, softmax_scale=softmax_scale).to(q.dtype)

    monkeypatch.setattr(api, "attention_varlen", fake)
    return seen
