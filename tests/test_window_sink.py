"""Sliding windows and learnable sinks without a GPU: block ranges, the kernels' walk, the
launch key, the API and the op.

Tier 0/1 (the GPU half, against the float64 reference, is tests/test_window_sink_gpu.py):
* the block-range rules (`fa4lab.tiling.block_range`, `mask_split`, `visit_block`: one
  implementation for ints and the kernels' Int32) against the brute-force element mask
  (`fa4lab.reference.visible_mask`) on random shapes, windows and pack-GQA ratios;
* both kernels' walk of every CTA, with their own index code run on Python ints
  (tests/kernel_walk.py): every role agrees block for block, each row sees exactly its keys;
* the launch key and the disk cache key hold a window's sides and the sink's presence, never
  their values; the runtime window arguments are clamped;
* `fa4lab.attention` and the op take window_size and learnable_sink (on CPU the reference
  answers) and refuse bad ones before anything runs.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_walk import check_walk

from fa4lab import tiling
from fa4lab.reference import visible_mask
from fa4lab.spec import AttentionSpec, effective_window

torch = pytest.importorskip("torch")

_SIDE = st.one_of(st.none(), st.integers(0, 80))


def _window(causal, left, right):
    return left, (0 if causal and right else right)


# ------------------------------------------------------------------ the block-range rules

@settings(max_examples=150, deadline=None)    # trimmed from 400 (2 s on a 2-core machine)
@given(sq=st.integers(1, 90), sk=st.integers(1, 90), bm=st.sampled_from([2, 4, 8, 12, 16]),
       bn=st.integers(1, 24), group=st.sampled_from([1, 2, 4]), causal=st.booleans(),
       left=_SIDE, right=_SIDE, data=st.data())
def test_visit_order_against_the_element_mask(sq, sk, bm, bn, group, causal, left, right, data):
    """The blocks a tile visits are exactly those with a visible element, each once; the
    masked prefix is exactly the blocks with an in-bounds hidden element or a column past
    seqlen_k; the runs come right edge, left edge, unmasked, each from the top down."""
    window = _window(causal, left, right)
    m = data.draw(st.integers(0, tiling.num_m_blocks(sq, bm, group) - 1))
    kw = dict(seqlen_q=sq, seqlen_k=sk, m_block_size=bm, n_block_size=bn, causal=causal,
              qhead_per_kvhead=group, window_size=window)
    blocks, masked = tiling.visit_order(m, **kw)
    rows = np.arange(m * bm, min((m + 1) * bm, sq * group)) // group    # positions, in bounds
    vis = visible_mask(sq, sk, causal, window_size=window)[rows]
    n_n = -(-sk // bn)
    seen = [b for b in range(n_n) if vis[:, b * bn:(b + 1) * bn].any()]
    needs = [b for b in seen if not vis[:, b * bn:(b + 1) * bn].all() or (b + 1) * bn > sk]
    assert sorted(blocks) == seen
    assert sorted(blocks[:masked]) == needs
    n_min, left_end = tiling.n_block_left_masked_range(m, **kw)
    mask_min, n_max = tiling.n_block_masked_range(m, **kw)
    want = [*range(n_max - 1, mask_min - 1, -1), *range(left_end - 1, n_min - 1, -1),
            *range(mask_min - 1, left_end - 1, -1)]
    assert blocks == want
    # The range is empty only when even the last row sees nothing to its right: n_max == 0
    # (the sm90 kernel's Note [fully masked CTAs] visits block 0 then).
    assert (not blocks) == (n_max == 0)


def test_a_worked_example_of_the_visit_order():
    # Rows 640..767 with a causal window of 300 keys, blocks of 64 keys: row 640 sees keys
    # 340..640, row 767 sees 467..767. Blocks 10, 11 hold the diagonal (right edge), blocks
    # 5, 6, 7 hold keys some row cannot see on the left (467 > 7 * 64), blocks 8, 9 are seen
    # whole by every row.
    kw = dict(seqlen_q=1000, seqlen_k=1000, m_block_size=128, n_block_size=64, causal=True,
              window_size=(300, 0))
    assert tiling.visit_order(5, **kw) == ([11, 10, 7, 6, 5, 9, 8], 5)


# ------------------------------------------------------------------ the kernels' walk

@settings(max_examples=40, deadline=None)
@given(arch=st.sampled_from(["sm90", "sm100"]), sq=st.integers(1, 700),
       sk=st.integers(1, 900), g=st.sampled_from([1, 2, 4]), causal=st.booleans(),
       left=st.one_of(st.none(), st.integers(0, 1000)),
       right=st.one_of(st.none(), st.integers(0, 1000)))
def test_kernel_walk_with_windows(arch, sq, sk, g, causal, left, right):
    check_walk(arch, sq, sk, g, causal, _window(causal, left, right))


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
@pytest.mark.parametrize("sq,sk,window", [
    (300, 700, (0, 0)),         # the diagonal only
    (700, 300, (5, 0)),         # rows with no key at the top (right side, sq > sk)
    (300, 1000, (None, 10)),    # right side only: a window that leaves the last keys unseen
    (1, 1, (0, None)),
    (130, 130, (10**9, 10**9)),  # wider than everything: clamped, nothing hidden
    (500, 500, (17, 23)),       # smaller than a block
])
def test_kernel_walk_edge_cases(arch, sq, sk, window):
    for g in (1, 4):
        check_walk(arch, sq, sk, g, False, window)


# ------------------------------------------------------------------ launch key and arguments

def _tensors(hq=8, hkv=2, d=128, sq=8, sk=8):
    return tuple(torch.empty(1, s, h, d, dtype=torch.bfloat16) for s, h in ((sq, hq), (sk, hkv),
                                                                          (sk, hkv)))


def test_launch_key_holds_sides_and_sink_not_values():
    from fa4lab.call import check_call
    from fa4lab.plan.key import config_name

    q, k, v = _tensors()
    sink = torch.zeros(8)

    def key(window=(None, None), sink=None, causal=False):
        return check_call(q, k, v, causal=causal, return_lse=True, pack_gqa=False,
                          window_size=window, learnable_sink=sink).key("sm90")

    base = key()
    assert key((64, None)) == key((3, None)) != base
    assert key((None, 5)) == key((None, 70)) != key((5, 5)) != key((5, None))
    assert key(sink=sink) == key(sink=torch.ones(8)) != base
    names = set()
    for args in [(), ((64, None),), ((None, 5),), ((5, 5),), ((5, None), sink, True)]:
        spec = key(*args).spec()
        assert [s is None for s in spec.window_size] == [
            s is None for s in (args[0] if args else (None, None))]
        assert spec.learnable_sink == (len(args) > 1)
        names.add(config_name(spec, "sm90a"))
    assert len(names) == 5 and "sm90a-hd128-causal-gqa4-lse-bf16-windowL-sink" in names


def test_window_arguments_are_clamped_and_zero_for_a_missing_side():
    from fa4lab.kernels.device.arguments import window_args

    assert window_args((None, None), 100, 200) == (0, 0)
    assert window_args((5, None), 100, 200) == (5, 0)
    assert window_args((10**12, 10**12), 100, 200) == (200, 100)
    # clamping hides nothing more and nothing less than the window itself
    for left, right in ((10**12, 7), (3, 10**12), (10**12, 10**12)):
        clamped = window_args((left, right), 100, 200)
        np.testing.assert_array_equal(visible_mask(100, 200, False, window_size=clamped),
                                      visible_mask(100, 200, False, window_size=(left, right)))


def test_plans_take_windows_and_sinks():
    from fa4lab.plan import plan_forward

    for arch in ("sm90", "sm100"):
        spec = AttentionSpec(2, 300, 700, 8, 2, 128, window_size=(100, 4), learnable_sink=True)
        assert plan_forward(spec, arch).spec == spec


# ------------------------------------------------------------------ the API and the op

def _qkv(gen, b=2, sq=9, sk=13, hq=4, hkv=2, d=16):
    return (torch.randn(b, sq, hq, d, generator=gen), torch.randn(b, sk, hkv, d, generator=gen),
            torch.randn(b, sk, hkv, d, generator=gen))


@pytest.fixture(autouse=True)
def _quiet(quiet_reference):
    yield


@pytest.mark.parametrize("causal,window", [(False, (3, 2)), (True, (4, None)), (False, (0, 0)),
                                           (False, (None, 1)), (True, (2, 0))])
def test_cpu_attention_is_the_reference(gen, causal, window):
    import fa4lab
    from fa4lab.reference import attention_reference

    q, k, v = _qkv(gen, sq=20, sk=9)
    sink = torch.randn(4, generator=gen)
    sink[0] = -math.inf
    out, lse = fa4lab.attention(q, k, v, causal=causal, window_size=window, learnable_sink=sink,
                                return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, causal=causal, window_size=window,
                                       learnable_sink=sink, return_lse=True)
    torch.testing.assert_close(out.double(), ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse.double(), ref_lse.float().double(), atol=1e-6, rtol=1e-6)


def test_the_op_takes_a_window_and_a_sink(gen):
    op = torch.ops.fa4lab.attention_forward.default
    q, k, v = _qkv(gen)
    sink = torch.randn(4, generator=gen)
    torch.library.opcheck(op, (q, k, v, False, None, True, None, 0.0, 3, 2, sink))
    torch.library.opcheck(op, (q, k, v, True, 0.2, True, False, 5.0, 1, None, None))
    out, lse = torch.ops.fa4lab.attention_forward(q, k, v, False, None, True, None, 0.0, None, 0,
                                                  sink)
    import fa4lab

    ref = fa4lab.attention(q, k, v, causal=True, learnable_sink=sink, return_lse=True)
    torch.testing.assert_close((out, lse), ref)


def test_fake_tensors_with_a_window_and_a_sink():
    from torch._subclasses.fake_tensor import FakeTensorMode

    import fa4lab

    with FakeTensorMode():
        q = torch.empty(3, 17, 8, 64, dtype=torch.bfloat16)
        k = torch.empty(3, 40, 2, 64, dtype=torch.bfloat16)
        out, lse = fa4lab.attention(q, k, k, window_size=(16, 4), learnable_sink=torch.zeros(8),
                                    return_lse=True)
        assert out.shape == (3, 17, 8, 64) and lse.shape == (3, 8, 17)
        with pytest.raises(ValueError, match="causal=True with window_size"):
            fa4lab.attention(q, k, k, causal=True, window_size=(16, 4))


@pytest.mark.parametrize("kwargs,exc,words", [
    (dict(causal=True, window_size=(4, 2)), ValueError, "causal means right = 0"),
    (dict(causal=True, window_size=(4, -2)), ValueError, "causal means right = 0"),
    (dict(window_size=128), TypeError, "pair"),
    (dict(learnable_sink=torch.zeros(3)), ValueError, r"\(heads_q,\) = \(4,\)"),
    (dict(learnable_sink=torch.zeros(4, dtype=torch.float16)), TypeError, "float32"),
    (dict(learnable_sink=[0.0] * 4), TypeError, "torch.Tensor"),
])
def test_bad_windows_and_sinks_raise_before_anything_runs(gen, kwargs, exc, words):
    import fa4lab

    q, k, v = _qkv(gen)
    with pytest.raises(exc, match=words):
        fa4lab.attention(q, k, v, **kwargs)


def test_a_sink_that_requires_grad_gets_its_gradient(gen):
    """On CPU the sink's gradient is the float64 reference's: -sum over its rows of
    P_sink * rowsum(dO * O) (Note [sink backward] in fa4lab.reference_backward)."""
    import fa4lab
    from fa4lab.reference import attention_reference

    q, k, v = _qkv(gen)
    sink = torch.randn(4, generator=gen).requires_grad_()
    out = fa4lab.attention(q, k, v, learnable_sink=sink, window_size=(4, 0))
    dout = torch.randn(out.shape, generator=gen)
    (got,) = torch.autograd.grad(out, sink, dout)
    ref = attention_reference(q, k, v, learnable_sink=sink, window_size=(4, 0))
    (want,) = torch.autograd.grad(ref, sink, dout.double())
    assert got.dtype == torch.float32 and (got != 0).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_signature_is_flash_attn_funcs():
    import inspect

    import fa4lab

    params = inspect.signature(fa4lab.attention).parameters
    assert list(params)[3:] == ["softmax_scale", "causal", "window_size", "learnable_sink",
                                "softcap", "num_splits", "pack_gqa", "score_mod", "mask_mod",
                                "aux_tensors", "return_lse", "page_table", "deterministic"]
    assert all(p.kind is p.KEYWORD_ONLY for p in list(params.values())[3:])
    assert effective_window(False, params["window_size"].default) == (None, None)
