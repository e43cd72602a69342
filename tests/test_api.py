"""`fa4lab.attention` on CPU: the labelled slow fallback to the reference, and input errors."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fa4lab  # noqa: E402
from fa4lab.api import SlowReferenceWarning  # noqa: E402
from fa4lab.call import check_call  # noqa: E402
from fa4lab.reference import attention_reference  # noqa: E402


def _qkv(rng, b=2, sq=9, sk=13, hq=4, hkv=2, d=16, dtype=torch.float32):
    q = torch.from_numpy(rng.standard_normal((b, sq, hq, d))).to(dtype)
    k = torch.from_numpy(rng.standard_normal((b, sk, hkv, d))).to(dtype)
    v = torch.from_numpy(rng.standard_normal((b, sk, hkv, d))).to(dtype)
    return q, k, v


@pytest.mark.parametrize("causal", [False, True])
def test_cpu_falls_back_to_reference_with_warning(rng, causal):
    q, k, v = _qkv(rng, sq=17, sk=5)  # causal: the first 12 rows see no key
    with pytest.warns(SlowReferenceWarning, match="SLOW"):
        out, lse = fa4lab.attention(q, k, v, causal=causal, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, causal=causal, return_lse=True)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert out.shape == (2, 17, 4, 16) and lse.shape == (2, 4, 17)
    np.testing.assert_allclose(out.double().numpy(), ref.numpy(), atol=1e-6)
    np.testing.assert_allclose(lse.double().numpy(), ref_lse.numpy(), atol=1e-5)
    assert not torch.isnan(out).any()
    if causal:
        assert (lse[:, :, :12] == -math.inf).all() and (out[:, :12] == 0).all()


def test_cpu_bf16_and_scale(rng):
    q, k, v = _qkv(rng, dtype=torch.bfloat16)
    with pytest.warns(SlowReferenceWarning):
        out = fa4lab.attention(q, k, v, softmax_scale=0.5)
    ref = attention_reference(q, k, v, softmax_scale=0.5)
    assert out.dtype == torch.bfloat16
    assert (out.double() - ref).abs().max() < 2e-2  # one bf16 rounding of values ~1


@pytest.mark.parametrize("causal", [False, True])
def test_cpu_softcap_is_the_reference_s(rng, causal):
    """softcap (upstream FA4's name and meaning) reaches the reference on a CPU; a cap changes
    the answer, and a bad one raises before anything runs."""
    q, k, v = _qkv(rng, sq=17, sk=9)
    q = q * 8  # scores well past the cap
    with pytest.warns(SlowReferenceWarning):
        out, lse = fa4lab.attention(q, k, v, causal=causal, softcap=3.0, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, causal=causal, softcap=3.0, return_lse=True)
    np.testing.assert_allclose(out.double().numpy(), ref.numpy(), atol=1e-6)
    np.testing.assert_allclose(lse.double().numpy(), ref_lse.numpy(), atol=1e-5)
    plain = attention_reference(q, k, v, causal=causal)
    assert (ref - plain).abs().max() > 1e-2
    with pytest.raises(ValueError, match="softcap"):
        fa4lab.attention(q, k, v, softcap=-1.0)


@pytest.mark.parametrize("make, exc, words", [
    (lambda q, k, v: (q[0], k, v), ValueError, "expected 4 dims"),
    (lambda q, k, v: (q, k[:1], v[:1]), ValueError, "batch"),
    (lambda q, k, v: (q, k, v[:, :3]), ValueError, "seqlen_k"),
    (lambda q, k, v: (q[:, :, :3], k, v), ValueError, "multiple"),
    (lambda q, k, v: (q, k[..., :8], v), ValueError, "head_dim"),
    (lambda q, k, v: (q, k.double(), v), TypeError, "dtype"),
    (lambda q, k, v: (q.long(), k.long(), v.long()), TypeError, "floating"),
    (lambda q, k, v: (q.numpy(), k, v), TypeError, "torch.Tensor"),
])
def test_bad_inputs_raise_clear_errors(rng, make, exc, words):
    q, k, v = make(*_qkv(rng))
    with pytest.raises(exc, match=words):
        fa4lab.attention(q, k, v)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("inf"), float("nan")])
def test_bad_softmax_scale(rng, scale):
    with pytest.raises(ValueError, match="softmax_scale"):
        fa4lab.attention(*_qkv(rng), softmax_scale=scale)


def test_kernel_input_checks(rng):
    """What the GPU kernels need beyond the math: checked before any launch, per arch."""
    q, k, v = _qkv(rng, d=64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        check_call(q.float(), k.float(), v.float(), arch="sm90")
    # Unbuilt head dims: the kernel check names what the kernel builds and the padded pair the
    # API runs them on (fa4lab.canonical); wider than every pair: what to do.
    q80, k80, v80 = _qkv(rng, d=80, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"\(80, 80\) is not built by the sm90 kernel, which "
                       r"builds 64, 96, 128, 256.*\(192, 128\).*zero-padded to \(96, 96\)"):
        check_call(q80, k80, v80, arch="sm90")
    q160, k160, v160 = _qkv(rng, d=160, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"\(160, 128\) is not built by the sm100 kernel.*"
                                         r"zero-padded to \(192, 128\)"):
        check_call(q160, k160, v160[..., :128].contiguous(), arch="sm100")
    q288, k288, v288 = _qkv(rng, d=288, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"\(288, 288\) is wider than any pair the sm90 "
                                         r"kernel builds \(each side at most 256"):
        check_call(q288, k288, v288, arch="sm90")
    with pytest.raises(ValueError, match="head_dim_v"):
        check_call(q, k, v[..., :32].contiguous(), arch="sm90")
    # Built pairs pass the head-dim check (and stop at the next one: CPU tensors).
    for d, dv in ((96, 96), (192, 128)):
        qd, kd, _ = _qkv(rng, d=d, dtype=torch.bfloat16)
        vd = _qkv(rng, d=dv, dtype=torch.bfloat16)[2]
        for arch in ("sm90", "sm100"):
            with pytest.raises(ValueError, match="needs CUDA tensors"):
                check_call(qd, kd, vd, arch=arch)
    qt = q.transpose(1, 3).contiguous().transpose(1, 3)  # same values, last dim strided
    with pytest.raises(ValueError, match=r"\.contiguous\(\)"):
        check_call(qt, k, v, arch="sm90")
    unaligned = torch.zeros(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape)
    with pytest.raises(ValueError, match="16-byte aligned"):
        check_call(unaligned, k, v, arch="sm90")
    # Everything a kernel needs except the GPU: the last check says where the tensors must be.
    with pytest.raises(ValueError, match=r"\.cuda\(\)"):
        check_call(q, k, v, arch="sm90")
    check_call(q, k, v)  # the math alone is fine on CPU


def test_kernel_layout_is_checked_at_every_rank():
    """`check_kernel_layout`, the rule every call in a kernel's form keeps
    (`fa4lab.call.Call.for_kernel`), on packed (total, heads, d) and paged (pages, page_size,
    heads, d) tensors as on dense ones: an
    InputError naming the tensor, before anything runs."""
    from fa4lab.errors import InputError
    from fa4lab.spec import check_kernel_layout

    for shape in ((50, 4, 96), (6, 16, 2, 64), (2, 30, 4, 128)):
        t = torch.zeros(shape, dtype=torch.bfloat16)
        check_kernel_layout(q=t, k=t[1:], v=t[..., :shape[-1]])
        with pytest.raises(InputError, match="k has strides .* last dim must be contiguous"):
            check_kernel_layout(q=t, k=t.transpose(-1, -2).contiguous().transpose(-1, -2))
        flat = torch.zeros(t.numel() + 1, dtype=t.dtype)
        with pytest.raises(InputError, match=r"v is not 16-byte aligned.*v\.contiguous\(\)"):
            check_kernel_layout(q=t, v=flat[1:].view(shape))
        wide = torch.zeros(*shape[:-1], shape[-1] + 4, dtype=t.dtype)[..., :shape[-1]]
        with pytest.raises(InputError, match="q is not 16-byte aligned"):
            check_kernel_layout(q=wide)


def test_error_vs_reference_on_cpu(rng):
    """The notebook's measurement: on CPU the fallback is the reference itself (error ~0)."""
    from fa4lab.api import error_vs_reference

    q, k, v = _qkv(rng, sq=12, sk=5, dtype=torch.bfloat16)
    r = error_vs_reference(q, k, v, causal=True)
    assert r["no_nan"] and r["empty_rows_ok"]
    assert r["kernel"] < 1e-2 and r["lse"] < 1e-6  # the reference, rounded to bf16
    assert 0 < r["sdpa"] < 5e-2                   # SDPA's own bf16 error is not zero


def test_the_first_call_does_not_import_dynamo():
    """`import fa4lab.api` and an eager call leave torch._dynamo unimported (a second or more
    of a student's first call): only a traced call with mods needs torch.compiler.disable."""
    import subprocess
    import sys

    code = ("import sys, warnings, torch, fa4lab; warnings.simplefilter('ignore'); "
            "q = torch.randn(1, 8, 2, 64); fa4lab.attention(q, q, q, causal=True); "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "False"


def test_nan_inputs_follow_the_same_rule_as_on_a_gpu():
    """Note [the same rules on CPU and GPU]: the CPU path does not read q, k, v's values; a NaN
    flows through the arithmetic (into the outputs of its head; another head stays finite), as
    through a kernel, instead of raising; the explicit reference still refuses it."""
    import warnings

    from fa4lab.api import SlowReferenceWarning
    from fa4lab.reference import attention_reference

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 6, 2, 16, generator=g) for _ in range(3))
    v[0, 4, 0, 0] = float("nan")        # key 4 of head 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowReferenceWarning)
        out = fa4lab.attention(q, k, v, causal=True)
    assert out[0, 4:, 0].isnan().any() and not out[0, :, 1].isnan().any()
    with pytest.raises(ValueError, match="v contains NaN or inf"):
        attention_reference(q, k, v)
