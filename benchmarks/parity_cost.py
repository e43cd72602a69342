"""The cost of the parity cases (padded head dims, copied views, small pages, seqused_q) beside
upstream FA4, one run.

    python benchmarks/parity_cost.py           # on an H100/H200 with flash_attn.cute installed
    python benchmarks/parity_cost.py pages     # the paged rows only
"""
import sys

import torch
from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

import fa4lab


def ms(fn, reps=30):
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main():
    g = torch.Generator(device="cuda").manual_seed(0)
    if sys.argv[1:] == ["pages"]:
        small_pages(g)
        return
    print(f"# {torch.cuda.get_device_name(0)}, bf16, batch 4, 16/4 heads, causal, CUDA events")
    print("case | seqlen | fa4lab ms | FA4 ms | fa4lab / FA4 speed")
    for d, dv, view in ((32, 32, ""), (80, 80, ""), (144, 64, ""), (128, 128, "strided")):
        for s in (1024, 4096):
            q, k, v = (torch.randn(4, s, h, e, device="cuda", generator=g, dtype=torch.bfloat16)
                       for h, e in ((16, d), (4, d), (4, dv)))
            if view:
                q = q.transpose(1, 2).contiguous().transpose(1, 2)
            ours = ms(lambda q=q, k=k, v=v: fa4lab.attention(q, k, v, causal=True))
            try:
                theirs = ms(lambda q=q, k=k, v=v: flash_attn_func(q, k, v, causal=True))
                ratio = f"{theirs / ours:.2f}x"
            except Exception as e:      # noqa: BLE001 - upstream refuses some shapes
                theirs, ratio = float("nan"), f"FA4 refused: {type(e).__name__}"
            name = f"({d}, {dv})" + (f" {view} q" if view else "")
            print(f"{name} | {s} | {ours:.3f} | {theirs:.3f} | {ratio}")
    small_pages(g)
    seqused_q(g)


def _compare(name, ours_fn, theirs_fn, floor_ms=None):
    """One row: fa4lab's and FA4's times, their ratio, and (given `floor_ms`) fa4lab's time
    over that floor, from the same timing."""
    ours = ms(ours_fn)
    extra = "" if floor_ms is None else f" | {ours / floor_ms:.2f}x"
    try:
        theirs = ms(theirs_fn)
        ratio = f"{theirs / ours:.2f}x"
    except Exception as e:      # noqa: BLE001 - upstream refuses some shapes
        theirs, ratio = float("nan"), f"FA4 refused: {type(e).__name__}"
    print(f"{name} | {ours:.3f} | {theirs:.3f} | {ratio}{extra}")


def _cache(g, batch, seqlen, page, hkv, d):
    per_seq = -(-seqlen // page)
    num_pages = batch * per_seq
    kc, vc = (torch.randn(num_pages, page, hkv, d, device="cuda", generator=g,
                          dtype=torch.bfloat16) for _ in range(2))
    table = torch.randperm(num_pages, device="cuda", generator=g).view(batch, per_seq)
    return kc, vc, table.to(torch.int32)


def small_pages(g):
    """Paged decode (batch 32, 4096 keys each, 32/8 heads, hd128) and paged causal prefill
    (batch 4, 4096 queries over 4096 keys) at pages of 1 to 128, default arguments: pages
    below 16 through the cp.async producer (Note [cp.async pages] in fa4lab.limits)."""
    print(f"\n# paged, {torch.cuda.get_device_name(0)}, bf16, 32/8 heads, hd128, default "
          f"arguments of both")
    print("case | fa4lab ms | FA4 ms | fa4lab / FA4 speed | fa4lab / HBM floor")
    for page in (1, 2, 4, 8, 16, 128):
        _paged_decode(g, page)
        _paged_prefill(g, page)


def _paged_decode(g, page, batch=32, seqlen=4096):
    peak = 4.8e12   # the H200's HBM bandwidth, bytes/s (published)
    kc, vc, table = _cache(g, batch, seqlen, page, 8, 128)
    q = torch.randn(batch, 32, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    used = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
    floor_ms = 2 * kc.numel() * 2 / peak * 1e3

    def ours():
        return fa4lab.attention_varlen(q, kc, vc, cu, None, 1, seqlen, seqused_k=used,
                                       page_table=table)

    def theirs():
        return flash_attn_varlen_func(q, kc, vc, cu_seqlens_q=cu, max_seqlen_q=1,
                                      max_seqlen_k=seqlen, seqused_k=used, page_table=table)

    _compare(f"decode, pages of {page}", ours, theirs, floor_ms)


def _paged_prefill(g, page, batch=4, seqlen=4096):
    kc, vc, table = _cache(g, batch, seqlen, page, 8, 128)
    q = torch.randn(batch, seqlen, 32, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    _compare(f"prefill {seqlen}, causal, pages of {page}",
             lambda: fa4lab.attention(q, kc, vc, causal=True, page_table=table),
             lambda: flash_attn_varlen_func(q, kc, vc, max_seqlen_q=seqlen, max_seqlen_k=seqlen,
                                            causal=True, page_table=table))


def seqused_q(g):
    """upstream's dense-q seqused_q form (batch 8, 2048 rows, half of them used), causal."""
    print("\n# seqused_q, bf16, batch 8, 2048 rows (1024 used), 32/8 heads, hd128, causal")
    print("case | fa4lab ms | FA4 ms | fa4lab / FA4 speed")
    q = torch.randn(8, 2048, 32, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(8, 2048, 8, 128, device="cuda", generator=g, dtype=torch.bfloat16)
            for _ in range(2))
    used = torch.full((8,), 1024, dtype=torch.int32, device="cuda")
    _compare("seqused_q 1024 of 2048", lambda: fa4lab.attention_varlen(
        q, k, v, None, None, 2048, 2048, seqused_q=used, seqused_k=used, causal=True),
             lambda: flash_attn_varlen_func(q, k, v, max_seqlen_q=2048, max_seqlen_k=2048,
                                            seqused_q=used, seqused_k=used, causal=True))


if __name__ == "__main__":
    main()
