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


def windowed_reference(q, k, v, *, causal, softmax_scale, return_lse, window_size=(None, None),
                       learnable_sink=None, drop=()):
    """The reference rounded to 16 bits, optionally dropping a window or the sink (a bug)."""
    window = (None, None) if "window" in drop else window_size
    sink = None if "sink" in drop else learnable_sink
    out, lse = attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                   return_lse=True, window_size=window, learnable_sink=sink)
    return out.to(q.dtype), lse.float()


def _sink(hq=4, seed=3):
    return torch.randn(hq, generator=torch.Generator().manual_seed(seed)) * 2


@pytest.mark.parametrize("window", [(5, 0), (3, 7), (None, 2), (0, None)])
def test_windows_and_sinks_pass_when_right(window):
    q, k, v = _inputs(sq=70, sk=20)          # windows that leave rows with no key
    check_kernel(windowed_reference, q, k, v, causal=False, window_size=window)
    sink = _sink()
    sink[1] = -float("inf")                  # no sink on head 1: its empty rows keep -inf
    check_kernel(windowed_reference, q, k, v, causal=False, window_size=window,
                 learnable_sink=sink)


@pytest.mark.parametrize("drop", ["window", "sink"])
def test_a_kernel_that_ignores_the_window_or_the_sink_fails(drop):
    q, k, v = _inputs(seed=2)
    with pytest.raises(AssertionError, match="kernel error|LSE|exactly 0"):
        check_kernel(windowed_reference, q, k, v, causal=True, window_size=(4, 0),
                     learnable_sink=_sink(), drop=(drop,))


def test_the_sequence_check_passes_the_reference_and_fails_a_wrong_row():
    """`check_sequences`, the varlen form of the rule: the rounded reference passes, an empty
    sequence and a fully masked row included; one row moved fails, naming its sequence."""
    from kernel_checks import check_sequences

    from fa4lab.reference import attention_varlen_reference

    g = torch.Generator().manual_seed(3)
    lens_q, lens_k = [5, 0, 9], [7, 3, 4]
    q = torch.randn(sum(lens_q), 4, 32, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(sum(lens_k), 2, 32, generator=g).to(torch.bfloat16) for _ in range(2))
    cu_q = [0, 5, 5, 14]
    cu_k = [0, 7, 10, 14]
    ref, ref_lse = attention_varlen_reference(q, k, v, *(torch.tensor(c, dtype=torch.int32)
                                                         for c in (cu_q, cu_k)),
                                              causal=True, return_lse=True)
    opts = dict(causal=True, window_size=(None, None), softcap=0.0, learnable_sink=None)

    def kv_of(b):
        return k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]]

    out, lse = ref.to(q.dtype), ref_lse.float()
    check_sequences(out, lse, ref, ref_lse, q, cu_q, lens_k, kv_of, opts)
    wrong = out.clone()
    wrong[12] += 0.1
    with pytest.raises(AssertionError, match=r"sequence 2 .*error"):
        check_sequences(wrong, lse, ref, ref_lse, q, cu_q, lens_k, kv_of, opts)


def _grad_problem(sq=40, sk=70, hq=4, hkv=2, d=16, seed=5, dtype=torch.float32, **options):
    """Float inputs on the CPU, their float64 gradients, the same-dtype yardstick's, and dout."""
    from fa4lab.acceptance import same_dtype_gradients
    from fa4lab.reference_backward import attention_backward_reference

    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(*shape, generator=g).to(dtype) for shape in
                   ((1, sq, hq, d), (1, sk, hkv, d), (1, sk, hkv, d), (1, sq, hq, d)))
    ref = attention_backward_reference(q, k, v, do, finite=False, **options)
    return ref, same_dtype_gradients(q, k, v, do, **options)


@pytest.mark.parametrize("options", [dict(causal=True), dict(window_size=(5, 0)),
                                     dict(softcap=3.0, learnable_sink=_sink().double())])
def test_the_gradient_yardstick_is_the_reference_in_float64(options):
    """`same_dtype_gradients` computes the reference's gradients (rows that see no key give 0;
    with a sink, d(sink) too): in float64 they agree to rounding."""
    ref, pt = _grad_problem(sq=70, sk=20, dtype=torch.float64, **options)
    for name, r, p in zip(("dq", "dk", "dv", "dsink"), ref, pt):
        if r is not None:
            torch.testing.assert_close(p, r, rtol=1e-9, atol=1e-9, msg=name)


def test_the_gradient_rule_passes_exact_gradients_and_fails_wrong_ones():
    """`gradient_violations`: the float64 gradients rounded to the inputs' dtype pass; one
    element of dk moved, a NaN in dv, a dq of the wrong dtype or a moved d(sink) each fail,
    naming the gradient."""
    from fa4lab.acceptance import gradient_violations

    ref, pt = _grad_problem(causal=True, learnable_sink=_sink())
    exact = [r.float() for r in ref]
    assert gradient_violations(exact, ref, pt) == []
    for i, name, wrong in ((1, "dk", lambda x: _moved(x, x.view(-1)[0] + 1e-2)),
                           (2, "dv", lambda x: _moved(x, float("nan"))),
                           (0, "dq", lambda x: x.double()),
                           (3, "dsink", lambda x: _moved(x, x.view(-1)[0] + 1e-1))):
        grads = list(exact)
        grads[i] = wrong(grads[i])
        problems = gradient_violations(grads, ref, pt)
        assert len(problems) == 1 and problems[0].startswith(name), problems


def _moved(x, value):
    """x with its first element set to value."""
    y = x.clone()
    y.view(-1)[0] = value
    return y
