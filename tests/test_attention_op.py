"""`fa4lab.attention` as a torch op: opcheck, torch.compile(fullgraph=True) of a Llama-style
block, fake tensors, gradients on CPU tensors (the float64 reference's, through the backward
op) and no silent gradient loss on CUDA ones (fake CUDA tensors here). On CPU the op computes the
float64 reference (the kernels need a GPU); tests/test_attention_op_gpu.py runs the same checks
on a GPU."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import fa4lab  # noqa: E402
from fa4lab.api import GradientNotSupportedError  # noqa: E402
from fa4lab.reference import attention_reference  # noqa: E402


def _qkv(gen, b=2, sq=9, sk=13, hq=4, hkv=2, d=16, dtype=torch.float32, device="cpu"):
    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(device, dtype)

    return r(b, sq, hq, d), r(b, sk, hkv, d), r(b, sk, hkv, d)


@pytest.fixture(autouse=True)
def _quiet(quiet_reference):
    yield


class LlamaBlock(torch.nn.Module):
    """RMSNorm, GQA projections, rotary embedding, causal attention, SwiGLU MLP, residuals."""

    def __init__(self, hidden=64, heads=4, kv_heads=2, head_dim=16, attn=None):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.norm1 = torch.nn.RMSNorm(hidden)
        self.norm2 = torch.nn.RMSNorm(hidden)
        self.wq = torch.nn.Linear(hidden, heads * head_dim, bias=False)
        self.wk = torch.nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.wv = torch.nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.wo = torch.nn.Linear(heads * head_dim, hidden, bias=False)
        self.w1 = torch.nn.Linear(hidden, 2 * hidden, bias=False)
        self.w3 = torch.nn.Linear(hidden, 2 * hidden, bias=False)
        self.w2 = torch.nn.Linear(2 * hidden, hidden, bias=False)
        self.attn = attn or (lambda q, k, v: fa4lab.attention(q, k, v, causal=True))

    def rope(self, x):
        s, d = x.shape[1], x.shape[-1]
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))
        ang = torch.arange(s, dtype=torch.float32, device=x.device)[:, None] * inv[None]
        cos, sin = ang.cos()[None, :, None].to(x.dtype), ang.sin()[None, :, None].to(x.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)

    def forward(self, x):
        b, s, _ = x.shape
        h = self.norm1(x)
        q = self.rope(self.wq(h).view(b, s, self.heads, self.head_dim))
        k = self.rope(self.wk(h).view(b, s, self.kv_heads, self.head_dim))
        v = self.wv(h).view(b, s, self.kv_heads, self.head_dim)
        x = x + self.wo(self.attn(q, k, v).reshape(b, s, -1))
        h = self.norm2(x)
        return x + self.w2(torch.nn.functional.silu(self.w1(h)) * self.w3(h))


def _sdpa_causal(q, k, v):
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
        enable_gqa=True)
    return out.transpose(1, 2)


def test_opcheck(gen):
    """Schema, fake implementation, autograd registration and AOT dispatch of the op."""
    op = torch.ops.fa4lab.attention_forward.default
    q, k, v = _qkv(gen)
    torch.library.opcheck(op, (q, k, v, True, None, True, False, 0.0))
    torch.library.opcheck(op, (q, k, v, False, 0.3, False, None, 0.0))
    torch.library.opcheck(op, (q, k, v, True, None, True, None, 5.0))   # softcap
    torch.library.opcheck(op, (q, k, v, False, None, True, None, 0.0, 3, 2,   # window, sink
                               torch.randn(4, generator=gen)))
    q1, k1, v1 = _qkv(gen, sq=1, sk=1, hq=2, hkv=1)  # seqlen 1
    torch.library.opcheck(op, (q1, k1, v1, True, None, True, False, 0.0))


def test_the_block_with_fa4lab_matches_sdpa(gen):
    """The Llama block is right before it is compiled: fa4lab vs SDPA inside the same block."""
    torch.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
    block = LlamaBlock().eval()
    x = torch.randn(2, 33, 64, generator=gen)
    with torch.no_grad():
        ours = block(x)
        block.attn = _sdpa_causal
        theirs = block(x)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_matches_eager(gen, backend):
    torch.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
    block = LlamaBlock().eval()
    x = torch.randn(2, 33, 64, generator=gen)
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend=backend, dynamic=False)
    with torch.no_grad():
        eager = block(x)
        out = compiled(x)
        again = compiled(torch.randn(2, 33, 64, generator=gen))  # same graph, new data
    torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)
    assert again.shape == eager.shape and torch.isfinite(again).all()


def test_fake_tensors_give_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(3, 17, 8, 64, dtype=torch.bfloat16)
        k = torch.empty(3, 40, 2, 64, dtype=torch.bfloat16)
        out, lse = fa4lab.attention(q, k, k, causal=True, return_lse=True)
        assert out.shape == (3, 17, 8, 64) and out.dtype == torch.bfloat16
        assert lse.shape == (3, 8, 17) and lse.dtype == torch.float32
        with pytest.raises(ValueError, match="heads_q=8 is not a multiple"):
            fa4lab.attention(q, torch.empty(3, 40, 3, 64, dtype=torch.bfloat16),
                             torch.empty(3, 40, 3, 64, dtype=torch.bfloat16))


def _reference_grads(inputs, dout, dlse=None, **options):
    """Autograd of the float64 reference at float64 copies of `inputs` (q, k, v[, sink])."""
    leaves = [x.detach().double().requires_grad_() for x in inputs]
    sink = leaves[3] if len(leaves) > 3 else None
    out, lse = attention_reference(*leaves[:3], learnable_sink=sink, return_lse=True, **options)
    loss = (out * dout.double()).sum()
    if dlse is not None:
        loss = loss + (torch.where(torch.isinf(lse), 0.0, lse) * dlse.double()).sum()
    return torch.autograd.grad(loss, leaves)


def test_cpu_inputs_that_require_grad_get_the_references_gradients(gen):
    """Note [backward on CPU, not yet on the GPU]: float32 q, k or v that requires grad gets
    the float64 reference's gradient, rounded once to float32; no_grad still runs no autograd."""
    q, k, v = _qkv(gen)
    for which in range(3):
        args = [x.clone() for x in (q, k, v)]
        args[which].requires_grad_()
        out = fa4lab.attention(*args, causal=True)
        dout = torch.randn(out.shape, generator=gen)
        (grad,) = torch.autograd.grad(out, args[which], dout)
        assert grad.dtype == torch.float32 and grad.shape == args[which].shape
        want = _reference_grads((q, k, v), dout, causal=True)[which]
        torch.testing.assert_close(grad.double(), want, rtol=1e-5, atol=1e-6)
        with torch.no_grad():
            assert not fa4lab.attention(*args, causal=True).requires_grad


@pytest.mark.parametrize("options", [
    dict(window_size=(3, -1), softcap=2.0),
    dict(causal=True, sink=True),          # the first rows see no key: lse is the sink
    dict(window_size=(1, 1), sink=True, softmax_scale=30.0),   # extreme logits
])
def test_every_option_and_the_lse_are_differentiated(gen, options):
    """float64 inputs: through the op and its backward op, gradients equal autograd of the
    reference to float64 round-off, the lse's gradient included."""
    options = dict(options)
    q, k, v = (x.double() for x in _qkv(gen, sq=9, sk=6))
    inputs = [q, k, v] + ([torch.randn(4, generator=gen)] if options.pop("sink", False) else [])
    leaves = [x.clone().requires_grad_() for x in inputs]
    sink = leaves[3] if len(leaves) > 3 else None
    out, lse = fa4lab.attention(*leaves[:3], learnable_sink=sink, return_lse=True, **options)
    dout, dlse = torch.randn(out.shape, generator=gen), torch.randn(lse.shape, generator=gen)
    got = torch.autograd.grad((out * dout).sum() + (lse.double() * dlse).sum(), leaves)
    want = _reference_grads(inputs, dout, dlse, **options)
    for g, w in zip(got, want):
        assert g.dtype == (torch.float32 if g.dim() == 1 else torch.float64)
        torch.testing.assert_close(g.double(), w, rtol=1e-6 if g.dim() == 1 else 1e-10,
                                   atol=1e-6 if g.dim() == 1 else 1e-10)


def test_a_paged_cache_and_mods_are_differentiated(gen):
    """The pages get the gradients of the keys they hold (a page read by both sequences sums
    them); a score_mod call (which skips the op) is differentiated too."""
    from fa4lab.mods import alibi

    q = torch.randn(2, 5, 4, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    cache = torch.randn(2, 3, 4, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    table = torch.tensor([[0, 2], [2, 1]], dtype=torch.int32)
    out = fa4lab.attention(q, cache[0], cache[1], page_table=table, causal=True)
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    dq, dcache = torch.autograd.grad(out, (q, cache), dout)
    k, v = (torch.stack([c[table[b].long()].flatten(0, 1) for b in range(2)]) for c in cache)
    want = torch.autograd.grad(attention_reference(q, k, v, causal=True), (q, cache), dout)
    torch.testing.assert_close(dq, want[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(dcache, want[1], rtol=1e-10, atol=1e-10)

    mod, aux = alibi(torch.rand(4, generator=gen))
    kd, vd = k.detach().requires_grad_(), v.detach().requires_grad_()
    out = fa4lab.attention(q, kd, vd, causal=True, score_mod=mod, aux_tensors=aux)
    got = torch.autograd.grad(out, (q, kd, vd), dout)
    ref = attention_reference(q, kd, vd, causal=True, score_mod=mod, aux_tensors=aux)
    for g, w in zip(got, torch.autograd.grad(ref, (q, kd, vd), dout)):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_cuda_inputs_that_require_grad_raise_before_launch():
    """Fake CUDA tensors (no GPU needed): `attention` raises GradientNotSupportedError naming
    the alternatives, and so does the op's autograd setup (what a direct call of the op runs
    first; tests/test_attention_op_gpu.py calls it on a GPU); no_grad runs."""
    from types import SimpleNamespace

    from torch._subclasses.fake_tensor import FakeTensorMode

    from fa4lab.backward import save_attention

    with FakeTensorMode():
        q = torch.empty(1, 16, 2, 64, device="cuda", requires_grad=True)
        k = torch.empty(1, 16, 2, 64, device="cuda")
        with pytest.raises(GradientNotSupportedError,
                           match="on cuda:0 requires grad.*scaled_dot_product_attention"
                                 ".*torch.no_grad"):
            fa4lab.attention(q, k, k)
        # autograd calls an op's setup_context with grad mode off (the forward ran below it)
        with torch.no_grad(), pytest.raises(GradientNotSupportedError,
                                            match="no backward kernel on the GPU"):
            save_attention(SimpleNamespace(), (q, k, k, False, None, False, False, 0.0, None,
                                               None, None, None, None, False), (q, q))
        with pytest.raises(GradientNotSupportedError):
            fa4lab.attention(q.detach(), k, k,
                             learnable_sink=torch.zeros(2, device="cuda", requires_grad=True))
        with torch.no_grad():
            out, _ = torch.ops.fa4lab.attention_forward(q, k, k, False, None, False, False, 0.0)
        assert out.shape == q.shape and not out.requires_grad


def test_a_training_block_gets_sdpas_gradients(gen):
    """The Llama block trains on CPU with fa4lab inside: its parameters' gradients are SDPA's
    (float32: what the two attentions' own rounding allows)."""
    torch.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
    block = LlamaBlock().train()
    x = torch.randn(2, 9, 64, generator=gen)
    ours = torch.autograd.grad(block(x).square().sum(), block.parameters())
    block.attn = _sdpa_causal
    theirs = torch.autograd.grad(block(x).square().sum(), block.parameters())
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_the_op_itself_records_its_gradient(gen):
    """Called directly (no wrapper), the op's autograd formula runs its backward op on the
    saved out and lse: opcheck of both with inputs that require grad (schema, fakes, autograd
    registration, AOT dispatch), with and without the lse (on CPU the reference backward
    recomputes both, so an op called without it still differentiates)."""
    q, k, v = _qkv(gen)
    sink = torch.randn(4, generator=gen)
    grads = [x.clone().requires_grad_() for x in (q, k, v, sink)]
    op = torch.ops.fa4lab.attention_forward.default
    torch.library.opcheck(op, (*grads[:3], True, None, True, False, 0.0, 2, None, grads[3]))
    torch.library.opcheck(op, (*grads[:3], False, 0.3, False, None, 0.0, None, None, grads[3]))
    out, lse = op(*grads[:3], True, None, True, False, 0.0, 2, None, grads[3])
    dout = torch.randn(out.shape, generator=gen)
    got = torch.autograd.grad(out, grads, dout)
    want = _reference_grads((q, k, v, sink), dout, causal=True, window_size=(2, None))
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-6)
    backward_op = torch.ops.fa4lab.attention_backward.default
    dlse = torch.randn(lse.shape, generator=gen)
    for d in (lse.new_empty((0,)), dlse):      # the lse's gradient, empty: not read
        torch.library.opcheck(backward_op, (dout, d, q, k, v, out.detach(), lse.detach(), True,
                                            None, 0.0, 2, None, sink, None))


def test_lse_is_empty_when_not_asked_for_through_the_op(gen):
    q, k, v = _qkv(gen)
    out, lse = torch.ops.fa4lab.attention_forward(q, k, v, True, None, False, False, 0.0)
    assert lse.numel() == 0 and out.shape == q.shape
    out2, lse2 = torch.ops.fa4lab.attention_forward(q, k, v, True, None, True, False, 0.0)
    ref, ref_lse = attention_reference(q, k, v, causal=True, return_lse=True)
    torch.testing.assert_close(lse2.double(), ref_lse, atol=1e-5, rtol=0)
    torch.testing.assert_close(out, out2)
    got = fa4lab.attention(q.clone().requires_grad_(), k, v, causal=True)
    assert isinstance(got, torch.Tensor)    # the lse computed for the backward stays inside
    torch.testing.assert_close(got, out)


def test_a_compiled_call_with_an_input_that_requires_grad_differentiates():
    """On CPU tensors torch.compile(fullgraph=True) of a call whose q requires grad gives the
    eager gradient: AOTAutograd traces the op's autograd formula and its backward op through
    their fakes (Note [the backward ops] in fa4lab.backward)."""
    import warnings

    torch._dynamo.reset()
    q = torch.randn(1, 16, 2, 64, requires_grad=True)
    k, v = torch.randn(1, 16, 2, 64), torch.randn(1, 16, 2, 64)
    f = torch.compile(lambda q, k, v: fa4lab.attention(q, k, v, causal=True), fullgraph=True,
                      backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (compiled,) = torch.autograd.grad(f(q, k, v).sum(), q)
        (eager,) = torch.autograd.grad(fa4lab.attention(q, k, v, causal=True).sum(), q)
        torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
        with torch.no_grad():
            assert f(q, k, v).shape == (1, 16, 2, 64)


def test_the_backward_op_returns_what_its_fake_says_for_strided_inputs():
    """The backward op's gradients are contiguous whatever the strides of q, k, v (views of
    (batch, heads, seqlen, d) tensors here), and its fake says so: under torch.compile the
    graph asserts the real op's strides against the fake's (a GPU run found a transposed dq)."""
    base = [torch.randn(1, 2, 16, 64) for _ in range(3)]
    q, k, v = (t.transpose(1, 2) for t in base)
    dout = torch.randn(1, 16, 2, 64)
    out, lse = torch.ops.fa4lab.attention_forward(q, k, v, True, None, True, False, 0.0)
    args = (dout, torch.empty(0), q, k, v, out, lse, True, None, 0.0, None, None, None, None)
    torch.library.opcheck(torch.ops.fa4lab.attention_backward.default, args,
                          test_utils=("test_faketensor",))
    for g, like in zip(torch.ops.fa4lab.attention_backward(*args)[:3], (q, k, v)):
        assert g.shape == like.shape and g.is_contiguous()


def test_deterministic_reaches_the_backward_op():
    """`fa4lab.attention(..., deterministic=True)` with inputs that require grad passes the
    switch through the forward op to its backward op (the GPU kernel's dQ order reads it; the
    CPU reference is deterministic either way): the gradients equal the default call's, eager
    and compiled, and both ops' schemas end with it (tests/test_backward_sm90_gpu.py holds the
    GPU's gradients bit for bit)."""
    import warnings
    from unittest import mock

    from fa4lab import backward

    torch._dynamo.reset()
    q = torch.randn(1, 24, 2, 32, requires_grad=True)
    k, v = torch.randn(1, 24, 2, 32), torch.randn(1, 24, 2, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (plain,) = torch.autograd.grad(fa4lab.attention(q, k, v, causal=True).sum(), q)
        with mock.patch.object(backward, "cuda_backward") as gpu:
            (det,) = torch.autograd.grad(
                fa4lab.attention(q, k, v, causal=True, deterministic=True).sum(), q)
        assert not gpu.called
        f = torch.compile(lambda q: fa4lab.attention(q, k, v, causal=True, deterministic=True),
                          fullgraph=True, backend="aot_eager")
        (compiled,) = torch.autograd.grad(f(q).sum(), q)
    torch.testing.assert_close(det, plain, rtol=0, atol=0)
    torch.testing.assert_close(compiled, plain, rtol=0, atol=0)
    schema = torch.ops.fa4lab.attention_backward.default._schema
    assert schema.arguments[-1].name == "deterministic"
    assert [a.name for a in schema.arguments[5:7]] == ["out", "lse"]   # what the forward saved
    assert torch.ops.fa4lab.attention_forward.default._schema.arguments[-1].name \
        == "deterministic"
