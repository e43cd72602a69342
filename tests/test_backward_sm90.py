"""The sm90 backward kernel on a CPU: its host side (keys, argument checks, refusals), the
autograd path on a faked Hopper GPU (one forward launch per training step: the backward reads
the forward's saved out and lse), the query block range its loop walks, and (marker `compile`)
every configuration it claims compiled for sm_90a with fake tensors, without local-memory
spills. The GPU's numbers are tests/test_backward_sm90_gpu.py's."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from fa4lab import tiling  # noqa: E402
from fa4lab.call import check_call  # noqa: E402
from fa4lab.errors import InputTypeError  # noqa: E402
from fa4lab.kernels.launch_backward import check_backward, unbuilt  # noqa: E402
from fa4lab.plan.key import BackwardKey  # noqa: E402
from fa4lab.reference import visible_mask  # noqa: E402
from fa4lab.spec import effective_window  # noqa: E402

_SIDE = st.one_of(st.none(), st.integers(-40, 400))


@given(sq=st.integers(1, 400), sk=st.integers(1, 400), m=st.sampled_from([16, 64]),
       n=st.sampled_from([16, 64, 128]), causal=st.booleans(), left=_SIDE, right=_SIDE,
       data=st.data())
@settings(max_examples=150, deadline=None)
def test_query_block_range_is_the_blocks_with_a_visible_key(sq, sk, m, n, causal, left, right,
                                                            data):
    """`fa4lab.tiling.query_block_range` is exactly the query blocks with a visible key in the
    key block (the backward's loop and its deterministic turns both read it)."""
    left, right = effective_window(causal, (left, None if causal else right))
    j = data.draw(st.integers(0, tiling.num_n_blocks(sk, n) - 1))
    vis = visible_mask(sq, sk, False, window_size=(left, right))[:, j * n:(j + 1) * n]
    rows = [i for i in range(tiling.num_m_blocks(sq, m)) if vis[i * m:(i + 1) * m].any()]
    want = (rows[0], rows[-1] + 1) if rows else (0, 0)
    assert tiling.query_block_range(j, n, m, sq, sk, left, right) == want
    assert rows == list(range(*want))


def test_keys_name_what_they_bake_in():
    """The key comes from the checked call (`Call.backward_key`): the window normalised, the
    GQA ratio and the dtype as check_call made them."""
    q = torch.empty(2, 10, 6, 128, dtype=torch.bfloat16)
    k = torch.empty(2, 12, 2, 128, dtype=torch.bfloat16)
    call = check_call(q, k, k, causal=True, softcap=30.0, window_size=(64, None))
    key = call.backward_key("sm90", deterministic=True)
    assert key == BackwardKey(128, 128, "bf16", True, 3, True, (True, False), True)
    assert key.name == "bwd-sm90a-hd128x128-bf16-causal-g3-softcap-windowl-det"
    assert check_call(q, k, k).backward_key("sm90").name == "bwd-sm90a-hd128x128-bf16-g3"
    assert check_call(q, k, k, window_size=(3, 3)).backward_key().window == (True, True)
    assert check_call(q.half(), k.half(), k.half()).backward_key().dtype == "fp16"
    with pytest.raises(ValueError, match="builds"):
        BackwardKey(80, 80, "bf16", False, 1)
    gqa = BackwardKey(64, 64, "bf16", False, 2, arch="sm100")     # GQA: one plan per ratio
    assert gqa.plan().spec.qhead_per_kvhead == 2 and gqa.name == "bwd-sm100a-hd64x64-bf16-g2"
    with pytest.raises(ValueError, match="softcap in the sm100 backward kernel"):
        BackwardKey(64, 64, "bf16", False, 2, softcap=True, arch="sm100")


def test_unbuilt_names_what_the_kernel_does_not_build():
    q = torch.empty(1, 8, 2, 64, dtype=torch.bfloat16)
    call = check_call(q, q, q)
    assert unbuilt(call, "sm90") is None
    assert unbuilt(call, "sm90", deterministic=True) is None
    assert "Hopper" in unbuilt(call, "sm100")
    assert "this GPU" in unbuilt(call, None)
    mods = check_call(q, q, q, score_mod=lambda s, b, h, i, j: s)
    assert "score_mod" in unbuilt(mods, "sm90")
    from fa4lab.varlen import check_varlen

    packed = q[0]
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    lengths = check_varlen(packed, packed, packed, cu, cu, 5, 5)
    assert "variable-length" in unbuilt(check_call(packed, packed, packed, lengths=lengths),
                                        "sm90")
    cache = torch.empty(2, 16, 2, 64, dtype=torch.bfloat16)
    table = torch.tensor([[1]], dtype=torch.int32)
    assert "paged" in unbuilt(check_call(q, cache, cache, page_table=table), "sm90")
    odd = torch.empty(1, 8, 2, 80, dtype=torch.bfloat16)
    assert "head dims (80, 80)" in unbuilt(check_call(odd, odd, odd), "sm90")


def test_the_kernel_dtype_is_the_call_check_s():
    """A float32 call reaches no backward key: `Call.for_kernel` (check_call with arch, the one
    kernel-form check the backward's calls pass) refuses it, naming the dtypes."""
    f32 = torch.empty(1, 8, 2, 64)
    with pytest.raises(InputTypeError, match="bfloat16 or float16"):
        check_call(f32, f32, f32, arch="sm90")


def test_check_backward_names_the_tensor_that_does_not_fit():
    q = torch.empty(1, 8, 4, 64, dtype=torch.bfloat16)
    k = torch.empty(1, 9, 2, 64, dtype=torch.bfloat16)
    out = torch.empty(1, 8, 4, 64, dtype=torch.bfloat16)
    lse = torch.empty(1, 4, 8)
    call = check_call(q, k, k)
    check_backward(call, out, out, lse)
    with pytest.raises(ValueError, match="dout has shape"):
        check_backward(call, out, out[:, :4], lse)
    with pytest.raises(ValueError, match="out has shape"):
        check_backward(call, out[..., :32], out, lse)
    with pytest.raises(ValueError, match="lse has shape"):
        check_backward(call, out, out, lse[..., :4])
    with pytest.raises(ValueError, match="dlse has shape"):
        check_backward(call, out, out, lse, lse[:, :2])
    with pytest.raises(ValueError, match="not a multiple"):     # the call's check, once
        check_call(q, torch.empty(1, 9, 3, 64, dtype=torch.bfloat16),
                   torch.empty(1, 9, 3, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="one dtype"):
        check_backward(call, out, out.half(), lse)


def test_cuda_gradients_where_no_kernel_runs_name_what_is_missing():
    """Fake CUDA tensors on a machine without a GPU: the op's autograd setup refuses, and the
    backward op itself too, saying the GPU has no backward kernel."""
    from types import SimpleNamespace

    from torch._subclasses.fake_tensor import FakeTensorMode

    from fa4lab.backward import save_attention
    from fa4lab.errors import GradientNotSupportedError

    with FakeTensorMode():
        q = torch.empty(1, 16, 2, 64, device="cuda", requires_grad=True)
        k = torch.empty(1, 16, 2, 64, device="cuda")
        with torch.no_grad(), pytest.raises(GradientNotSupportedError,
                                            match="no backward kernel on the GPU yet"):
            save_attention(SimpleNamespace(), (q, k, k, False, None, False, False, 0.0, None,
                                               None, None, None, None, False), (q, q))


@pytest.fixture
def faked_sm90(monkeypatch):
    """CPU tensors dressed as a Hopper GPU's (`is_cuda`, the device's arch), its two kernels
    replaced by recorders over the float64 reference: the forward's launch
    (`fa4lab.kernels.launch.forward`, what the forward op and the old recomputing backward
    called) and the backward's (`launch_backward.backward`, which checks what it is given as
    the kernel's does). `seen.forwards` holds each forward's (call, out, lse),
    `seen.backwards` what each backward read."""
    from types import SimpleNamespace

    from fa4lab import backward as autograd
    from fa4lab.kernels import launch, launch_backward
    from fa4lab.reference import attention_reference
    from fa4lab.reference_backward import attention_backward_reference

    seen = SimpleNamespace(forwards=[], backwards=[])

    def forward(call, arch):
        with torch.no_grad():
            out, lse = attention_reference(call.q.detach(), call.k.detach(), call.v.detach(),
                                           return_lse=True, finite=False, **call.options())
        out, lse = out.to(call.q.dtype), (lse.float() if call.spec.return_lse else None)
        seen.forwards.append((call, out, lse))
        return out, lse

    def backward(call, out, dout, lse, *, dlse=None, deterministic=False, arch="sm90"):
        check_backward(call, out, dout, lse, dlse)
        call.backward_key(arch, deterministic)
        seen.backwards.append(dict(out=out, lse=lse, dlse=dlse, deterministic=deterministic))
        q, k, v = call.q, call.k, call.v
        g = attention_backward_reference(q, k, v, dout, dlse=dlse, finite=False,
                                         **call.options())
        sink = call.sink
        return (g.dq.to(q.dtype), g.dk.to(k.dtype), g.dv.to(v.dtype),
                None if sink is None else g.dsink.to(sink.dtype))

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(launch, "device_arch", lambda index: "sm90")
    monkeypatch.setattr(launch, "forward", forward)
    monkeypatch.setattr(autograd, "_kernel_arch", lambda t: "sm90")
    monkeypatch.setattr(launch_backward, "backward", backward)
    return seen


def _bf16_inputs(gen):
    def r(*shape):
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    return r(2, 9, 4, 64), r(2, 13, 2, 64), r(2, 13, 2, 64), torch.randn(4, generator=gen)


@pytest.mark.parametrize("return_lse", [False, True])
def test_a_training_step_launches_the_forward_once(faked_sm90, gen, return_lse):
    """Note [the backward on the GPU] in fa4lab.backward, on a faked Hopper GPU: a forward
    and a backward of `fa4lab.attention` launch the forward kernel once (the backward once
    recomputed out and lse with a second launch), and the backward kernel reads the forward's
    own out and lse (the same tensors: the lse returned with return_lse=True is the saved one,
    its gradient dlse reaching the kernel), with `deterministic`; the gradients are the
    reference's."""
    import fa4lab
    from fa4lab.reference_backward import attention_backward_reference

    q, k, v, sink = _bf16_inputs(gen)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, sink)]
    got = fa4lab.attention(*leaves[:3], causal=True, window_size=(5, None),
                           learnable_sink=leaves[3], return_lse=return_lse, deterministic=True)
    out, lse = got if return_lse else (got, None)
    (call, fwd_out, fwd_lse), = faked_sm90.forwards
    assert call.spec.return_lse, "inputs that require grad: the forward computes the lse"
    dout = torch.randn(out.shape, generator=gen).to(out.dtype)
    dlse = torch.randn(fwd_lse.shape, generator=gen) if return_lse else None
    loss = (out.float() * dout.float()).sum()
    if return_lse:
        loss = loss + (lse * dlse).sum()
    grads = torch.autograd.grad(loss, leaves)
    assert len(faked_sm90.forwards) == 1, "the backward launched the forward again"
    (read,) = faked_sm90.backwards
    assert read["out"].data_ptr() == fwd_out.data_ptr() == out.data_ptr()
    assert read["lse"].data_ptr() == fwd_lse.data_ptr()
    assert torch.equal(read["lse"], fwd_lse) and read["deterministic"] is True
    if return_lse:
        assert lse.data_ptr() == fwd_lse.data_ptr()
        torch.testing.assert_close(read["dlse"], dlse, rtol=0, atol=0)
    else:
        assert read["dlse"] is None
    want = attention_backward_reference(q, k, v, dout, causal=True, window_size=(5, None),
                                        learnable_sink=sink, dlse=dlse, finite=False)
    for g, w in zip(grads, want):
        torch.testing.assert_close(g.double(), w, rtol=2e-2, atol=2e-2)


def test_a_compiled_training_step_launches_the_forward_once(faked_sm90, gen):
    """The same under torch.compile(fullgraph=True): the traced forward op (its fake) asks for
    the lse, the autograd setup saves it, the backward op (its fake: out and lse among its
    inputs) reads it; one forward launch per step."""
    import warnings

    import fa4lab

    q, k, v, _ = _bf16_inputs(gen)
    q.requires_grad_()
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v: fa4lab.attention(q, k, v, causal=True), fullgraph=True,
                      backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = f(q, k, v)
        assert len(faked_sm90.forwards) == 1
        (dq,) = torch.autograd.grad(out.float().sum(), q)
    assert len(faked_sm90.forwards) == 1, "the backward launched the forward again"
    (_, fwd_out, fwd_lse), = faked_sm90.forwards
    (read,) = faked_sm90.backwards
    assert torch.equal(read["out"], fwd_out) and torch.equal(read["lse"], fwd_lse)
    assert dq.shape == q.shape and torch.isfinite(dq).all()


def test_the_op_without_its_lse_refuses_cuda_gradients(faked_sm90, gen):
    """`fa4lab::attention_forward` called directly with return_lse=False on (faked) CUDA
    inputs that require grad has no lse for the backward kernel: its autograd setup says to
    pass True (fa4lab.attention does); with True it differentiates, one forward launch."""
    from fa4lab.errors import GradientNotSupportedError

    q, k, v, _ = _bf16_inputs(gen)
    q.requires_grad_()
    op = torch.ops.fa4lab.attention_forward
    with pytest.raises(GradientNotSupportedError, match="return_lse=True"):
        op(q, k, v, True, None, False, None, 0.0)
    faked_sm90.forwards.clear()
    out, lse = op(q, k, v, True, None, True, None, 0.0)
    (dq,) = torch.autograd.grad(out.float().sum(), q)
    assert len(faked_sm90.forwards) == 1 and dq.shape == q.shape


# Every configuration the backward claims, compiled for sm_90a: the head dims the forward
# builds (causal and not), GQA, fp16, softcap, each window's sides, deterministic dQ.
COMPILES = [
    ((64, 64, "bf16", False, 1), {}),
    ((64, 64, "bf16", True, 4), {}),
    ((96, 96, "bf16", True, 1), {}),
    ((128, 128, "bf16", False, 1), {}),
    ((128, 128, "fp16", True, 2), {}),
    ((192, 128, "bf16", True, 1), {}),
    ((256, 256, "bf16", False, 1), {}),
    ((128, 128, "bf16", True, 1), {"softcap": True}),
    ((64, 64, "bf16", False, 2), {"window": (True, True)}),
    ((128, 128, "bf16", True, 1), {"window": (True, False)}),
    ((64, 64, "bf16", False, 1), {"window": (False, True), "deterministic": True}),
    ((128, 128, "bf16", True, 3), {"deterministic": True}),
    ((256, 256, "bf16", True, 2), {"softcap": True, "window": (True, False),
                                   "deterministic": True}),
]


@pytest.mark.compile
@pytest.mark.parametrize("args,options", COMPILES,
                         ids=[BackwardKey(*a, **o).name for a, o in COMPILES])
def test_compiles_for_sm90a_without_spills(args, options, tmp_path):
    from fa4lab.kernels import binary
    from fa4lab.kernels.launch_backward import compile_backward

    cb = compile_backward(BackwardKey(*args, **options), keep_dir=tmp_path)
    usage = binary.resource_usage(cb.cubin_path)
    assert usage["local"] == 0 and usage["stack"] == 0, usage
    assert usage["registers"] <= 255, usage
    text = cb.ptx_path.read_text()
    assert "mma.sync.aligned.m16n8k16" in text and "ldmatrix" in text
    assert ("ld.acquire.gpu" in text) == bool(options.get("deterministic")), \
        "the semaphore's acquire load is deterministic mode's alone"
