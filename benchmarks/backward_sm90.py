"""Time the sm90 backward against upstream FA4's on a Hopper GPU (triton.testing.do_bench,
median), 16k tokens and hidden 2048 as FACTS' backward anchor, bf16.

    python benchmarks/backward_sm90.py                 # hd 64 and 128, seqlen 2048 and 8192
    python benchmarks/backward_sm90.py --deterministic

TFLOP/s counts the backward as 2.5x the forward's FLOPs, 4 * b * h * s^2 * d (halved for
causal). fa4lab's time is `fa4lab.kernels.launch_backward.backward` from the forward's out and
lse (its torch pre- and postprocessing included); upstream's is autograd through
`flash_attn.cute.interface.flash_attn_func`'s backward (its own pre- and postprocessing).
The bench's own mode, with SDPA beside them, a check before timing and a record, is
`fa4lab bench --backward` (fa4lab.bench.backward).
"""

from __future__ import annotations

import argparse

import torch
import triton.testing

from fa4lab.call import check_call
from fa4lab.kernels.launch_backward import backward, saved_forward


def bench(d: int, seqlen: int, causal: bool, deterministic: bool) -> dict:
    tokens, hidden = 16384, 2048
    b, h = tokens // seqlen, hidden // d
    q, k, v, do = (torch.randn(b, seqlen, h, d, device="cuda", dtype=torch.bfloat16)
                   for _ in range(4))
    call = check_call(q, k, v, causal=causal, arch="sm90")
    out, lse = saved_forward(call, "sm90")
    ours = triton.testing.do_bench(lambda: backward(call, out, do, lse,
                                                    deterministic=deterministic))
    row = {"head_dim": d, "seqlen": seqlen, "causal": causal, "fa4lab_ms": ours}
    try:
        from flash_attn.cute.interface import flash_attn_func

        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        o = flash_attn_func(*leaves, causal=causal, deterministic=deterministic)
        o = o[0] if isinstance(o, tuple) else o
        row["fa4_ms"] = triton.testing.do_bench(
            lambda: torch.autograd.grad(o, leaves, do, retain_graph=True))
    except ImportError as err:
        row["fa4_ms"] = None
        row["fa4_error"] = str(err)
    flops = 2.5 * 4 * b * h * seqlen * seqlen * d / (2 if causal else 1)
    for name in ("fa4lab", "fa4"):
        ms = row.get(f"{name}_ms")
        row[f"{name}_tflops"] = None if ms is None else flops / ms / 1e9
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--deterministic", action="store_true")
    args = p.parse_args()
    print(torch.cuda.get_device_name())
    for d in (64, 128):
        for seqlen in (2048, 8192):
            for causal in (False, True):
                r = bench(d, seqlen, causal, args.deterministic)
                ratio = (r["fa4lab_tflops"] / r["fa4_tflops"] if r["fa4_tflops"] else None)
                fa4 = "n/a" if r["fa4_tflops"] is None else f"{r['fa4_tflops']:.0f}"
                print(f"hd{d} s{seqlen} {'causal' if causal else 'full  '}: fa4lab "
                      f"{r['fa4lab_tflops']:.0f} TFLOP/s, FA4 {fa4}"
                      + ("" if ratio is None else f" ({ratio:.2f}x)"))


if __name__ == "__main__":
    main()
