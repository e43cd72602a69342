"""The one call contract (`fa4lab.call`): `check_call` checks a forward call once and describes
it by a sized spec; `Call.for_kernel` brings it to a kernel's form, `Call.key` names the kernel
and `KernelArgs.of` fills its arguments. Note [one check per call]."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fa4lab import spec as spec_module  # noqa: E402
from fa4lab.call import check_call  # noqa: E402
from fa4lab.errors import InputError  # noqa: E402
from fa4lab.plan.key import KernelKey  # noqa: E402


def _qkv(hq=4, hkv=2, sq=3, sk=5, d=8, dtype=torch.float32):
    return (torch.zeros(1, sq, hq, d, dtype=dtype), torch.zeros(1, sk, hkv, d, dtype=dtype),
            torch.zeros(1, sk, hkv, d, dtype=dtype))


# --------------------------------------------------------------------------- the checks


def test_check_call_accepts_the_options():
    q, k, v = _qkv()
    check_call(q, k, v)
    check_call(q, k, v, window_size=(None, None), softcap=0.0, learnable_sink=None)
    check_call(q, k, v, softmax_scale=0.5, window_size=[3, 0], softcap=30.0,
               learnable_sink=torch.zeros(4))
    check_call(q, k, v, window_size=(0, 0), softcap=1)


@pytest.mark.parametrize("kwargs,err,words", [
    (dict(window_size=(2,)), TypeError, "window_size must be a pair"),
    (dict(window_size=None), TypeError, "window_size must be a pair"),
    (dict(window_size=(2.0, None)), TypeError, "window_size.*left must be an int"),
    (dict(causal=True, window_size=(4, 2)), ValueError, "causal=True with window_size=.4, 2."),
    (dict(softcap=-0.5), ValueError, "softcap must be 0.0"),
    (dict(softcap=float("nan")), ValueError, "softcap must be 0.0"),
    (dict(softcap=None), TypeError, "softcap must be a number"),
    (dict(softmax_scale=-1.0), ValueError, "softmax_scale must be a positive finite number"),
    (dict(softmax_scale=float("inf")), ValueError, "softmax_scale must be a positive finite"),
    (dict(learnable_sink=torch.zeros(2)), ValueError,
     r"learnable_sink has shape \(2,\): expected \(heads_q,\) = \(4,\)"),
    (dict(learnable_sink=torch.zeros(1, 4)), ValueError, r"learnable_sink has shape \(1, 4\)"),
    (dict(learnable_sink=torch.zeros(4, dtype=torch.bfloat16)), TypeError,
     r"learnable_sink has dtype torch.bfloat16.*float32.*learnable_sink.float\(\)"),
    (dict(learnable_sink=torch.zeros(4, dtype=torch.float64)), TypeError,
     "learnable_sink has dtype torch.float64"),
    (dict(learnable_sink=torch.zeros(4, device="meta")), ValueError,
     r"learnable_sink is on meta but q is on cpu.*learnable_sink.to\(q.device\)"),
    (dict(learnable_sink=np.zeros(4, dtype=np.float32)), TypeError,
     "learnable_sink must be a torch.Tensor"),
    (dict(learnable_sink=[0.0] * 4), TypeError, "learnable_sink must be a torch.Tensor"),
    (dict(pack_gqa="yes"), TypeError, r"pack_gqa must be None \(choose\), True or False"),
    (dict(persistent=1), TypeError, r"persistent must be None \(choose\), True or False"),
    (dict(deterministic=None), TypeError, "deterministic must be True or False"),
    (dict(num_splits=0), ValueError, "num_splits must be >= 1"),
])
def test_check_call_names_the_bad_option(kwargs, err, words):
    with pytest.raises(err, match=words):
        check_call(*_qkv(), **kwargs)


@pytest.mark.parametrize("tensors,err,words", [
    ((np.zeros((1, 3, 4, 8)),) + _qkv()[1:], TypeError, "q must be a torch.Tensor"),
    (_qkv()[:2] + (torch.zeros(1, 5, 2, 8, dtype=torch.float64),), TypeError,
     "q, k, v must share one dtype"),
    ((torch.zeros(1, 3, 4, 8, dtype=torch.int32),) * 3, TypeError, "floating point"),
    (_qkv(hq=3), ValueError, "heads_q=3 is not a multiple of heads_kv=2"),
    (_qkv()[:1] + (torch.zeros(1, 5, 2, 16),) + _qkv()[2:], ValueError,
     "q and k must have the same head_dim"),
])
def test_check_call_names_the_bad_tensor(tensors, err, words):
    with pytest.raises(err, match=words):
        check_call(*tensors)


def test_check_call_takes_its_options_by_keyword():
    params = inspect.signature(check_call).parameters
    assert list(params)[:3] == ["q", "k", "v"]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in list(params.values())[3:])
    assert (params["window_size"].default, params["softcap"].default,
            params["learnable_sink"].default, params["arch"].default) == (
        (None, None), 0.0, None, None)


# --------------------------------------------------------------------------- the Call


def test_the_call_holds_a_sized_spec_with_the_mask_in_one_form():
    q, k, v = _qkv(sq=3, sk=5, dtype=torch.bfloat16)
    call = check_call(q, k, v, window_size=(7, 0), softcap=2, softmax_scale=1, return_lse=1)
    s = call.spec
    assert (s.batch, s.seqlen_q, s.seqlen_k, s.heads_q, s.heads_kv, s.head_dim) == (
        1, 3, 5, 4, 2, 8)
    assert s.dtype == "bf16" and s.return_lse is True and s.softcap == 2.0
    assert s.causal and call.window_size == (7, None)       # right = 0 is causal
    assert s.softmax_scale == 1.0 and not call.empty and call.sink is None
    assert call.options() == dict(causal=True, softmax_scale=1.0, window_size=(7, None),
                                  softcap=2.0, learnable_sink=None)
    with pytest.raises(AttributeError):
        call.q = q                                          # frozen


def test_an_empty_call_is_checked_and_flagged():
    """Note [empty calls]: no query row or no key is answered without a launch; its options
    are checked all the same."""
    for sq, sk in ((0, 5), (3, 0)):
        call = check_call(*_qkv(sq=sq, sk=sk), causal=True)
        assert call.empty and call.spec.causal
        with pytest.raises(TypeError, match="window_size must be a pair"):
            check_call(*_qkv(sq=sq, sk=sk), window_size=3)
    assert not check_call(*_qkv()).empty


def test_the_kernel_form_is_checked_once_per_need():
    """`Call.for_kernel` without padding refuses what the kernel does not build; with padding
    (the API) pads the head dims to a built pair and makes the scale explicit."""
    q, k, v = _qkv(d=80, dtype=torch.bfloat16)
    call = check_call(q, k, v)
    with pytest.raises(InputError, match=r"\(80, 80\) is not built by the sm90 kernel"):
        call.for_kernel("sm90", pad=False)
    with pytest.raises(InputError, match="needs CUDA tensors"):  # padded, then the device
        call.for_kernel("sm90")
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        check_call(*_qkv(d=64)).for_kernel("sm90")


def test_the_kernel_form_pads_and_keeps_the_spec_with_the_tensors(monkeypatch):
    q, k, v = _qkv(d=80, dtype=torch.bfloat16)
    monkeypatch.setattr(type(q), "is_cuda", property(lambda self: True))
    call = check_call(q, k, v, window_size=(2, None)).for_kernel("sm90")
    assert call.q.shape[-1] == call.spec.head_dim == 96 and call.spec.head_dim_v == 96
    assert call.spec.softmax_scale == pytest.approx(80 ** -0.5)    # the caller's default
    assert call.window_size == (2, None)
    ready = check_call(*_qkv(d=64, dtype=torch.bfloat16))
    assert ready.for_kernel("sm90") is ready                        # nothing to do


# --------------------------------------------------------------------------- the key


def test_the_key_is_the_spec_without_sizes_and_the_switches_resolved():
    q, k, v = _qkv(hq=8, hkv=2, sq=8, sk=8, d=128, dtype=torch.bfloat16)
    sink = torch.zeros(8)
    call = check_call(q, k, v, window_size=(64, None), learnable_sink=sink, return_lse=True,
                      softcap=3.0)
    key = call.key("sm90")
    assert isinstance(key, KernelKey)
    assert (key.head_dim, key.head_dim_v, key.dtype, key.causal, key.qhead_per_kvhead) == (
        128, 128, "bf16", False, 4)
    assert key.window_sides == (True, False) and key.sink and key.softcap and key.return_lse
    assert key.persistent is not None              # sm90 resolves it for the shape
    assert key.pack_gqa is True                    # pack_gqa None: limits.pack_gqa_default
    assert call.key("sm100").persistent is None    # the sm100 plan decides
    other = check_call(q, k, v, window_size=(3, None), learnable_sink=torch.ones(8),
                       return_lse=True, softcap=9.0)
    assert other.key("sm90") == key                # sizes and values are runtime values
    split = call.key("sm90", split_kv=True)        # the combine gives the LSE and the sink
    assert split.split_kv and not split.return_lse and not split.sink
    assert check_call(q, k, v, pack_gqa=False).key("sm90").pack_gqa is False


# --------------------------------------------------------------------------- the arguments


def test_kernel_args_of_a_call_read_its_spec():
    from fa4lab.kernels.device.arguments import KernelArgs, scale_args, window_args

    q, k, v = _qkv(sq=3, sk=5, dtype=torch.bfloat16)
    sink = torch.zeros(4)
    call = check_call(q, k, v, window_size=(10**9, 1), learnable_sink=sink, softcap=2.0,
                      softmax_scale=0.25)
    out = torch.empty_like(q)
    args = KernelArgs.of(call, out, None, num_splits=3)
    assert args.q is q and args.k is k and args.v is v and args.out is out and args.sink is sink
    assert (args.scale_log2, args.pre_scale) == scale_args(0.25, 8, 2.0)
    assert (args.window_left, args.window_right) == window_args((10**9, 1), 3, 5) == (5, 1)
    assert args.num_splits == 3 and args.aux is None and args.page_table is None
    assert KernelArgs.of(call, out, sink=None).sink is None     # a slot replaced by name


# --------------------------------------------------------------------------- one check


def test_a_kernel_call_checks_its_window_once(monkeypatch):
    """Note [one check per call]: `fa4lab.attention` on a (faked) B200 validates the window
    once, in `check_call`'s spec; the key, the arguments and the launch read it from the Call
    (the kernel replaced by a recorder: no compile, so no canonical spec of the key)."""
    import fa4lab
    from fa4lab.kernels import launch

    checks, launched = [], []
    normalize = spec_module.normalize_mask

    def counted(*args, **kwargs):
        checks.append(args)
        return normalize(*args, **kwargs)

    q, k, v = _qkv(hq=4, hkv=4, sq=8, sk=8, d=128, dtype=torch.bfloat16)
    monkeypatch.setattr(spec_module, "normalize_mask", counted)
    monkeypatch.setattr(type(q), "is_cuda", property(lambda self: True))
    monkeypatch.setattr(launch, "device_arch", lambda index: "sm100")
    monkeypatch.setattr(launch, "kernel_for",
                        lambda key, mods=None: lambda *args: launched.append((key, args)))
    fa4lab.attention(q, k, v, window_size=(3, 0), return_lse=True)
    assert checks == [(False, (3, 0))]
    (key, args), = launched
    assert key.causal and key.window_sides == (True, False)
    assert (args[8], args[9]) == (3, 0)            # window_left, window_right

