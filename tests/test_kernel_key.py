"""`KernelKey` (fa4lab.plan.key): what a compiled kernel is, and its one name."""

from __future__ import annotations

import dataclasses

import pytest

from fa4lab.digest import digest
from fa4lab.plan.key import KernelKey, config_name


def test_key_is_frozen_hashable_and_names_its_switches():
    key = KernelKey("sm90", 64, 64, "bf16", True, 8, pack_gqa=True, persistent=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        key.causal = False
    assert {key: 1}[KernelKey("sm90", 64, 64, "bf16", True, 8, pack_gqa=True,
                              persistent=False)] == 1
    assert key.name == "sm90a-hd64-causal-gqa8-nolse-bf16-packgqa-onetile"
    assert key.disk_key == "fwd-" + digest(key.name)
    assert dataclasses.replace(key, persistent=None).name.endswith("-packgqa")
    assert dataclasses.replace(key, pack_gqa=False, persistent=True).name.endswith(
        "-bf16-persistent")


def test_key_spec_holds_what_the_key_holds():
    key = KernelKey("sm100", 192, 128, "fp16", False, 4, return_lse=True, softcap=True,
                    window_sides=(True, False), sink=True, varlen=True, page_size=16)
    spec = key.spec()
    assert (spec.head_dim, spec.head_dim_v, spec.dtype, spec.qhead_per_kvhead) == \
        (192, 128, "fp16", 4)
    assert spec.return_lse and spec.softcap and spec.learnable_sink and spec.varlen
    assert [side is not None for side in spec.window_size] == [True, False]
    assert spec.page_size == 16 and not spec.split_kv
    assert key.name == config_name(spec, "sm100a")


def test_every_field_changes_the_name():
    """Two keys that differ in any field name two kernels (the disk cache keeps them apart)."""
    base = KernelKey("sm90", 128, 128, "bf16", False, 4, persistent=False)
    other = {"arch": "sm100", "head_dim": 64, "head_dim_v": 64, "dtype": "fp16", "causal": True,
             "qhead_per_kvhead": 2, "return_lse": True, "softcap": True,
             "window_sides": (True, True), "sink": True, "persistent": True, "pack_gqa": True,
             "varlen": True, "split_kv": True, "page_size": 64}
    assert set(other) == {f.name for f in dataclasses.fields(KernelKey)}
    for name, value in other.items():
        changed = dataclasses.replace(base, **{name: value})
        if name == "head_dim":
            changed = dataclasses.replace(changed, head_dim_v=64)
        assert changed.name != base.name, name


def _snake(name: str) -> str:
    """mCuSeqlensQ -> cu_seqlens_q, mLSE -> lse, mOPartial -> out_partial: a kernel parameter's
    KernelArgs name."""
    import re

    if name.startswith("m") and name[1:2].isupper():
        name = {"mO": "mOut", "mOPartial": "mOutPartial", "mLSEPartial": "mLsePartial",
                "mLSE": "mLse", "mSeqUsedK": "mSequsedK"}.get(name, name)[1:]
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


@pytest.mark.parametrize("module,cls", [("fa4lab.kernels.fwd_sm90", "FlashForwardSm90"),
                                        ("fa4lab.kernels.fwd_sm100", "FlashForwardSm100")])
def test_both_kernels_take_kernel_args_in_order(module, cls):
    """Each kernel's __call__ takes KernelArgs' slots, in their order, then the stream: the one
    signature the launches fill (`KernelArgs.of`) and a compile fakes (`KernelArgs.fake`)."""
    import importlib
    import inspect

    from fa4lab.kernels.device.arguments import KernelArgs

    call = getattr(importlib.import_module(module), cls).__call__
    params = list(inspect.signature(inspect.unwrap(call)).parameters)[1:]
    assert [_snake(p) for p in params] == [*KernelArgs._fields, "stream"]


@pytest.mark.parametrize("module,cls", [("fa4lab.kernels.bwd_sm90", "FlashBackwardSm90"),
                                        ("fa4lab.kernels.bwd_sm100", "FlashBackwardSm100")])
def test_both_backward_kernels_take_backward_args_in_order(module, cls):
    """Each backward kernel's __call__ takes BackwardArgs' slots, in their order, then the
    stream: the one signature the launch fills and a compile fakes (`BackwardArgs.fake`)."""
    import importlib
    import inspect

    from fa4lab.kernels.device.arguments import BackwardArgs

    call = getattr(importlib.import_module(module), cls).__call__
    params = list(inspect.signature(inspect.unwrap(call)).parameters)[1:]
    names = {"mdO": "dout", "mdQaccum": "dq_accum", "mdK": "dk", "mdV": "dv", "mLSE": "lse",
             "mD": "d"}
    assert [names.get(p, _snake(p)) for p in params] == [*BackwardArgs._fields, "stream"]
