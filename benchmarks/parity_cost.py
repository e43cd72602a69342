"""The cost of the parity cases (padded head dims, copied views) beside upstream FA4, one run.

    python benchmarks/parity_cost.py      # on an H100/H200 with flash_attn.cute installed
"""
import torch
from flash_attn.cute import flash_attn_func

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
    print(f"# {torch.cuda.get_device_name(0)}, bf16, batch 4, 16/4 heads, causal, CUDA events")
    print("case | seqlen | fa4lab ms | FA4 ms | fa4lab / FA4 speed")
    g = torch.Generator(device="cuda").manual_seed(0)
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


if __name__ == "__main__":
    main()
