"""The kernels' argument contract (`fa4lab.kernels.device.arguments`) on the CPU: each variant
takes exactly its tensors, and anything missing or extra is a ValueError naming why."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("cutlass")

from fa4lab.kernels.device import arguments  # noqa: E402

T = object()    # a tensor stands in: the contract only asks whether one is given
NOTE = "Note [sm90 varlen]"


def _kernel(mask_mod=False, page_size=None, varlen=False, split_kv=False):
    return SimpleNamespace(has_mask_mod=mask_mod, page_size=page_size, varlen=varlen,
                           split_kv=split_kv)


def _call(kernel, *, mask_blocks=None, cu_q=None, cu_k=None, used=None, tiles=None,
          pages=None, o_part=None, lse_part=None):
    arguments.check_call(kernel, NOTE, mask_blocks, cu_q, cu_k, used, tiles, pages, o_part,
                         lse_part)


VARIANTS = {    # what each variant's launch passes (fa4lab.kernels.launch)
    "dense": (_kernel(), {}),
    "mask_mod": (_kernel(mask_mod=True), {"mask_blocks": T}),
    "seqused_k": (_kernel(), {"used": T}),
    "paged": (_kernel(page_size=16), {"used": T, "pages": T}),
    "varlen": (_kernel(varlen=True), {"cu_q": T, "cu_k": T, "used": T, "tiles": T}),
    "paged varlen": (_kernel(page_size=128, varlen=True),
                     {"cu_q": T, "used": T, "tiles": T, "pages": T}),
    "split": (_kernel(split_kv=True), {"o_part": T, "lse_part": T}),
    "paged split": (_kernel(page_size=64, split_kv=True),
                    {"used": T, "pages": T, "o_part": T, "lse_part": T}),
}
OPTIONAL = ("mask_blocks", "cu_q", "cu_k", "pages", "o_part", "lse_part", "tiles")


@pytest.mark.parametrize("name", list(VARIANTS))
def test_each_variant_takes_its_tensors_and_no_other(name):
    kernel, given = VARIANTS[name]
    _call(kernel, **given)
    for arg in OPTIONAL:                 # one tensor dropped, or one added: refused
        changed = {k: v for k, v in given.items() if k != arg} if arg in given \
            else {**given, arg: T}
        with pytest.raises(ValueError, match="takes"):
            _call(kernel, **changed)


def test_a_paged_kernel_needs_seqused_k():
    with pytest.raises(ValueError, match="page table and seqused_k"):
        _call(_kernel(page_size=16), pages=T)


def test_variants_no_kernel_builds():
    arguments.check_variant(True, False, False, NOTE)
    with pytest.raises(ValueError, match="without pack-GQA.*sm90 varlen"):
        arguments.check_variant(True, False, True, NOTE)
    with pytest.raises(ValueError, match="split-KV does not compose with varlen"):
        arguments.check_variant(True, True, False, NOTE)


def test_packed_views_leave_a_non_varlen_call_alone():
    tensors = tuple(object() for _ in range(5))
    assert arguments.packed_views(False, False, *tensors) == tensors
