"""The sm90 kernel under compute-sanitizer: a few small launches that cover its synchronization.

Run by `make sanitize-gpu` as `compute-sanitizer --tool synccheck|racecheck python
tests/sanitize_sm90.py` on a Hopper GPU. The cases cover one, two and three consumer
warpgroups (head_dim 256, 128, 64: the ping-pong turns and the per-consumer epilogue barriers),
causal and not, GQA with and without pack-GQA, key-length tails, and a fully masked first block
(seqlen_q > seqlen_k, causal); a sliding window (the left-edge masked blocks, a window that
leaves rows without a key) with a learnable sink, packed and not, and a mask_mod (every block
masked); and persistent CTAs (Note [sm90 persistent CTAs] in fa4lab.plan.sm90) with several
tiles per CTA, two and three consumers; split-KV (a packed GQA decode in three splits and
their combine) and a variable-length batch (the tile table, the row-by-row O store; an empty
and a length-1 sequence), and a paged decode (one launch, the page table read per key block,
seqused_k ending inside a page, 0 included; pages of 1, 4 and 12, across key blocks, through
the cp.async producer, Note [cp.async gather]), and a chunked prefill over pages (the one varlen
launch over a paged cache, `fa4lab.kernels.launch.forward_varlen(page_table=)`: its padding
tiles' phantom sequence past the table's last row). Each output is also checked against the float64
reference, so a run that the tool passes but that computes garbage still fails. Small sizes:
under the tool every launch is slow.
"""

from __future__ import annotations

import sys

import torch

from fa4lab.kernels.launch import attention_sm90
from fa4lab.reference import attention_reference

CASES = [  # (head_dim, causal, seqlen_q, seqlen_k, heads_q, heads_kv, pack_gqa, options)
    (128, True, 640, 640, 32, 8, False, {"persistent": True, "batch": 4}),
    (64, False, 500, 520, 16, 4, False, {"persistent": True, "batch": 4}),
    (64, True, 300, 333, 4, 2, False, {}),
    (128, False, 300, 333, 4, 2, True, {}),
    (128, True, 333, 300, 2, 2, False, {}),
    (256, True, 200, 200, 2, 1, False, {}),
    (128, False, 400, 300, 4, 2, False, {"window_size": (70, 5), "sink": True}),
    (64, True, 300, 333, 8, 2, True, {"window_size": (100, 0)}),
    (128, True, 300, 300, 2, 2, False, {"documents": 3}),
    ((192, 128), True, 333, 300, 4, 4, False, {}),   # O staged in Q's bytes, 128-key blocks
    (64, True, 700, 700, 16, 2, True, {}),           # packed, three consumers
]


def options_of(opts: dict, hq: int) -> dict:
    """Keyword arguments for both the kernel and the reference."""
    from fa4lab import mods

    kw = {}
    if "window_size" in opts:
        kw["window_size"] = opts["window_size"]
    if opts.get("sink"):
        kw["learnable_sink"] = torch.linspace(-2.0, 3.0, hq, device="cuda")
    if "documents" in opts:
        mod, aux = mods.document_mask(torch.arange(300, device="cuda", dtype=torch.int32)
                                      * opts["documents"] // 300)
        kw["mask_mod"], kw["aux_tensors"] = mod, aux
    return kw


def on_cpu(kw: dict) -> dict:
    return {k: (v.cpu() if isinstance(v, torch.Tensor)
                else tuple(t.cpu() for t in v) if k == "aux_tensors" else v)
            for k, v in kw.items()}


def main() -> int:
    torch.manual_seed(0)
    worst = 0.0
    for dims, causal, sq, sk, hq, hkv, pack, opts in CASES:
        d, dv = dims if isinstance(dims, tuple) else (dims, dims)
        b = opts.get("batch", 1)
        q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, sk, hkv, dv, device="cuda", dtype=torch.bfloat16)
        kw = options_of(opts, hq)
        out, lse = attention_sm90(q, k, v, causal=causal, return_lse=True, pack_gqa=pack,
                                  persistent=opts.get("persistent"), **kw)
        torch.cuda.synchronize()
        ref, ref_lse = attention_reference(q.cpu(), k.cpu(), v.cpu(), causal=causal,
                                           return_lse=True, **on_cpu(kw))
        err = (out.double().cpu() - torch.as_tensor(ref)).abs().max().item()
        finite = torch.isfinite(torch.as_tensor(ref_lse))
        lse_err = (lse.double().cpu() - torch.as_tensor(ref_lse))[finite].abs().max().item()
        same_inf = torch.equal(torch.isinf(lse.cpu()), ~finite)
        print(f"hd{dims} causal={causal} {sq}x{sk} heads {hq}/{hkv} pack={pack} {opts}: "
              f"max|out - ref| {err:.2e}, max|lse - ref| {lse_err:.2e}, -inf rows agree "
              f"{same_inf}", flush=True)
        if not same_inf:
            return 1
        worst = max(worst, err, lse_err)
    for name, err in (("split-KV decode, 3 splits", split_case()),
                      ("varlen batch", varlen_case(64)),
                      ("varlen batch, head_dim 96", varlen_case(96)),
                      ("paged decode, pages of 16", paged_decode_case(16)),
                      ("paged decode, pages of 128", paged_decode_case(128)),
                      ("paged decode, pages of 4 (cp.async)", paged_decode_case(4)),
                      ("paged decode, pages of 1 (cp.async)", paged_decode_case(1)),
                      ("paged decode, pages of 12 (cp.async, across key blocks)",
                       paged_decode_case(12)),
                      ("chunked prefill over pages of 16", paged_prefill_case(16)),
                      ("chunked prefill over pages of 2 (cp.async)", paged_prefill_case(2)),
                      ("chunked prefill over pages of 128", paged_prefill_case(128))):
        print(f"{name}: max|out - ref| {err:.2e}", flush=True)
        worst = max(worst, err)
    return 0 if worst < 2e-2 else 1


def split_case() -> float:
    """A GQA-8 decode (packed rows) in three splits (fa4lab.kernels.device.split), combined."""
    q = torch.randn(2, 1, 16, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 1000, 2, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 1000, 2, 128, device="cuda", dtype=torch.bfloat16)
    out = attention_sm90(q, k, v, num_splits=3, pack_gqa=True)
    torch.cuda.synchronize()
    ref = attention_reference(q.cpu(), k.cpu(), v.cpu())
    return (out.double().cpu() - torch.as_tensor(ref)).abs().max().item()


def varlen_case(d: int) -> float:
    """A causal varlen batch with an empty and a length-1 sequence (Note [sm90 varlen]); head
    dim 96 stores rows of 12 chunks with 96 of a consumer's 128 threads (`store_rows_threads`)."""
    import fa4lab
    from fa4lab.reference import attention_varlen_reference

    lengths_q, lengths_k = [130, 0, 1, 257], [200, 64, 1, 140]
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), 8, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(int(cu_k[-1]), 2, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(int(cu_k[-1]), 2, d, device="cuda", dtype=torch.bfloat16)
    out = fa4lab.attention_varlen(q, k, v, cu_q.cuda(), cu_k.cuda(), max(lengths_q),
                                  max(lengths_k), causal=True)
    torch.cuda.synchronize()
    ref = attention_varlen_reference(q.cpu(), k.cpu(), v.cpu(), cu_q, cu_k, causal=True)
    return (out.double().cpu() - torch.as_tensor(ref)).abs().max().item()


def paged_decode_case(page_size: int) -> float:
    """A GQA-8 decode over a paged cache (Note [paged key blocks]): attention_varlen's one
    paged launch, ragged seqused_k (inside a page, a page edge, 0), pages in random order."""
    import fa4lab
    from fa4lab.reference import attention_varlen_reference

    used = torch.tensor([300, 0, page_size, 1], dtype=torch.int32)
    pages = 384 // page_size
    q = torch.randn(4, 16, 128, device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache = (torch.randn(4 * pages + 1, page_size, 2, 128, device="cuda",
                                    dtype=torch.bfloat16) for _ in range(2))
    table = torch.randperm(4 * pages + 1)[:4 * pages].view(4, pages).to(torch.int32)
    cu_q = torch.arange(5, dtype=torch.int32)
    out = fa4lab.attention_varlen(q, k_cache, v_cache, cu_q.cuda(), None, 1, 384,
                                  seqused_k=used.cuda(), page_table=table.cuda())
    torch.cuda.synchronize()
    ref = attention_varlen_reference(q.cpu(), k_cache.cpu(), v_cache.cpu(), cu_q, None,
                                     seqused_k=used, page_table=table)
    return (out.double().cpu() - torch.as_tensor(ref)).abs().max().item()


def paged_prefill_case(page_size: int) -> float:
    """Ragged query counts over a paged cache in one varlen launch: an empty chunk, a length-1
    chunk, a chunk longer than its keys, a sequence with no key, pages in random order."""
    from fa4lab.call import check_call
    from fa4lab.kernels import launch
    from fa4lab.reference import attention_varlen_reference
    from fa4lab.varlen import check_varlen

    lens_q, used = [0, 1, 200, 3, 130], [40, 300, 129, 0, 384]
    pages = 384 // page_size
    batch = len(lens_q)
    q = torch.randn(sum(lens_q), 16, 128, device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache = (torch.randn(batch * pages + 1, page_size, 2, 128, device="cuda",
                                    dtype=torch.bfloat16) for _ in range(2))
    table = torch.randperm(batch * pages + 1)[:batch * pages].view(batch, pages).to(torch.int32)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    used = torch.tensor(used, dtype=torch.int32)
    lengths = check_varlen(q, k_cache, v_cache, cu_q.cuda(), None, None, None, used.cuda(),
                           table.cuda())
    call = check_call(q, k_cache, v_cache, causal=True, page_table=table.cuda(),
                      lengths=lengths, arch="sm90")
    out, _ = launch.forward_varlen(call, "sm90")
    torch.cuda.synchronize()
    ref = attention_varlen_reference(q.cpu(), k_cache.cpu(), v_cache.cpu(), cu_q, None,
                                     seqused_k=used, page_table=table, causal=True)
    return (out.double().cpu() - torch.as_tensor(ref)).abs().max().item()


if __name__ == "__main__":
    sys.exit(main())
