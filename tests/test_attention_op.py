"""`fa4lab.attention` as a torch op: opcheck, torch.compile(fullgraph=True) of a Llama-style
block, fake tensors, and no silent gradient loss. On CPU the op computes the float64 reference
(the kernels need a GPU); tests/test_attention_op_gpu.py runs the same checks on a GPU."""

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


def test_inputs_that_require_grad_raise_before_launch(gen):
    q, k, v = _qkv(gen)
    for which in range(3):
        args = [q, k, v]
        args[which] = args[which].clone().requires_grad_()
        with pytest.raises(GradientNotSupportedError,
                           match="scaled_dot_product_attention.*torch.no_grad"):
            fa4lab.attention(*args)
        with torch.no_grad():  # inference: fine, and the answer is right
            out = fa4lab.attention(*args, causal=True)
        torch.testing.assert_close(out.double(), attention_reference(q, k, v, causal=True))


def test_a_training_block_raises_instead_of_dropping_gradients(gen):
    block = LlamaBlock().train()
    x = torch.randn(2, 9, 64, generator=gen)
    with pytest.raises(GradientNotSupportedError):
        block(x)


def test_the_op_itself_never_drops_a_gradient(gen):
    """Called directly (no wrapper check), the op raises at the call when an input requires
    grad (its autograd's setup, Note [no backward yet]); without grad mode it runs."""
    q, k, v = _qkv(gen)
    q.requires_grad_()
    with pytest.raises(GradientNotSupportedError):
        torch.ops.fa4lab.attention_forward(q, k, v, False, None, False, False, 0.0)
    with torch.no_grad():
        out, _ = torch.ops.fa4lab.attention_forward(q, k, v, False, None, False, False, 0.0)
    assert not out.requires_grad


def test_lse_is_empty_when_not_asked_for_through_the_op(gen):
    q, k, v = _qkv(gen)
    out, lse = torch.ops.fa4lab.attention_forward(q, k, v, True, None, False, False, 0.0)
    assert lse.numel() == 0 and out.shape == q.shape
    out2, lse2 = torch.ops.fa4lab.attention_forward(q, k, v, True, None, True, False, 0.0)
    ref, ref_lse = attention_reference(q, k, v, causal=True, return_lse=True)
    torch.testing.assert_close(lse2.double(), ref_lse, atol=1e-5, rtol=0)
    torch.testing.assert_close(out, out2)


def test_a_compiled_call_with_an_input_that_requires_grad_says_why():
    """Note [no backward yet]: under torch.compile(fullgraph=True) the error carries fa4lab's
    GradientNotSupportedError (in its chain and its text, not buried in a debug context); under
    no_grad the same compiled function runs."""
    import warnings

    import fa4lab
    from fa4lab.api import GradientNotSupportedError

    torch._dynamo.reset()
    q = torch.randn(1, 16, 2, 64, requires_grad=True)
    k, v = torch.randn(1, 16, 2, 64), torch.randn(1, 16, 2, 64)
    f = torch.compile(lambda q, k, v: fa4lab.attention(q, k, v), fullgraph=True,
                      backend="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(Exception) as err:
            f(q, k, v)
        chain, e = [], err.value
        while e is not None:
            chain.append(e)
            e = e.__cause__ or e.__context__
        assert any(isinstance(x, GradientNotSupportedError) for x in chain)
        assert "fa4lab.attention has no backward pass yet" in str(err.value)
        with torch.no_grad():
            assert f(q, k, v).shape == (1, 16, 2, 64)
