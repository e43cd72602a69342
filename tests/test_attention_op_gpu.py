"""`fa4lab.attention` and `fa4lab.attention_varlen` in model code on a GPU with a kernel (marker
`gpu`): torch.compile with fullgraph and CUDA graphs, opcheck on CUDA tensors, and the disk
cache across processes."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from test_attention_op import LlamaBlock, _sdpa_causal  # noqa: E402
from test_attention_varlen_op import PackedBlock, _cu, _reference_block  # noqa: E402

import fa4lab  # noqa: E402
from fa4lab.environment import gpu  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_a_kernel():
    g = gpu()
    if g is not None and g.arch is None:
        pytest.skip(f"fa4lab has no kernel for {g.name} (compute capability {g.capability})")


def _block(seed, hidden=1024, heads=8, kv_heads=2, head_dim=128):
    torch.manual_seed(seed)
    return LlamaBlock(hidden, heads, kv_heads, head_dim).cuda().to(torch.bfloat16).eval()


def test_compile_fullgraph_matches_eager_and_sdpa():
    block = _block(1)
    x = torch.randn(2, 300, 1024, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(block, fullgraph=True)
    with torch.no_grad():
        eager = block(x)
        out = compiled(x)
        block.attn = _sdpa_causal
        sdpa = block(x)
    # Same kernel, same inputs: the graph changes only the ops around it (inductor may fuse
    # the projections differently, so not bit for bit).
    torch.testing.assert_close(out, eager, atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(eager, sdpa, atol=3e-2, rtol=2e-2)


def test_cuda_graph_capture_and_replay():
    q = torch.randn(2, 500, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 700, 2, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    fa4lab.attention(q, k, v, causal=True)            # compile (or load) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fa4lab.attention(q, k, v, causal=True)
    for _ in range(2):
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fa4lab.attention(q, k, v, causal=True))


def test_compile_reduce_overhead_mode():
    block = _block(2, hidden=512, heads=4, kv_heads=4, head_dim=128)
    compiled = torch.compile(block, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for _ in range(3):       # warm-up, record, replay
            x = torch.randn(1, 256, 512, device="cuda", dtype=torch.bfloat16)
            out = compiled(x).clone()
            torch.testing.assert_close(out, block(x), atol=3e-2, rtol=2e-2)


def test_opcheck_on_cuda():
    q = torch.randn(1, 70, 4, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 90, 2, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    op = torch.ops.fa4lab.attention_forward.default
    torch.library.opcheck(op, (q, k, v, True, None, True, False, 0.0))
    torch.library.opcheck(op, (q, k, v, False, 0.2, False, None, 3.0))
    sink = torch.randn(4, device="cuda")
    torch.library.opcheck(op, (q, k, v, False, None, True, None, 0.0, 16, 4, sink))  # window


def test_requires_grad_raises_on_the_gpu_too():
    """Where no backward kernel runs the call (Note [backward on CPU, not yet on the GPU] in
    fa4lab.backward; on Hopper the kernel builds no paged K/V cache yet: Note [the backward on
    the GPU]): the eager call, the op called directly (its autograd setup) and a compiled call
    raise GradientNotSupportedError (under torch.compile in the error's chain and text)."""
    import warnings

    from fa4lab.api import GradientNotSupportedError

    q = torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = q.detach()                 # also one page of 64 keys per sequence
    table = torch.zeros((1, 1), dtype=torch.int32, device="cuda")
    with pytest.raises(GradientNotSupportedError, match="no backward kernel on the GPU"):
        fa4lab.attention(q, k, k, page_table=table)
    with pytest.raises(GradientNotSupportedError):
        torch.ops.fa4lab.attention_forward(q, k, k, False, None, False, False, 0.0, None, None,
                                           None, None, table)
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v: fa4lab.attention(q, k, v, page_table=table),
                      fullgraph=True, backend="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(Exception) as err:
            f(q, k, k)
    chain, e = [], err.value
    while e is not None:
        chain.append(e)
        e = e.__cause__ or e.__context__
    assert any(isinstance(x, GradientNotSupportedError) for x in chain)
    assert "no backward kernel on the GPU" in str(err.value)


def test_a_second_process_loads_the_kernel_from_disk():
    from fa4lab.bench.host_overhead import first_calls_in_new_processes, format_first_calls

    first, second = first_calls_in_new_processes()
    assert first["compiled"] == 1 and first["loaded"] == 0
    assert second["compiled"] == 0 and second["loaded"] == 1, second
    assert not second["dsl_imported"], "loading a cached kernel should not need the CuTe DSL"
    assert second["checksum"] == first["checksum"]     # the same kernel on the same inputs
    print(format_first_calls([first, second]))


def _packed_cuda(lengths, heads_q=8, heads_kv=2, d=128, seed=3):
    g = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lengths)

    def r(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)

    return r(total, heads_q, d), r(total, heads_kv, d), r(total, heads_kv, d), \
        _cu(lengths).cuda()


def test_varlen_compile_fullgraph_matches_eager_and_the_reference():
    torch.manual_seed(4)
    block = PackedBlock(hidden=256, heads=8, kv_heads=2, head_dim=64).cuda().eval()
    block = block.to(torch.bfloat16)
    lengths = [300, 1, 0, 129, 640]
    x = torch.randn(sum(lengths), 256, device="cuda", dtype=torch.bfloat16)
    cu = _cu(lengths).cuda()
    compiled = torch.compile(block, fullgraph=True)
    with torch.no_grad():
        eager = block(x, cu, max(lengths))
        out = compiled(x, cu, max(lengths))
        ref = _reference_block(block, x, cu)
    torch.testing.assert_close(out, eager, atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(eager.double(), ref, atol=3e-2, rtol=2e-2)


def test_varlen_cuda_graph_capture_and_replay():
    """The capture skips the value check (Note [reading the lengths]); replays on new data
    give the eager answer bit for bit."""
    lengths = [500, 0, 1, 257]
    q, k, v, cu = _packed_cuda(lengths)

    def call():
        return fa4lab.attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths),
                                       causal=True)

    call()                           # compile (or load) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for _ in range(2):
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, call())


def test_varlen_opcheck_on_cuda():
    lengths = [70, 0, 1, 33]
    q, k, v, cu = _packed_cuda(lengths, heads_q=4, d=64)
    op = torch.ops.fa4lab.attention_varlen_forward.default
    torch.library.opcheck(op, (q, k, v, cu, cu, None, None, None, None, True, None, None, None,
                               0.0, None, True, "sync"))
    torch.library.opcheck(op, (q, k, v, cu, cu, 70, 70, None, None, False, 0.2, 16, 4, 3.0,
                               torch.randn(4, device="cuda"), False, "off"))
