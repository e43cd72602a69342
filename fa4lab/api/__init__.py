"""`fa4lab.attention`: the one validated entry point, dispatching by where the tensors live.

    out = fa4lab.attention(q, k, v, causal=True)
    out, lse = fa4lab.attention(q, k, v, return_lse=True)

q (batch, seqlen_q, heads_q, head_dim), k (batch, seqlen_k, heads_kv, head_dim),
v (batch, seqlen_k, heads_kv, head_dim_v) torch tensors; out like q with head_dim_v; lse
(batch, heads_q, seqlen_q) float32, natural log, -inf for rows that see no key.

Dispatch:
* CUDA tensors on compute capability 10.x (B200): the sm100 kernel (`fwd_sm100`);
* CUDA tensors on 9.0 (H100/H200): the sm90 kernel (`fwd_sm90`);
* anything else (CPU tensors, other GPUs): the float64 reference, with a `SlowReferenceWarning`
  -- correct but slow, so you always know when no kernel ran.

Pack-GQA folds the query heads that share a KV head into one CTA's rows, so K/V are read once
per group (decode and short seqlen_q gain most). By default (`pack_gqa=None`) it is on whenever
heads_q / heads_kv > 1 divides the Q tile's rows (64 on Hopper, 128 on the B200) and packing
takes fewer Q tiles than not, or (on Hopper) at head_dim 64 or where a narrow window makes packed
tiles read far fewer keys (`fa4lab.limits.pack_gqa_default`); `pack_gqa=True` / `False` force it
(True with a ratio that does not divide the tile raises PlanError). The B200 packed kernel is
compiled and audited but not yet run on a B200. The reference ignores it.

`softcap=c > 0` caps the scores as Gemma 2 does: s -> c * tanh(s / c) on s = softmax_scale * q.k,
before the softmax (0, the default, is off; Note [softcap] in `fa4lab.kernels.device.softmax`).
`window_size=(left, right)` is a sliding window on the bottom-right diagonal: query i sees key
j iff i + d - left <= j <= i + d + right, d = seqlen_k - seqlen_q, None for an unbounded side
(causal=True is right = 0; a negative side moves its edge past the diagonal, as upstream reads
it, and both negative, FA2's (-1, -1), is no window: Note [window and causal] in
`fa4lab.spec`). The kernels never load the key blocks outside it. `learnable_sink` (heads_q,)
float32 adds e^{sink[h]} to every softmax denominator of query head h (GPT-OSS; Note [sinks]
in `fa4lab.kernels.device.softmax`): a row that sees no key then gives out 0 and lse =
sink[h]. A new window size, sink, scale or cap value never compiles a new kernel; which window
sides exist and whether a sink comes do. The argument names are upstream FA4's
`flash_attn_func`'s where the meaning is the same.

Split-KV (flash-decoding, `fa4lab.splitkv`): `num_splits=n > 1` cuts each tile's keys into n
ranges run by n CTAs, whose float32 partial outputs and LSEs the combine kernel merges (the sink
joins there); 1 never splits; None (the default) chooses for the shape and the GPU
(`fa4lab.splitkv.choose_num_splits`: decode shapes that cannot fill the GPU split, prefill does
not). The split count is a runtime value: no compile per count. Not with mods yet.

`score_mod(score, b, h, q_idx, kv_idx[, aux])`, `mask_mod(b, h, q_idx, kv_idx[, aux])` and
`aux_tensors` are FlexAttention-style user functions compiled into the kernel (`fa4lab.mods`:
the contract, what a mod may use, ready-made ALiBi / relative-bias / document / prefix-LM mods).
Each new mod compiles once per process (never cached on disk), and a call with mods skips the
custom op: torch.compile graph-breaks there (Note [mods in the kernels] in `fa4lab.mods`).

Bad inputs raise before anything runs, with what is wrong and what to do (one check per call,
`fa4lab.call.check_call`). Gradients: on CPU tensors that require grad, autograd
differentiates the float64 reference (`fa4lab.backward`: the explicit backward of
`fa4lab.reference_backward`); on a Hopper GPU `fa4lab.attention` runs the sm90 backward kernel
(`fa4lab.kernels.bwd_sm90`; deterministic=True orders its dQ additions), and where no kernel
builds the call (another arch, a paged cache, mods, varlen) inputs that require grad raise
`GradientNotSupportedError` naming what is missing, while grad mode is on (a silently dropped
gradient is worse than an error). Compiled kernels are kept per configuration
(`fa4lab.kernels.launch`) and on disk (`fa4lab.kernels.cache`, shared across processes): the
same head_dim, dtype, causal flag, GQA ratio and LSE flag never compile twice, whatever the
batch, sequence lengths or softmax scale (a runtime argument of the kernel).

`page_table` (int32 (batch, pages_per_seq)) makes k and v a paged K/V cache (num_pages,
page_size, heads_kv, d), `fa4lab.varlen`'s layout: sequence b's keys are its pages
page_table[b, 0], page_table[b, 1], ..., pages_per_seq * page_size of them; q stays dense. The
kernels read the pages in place (Note [paged key blocks] in `fa4lab.kernels.device.paged`: the
page size must be a multiple of the kernel's key block or divide it); a new page table costs no
compile, a new page size does. num_splits splits a paged cache's keys as it does contiguous
ones (None chooses from the table's capacity). The reference gathers the sequences' K/V first.

`attention_varlen` takes variable-length batches (packed tokens + cu_seqlens) and paged K/V
caches (`fa4lab.varlen`): one varlen kernel launch per batch; a paged cache whose sequences
all have the same query count (decode) is one paged launch (split-KV and the combine when the
shape asks, as `attention` chooses); other paged batches (chunked prefill) are one varlen launch
over the pages on the archs where it has run (`fa4lab.kernels.launch.PAGED_VARLEN_ARCHS`: the
H100/H200), `attention` once per sequence elsewhere.

torch.compile and CUDA graphs: `attention` is backed by the custom op
`torch.ops.fa4lab.attention_forward` (Note [the attention op] in fa4lab.api.dense),
`attention_varlen` by `torch.ops.fa4lab.attention_varlen_forward` (Note [the varlen op] in
fa4lab.api.varlen).
"""

from fa4lab.api.dense import (
    SlowReferenceWarning,
    attention,
    attention_forward,
    error_vs_reference,
    sdpa_same_dtype,
)
from fa4lab.api.varlen import attention_varlen, attention_varlen_forward
from fa4lab.errors import GradientNotSupportedError, UnsupportedArchError

__all__ = ["GradientNotSupportedError", "SlowReferenceWarning", "UnsupportedArchError",
           "attention", "attention_forward", "attention_varlen", "attention_varlen_forward",
           "error_vs_reference", "sdpa_same_dtype"]
