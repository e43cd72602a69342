"""The acceptance check both GPU kernels share (tests/test_sm90.py, tests/test_sm100.py).

FA4's rule: the kernel's max error against the float64 reference is at most twice PyTorch's own
same-dtype attention error (`fa4lab.api.sdpa_same_dtype`) plus ATOL = 1e-3. The atol is a floor
for cases where SDPA happens to be exact (seqlen_k = 1, or one-hot rows at extreme logits): it
is below half a bf16 ulp at magnitude 0.5 (2**-9 ~ 2e-3), so it absorbs fp32 summation-order
noise but not one output rounded the wrong way. Rows that see no key must give exactly 0 and
LSE -inf (with a learnable sink: the sink's logit, to the LSE tolerance; -inf for a -inf sink);
nothing may be NaN; LSE must match the reference to 1e-3 + 1e-5 * |lse| (fp32 accumulation of
16-bit products); two runs on the same inputs must agree bit for bit. With a softcap or a
learnable sink the yardstick is `torch_same_dtype` (SDPA can do neither); a window is a mask,
which SDPA takes.
"""

from __future__ import annotations

import math

import torch

ATOL = 1e-3
SEQLENS = [(1, 1), (17, 1000), (1000, 17), (1000, 4097)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def make_inputs(batch, sq, sk, hq, hkv, d, dtype, seed, q_scale=1.0, dv=None):
    """q, k (head_dim d) and v (head_dim_v dv, default d) on the GPU, standard normal."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, sq, hq, d, device="cuda", generator=g) * q_scale
    k = torch.randn(batch, sk, hkv, d, device="cuda", generator=g)
    v = torch.randn(batch, sk, hkv, d if dv is None else dv, device="cuda", generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def output_ulp_atol(v, dtype: str) -> float:
    """One ulp of `dtype` at the output's magnitude (at least ATOL). See Note [extreme logits].

    Note [extreme logits]: with logits ~1e4 rows are nearly one-hot and SDPA's largest P is
    exactly 1, so it returns v exactly. With FA4's conditional rescale the kept (stale) max may
    sit up to 8 log2 units below the row max, so the largest P is up to 2**8 and is itself
    rounded to 16 bits before P V: the output can land one rounding step away. A wrong max, a
    lost rescale or an overflow would be off by O(|v|), far beyond this.
    """
    mantissa = {"bf16": 7, "fp16": 10}[dtype]
    top = v.abs().max().item()
    return max(ATOL, 2.0 ** (math.floor(math.log2(top)) - mantissa))


def torch_same_dtype(q, k, v, *, causal=False, softmax_scale=None, softcap=0.0,
                     window_size=(None, None), learnable_sink=None):
    """Attention in eager PyTorch in the inputs' 16-bit dtype, for the options SDPA lacks (a
    softcap, a learnable sink): scores, cap, softmax and P V each rounded to q.dtype, as a
    straightforward PyTorch implementation would; bottom-right causal and windows
    (`fa4lab.reference.visible_mask`); the sink as one more logit per head, dropped after the
    softmax. Rows that see no key come out NaN (0 with a sink)."""
    from fa4lab.reference import visible_mask

    sq, sk, d = q.shape[1], k.shape[1], q.shape[3]
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    g = q.shape[2] // k.shape[2]
    kk, vv = (x.repeat_interleave(g, dim=2).transpose(1, 2) for x in (k, v))
    s = (q.transpose(1, 2) @ kk.transpose(-1, -2)) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    mask = torch.as_tensor(visible_mask(sq, sk, causal, window_size=window_size),
                           device=q.device)
    s = s.masked_fill(~mask, float("-inf"))
    if learnable_sink is not None:
        sink = learnable_sink.to(s.dtype)[None, :, None, None].expand(*s.shape[:3], 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :sk]
    else:
        p = torch.softmax(s, dim=-1)
    return (p @ vv).transpose(1, 2)


def check_kernel(attn, q, k, v, *, causal, softmax_scale=None, atol=ATOL, softcap=0.0,
                 window_size=(None, None), learnable_sink=None, **kernel_options):
    """Run `attn(q, k, v, ..., **kernel_options)` twice and hold it to the rule above (with a
    softcap or a sink, against `torch_same_dtype`'s error). softcap, window_size and
    learnable_sink reach `attn` only when set."""
    from fa4lab.api import sdpa_same_dtype
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
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()

    sees = torch.as_tensor(visible_mask(q.shape[1], k.shape[1], causal,
                                        window_size=window_size).any(axis=1), device=q.device)
    seen_rows = sees[None, :, None].expand(out.shape[:3])    # (b, sq, h): rows that see a key
    assert (out[~seen_rows] == 0).all(), "a row that sees no key must be exactly 0"
    finite = torch.isfinite(ref_lse)      # rows that see a key, or a finite sink
    assert (lse[~finite] == -math.inf).all(), "a row that sees no key must have LSE -inf"
    if finite.any():
        lse_err = (lse.double() - ref_lse)[finite].abs()
        lse_tol = 1e-3 + 1e-5 * ref_lse[finite].abs()
        assert (lse_err <= lse_tol).all(), f"LSE error up to {lse_err.max().item():.3g}"
    if not sees.any():
        return
    if softcap or learnable_sink is not None:
        pt = torch_same_dtype(q, k, v, causal=causal, softmax_scale=softmax_scale, **options)
    else:
        pt = sdpa_same_dtype(q, k, v, causal=causal, softmax_scale=softmax_scale,
                             window_size=window_size)
    err = (out.double() - ref)[seen_rows].abs().max().item()
    pt_err = (pt.double() - ref)[seen_rows].abs().max().item()
    assert err <= 2 * pt_err + atol, f"kernel error {err:.3g} > 2 x SDPA error {pt_err:.3g} + atol"


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
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    for b, lk in enumerate(lens_k):
        lq = cu_q[b + 1] - cu_q[b]
        if lq == 0:
            continue
        rows = slice(cu_q[b], cu_q[b + 1])
        o_b, r_b, lse_b, rlse_b = out[rows], ref[rows], lse[:, rows], ref_lse[:, rows]
        where = f"sequence {b} (len_q {lq}, len_k {lk}{what})"
        sees = torch.zeros(lq, dtype=torch.bool, device=q.device)
        if lk:
            sees = torch.as_tensor(visible_mask(lq, lk, causal, window_size=window_size)
                                   .any(axis=1), device=q.device)
        assert (o_b[~sees] == 0).all(), f"{where}: a row that sees no key must be exactly 0"
        finite = torch.isfinite(rlse_b)
        assert (lse_b[~finite] == -math.inf).all(), f"{where}: LSE of an empty row not -inf"
        if finite.any():
            lse_err = (lse_b.double() - rlse_b)[finite].abs()
            assert (lse_err <= 1e-3 + 1e-5 * rlse_b[finite].abs()).all(), \
                f"{where}: LSE error up to {lse_err.max().item():.3g}"
        if not sees.any():
            continue
        k_b, v_b = kv_of(b)
        pt = torch_same_dtype(q[rows][None], k_b[None], v_b[None], **opts)[0]
        err = (o_b.double() - r_b)[sees].abs().max().item()
        pt_err = (pt.double() - r_b)[sees].abs().max().item()
        assert err <= 2 * pt_err + atol, \
            f"{where}: error {err:.3g} > 2 x PyTorch's {pt_err:.3g} + {atol:.3g}"


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
