"""The acceptance check both GPU kernels share (tests/test_sm90.py, tests/test_sm100.py, the
varlen, paged and matrix GPU tests).

The rule itself, its tolerances and its 16-bit yardsticks live once in `fa4lab.acceptance`
(the fuzzer, `fa4lab.fuzz`, holds every case to the same): the kernel's max error against the
float64 reference at most twice PyTorch's own same-dtype error plus ATOL (one output ulp with
extreme logits: Note [extreme logits] there); rows that see no key exactly 0 with LSE -inf (the
sink's logit with a sink); no NaN; LSE to `lse_tolerance`; two runs bit for bit. Here: the
inputs, and the rule applied to whole outputs (`check_kernel`) and sequence by sequence
(`check_sequences`).
"""

from __future__ import annotations

import torch

from fa4lab.acceptance import (  # noqa: F401 -- ATOL, output_ulp_atol: the GPU tests' floor
    ATOL,
    output_ulp_atol,
    rule_violations,
    same_dtype_yardstick,
    torch_same_dtype,
)

SEQLENS = [(1, 1), (17, 1000), (1000, 17), (1000, 4097)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def make_inputs(batch, sq, sk, hq, hkv, d, dtype, seed, q_scale=1.0, dv=None):
    """q, k (head_dim d) and v (head_dim_v dv, default d) on the GPU, standard normal."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, sq, hq, d, device="cuda", generator=g) * q_scale
    k = torch.randn(batch, sk, hkv, d, device="cuda", generator=g)
    v = torch.randn(batch, sk, hkv, d if dv is None else dv, device="cuda", generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def check_kernel(attn, q, k, v, *, causal, softmax_scale=None, atol=ATOL, softcap=0.0,
                 window_size=(None, None), learnable_sink=None, **kernel_options):
    """Run `attn(q, k, v, ..., **kernel_options)` twice and hold it to the rule above (with a
    softcap or a sink, against `torch_same_dtype`'s error). softcap, window_size and
    learnable_sink reach `attn` only when set."""
    from fa4lab.reference import attention_reference, visible_mask

    options = dict(softcap=softcap, window_size=window_size, learnable_sink=learnable_sink)
    set_options = {name: options[name] for name, unset in (
        ("softcap", softcap == 0.0), ("window_size", tuple(window_size) == (None, None)),
        ("learnable_sink", learnable_sink is None)) if not unset}

    def run():
        return attn(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=True,
                    **set_options, **kernel_options)

    (out, lse), (out2, lse2) = run(), run()
    assert torch.equal(out, out2) and torch.equal(lse, lse2), "two runs differ: not deterministic"
    ref, ref_lse = attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                       return_lse=True, **options)
    assert out.shape == q.shape[:3] + (v.shape[-1],) and out.dtype == q.dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    sees = torch.as_tensor(visible_mask(q.shape[1], k.shape[1], causal,
                                        window_size=window_size).any(axis=1), device=q.device)
    seen_rows = sees[None, :, None].expand(out.shape[:3])    # (b, sq, h): rows that see a key
    pt = (same_dtype_yardstick(q, k, v, causal=causal, softmax_scale=softmax_scale, **options)
          if sees.any() else None)
    problems = rule_violations(out, ref, seen_rows, pt, lse=lse.transpose(1, 2),
                               ref_lse=ref_lse.transpose(1, 2), atol=atol, where="kernel ")
    assert not problems, "; ".join(problems)


def check_sequences(out, lse, ref, ref_lse, q, cu_q, lens_k, kv_of, opts, *, atol=ATOL,
                    what: str = "") -> None:
    """The rule above, sequence by sequence, for a varlen result: out (total_q, heads, dv) and
    lse (heads, total_q) against the float64 `ref` / `ref_lse` of
    `fa4lab.reference.attention_varlen_reference`; cu_q the host cu_seqlens_q, lens_k each
    sequence's key count, kv_of(b) its contiguous (k_b, v_b) (seqlen_k, heads_kv, d) for the
    16-bit yardstick (`torch_same_dtype` with `opts`: causal, window_size, softcap,
    learnable_sink), `what` a note for the failure messages."""
    from fa4lab.reference import visible_mask

    causal, window_size = opts.get("causal", False), opts.get("window_size", (None, None))
    assert out.shape == (*q.shape[:2], out.shape[-1]) and out.dtype == q.dtype
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
    for b, lk in enumerate(lens_k):
        lq = cu_q[b + 1] - cu_q[b]
        if lq == 0:
            continue
        rows = slice(cu_q[b], cu_q[b + 1])
        sees = torch.zeros(lq, dtype=torch.bool, device=q.device)
        if lk:
            sees = torch.as_tensor(visible_mask(lq, lk, causal, window_size=window_size)
                                   .any(axis=1), device=q.device)
        pt = None
        if sees.any():
            k_b, v_b = kv_of(b)
            pt = torch_same_dtype(q[rows][None], k_b[None], v_b[None], **opts)[0]
        problems = rule_violations(out[rows], ref[rows], sees[:, None].expand(lq, q.shape[1]),
                                   pt, lse=lse[:, rows].T, ref_lse=ref_lse[:, rows].T,
                                   atol=atol,
                                   where=f"sequence {b} (len_q {lq}, len_k {lk}{what}): ")
        assert not problems, "; ".join(problems)


def replays_in_a_cuda_graph(call, buffers, settings, *, synchronises: bool = False) -> None:
    """`call()` reads its index tensors from `buffers`; for each entry of `settings` (new
    values for the buffers, same shapes) it must (1) run without a device-to-host
    synchronisation (`torch.cuda.set_sync_debug_mode("error")` raises on one), or, with
    `synchronises`, synchronise; and (2) replay from ONE CUDA graph captured on the first
    setting, bit for bit as an eager call on the same values: nothing of the launch was
    decided on the host from the values."""

    def load(values):
        for buf, val in zip(buffers, values):
            buf.copy_(val)

    def outputs():
        got = call()
        return tuple(t.clone() for t in (got if isinstance(got, tuple) else (got,)))

    load(settings[0])
    outputs()                                   # compiles outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for values in settings:
            load(values)
            try:
                call()
            except RuntimeError as e:
                if not (synchronises and "synchroniz" in str(e)):
                    raise
            else:
                assert not synchronises, "the call was expected to synchronise"
    finally:
        torch.cuda.set_sync_debug_mode(0)
    eager = []
    for values in settings:
        load(values)
        eager.append(outputs())
    load(settings[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):               # warm-up on a side stream, torch's recipe
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = call()
    static = static if isinstance(static, tuple) else (static,)
    for i, (values, want) in enumerate(zip(settings, eager)):
        load(values)
        graph.replay()
        torch.cuda.synchronize()
        for got, ref in zip(static, want):
            assert torch.equal(got, ref), f"setting {i}: the graph's replay differs from eager"
