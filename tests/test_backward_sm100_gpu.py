"""The sm100 backward kernel (fa4lab.kernels.bwd_sm100) on a B200 (marker `sm100`): dQ, dK and
dV against the float64 `fa4lab.reference_backward` on fresh random inputs, under FA4's rule
per gradient (`fa4lab.acceptance.gradient_violations` against `same_dtype_gradients`).
No NaN anywhere, rows that see no key included.

It has not run yet: no B200 was at hand when it was written; on any other machine it skips
with the conftest's reason. The grid: the head dims the kernel builds (64, 128) x causal or
not x sequence lengths with tails of both 128-row tiles, length 1, seqlen_q > seqlen_k under
causal (the top rows see no key) and several blocks each way; fp16 once per head dim; GQA 4:1
(one CTA per KV head summing dK and dV over its group in TMEM: Note [sm100 backward, GQA]),
against the reference's dK and dV summed over each group.

    python -m pytest -x -q tests/test_backward_sm100_gpu.py
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from test_backward_sm90_gpu import _inputs  # noqa: E402

from fa4lab.acceptance import gradient_violations, same_dtype_gradients  # noqa: E402

pytestmark = pytest.mark.sm100

# (seqlen_q, seqlen_k): single rows, tails of the 128-row and 128-key tiles, seqlen_q >
# seqlen_k (causal leaves the first rows without a key) and < seqlen_k, several blocks.
SEQLENS = [(1, 1), (1, 300), (113, 203), (203, 113), (256, 256), (129, 1), (300, 517)]


def _check(q, k, v, do, *, causal=False):
    from fa4lab.call import check_call
    from fa4lab.kernels.launch_backward import backward, saved_forward
    from fa4lab.reference_backward import attention_backward_reference
    from fa4lab.spec import normalize_mask

    causal_n, window_n = normalize_mask(causal, (None, None))
    call = check_call(q, k, v, causal=causal, arch="sm100")
    out, lse = saved_forward(call, "sm100")
    got = backward(call, out, do, lse, arch="sm100")
    ref = attention_backward_reference(q, k, v, do, causal=causal_n, window_size=window_n,
                                       finite=False)
    pt = same_dtype_gradients(q, k, v, do, causal=causal_n, window_size=window_n)
    problems = gradient_violations(got[:3], ref, pt)
    assert not problems, "; ".join(problems)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_dense(d, causal):
    for i, (sq, sk) in enumerate(SEQLENS):
        _check(*_inputs(2, sq, sk, 4, 4, d, d, torch.bfloat16, 300 + i), causal=causal)


@pytest.mark.parametrize("d", [64, 128])
def test_fp16(d):
    _check(*_inputs(1, 203, 113, 4, 4, d, d, torch.float16, 3), causal=True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_gqa(d, causal):
    # 8 query heads on 2 KV heads; lengths with both tails, several blocks, seqlen_q > seqlen_k
    for i, (sq, sk) in enumerate([(113, 203), (203, 113), (300, 517)]):
        _check(*_inputs(2, sq, sk, 8, 2, d, d, torch.bfloat16, 400 + i), causal=causal)
