"""`fa4lab.attention_varlen` as a torch op (Note [the varlen op] in fa4lab.api.varlen): opcheck on
packed and paged batches, torch.compile(fullgraph=True) of a packed-sequence block against the
float64 reference, one graph for every batch under dynamic shapes, fake tensors, bad lengths
raising from inside a compiled graph, gradients on CPU tensors (the float64 reference's) and no
silent gradient loss on CUDA ones. On CPU the op computes the float64 reference;
tests/test_attention_op_gpu.py runs the kernels through it on a GPU."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import fa4lab  # noqa: E402
from fa4lab.api import GradientNotSupportedError  # noqa: E402
from fa4lab.errors import InputError  # noqa: E402
from fa4lab.reference import attention_reference, attention_varlen_reference  # noqa: E402

OP = torch.ops.fa4lab.attention_varlen_forward.default


@pytest.fixture(autouse=True)
def _quiet(quiet_reference):
    yield


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _packed(gen, lens_q, lens_k, hq=4, hkv=2, d=16):
    def r(*shape):
        return torch.randn(*shape, generator=gen)

    return (r(sum(lens_q), hq, d), r(sum(lens_k), hkv, d), r(sum(lens_k), hkv, d),
            _cu(lens_q), _cu(lens_k))


def _paged(gen, lens_q, used, page_size=4, pages_per_seq=3, hq=4, hkv=2, d=16):
    """A paged cache whose pages are a random permutation, one page read by two sequences."""
    batch = len(lens_q)
    num_pages = batch * pages_per_seq
    table = torch.randperm(num_pages, generator=gen).to(torch.int32).view(batch, pages_per_seq)
    table[-1, 0] = table[0, 0]
    cache = torch.randn(2, num_pages, page_size, hkv, d, generator=gen)
    return (torch.randn(sum(lens_q), hq, d, generator=gen), cache[0], cache[1], _cu(lens_q),
            table, torch.tensor(used, dtype=torch.int32))


def _args(q, k, v, cu_q, cu_k, *, max_q=None, max_k=None, used=None, table=None, causal=False,
          scale=None, left=None, right=None, softcap=0.0, sink=None, lse=True, check="device"):
    return (q, k, v, cu_q, cu_k, max_q, max_k, used, table, causal, scale, left, right, softcap,
            sink, lse, check)


def test_opcheck_packed_and_paged(gen):
    """Schema, fake implementation, autograd registration and AOT dispatch of the op, with an
    empty sequence, a length-1 one, seqlen_q > seqlen_k, a window, softcap, a sink and pages
    in random order."""
    q, k, v, cu_q, cu_k = _packed(gen, [5, 0, 1, 9], [7, 3, 1, 4])
    torch.library.opcheck(OP, _args(q, k, v, cu_q, cu_k, causal=True))
    torch.library.opcheck(OP, _args(q, k, v, cu_q, cu_k, max_q=9, max_k=7, scale=0.3,
                                    lse=False))
    torch.library.opcheck(OP, _args(q, k, v, cu_q, cu_k, left=3, right=2, softcap=5.0,
                                    sink=torch.randn(4, generator=gen)))
    q, k, v, cu_q, table, used = _paged(gen, [2, 1, 4], [9, 1, 12])
    torch.library.opcheck(OP, _args(q, k, v, cu_q, None, used=used, table=table, causal=True))


def test_the_op_matches_the_reference(gen):
    q, k, v, cu_q, cu_k = _packed(gen, [6, 1, 0, 11], [6, 8, 2, 3])
    out, lse = OP(*_args(q, k, v, cu_q, cu_k, causal=True))
    ref, ref_lse = attention_varlen_reference(q, k, v, cu_q, cu_k, causal=True,
                                              return_lse=True)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=0)
    out, lse = OP(*_args(q, k, v, cu_q, cu_k, causal=True, lse=False))
    assert lse.numel() == 0
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


class PackedBlock(torch.nn.Module):
    """Projections, causal attention per packed sequence, an output projection: the shape of a
    packed-sequence (document-masked) transformer layer."""

    def __init__(self, hidden=32, heads=4, kv_heads=2, head_dim=8):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.wq = torch.nn.Linear(hidden, heads * head_dim, bias=False)
        self.wkv = torch.nn.Linear(hidden, 2 * kv_heads * head_dim, bias=False)
        self.wo = torch.nn.Linear(heads * head_dim, hidden, bias=False)

    def qkv(self, x):
        q = self.wq(x).view(-1, self.heads, self.head_dim)
        k, v = self.wkv(x).view(-1, 2, self.kv_heads, self.head_dim).unbind(1)
        return q, k, v

    def forward(self, x, cu_seqlens, max_seqlen):
        q, k, v = self.qkv(x)
        out = fa4lab.attention_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                      causal=True)
        return x + self.wo(out.reshape(x.shape[0], -1))


def _block_and_batch(gen, lengths):
    torch.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
    block = PackedBlock().eval()
    return block, torch.randn(sum(lengths), 32, generator=gen), _cu(lengths), max(lengths)


def _reference_block(block, x, cu):
    q, k, v = block.qkv(x)
    attn = attention_varlen_reference(q, k, v, cu, cu, causal=True)
    return x.double() + torch.nn.functional.linear(attn.reshape(x.shape[0], -1),
                                                  block.wo.weight.double())


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_matches_the_reference(gen, backend):
    block, x, cu, max_len = _block_and_batch(gen, [7, 1, 0, 12])
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend=backend, dynamic=False)
    with torch.no_grad():
        out = compiled(x, cu, max_len)
        ref = _reference_block(block, x, cu)
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_dynamic_shapes_compile_one_graph_for_every_batch(gen):
    """Under dynamic shapes a new packed total, batch or max_seqlen is not a new graph: the
    fake implementation reads shapes only (Note [the varlen op])."""
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    block, _, _, _ = _block_and_batch(gen, [1])
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend=counting_backend, dynamic=True)
    with torch.no_grad():
        for lengths in ([5, 9], [3, 1, 12, 6], [17, 2, 4]):
            _, x, cu, max_len = _block_and_batch(gen, lengths)
            out = compiled(x, cu, max_len)
            torch.testing.assert_close(out.double(), _reference_block(block, x, cu),
                                       atol=1e-4, rtol=1e-4)
    assert len(graphs) == 1, f"{len(graphs)} graphs for three batches"


@pytest.mark.slow
def test_bad_lengths_raise_from_a_compiled_graph(gen):
    """The value check runs when the graph runs: a decreasing cu_seqlens is an InputError, not
    a wrong answer."""
    block, x, _, _ = _block_and_batch(gen, [4, 4])
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager", dynamic=False)
    with torch.no_grad(), pytest.raises(InputError, match="decreases at index 2"):
        compiled(x, torch.tensor([0, 6, 2, 8], dtype=torch.int32), 6)


def test_fake_tensors_give_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(30, 8, 64, dtype=torch.bfloat16)
        k = torch.empty(50, 2, 64, dtype=torch.bfloat16)
        v = torch.empty(50, 2, 32, dtype=torch.bfloat16)
        cu_q, cu_k = (torch.empty(4, dtype=torch.int32) for _ in range(2))
        out, lse = fa4lab.attention_varlen(q, k, v, cu_q, cu_k, 20, 30, causal=True,
                                           return_lse=True)
        assert out.shape == (30, 8, 32) and out.dtype == torch.bfloat16
        assert lse.shape == (8, 30) and lse.dtype == torch.float32
        cache = torch.empty(12, 16, 2, 64, dtype=torch.bfloat16)
        table = torch.empty(3, 4, dtype=torch.int32)
        out = fa4lab.attention_varlen(q, cache, cache, cu_q, None, 20, 64, page_table=table)
        assert out.shape == (30, 8, 64)
        with pytest.raises(ValueError, match="heads_q=8 is not a multiple"):
            fa4lab.attention_varlen(q, torch.empty(50, 3, 64, dtype=torch.bfloat16),
                                    torch.empty(50, 3, 64, dtype=torch.bfloat16), cu_q, cu_k,
                                    None, None)


def _reference_grads(inputs, cu_q, cu_k, dout, dlse, **options):
    """Autograd of the float64 varlen reference at float64 copies of (q, k, v, sink)."""
    leaves = [x.detach().double().requires_grad_() for x in inputs]
    out, lse = attention_varlen_reference(*leaves[:3], cu_q, cu_k, learnable_sink=leaves[3],
                                          return_lse=True, **options)
    loss = (out * dout.double()).sum() + (lse * dlse.double()).sum()
    return torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("paged", [False, True])
def test_cpu_inputs_that_require_grad_get_the_references_gradients(gen, paged):
    """Note [backward on CPU, not yet on the GPU] in fa4lab.backward: packed sequences (one
    empty) or a paged cache (a page read by two sequences), causal, a window and a sink; the
    gradients of q, k, v (or the cache) and the sink are the float64 reference's."""
    if paged:
        q, k, v, cu_q, table, used = _paged(gen, [3, 1, 4], [7, 12, 5])
        cu_k, extra = None, dict(seqused_k=used, page_table=table)
    else:
        q, k, v, cu_q, cu_k = _packed(gen, [3, 0, 5], [4, 2, 6])
        extra = {}
    sink = torch.randn(4, generator=gen)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, sink)]
    options = dict(causal=True, window_size=(3, None), **extra)
    out, lse = fa4lab.attention_varlen(*leaves[:3], cu_q, cu_k, learnable_sink=leaves[3],
                                       return_lse=True, **options)
    dout, dlse = torch.randn(out.shape, generator=gen), torch.randn(lse.shape, generator=gen)
    got = torch.autograd.grad((out * dout).sum() + (lse * dlse).sum(), leaves)
    want = _reference_grads((q, k, v, sink), cu_q, cu_k, dout, dlse, **options)
    for g, w, x in zip(got, want, (q, k, v, sink)):
        assert g.dtype == x.dtype and g.shape == x.shape
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5)


def test_the_dense_form_is_differentiated(gen):
    """Upstream's dense q (cu_seqlens_q None) and seqused_q go through the same op: the rows
    past seqused_q come back 0 and get no gradient."""
    q = torch.randn(2, 5, 4, 16, generator=gen, requires_grad=True)
    k = torch.randn(2, 6, 2, 16, generator=gen, requires_grad=True)
    v = torch.randn(2, 6, 2, 16, generator=gen, requires_grad=True)
    seqused_q = torch.tensor([5, 2], dtype=torch.int32)
    out = fa4lab.attention_varlen(q, k, v, causal=True, seqused_q=seqused_q)
    dout = torch.randn(out.shape, generator=gen)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert (dq[1, 2:] == 0).all() and (dq[1, :2] != 0).all()
    ref = attention_reference(q[1:, :2], k[1:], v[1:], causal=True)
    want = torch.autograd.grad(ref, (q, k, v), dout[1:, :2].double())
    torch.testing.assert_close(dq[1, :2], want[0][1, :2], rtol=1e-5, atol=1e-5)
    ref0 = attention_reference(q[:1], k[:1], v[:1], causal=True)
    want0 = torch.autograd.grad(ref0, (k,), dout[:1].double())[0]
    torch.testing.assert_close(dk, want0 + want[1], rtol=1e-5, atol=1e-5)


def test_cuda_inputs_that_require_grad_raise_before_launch(gen):
    """Fake CUDA tensors (no GPU needed): `attention_varlen` raises, as does the op's autograd
    setup (what a direct call of the op runs first)."""
    from types import SimpleNamespace

    from torch._subclasses.fake_tensor import FakeTensorMode

    from fa4lab.backward import save_attention_varlen

    with FakeTensorMode():
        q, k = torch.empty(8, 4, 16, device="cuda"), torch.empty(10, 2, 16, device="cuda")
        v = torch.empty_like(k)
        cu_q, cu_k = (torch.empty(3, dtype=torch.int32, device="cuda") for _ in range(2))
        for which in range(3):
            args = [q, k, v]
            args[which] = args[which].clone().requires_grad_()
            with pytest.raises(GradientNotSupportedError, match="attention_varlen.*torch.no_grad"):
                fa4lab.attention_varlen(*args, cu_q, cu_k, None, None)
        with pytest.raises(GradientNotSupportedError, match="no backward kernel on the GPU"):
            save_attention_varlen(SimpleNamespace(), (*_args(q.clone().requires_grad_(), k,
                                                             v, cu_q, cu_k), None, None), (q, q))


def test_the_op_itself_records_its_gradient(gen):
    """opcheck of the op with inputs that require grad, and of its backward op."""
    q, k, v, cu_q, cu_k = _packed(gen, [3, 0, 5], [4, 2, 6])
    sink = torch.randn(4, generator=gen)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, sink)]
    torch.library.opcheck(OP, _args(*leaves[:3], cu_q, cu_k, causal=True, sink=leaves[3]))
    out, lse = OP(*_args(q, k, v, cu_q, cu_k, causal=True, sink=sink))
    torch.library.opcheck(torch.ops.fa4lab.attention_varlen_backward.default,
                          (torch.randn(out.shape, generator=gen), torch.randn(lse.shape),
                           q, k, v, cu_q, cu_k, None, None, True, None, 0.0, None, None, sink))


def test_the_slow_reference_warning_names_the_callers_line(gen):
    from fa4lab.api import SlowReferenceWarning

    q, k, v, cu_q, cu_k = _packed(gen, [3, 5], [4, 6])
    with pytest.warns(SlowReferenceWarning, match="attention_varlen") as caught:
        fa4lab.attention_varlen(q, k, v, cu_q, cu_k, None, None)
    assert caught[0].filename == __file__
