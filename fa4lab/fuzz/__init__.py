"""`fa4lab.fuzz`: random configurations of the entry points, crossed over every option, each
held to the float64 reference on the GPU (`make fuzz-gpu`).

What a case is (`fa4lab.fuzz.cases`): one call of
* `fa4lab.attention` on dense (batch, seqlen, heads, d) tensors, or over a paged K/V cache
  (`page_table`), at decode shapes with split-KV (num_splits > 1 or None);
* `fa4lab.attention_varlen` on packed sequences (cu_seqlens, seqused_k), over a paged cache
  with the same query count per sequence (decode) or ragged ones (chunked prefill);
with a (head_dim, head_dim_v) pair of `fa4lab.limits.ALL_HEAD_DIMS`, bf16 or fp16, causal,
windows (left, right, both, asymmetric), softcap, learnable sinks, score_mod / mask_mod,
softmax_scale, return_lse, pack_gqa, num_splits, GQA ratios 1..8, page sizes (a few the kernels
refuse), lengths 0..5000 (mostly short; empty and one-token sequences), extreme logits, rows
that see no key, and tensors laid out contiguous, as slices of one packed qkv tensor,
transposed, padded, misaligned or with a strided last dim (`fa4lab.fuzz.inputs`). Case i of
seed s is a pure function of (s, i): it replays alone. The kernel configurations come from a
bounded pool, so a run compiles a bounded set of kernels (Note [a bounded pool of kernels]).

How a case is judged (`fa4lab.fuzz.judge`): by `fa4lab.acceptance`'s rule against the float64
reference, two runs bit for bit; a call that raises one of fa4lab's documented errors before
launch is a refusal, counted by message; any other exception is a failure, and a CUDA fault
stops the run (Note [refusals]).

    python -m fa4lab.fuzz --seconds 200 --seed 0 --out fuzz-failures    # on a Hopper / B200
    python -m fa4lab.fuzz --replay fuzz-failures/seed0-case17.json
    python -m fa4lab.fuzz --device cpu --seconds 10                     # a CPU smoke run

On a CPU `fa4lab.attention` computes the float64 reference itself, so `--device cpu` checks the
fuzzer (its draws, layouts, judge), not a kernel.
"""

from fa4lab.fuzz.cases import Case, draw_case, from_json, parse_replay, to_json
from fa4lab.fuzz.judge import Verdict, run_case

__all__ = ["Case", "Verdict", "draw_case", "from_json", "parse_replay", "run_case", "to_json"]
