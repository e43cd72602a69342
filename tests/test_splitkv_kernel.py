"""Split-KV inside the forward kernels (`fa4lab.kernels.device.split`, `AttentionSpec.split_kv`).

CPU: the device split range is `fa4lab.splitkv.split_blocks`' rule on Python ints (the DSL's
min and max), its empty splits stay inside the tile's range (Note [empty splits]), the grid's
folded head axis unfolds to every (head, split) once; the API's num_splits checks.

GPU (marker `sm90`; the lead runs them on an H200): the split kernel's float32 partials against
`fa4lab.splitkv.partial_attention_reference` (float64), and `fa4lab.attention(...,
num_splits=n)` (split kernel + combine kernel) against the float64 reference under FA4's rule
(`kernel_checks.check_kernel`), for num_splits 1, 2, 3, 7 and more than the key blocks; causal,
windows, softcap, a learnable sink, pack-GQA decode (seqlen_q 1, GQA 8), seqlen_k not a
multiple of n_block, fully masked rows and logits of 1e4. Grids trimmed: one compile per
(causal, window sides, softcap, pack-GQA) kernel, a few shapes each.
"""

from __future__ import annotations

import math
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fa4lab.splitkv import split_blocks, split_range

torch = pytest.importorskip("torch")


# trimmed from 300 examples (5 s on a 2-core machine; each runs up to 300 splits through the
# DSL's min): the edges (no blocks, one split, more splits than blocks) come early
@given(n_blocks=st.integers(0, 5000), num_splits=st.integers(1, 300))
@settings(max_examples=100, deadline=None)
def test_device_split_range_is_split_blocks(n_blocks, num_splits):
    """The kernels' split range (ints through the DSL's min) is split_blocks' rule, and
    split_blocks' ranges tile [0, n_blocks) in order, none longer than the ceiling share."""
    cutlass = pytest.importorskip("cutlass")
    ranges = split_blocks(n_blocks, num_splits)
    assert [split_range(n_blocks, num_splits, s, imin=cutlass.min)
            for s in range(num_splits)] == list(ranges)
    assert ranges[0][0] == 0 and ranges[-1][1] == n_blocks
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert max(hi - lo for lo, hi in ranges) == -(-n_blocks // num_splits)


@given(seqlen_k=st.integers(1, 20_000), n_block=st.sampled_from([64, 80, 128, 176]),
       num_splits=st.integers(1, 200), data=st.data())
@settings(max_examples=100, deadline=None)    # trimmed from 300 (10 s: up to 200 splits each)
def test_narrow_is_the_split_within_the_tile_range(seqlen_k, n_block, num_splits, data):
    """Each split of a tile visits exactly (its split_blocks range) & (the tile's range); the
    splits together visit the tile's range once; an empty split (seen 0) keeps one block of
    the tile's range to visit masked whole, never one outside it (Note [empty splits])."""
    pytest.importorskip("cutlass")
    from fa4lab.kernels.device import split

    n_blocks = -(-seqlen_k // n_block)
    n_min = data.draw(st.integers(0, n_blocks - 1))
    n_max = data.draw(st.integers(n_min, n_blocks))
    covered = []
    for s, (lo, hi) in enumerate(split_blocks(n_blocks, num_splits)):
        a, b, seen = split.narrow(n_min, n_max, seqlen_k, n_block, num_splits, s)
        want = range(max(lo, n_min), min(hi, n_max))
        assert seen == (1 if len(want) else 0)
        if seen:
            assert (a, b) == (want.start, want.stop)
            covered += range(a, b)
        else:
            assert a == b and n_min <= a <= max(n_max - 1, n_min) < n_blocks
        assert split.keys_seen(seqlen_k, seen) == (seqlen_k if seen else 0)
    assert covered == list(range(n_min, n_max))


@given(heads=st.integers(1, 64), num_splits=st.integers(1, 130))
@settings(max_examples=100, deadline=None)
def test_folded_heads_unfold_once(heads, num_splits):
    pytest.importorskip("cutlass")
    from fa4lab.kernels.device import split

    got = [split.split_of(x, num_splits) for x in range(heads * num_splits)]
    assert sorted(got) == [(h, s) for h in range(heads) for s in range(num_splits)]


@pytest.mark.parametrize("bad, error", [(0, "InputError"), (-3, "InputError"),
                                        (2.0, "InputTypeError"), (True, "InputTypeError"),
                                        ("4", "InputTypeError")])
def test_bad_num_splits_raise_before_anything_runs(bad, error):
    import fa4lab

    q = torch.randn(1, 2, 2, 16)
    with pytest.raises(Exception) as info:
        fa4lab.attention(q, q, q, num_splits=bad)
    assert type(info.value).__name__ == error and "num_splits" in str(info.value)


def test_num_splits_with_mods_is_refused():
    import fa4lab
    from fa4lab.errors import InputError

    q = torch.randn(1, 2, 2, 16)
    with pytest.raises(InputError, match="num_splits=2"):
        fa4lab.attention(q, q, q, num_splits=2, score_mod=lambda s, b, h, i, j: s)


def test_reference_path_takes_num_splits():
    """On the CPU the float64 reference answers whatever num_splits says (a split changes the
    summation, not the result)."""
    import warnings

    import fa4lab
    from fa4lab.reference import attention_reference

    g = torch.Generator().manual_seed(7)
    q, k = torch.randn(1, 3, 4, 16, generator=g), torch.randn(1, 50, 2, 16, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = fa4lab.attention(q, k, k, causal=True, num_splits=3)
    torch.testing.assert_close(out, attention_reference(q, k, k, causal=True).float())


def test_launch_key_holds_split_kv_and_its_spec_compiles_the_split_kernel():
    from fa4lab.call import check_call
    from fa4lab.plan.key import config_name

    q = torch.empty(1, 1, 8, 128, dtype=torch.bfloat16)
    k = torch.empty(1, 4096, 1, 128, dtype=torch.bfloat16)
    call = check_call(q, k, k, return_lse=True)
    plain, split = call.key("sm90"), call.key("sm90", split_kv=True)
    assert plain.return_lse and not split.return_lse     # the combine gives the LSE
    assert plain != split and not plain.spec().split_kv and split.spec().split_kv
    assert config_name(split.spec(), "sm90a").endswith("-splitkv")


def test_a_given_num_splits_is_capped_at_the_key_blocks():
    """More splits than key blocks would only add empty ones; None on an arch whose split
    kernel has not run yet (sm100) does not split."""
    from fa4lab.call import check_call
    from fa4lab.kernels.launch import cta_tiles, splits_for

    q = torch.empty(1, 1, 8, 128, dtype=torch.bfloat16)
    k = torch.empty(1, 1000, 1, 128, dtype=torch.bfloat16)
    for arch in ("sm90", "sm100"):
        key = check_call(q, k, k).key(arch)
        blocks = -(-1000 // cta_tiles(key)[1])
        assert [splits_for(key, check_call(q, k, k, num_splits=n))
                for n in (1, 3, blocks, blocks + 1, 1000)] == [1, 3, blocks, blocks, blocks]
    call = check_call(q, k, k)
    assert splits_for(call.key("sm100"), call) == 1


# ---------------------------------------------------------------- GPU (H200)

def _seed(*parts) -> int:
    """A seed of the test case's parameters, the same in every process (quoted on failure by
    the parametrised test id)."""
    return zlib.crc32(repr(parts).encode())


def _inputs(b, sq, sk, hq, hkv, d, seed, q_scale=1.0, dtype="bf16"):
    from kernel_checks import DTYPES, make_inputs

    return make_inputs(b, sq, sk, hq, hkv, d, DTYPES[dtype], seed, q_scale=q_scale)


def _partials(q, k, v, num_splits, *, causal=False, window_size=(None, None), softcap=0.0,
              pack_gqa=None):
    """The sm90 split kernel's partials and the n_block its plan cuts the keys by."""
    from fa4lab.call import check_call
    from fa4lab.kernels import launch

    call = check_call(q, k, v, causal=causal, window_size=window_size, softcap=softcap,
                      pack_gqa=pack_gqa, arch="sm90")
    out_p, lse_p = launch.partials(call, "sm90", num_splits)
    return out_p, lse_p, launch.cta_tiles(call.key("sm90", split_kv=True))[1]


# (batch, seqlen_q, seqlen_k, heads_q, heads_kv): decode GQA 8 (packed), short prefill with a
# tail, seqlen_q > seqlen_k (causal: fully masked rows), seqlen_k of one block.
PARTIAL_SHAPES = [(2, 1, 1000, 8, 1), (1, 17, 1000, 4, 2), (1, 300, 130, 2, 2), (2, 5, 90, 2, 1)]
PARTIAL_OPTIONS = {
    "full": {},
    "causal": dict(causal=True),
    "window": dict(window_size=(200, 30)),
    "causal-left-softcap": dict(causal=True, window_size=(150, None), softcap=20.0),
}


@pytest.mark.sm90
@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 40])
@pytest.mark.parametrize("options", list(PARTIAL_OPTIONS), ids=str)
@pytest.mark.parametrize("shape", PARTIAL_SHAPES, ids=lambda s: "b{}-q{}-k{}-h{}/{}".format(*s))
def test_sm90_partials_are_the_reference_partials(shape, options, num_splits):
    """Each split's float32 out and LSE against the float64 partials of the same key blocks:
    a split that sees no key of a row (empty split, or masked) gives exactly 0 and -inf."""
    from fa4lab.splitkv import partial_attention_reference

    opts = PARTIAL_OPTIONS[options]
    q, k, v = _inputs(*shape, 128, seed=_seed(shape, options, num_splits))
    out_p, lse_p, n_block = _partials(q, k, v, num_splits, **opts)
    ref_p, ref_lse = partial_attention_reference(q, k, v, num_splits=num_splits,
                                                 n_block_size=n_block, **opts)
    assert out_p.shape == ref_p.shape and lse_p.shape == ref_lse.shape
    assert not torch.isnan(out_p).any() and not torch.isnan(lse_p).any()
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse_p), empty), \
        "the kernel's empty (-inf) partial LSEs are not the reference's"
    assert (out_p[empty] == 0).all(), "a split that sees no key of a row must write 0"
    seen = ~empty
    lse_err = (lse_p.double() - ref_lse)[seen].abs()
    assert (lse_err <= 1e-3 + 1e-5 * ref_lse[seen].abs()).all(), lse_err.max()
    # P is rounded to bf16 before P V (2^-9 relative): a few units of that times max |v|.
    err = (out_p.double() - ref_p)[seen].abs().max().item() if seen.any() else 0.0
    assert err <= 4 * 2.0 ** -9 * v.abs().max().item() + 1e-3, err


COMBINED = [
    # (shape (b, sq, sk, hq, hkv), options, num_splits, q_scale)
    ((2, 1, 1000, 8, 1), {}, 3, 1.0),                                  # decode, pack-GQA 8
    ((4, 1, 4097, 16, 2), {}, 7, 1.0),                                 # decode, tail block
    ((1, 1, 1000, 8, 1), {}, 40, 1.0),                 # more splits than blocks (capped)
    ((2, 1, 1000, 8, 1), dict(causal=True), 2, 100.0),                 # logits of 1e4
    ((1, 17, 1000, 4, 2), dict(causal=True), 3, 1.0),
    ((1, 300, 130, 2, 2), dict(causal=True), 2, 1.0),                  # fully masked rows
    ((2, 33, 1000, 4, 1), dict(window_size=(200, 30)), 7, 1.0),
    ((2, 1, 1000, 8, 1), dict(window_size=(300, None)), 5, 1.0),       # splits outside the window
    ((2, 1, 1000, 8, 1), dict(softcap=20.0), 3, 1.0),
    ((2, 1, 1000, 8, 1), dict(sink=True), 3, 1.0),
    ((1, 1000, 17, 2, 2), dict(causal=True, sink=True), 2, 1.0),       # empty rows: the sink
]


@pytest.mark.sm90
@pytest.mark.parametrize("shape, options, num_splits, q_scale", COMBINED)
def test_sm90_split_attention_is_the_reference(shape, options, num_splits, q_scale):
    """fa4lab.attention(num_splits=n): split kernel + combine kernel, under FA4's rule."""
    from kernel_checks import check_kernel

    import fa4lab

    opts = dict(options)
    q, k, v = _inputs(*shape, 128, seed=_seed(shape, options, num_splits), q_scale=q_scale)
    if opts.pop("sink", False):
        g = torch.Generator(device="cpu").manual_seed(3)
        opts["learnable_sink"] = (torch.randn(shape[3], generator=g) * 3).cuda()
    check_kernel(fa4lab.attention, q, k, v, causal=opts.pop("causal", False),
                 num_splits=num_splits, **opts)


@pytest.mark.sm90
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_sm90_split_head_dims_and_dtypes(head_dim, dtype):
    from kernel_checks import check_kernel

    import fa4lab

    q, k, v = _inputs(3, 1, 3000, 8, 2, head_dim, seed=head_dim, dtype=dtype)
    check_kernel(fa4lab.attention, q, k, v, causal=False, num_splits=5)


@pytest.mark.sm90
def test_sm90_num_splits_is_runtime_and_none_chooses():
    """One split kernel serves every split count (no compile per count); num_splits=None splits
    a decode shape (batch 1, 128k keys, GQA 8) and not a prefill one, and both are right."""
    from kernel_checks import check_kernel

    import fa4lab
    from fa4lab.call import check_call
    from fa4lab.kernels import launch

    q, k, v = _inputs(1, 1, 4096, 8, 1, 128, seed=11)
    fa4lab.attention(q, k, v, num_splits=2)
    before = launch.stats()["misses"]
    for n in (3, 4, 9, 17):
        fa4lab.attention(q, k, v, num_splits=n)
    assert launch.stats()["misses"] == before
    q, k, v = _inputs(1, 1, 131072, 64, 8, 128, seed=12)
    call = check_call(q, k, v)
    assert launch.splits_for(call.key("sm90"), call) > 1
    check_kernel(fa4lab.attention, q, k, v, causal=False)
    q, k, v = _inputs(4, 4096, 4096, 16, 16, 128, seed=13)
    call = check_call(q, k, v, causal=True)
    assert launch.splits_for(call.key("sm90"), call) == 1


@pytest.mark.sm90
def test_sm90_split_attention_under_torch_compile():
    """The custom op carries num_splits; its fake implementation gives the same shapes."""
    import fa4lab

    q, k, v = _inputs(2, 1, 2000, 8, 1, 128, seed=5)
    f = torch.compile(lambda q, k, v: fa4lab.attention(q, k, v, num_splits=4, return_lse=True),
                      fullgraph=True)
    out, lse = f(q, k, v)
    ref, ref_lse = fa4lab.attention(q, k, v, num_splits=4, return_lse=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    assert math.isfinite(lse.max().item())


@pytest.mark.sm90
def test_sm90_split_attention_in_a_cuda_graph():
    """Split kernel + combine kernel captured once and replayed on new inputs: the launch
    allocates its partials inside the capture and syncs nothing."""
    import fa4lab

    q, k, v = _inputs(2, 1, 3000, 16, 2, 128, seed=21)
    fa4lab.attention(q, k, v, num_splits=6)       # compile (or load) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fa4lab.attention(q, k, v, num_splits=6)
    for _ in range(2):
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fa4lab.attention(q, k, v, num_splits=6))
