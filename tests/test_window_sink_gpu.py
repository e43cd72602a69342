"""Sliding windows and learnable sinks in the sm90 kernel on a Hopper GPU (marker `sm90`).

Held to the acceptance rule of tests/kernel_checks.py against the float64 reference (the
yardstick: SDPA with the window as a mask; PyTorch eager in bf16 with a sink, which SDPA
lacks). Rows that see no key must give exactly 0 and LSE -inf, or the sink's logit with a sink.

Grid (trimmed; each (head_dim, window sides, sink, pack-GQA) is one compile, every window size
and sink value of it a runtime argument):
* windows: left only, right only, both, causal + left, each at sizes from 0 (the diagonal) and
  smaller than a key block to wider than any seqlen, on seqlen pairs with tails both ways,
  seqlen_q != seqlen_k both ways and single rows; windows whose right edge leaves the top rows
  with no key; GQA 4 unpacked and packed (decode included), head_dim 64, 128, 256;
* sinks: with and without causal and a window, per-head values from -1e3 to 1e3, -inf (no sink
  on that head), packed and not, head_dim 64 and 256; logits of 1e4 with a window and a sink;
* three window sizes and three sink tensors cost one compile; fa4lab.attention and the op
  dispatch to the same kernel.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from kernel_checks import check_kernel, output_ulp_atol  # noqa: E402
from kernel_checks import make_inputs as _inputs  # noqa: E402

pytestmark = pytest.mark.sm90

# Each family of windows shares its sides (one compile): from the diagonal only and smaller
# than a key block to wider than every seqlen below.
WINDOWS = {
    "left": [(0, None), (5, None), (100, None), (10**6, None)],
    "right": [(None, 1), (None, 50), (None, 10**6)],
    "both": [(3, 5), (30, 70), (200, 1), (10**6, 10**6)],
    "causal_left": [(0, 0), (5, 0), (200, 0), (10**6, 0)],
}
# Tails both ways, single rows, seqlen_q > seqlen_k (a right edge leaves the top rows without
# a key), seqlen_q < seqlen_k.
PAIRS = [(1, 1), (17, 1000), (1000, 17), (300, 777), (1000, 4097)]


def _check(q, k, v, pack_gqa=False, **checks):
    from fa4lab.kernels.launch import attention_sm90

    check_kernel(attention_sm90, q, k, v, pack_gqa=pack_gqa, **checks)


def _sinks(heads: int, seed: int):
    """Per-head sink logits: ordinary, large both ways, and -inf (no sink on that head)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    sink = torch.randn(heads, device="cuda", generator=g) * 2
    extremes = torch.tensor([30.0, -30.0, -math.inf, 1e3, -1e3], device="cuda")
    sink[1:1 + min(heads - 1, len(extremes))] = extremes[:heads - 1]
    return sink


@pytest.mark.parametrize("sides", list(WINDOWS))
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_windows(head_dim, sides):
    for i, (sq, sk) in enumerate(PAIRS):
        q, k, v = _inputs(2 if sq * sk < 10**6 else 1, sq, sk, 8, 2, head_dim, torch.bfloat16,
                          seed=5000 + 100 * head_dim + i)
        for window in WINDOWS[sides]:
            _check(q, k, v, causal=sides == "causal_left", window_size=window)


@pytest.mark.parametrize("sides", ["left", "both", "causal_left"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_windows_pack_gqa(head_dim, sides):
    """One CTA per (KV head, packed row tile): the window compares keys with positions."""
    for i, (sq, sk) in enumerate([(1, 1000), (17, 1000), (1000, 17), (333, 700)]):
        q, k, v = _inputs(2, sq, sk, 16, 4, head_dim, torch.bfloat16, seed=6000 + i)
        for window in WINDOWS[sides]:
            _check(q, k, v, pack_gqa=True, causal=sides == "causal_left", window_size=window)


@pytest.mark.parametrize("causal,window", [(False, (None, None)), (True, (None, None)),
                                           (False, (64, 32)), (True, (100, 0))])
@pytest.mark.parametrize("head_dim", [64, 256])   # the two tightest register budgets
def test_sinks(head_dim, causal, window):
    for i, (sq, sk) in enumerate(PAIRS):
        q, k, v = _inputs(2 if sq * sk < 10**6 else 1, sq, sk, 8, 2, head_dim, torch.bfloat16,
                          seed=7000 + 10 * head_dim + i)
        _check(q, k, v, causal=causal, window_size=window, learnable_sink=_sinks(8, seed=i))


@pytest.mark.parametrize("causal", [False, True])
def test_sinks_pack_gqa(causal):
    """With pack-GQA each packed row reads the sink of its own query head (head * g + r % g)."""
    for i, (sq, sk) in enumerate([(1, 1000), (17, 1000), (1000, 17)]):
        q, k, v = _inputs(2, sq, sk, 16, 2, 128, torch.bfloat16, seed=8000 + i)
        _check(q, k, v, pack_gqa=True, causal=causal, window_size=(50, None),
               learnable_sink=_sinks(16, seed=i))


def test_extreme_logits_with_a_window_and_a_sink():
    """Logits ~1e4 (q scaled): the max subtraction and the sink's basis must keep every exp2
    finite; atol one output ulp (Note [extreme logits] in fa4lab.acceptance). bf16 only:
    the yardstick's fp16 scores would overflow."""
    q, k, v = _inputs(1, 300, 555, 4, 4, 128, torch.bfloat16, seed=17, q_scale=1e4)
    sink = torch.tensor([0.0, 5e3, -math.inf, 2e4], device="cuda")
    _check(q, k, v, causal=True, window_size=(100, 0), learnable_sink=sink,
           atol=output_ulp_atol(v, "bf16"))


def test_window_sizes_and_sinks_do_not_recompile():
    """Window sizes and sink values are runtime arguments (Note [runtime window]): three of
    each, one compile, each result held to the rule at its own window and sink."""
    from fa4lab.kernels import launch

    q, k, v = _inputs(2, 300, 777, 8, 2, 128, torch.bfloat16, seed=31)
    _check(q, k, v, causal=False, window_size=(50, 20), learnable_sink=_sinks(8, seed=1))
    before = launch.stats()["misses"]
    for i, window in enumerate([(3, 7), (200, 1), (10**6, 64)]):
        _check(q, k, v, causal=False, window_size=window, learnable_sink=_sinks(8, seed=10 + i))
    assert launch.stats()["misses"] == before, "a new window size or sink compiled a new kernel"
    _check(q, k, v, causal=False, window_size=(50, None), learnable_sink=_sinks(8, seed=1))
    assert launch.stats()["misses"] == before + 1, "a window without a right side is a new kernel"


def test_fa4lab_attention_and_the_op_take_windows_and_sinks():
    import fa4lab
    from fa4lab.kernels.launch import attention_sm90

    q, k, v = _inputs(2, 129, 700, 8, 2, 128, torch.bfloat16, seed=41)
    sink = _sinks(8, seed=2)
    out, lse = fa4lab.attention(q, k, v, window_size=(64, 0), learnable_sink=sink,
                                return_lse=True, num_splits=1)
    want = attention_sm90(q, k, v, causal=True, window_size=(64, None), learnable_sink=sink,
                          return_lse=True, pack_gqa=None)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    op_out, op_lse = torch.ops.fa4lab.attention_forward(q, k, v, True, None, True, None, 0.0,
                                                        64, None, sink, 1)
    assert torch.equal(op_out, out) and torch.equal(op_lse, lse)
