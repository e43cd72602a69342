"""The sm90 kernel under compute-sanitizer: a few small launches that cover its synchronization.

Run by `make sanitize-gpu` as `compute-sanitizer --tool synccheck|racecheck python
tests/sanitize_sm90.py` on a Hopper GPU. The cases cover one, two and three consumer
warpgroups (head_dim 256, 128, 64: the ping-pong turns and the per-consumer epilogue barriers),
causal and not, GQA with and without pack-GQA, key-length tails, and a fully masked first block
(seqlen_q > seqlen_k, causal). Each output is also checked against the float64 reference, so a
run that the tool passes but that computes garbage still fails. Small sizes: under the tool
every launch is slow.
"""

from __future__ import annotations

import sys

import torch

from fa4lab.kernels.fwd_sm90 import attention_sm90
from fa4lab.reference import attention_reference

CASES = [  # (head_dim, causal, seqlen_q, seqlen_k, heads_q, heads_kv, pack_gqa)
    (64, True, 300, 333, 4, 2, False),
    (128, False, 300, 333, 4, 2, True),
    (128, True, 333, 300, 2, 2, False),
    (256, True, 200, 200, 2, 1, False),
]


def main() -> int:
    torch.manual_seed(0)
    worst = 0.0
    for d, causal, sq, sk, hq, hkv, pack in CASES:
        q = torch.randn(1, sq, hq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, sk, hkv, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, sk, hkv, d, device="cuda", dtype=torch.bfloat16)
        out, lse = attention_sm90(q, k, v, causal=causal, return_lse=True, pack_gqa=pack)
        torch.cuda.synchronize()
        ref, ref_lse = attention_reference(q.cpu(), k.cpu(), v.cpu(), causal=causal,
                                           return_lse=True)
        err = (out.double().cpu() - torch.as_tensor(ref)).abs().max().item()
        finite = torch.isfinite(torch.as_tensor(ref_lse))
        lse_err = (lse.double().cpu() - torch.as_tensor(ref_lse))[finite].abs().max().item()
        same_inf = torch.equal(torch.isinf(lse.cpu()), ~finite)
        print(f"hd{d} causal={causal} {sq}x{sk} heads {hq}/{hkv} pack={pack}: "
              f"max|out - ref| {err:.2e}, max|lse - ref| {lse_err:.2e}, -inf rows agree "
              f"{same_inf}", flush=True)
        if not same_inf:
            return 1
        worst = max(worst, err, lse_err)
    return 0 if worst < 2e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
