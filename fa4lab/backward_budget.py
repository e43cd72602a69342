"""What a backward kernel pays beyond its MMAs: the bytes of accumulating dQ, and TMEM columns.

A MODEL, not a measurement: arithmetic from tile shapes and element sizes (`fa4lab.limits`), and
the B200's published rates (`fa4lab.hardware`) where a rate is needed. Nothing here was timed.

    from fa4lab.backward_budget import dq_costs, step_bytes, backward_tmem
    step_bytes(head_dim=128)            # what one (key block, query block) step moves
    dq_costs(8192)["deterministic"]     # one (batch, head): bytes, MMA work, critical path
    backward_tmem(128).regions          # the 1-CTA TMEM map of the sm100 backward

`fa4lab.viz.backward.plot_dq_schemes` draws `dq_costs` against the sequence length; notebook 10
teaches it (Note [accumulating dQ], Note [the backward's TMEM]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fa4lab.hardware import B200
from fa4lab.limits import ELEMENT_BYTES
from fa4lab.plan.tmem import TmemPlan, TmemRegion, alloc_columns

__all__ = ["SCHEMES", "DqCost", "saved_bytes", "step_bytes", "step_flops", "dq_costs",
           "machine_balance", "backward_tmem", "tmem_table_markdown"]

SCHEMES = ("atomic", "deterministic", "separate pass")

# Note [accumulating dQ]
# With key blocks outside (Note [key blocks outside] in fa4lab.backward_blocks) every step of a
# key block's CTA makes a partial dQ for one query block. Three ways to sum them, per step of
# block_m x block_n at head_dim d (16-bit inputs, fp32 accumulators):
#   atomic         the partial (block_m x d fp32, 64 KiB at 128 x 128) is added into a float32
#                  dQ_accum in global memory with reduce-adds (upstream FA4 on sm100: TMA bulk
#                  reduce-add, `cpasync_reduce_bulk_add_f32` in flash_attn/cute/flash_bwd_sm100.py);
#                  then a pass converts dQ_accum to dQ's dtype (flash_bwd_postprocess.py). Bytes:
#                  the partial per step, plus zeroing, reading and writing dQ once. Order: whoever
#                  arrives first (Note [dQ's order of additions]).
#   deterministic  the same adds, in a fixed order: the CTAs that add into one query block take
#                  turns by key block, waiting on a semaphore in global memory (upstream:
#                  `deterministic=True`, `mdQ_semaphore`, lock value n_block). Bytes: the atomic
#                  scheme's plus a semaphore read and write per step. Cost: waiting. In this
#                  model every key block of a head starts together, walks the query blocks in the
#                  same order and cannot run ahead of its own turn (ASSUMED; buffers that let a
#                  CTA run ahead wait less), so key block j adds into query block i at step i + j:
#                  the last one finishes after M + K - 1 steps instead of M (a pipeline fill).
#   separate pass  no dQ in the key-block pass (4 MMAs: S, dP, dV, dK); a second kernel puts
#                  QUERY blocks outside, recomputes S and dP and accumulates dQ = dS K on chip,
#                  written once. Bytes: K and V re-read per step (the query block's Q, dO, LSE
#                  and D read once); MMAs: 7 per step instead of 5 (S and dP twice).
# "Bytes" are global-memory traffic (reads + writes through L2), not HBM traffic: the re-read
# Q, dO and K, V tiles and the reduce-adds mostly hit L2, which this model does not size.


def _dims(head_dim: int, head_dim_v: int | None) -> tuple[int, int]:
    return int(head_dim), int(head_dim if head_dim_v is None else head_dim_v)


def saved_bytes(seqlen: int, head_dim_v: int = 128, *, dtype: str = "bf16") -> dict[str, int]:
    """What the forward could keep for the backward, per (batch, head) of `seqlen` queries and
    keys: `P` (seqlen^2 probabilities in the inputs' dtype) against what FlashAttention keeps,
    `O` (seqlen x head_dim_v, the output anyway) and `LSE` (one fp32 per query row)."""
    e = ELEMENT_BYTES[dtype]
    return {"P": seqlen * seqlen * e, "O": seqlen * head_dim_v * e,
            "LSE": seqlen * ELEMENT_BYTES["fp32"]}


def step_bytes(head_dim: int = 128, head_dim_v: int | None = None, *, block_m: int = 128,
               block_n: int = 128, dtype: str = "bf16") -> dict[str, int]:
    """Bytes one (key block, query block) step moves through global memory, by what:
    `q`, `dout` the query block's tiles, `lse_d` its LSE and D rows (fp32), read by every scheme's
    key-block pass; `dq_partial` the fp32 partial dQ the atomic and deterministic schemes add;
    `kv_reread` K and V of the key block, which the separate dQ pass reads per step."""
    d, dv = _dims(head_dim, head_dim_v)
    e, f32 = ELEMENT_BYTES[dtype], ELEMENT_BYTES["fp32"]
    return {"q": block_m * d * e, "dout": block_m * dv * e, "lse_d": 2 * block_m * f32,
            "dq_partial": block_m * d * f32, "kv_reread": block_n * (d + dv) * e}


def step_flops(head_dim: int = 128, head_dim_v: int | None = None, *, block_m: int = 128,
               block_n: int = 128) -> dict[str, int]:
    """FLOPs of the five MMAs of one step (2 per multiply-add): S = Q K^T and dQ = dS K, dK =
    dS^T Q over head_dim; dP = dO V^T and dV = P^T dO over head_dim_v."""
    d, dv = _dims(head_dim, head_dim_v)
    mn = 2 * block_m * block_n
    return {"S": mn * d, "dP": mn * dv, "dV": mn * dv, "dQ": mn * d, "dK": mn * d}


def machine_balance(hw=B200) -> float:
    """FLOPs per HBM byte at which `hw`'s dense 16-bit MMA peak and its HBM bandwidth (both
    published figures, `fa4lab.hardware`) take equal time."""
    return hw.peak_mma_tflops * 1e12 / hw.hbm_bytes_per_s


@dataclass(frozen=True)
class DqCost:
    """One scheme's cost of dQ for one (batch, head), seqlen_q = seqlen_k (Note [accumulating
    dQ]): a MODEL."""

    scheme: str
    seqlen: int
    steps: int               # (key block, query block) steps of the problem
    dq_bytes: int            # global-memory traffic the scheme spends on dQ
    pass_bytes: int          # the key-block pass's own: Q, dO, LSE, D per step; K, V, dK, dV
    mma_flops: int           # every MMA of the backward under this scheme
    base_mma_flops: int      # the five-MMA backward's
    critical_steps: int      # steps on the longest key block's path
    base_steps: int          # a key block's own steps (query blocks it visits)

    @property
    def mma_ratio(self) -> float:
        return self.mma_flops / self.base_mma_flops

    @property
    def path_ratio(self) -> float:
        return self.critical_steps / self.base_steps

    @property
    def relative_time(self) -> float:
        """Modelled time over the atomic scheme's, all MMA-bound (ASSUMED): the larger of the
        extra MMA work and the longer critical path."""
        return max(self.mma_ratio, self.path_ratio)


def dq_costs(seqlen: int, *, head_dim: int = 128, head_dim_v: int | None = None,
             block_m: int = 128, block_n: int = 128, dtype: str = "bf16") -> dict[str, DqCost]:
    """{scheme: DqCost} for one (batch, head) of a non-causal backward of `seqlen` queries and
    keys (Note [accumulating dQ])."""
    d, dv = _dims(head_dim, head_dim_v)
    m_blocks, k_blocks = math.ceil(seqlen / block_m), math.ceil(seqlen / block_n)
    steps = m_blocks * k_blocks
    b = step_bytes(d, dv, block_m=block_m, block_n=block_n, dtype=dtype)
    e, f32 = ELEMENT_BYTES[dtype], ELEMENT_BYTES["fp32"]
    flops = step_flops(d, dv, block_m=block_m, block_n=block_n)
    five = steps * sum(flops.values())
    # zero dQ_accum, read it back, write dQ in its dtype
    finish = seqlen * d * (2 * f32 + e)
    atomic = steps * b["dq_partial"] + finish
    semaphore = steps * 2 * 4                    # an int32 read (the turn) and write (release)
    # the dQ pass: Q, dO, LSE and D once per query block, K and V per step, dQ written once
    separate = steps * b["kv_reread"] + seqlen * (d + dv) * e + seqlen * 2 * f32 + seqlen * d * e
    redo = steps * (flops["S"] + flops["dP"])
    own = steps * (b["q"] + b["dout"] + b["lse_d"]) + 2 * seqlen * (d + dv) * e
    common = dict(seqlen=seqlen, steps=steps, pass_bytes=own, base_mma_flops=five,
                  base_steps=m_blocks)
    return {
        "atomic": DqCost("atomic", dq_bytes=atomic, mma_flops=five, critical_steps=m_blocks,
                         **common),
        "deterministic": DqCost("deterministic", dq_bytes=atomic + semaphore, mma_flops=five,
                                critical_steps=m_blocks + k_blocks - 1, **common),
        "separate pass": DqCost("separate pass", dq_bytes=separate, mma_flops=five + redo,
                                critical_steps=m_blocks, **common),
    }


# Note [the backward's TMEM]
# One CTA of the sm100 backward owns a key block of 128 keys, so the MMAs that produce its
# results put the KEYS in TMEM's 128 lanes: upstream computes S^T = K Q^T and dP^T = V dO^T
# (flash_attn/cute/flash_bwd_sm100.py, "S = K @ Q.T", "dP = V @ dO.T"), and dV = P^T dO,
# dK = dS^T Q accumulate key rows; dQ = dS K has the block's 128 QUERY rows in the lanes. Its
# 1-CTA layout (`tmem_S_offset` ... `tmem_dK_offset`), which `backward_tmem` follows:
#   S (fp32, block_m columns), P (16-bit, half as many) over S;
#   dV (fp32, head_dim_v columns), accumulated over the whole key block;
#   dP (fp32, block_m columns), dS (16-bit) over dP;
#   dK (fp32, head_dim columns), accumulated over the whole key block;
#   dQ (fp32, head_dim columns) over dP and dS: live for one step only, read out by the warps
#   that add it into dQ_accum. Nothing orders dS's last reader against the dQ MMA but their
#   issue order on the MMA thread (the dK MMA, which reads dS from TMEM, is issued before the
#   dQ MMA), the same kind of reuse as Note [P aliases S] in fa4lab.plan.tmem.
# S + dV + dP + dK = 2 * 128 + head_dim_v + head_dim: 384 columns at head_dim 64, exactly 512 at
# 128; head_dim 256 needs 768 and does not fit (upstream has a separate 2-CTA kernel for it,
# sm100_hd256_2cta_fmha_backward.py, and picks 2-CTA MMA, `use_2cta_instrs`, for head_dim >= 128
# in flash_attn/cute/interface.py; its layout differs from this one). The reuse guard of each
# region is "-": the barriers that order each reuse are in the backward plan's protocol table
# (Note [the backward's protocol] in fa4lab.plan.protocol_bwd_sm100), which reads this map.


def backward_tmem(head_dim: int, head_dim_v: int | None = None, *,
                  dtype: str = "bf16") -> TmemPlan:
    """The 1-CTA TMEM map of the sm100 backward at 128 x 128 tiles (Note [the backward's
    TMEM]), checked against the B200's TMEM (`fa4lab.hardware.B200`): a PlanError when the
    accumulators do not fit, or dQ does not fit over dP."""
    from fa4lab.errors import PlanError

    d, dv = _dims(head_dim, head_dim_v)
    block = B200.tmem_lanes                         # 128 keys (and 128 queries) per tile
    half = block * ELEMENT_BYTES[dtype] // ELEMENT_BYTES["fp32"]
    s, dv_col = 0, block
    dp = dv_col + dv
    dk = dp + block
    region = TmemRegion
    regions = (
        region("S", 0, s, block, "fp32", None, "-"),
        region("P", 0, s, half, dtype, "S", "-"),
        region("dV", 0, dv_col, dv, "fp32", None, "-"),
        region("dP", 0, dp, block, "fp32", None, "-"),
        region("dS", 0, dp, half, dtype, "dP", "-"),
        region("dK", 0, dk, d, "fp32", None, "-"),
        region("dQ", 0, dp, d, "fp32", "dP", "-"),
    )
    total = dk + d
    plan = TmemPlan(regions=regions, total_cols=total, alloc_cols=alloc_columns(total),
                    lanes=B200.tmem_lanes, capacity_cols=B200.tmem_columns)
    if d > block:
        raise PlanError(f"dQ ({d} fp32 columns at head_dim {d}) does not fit over dP's {block} "
                        f"columns; this 1-CTA layout needs head_dim <= {block}")
    return plan


_HOLDS = {"S": "scores S^T = K Q^T", "P": "P = exp(S - LSE), 16-bit", "dV": "dV += P^T dO",
          "dP": "dP^T = V dO^T", "dS": "dS = P * (dP - D), 16-bit", "dK": "dK += dS^T Q",
          "dQ": "dQ = dS K (one step)"}


def tmem_table_markdown(head_dims=(64, 128)) -> str:
    """A markdown table of `backward_tmem` at each head dim: each region's columns, and the
    total against the TMEM's columns."""
    plans = {d: backward_tmem(d) for d in head_dims}
    first = plans[head_dims[0]]
    head = "| region | holds | lanes | " + " | ".join(f"hd {d}: columns" for d in head_dims)
    rows = [head + " |", "|---" * (3 + len(head_dims)) + "|"]
    for r in first.regions:
        lanes = "128 queries" if r.name == "dQ" else "128 keys"
        cells = []
        for d in head_dims:
            x = plans[d].region(r.name, 0)
            over = f" (over {x.alias_of})" if x.alias_of else ""
            cells.append(f"{x.col_offset}-{x.col_end - 1}{over}")
        rows.append(f"| {r.name} | {_HOLDS[r.name]} | {lanes} | " + " | ".join(cells) + " |")
    rows.append("| **total** | of " + f"{first.capacity_cols} columns | | " + " | ".join(
        f"**{plans[d].total_cols}** (alloc {plans[d].alloc_cols})" for d in head_dims) + " |")
    return "\n".join(rows)
