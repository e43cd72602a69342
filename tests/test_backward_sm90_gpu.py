"""The sm90 backward kernel on a Hopper GPU (marker `sm90`): dQ, dK, dV (and the sink's
gradient) against the float64 `fa4lab.reference_backward` on fresh random inputs.

FA4's rule per gradient, `fa4lab.acceptance.gradient_violations` against
`same_dtype_gradients` (the module's docstring says it). No NaN anywhere, rows that see no key
included. Deterministic mode: dQ bit for bit over two runs.

The grid (trimmed: each (head dims, dtype, causal, GQA, softcap, window sides, deterministic)
is one compile; sizes, the scale, the cap and the window's sizes are runtime values): every
head-dim pair the sm90 forward builds, causal or not, GQA 3:1 and 1:1, sequence lengths with
tails of both tiles (64), length 1, seqlen_q > seqlen_k under causal (the top rows see no key),
windows (both sides, left only with causal, right only), softcap, a learnable sink, a
differentiated lse, fp16; the autograd path (`fa4lab.attention` with inputs that require grad,
eager and under torch.compile(fullgraph=True): one forward launch per step, the backward reading
its saved out and lse); the refusals of what the kernel does not build.

    python -m pytest -x -q tests/test_backward_sm90_gpu.py   # or: python tests/<this file>
"""

from __future__ import annotations

import sys

import pytest

torch = pytest.importorskip("torch")

from fa4lab.acceptance import gradient_violations, same_dtype_gradients  # noqa: E402

pytestmark = pytest.mark.sm90

# (seqlen_q, seqlen_k): single rows, tails of the 64-row and 64-key tiles, seqlen_q > seqlen_k
# (causal leaves the first rows without a key) and < seqlen_k, one of several blocks each way.
SEQLENS = [(1, 1), (1, 130), (113, 203), (203, 113), (256, 256), (65, 1)]
HEAD_DIMS = [(64, 64), (96, 96), (128, 128), (192, 128), (256, 256)]
GQA = [(4, 4), (6, 2)]


def _inputs(b, sq, sk, hq, hkv, d, dv, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, do = (torch.randn(*shape, device="cuda", generator=g).to(dtype) for shape in
                   ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, dv), (b, sq, hq, dv)))
    return q, k, v, do


def _check(q, k, v, do, *, causal=False, softmax_scale=None, window_size=(None, None),
           softcap=0.0, sink=None, with_dlse=False, deterministic=False):
    from fa4lab.call import check_call
    from fa4lab.kernels.launch_backward import backward, saved_forward
    from fa4lab.reference_backward import attention_backward_reference
    from fa4lab.spec import normalize_mask

    causal_n, window_n = normalize_mask(causal, window_size)
    call = check_call(q, k, v, causal=causal, softmax_scale=softmax_scale, softcap=softcap,
                      window_size=window_size, learnable_sink=sink, arch="sm90")
    out, lse = saved_forward(call, "sm90")
    dlse = (torch.randn(lse.shape, device="cuda", generator=torch.Generator(device="cuda")
                        .manual_seed(7)) if with_dlse else None)
    got = backward(call, out, do, lse, dlse=dlse, deterministic=deterministic)
    ref = attention_backward_reference(q, k, v, do, causal=causal_n,
                                       softmax_scale=softmax_scale, window_size=window_n,
                                       softcap=softcap, learnable_sink=sink, dlse=dlse,
                                       finite=False)
    pt = same_dtype_gradients(q, k, v, do, causal=causal_n, softmax_scale=softmax_scale,
                              window_size=window_n, softcap=softcap, learnable_sink=sink,
                              dlse=dlse)
    problems = gradient_violations(got, ref, pt)
    assert not problems, "; ".join(problems)
    return got


@pytest.mark.parametrize("dims", HEAD_DIMS, ids=[f"hd{d}x{dv}" for d, dv in HEAD_DIMS])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", GQA, ids=["mha", "gqa3"])
def test_dense(dims, causal, heads):
    d, dv = dims
    seqlens = SEQLENS if d in (64, 128) else SEQLENS[2:4]   # trimmed: the other dims' tails
    for i, (sq, sk) in enumerate(seqlens):
        _check(*_inputs(2, sq, sk, *heads, d, dv, torch.bfloat16, 100 + i), causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_fp16(causal):
    _check(*_inputs(1, 203, 113, 4, 2, 128, 128, torch.float16, 1), causal=causal)


@pytest.mark.parametrize("causal,window", [(False, (17, 5)), (False, (40, None)),
                                           (False, (None, 9)), (True, (33, None)),
                                           (False, (0, 0))])
@pytest.mark.parametrize("d", [64, 128])
def test_windows(causal, window, d):
    for i, (sq, sk) in enumerate([(113, 203), (203, 113), (256, 256)]):
        _check(*_inputs(1, sq, sk, 6, 2, d, d, torch.bfloat16, 200 + i), causal=causal,
               window_size=window)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_softcap(causal, d):
    q, k, v, do = _inputs(2, 203, 113, 4, 4, d, d, torch.bfloat16, 3)
    _check(q * 4, k, v, do, causal=causal, softcap=15.0)


@pytest.mark.parametrize("causal", [False, True])
def test_sink_and_dlse(causal):
    q, k, v, do = _inputs(2, 113, 203, 6, 2, 64, 64, torch.bfloat16, 4)
    sink = torch.randn(6, device="cuda")
    _check(q, k, v, do, causal=causal, sink=sink)
    _check(q, k, v, do, causal=causal, with_dlse=True)
    _check(q, k, v, do, causal=causal, sink=sink, with_dlse=True, window_size=(30, None))


@pytest.mark.parametrize("causal,window", [(False, (None, None)), (True, (None, None)),
                                           (False, (40, 7))])
def test_deterministic_dq_bit_for_bit(causal, window):
    from fa4lab.kernels.launch_backward import backward

    q, k, v, do = _inputs(2, 1000, 1000, 6, 2, 128, 128, torch.bfloat16, 5)
    first = _check(q, k, v, do, causal=causal, window_size=window, deterministic=True)
    from fa4lab.call import check_call
    from fa4lab.kernels.launch_backward import saved_forward

    call = check_call(q, k, v, causal=causal, window_size=window, arch="sm90")
    out, lse = saved_forward(call, "sm90")
    for _ in range(3):
        again = backward(call, out, do, lse, deterministic=True)
        for a, b in zip(first[:3], again[:3]):
            assert torch.equal(a, b), "deterministic=True gave two different gradients"


def test_autograd_through_fa4lab_attention_eager_and_compiled():
    """`fa4lab.attention` with CUDA inputs that require grad runs the kernel (Note [the
    backward on the GPU] in fa4lab.backward): the gradients equal the kernel's called directly,
    eagerly and under torch.compile(fullgraph=True)."""
    import fa4lab
    from fa4lab.call import check_call
    from fa4lab.kernels.launch_backward import backward, saved_forward

    q, k, v, do = _inputs(1, 130, 190, 4, 2, 64, 64, torch.bfloat16, 6)
    call = check_call(q, k, v, causal=True, arch="sm90")
    out, lse = saved_forward(call, "sm90")
    want = backward(call, out, do, lse)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]

    def f(q, k, v):
        return fa4lab.attention(q, k, v, causal=True)

    torch._dynamo.reset()
    for fn in (f, torch.compile(f, fullgraph=True)):
        got = torch.autograd.grad(fn(*leaves), leaves, do)
        for g, w in zip(got, want[:3]):
            torch.testing.assert_close(g, w, rtol=0, atol=2e-2)   # dQ's add order may differ


def test_what_the_kernel_does_not_build_is_refused():
    import fa4lab
    from fa4lab.errors import GradientNotSupportedError
    from fa4lab.mods import alibi

    q, k, v, _ = _inputs(1, 64, 64, 2, 2, 64, 64, torch.bfloat16, 8)
    q.requires_grad_()
    mod, aux = alibi(torch.rand(2, device="cuda"))
    with pytest.raises(GradientNotSupportedError, match="score_mod"):
        fa4lab.attention(q, k, v, score_mod=mod, aux_tensors=aux)
    cache = k.detach().clone()       # one page of 64 keys per sequence
    table = torch.zeros((1, 1), dtype=torch.int32, device="cuda")
    with pytest.raises(GradientNotSupportedError, match="paged"):
        fa4lab.attention(q, cache, cache, page_table=table)


@pytest.mark.parametrize("return_lse", [False, True])
def test_autograd_reads_the_saved_forward(monkeypatch, return_lse):
    """`fa4lab.attention` with inputs that require grad, eager and under
    torch.compile(fullgraph=True): one forward launch per training step (the backward kernel
    reads the forward op's saved out and lse: Note [the backward on the GPU] in
    fa4lab.backward), and dQ, dK, dV, d(sink) against the float64 reference under FA4's rule,
    with a window and a sink; with return_lse the lse's gradient too."""
    import fa4lab
    from fa4lab.kernels import launch
    from fa4lab.reference_backward import attention_backward_reference

    q, k, v, do = _inputs(2, 203, 113, 6, 2, 128, 128, torch.bfloat16, 9)
    sink = torch.randn(6, device="cuda")
    dlse = (torch.randn((2, 6, 203), device="cuda", generator=torch.Generator(device="cuda")
                        .manual_seed(10)) if return_lse else None)
    options = dict(causal=True, window_size=(40, None))
    ref = attention_backward_reference(q, k, v, do, learnable_sink=sink, dlse=dlse,
                                       finite=False, **options)
    pt = same_dtype_gradients(q, k, v, do, learnable_sink=sink, dlse=dlse, **options)
    launches = []
    real = launch.forward
    monkeypatch.setattr(launch, "forward",
                        lambda call, arch: launches.append(arch) or real(call, arch))

    def f(q, k, v, sink):
        return fa4lab.attention(q, k, v, learnable_sink=sink, return_lse=return_lse, **options)

    torch._dynamo.reset()
    for fn in (f, torch.compile(f, fullgraph=True)):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, sink)]
        launches.clear()
        got = fn(*leaves)
        outputs, grads_of = ((got, (do, dlse)) if return_lse else ((got,), (do,)))
        grads = torch.autograd.grad(outputs, leaves, grads_of)
        assert len(launches) == 1, f"{len(launches)} forward launches in one training step"
        problems = gradient_violations(grads, ref, pt)
        assert not problems, "; ".join(problems)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-x", "-q", *sys.argv[1:]]))


def test_deterministic_through_fa4lab_attention():
    """`fa4lab.attention(..., deterministic=True)` reaches the kernel's ordered dQ (the op's
    switch, saved by its autograd setup): two backward passes give the same dq bit for bit."""
    import fa4lab

    q, k, v, do = _inputs(2, 700, 900, 6, 2, 128, 128, torch.bfloat16, 8)
    grads = []
    for _ in range(2):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = fa4lab.attention(*leaves, causal=True, deterministic=True)
        grads.append(torch.autograd.grad(out, leaves, do))
    for a, b in zip(*grads):
        assert torch.equal(a, b), "deterministic=True gave two different gradients"
