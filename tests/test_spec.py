import math

import numpy as np
import pytest

from fa4lab.spec import AttentionSpec, check_qkv_shapes, normalize_dtype


def test_defaults_and_derived():
    s = AttentionSpec(2, 100, 300, 8, 2, 64)
    assert s.head_dim_v == 64 and s.gqa_ratio == 4
    assert math.isclose(s.scale, 1 / 8)
    assert math.isclose(s.scale_log2, s.scale * math.log2(math.e))
    assert s.flops() == 4 * 2 * 8 * 100 * 300 * 64
    assert s.with_(causal=True).flops() == s.flops() / 2


@pytest.mark.parametrize("kwargs, words", [
    (dict(heads_q=6, heads_kv=4), "not a multiple"),
    (dict(seqlen_q=0), "seqlen_q must be >= 1"),
    (dict(head_dim=-1), "head_dim must be >= 1"),
    (dict(softmax_scale=float("nan")), "softmax_scale"),
])
def test_bad_specs_say_what_is_wrong(kwargs, words):
    base = dict(batch=1, seqlen_q=4, seqlen_k=4, heads_q=4, heads_kv=2, head_dim=64)
    with pytest.raises(ValueError, match=words):
        AttentionSpec(**{**base, **kwargs})


def test_dtype_names():
    assert normalize_dtype("bfloat16") == "bf16" and normalize_dtype("half") == "fp16"
    with pytest.raises(TypeError, match="bf16 or fp16"):
        normalize_dtype("float32")


def test_shape_checks():
    q = np.zeros((1, 3, 4, 8))
    k = np.zeros((1, 5, 2, 8))
    check_qkv_shapes(q, k, k)
    with pytest.raises(ValueError, match="4 dims"):
        check_qkv_shapes(q[0], k, k)
    with pytest.raises(ValueError, match="head_dim"):
        check_qkv_shapes(q, np.zeros((1, 5, 2, 16)), k)
    with pytest.raises(ValueError, match="multiple"):
        check_qkv_shapes(np.zeros((1, 3, 3, 8)), k, k)
    spec = AttentionSpec.from_tensors(q, k, k, causal=True)
    assert (spec.seqlen_q, spec.seqlen_k, spec.heads_q, spec.heads_kv) == (3, 5, 4, 2)
