"""The GPU acceptance check itself, on CPU: it passes a correct kernel and fails wrong ones."""

import pytest

torch = pytest.importorskip("torch")

from kernel_checks import check_kernel  # noqa: E402

from fa4lab.reference import attention_reference  # noqa: E402


def _inputs(sq=40, sk=70, hq=4, hkv=2, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, s, h, d, generator=g).to(torch.bfloat16)
                 for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))


def rounded_reference(q, k, v, *, causal, softmax_scale, return_lse, shift=0.0, scale_bug=1.0):
    out, lse = attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                   return_lse=True)
    return (out * scale_bug + shift).to(q.dtype), lse.float()


@pytest.mark.parametrize("causal", [False, True])
def test_a_correct_kernel_passes(causal):
    q, k, v = _inputs()
    check_kernel(rounded_reference, q, k, v, causal=causal)


def test_fully_masked_rows_pass_when_zero():
    q, k, v = _inputs(sq=70, sk=20)          # causal: the first 50 rows see no key
    check_kernel(rounded_reference, q, k, v, causal=True)


@pytest.mark.parametrize("bug", [dict(shift=0.05), dict(scale_bug=1.1)])
def test_a_wrong_kernel_fails(bug):
    q, k, v = _inputs(seed=1)
    with pytest.raises(AssertionError, match="kernel error"):
        check_kernel(rounded_reference, q, k, v, causal=False, **bug)
