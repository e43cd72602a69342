"""Every launch path against the kernel's argument contract, on the CPU.

`KernelArgs.fake` (fa4lab.kernels.device.arguments) is the contract each compiled kernel is
built with: which slots are tensors, their ranks, and which sizes are one symbol (the launch's
argument check on the GPU rejects a call whose sizes disagree). `launch.forward`,
`launch.partials` and `launch.forward_varlen` build the real arguments (`KernelArgs.of` a
checked call). Here a recording stand-in takes the compiled
function's place, and `contract_mismatches` holds what each path passes to the contract of the
kernel of its key, for every kernel family (dense, paged, split, varlen, paged varlen) at every
head-dim pair of both archs. A launch that would fail the GPU's argument check (the paged varlen
launch's page table once had one row fewer than its seqused_k, which the contract declared one
size) fails here first.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("cutlass")

from fa4lab.call import check_call  # noqa: E402
from fa4lab.kernels import launch  # noqa: E402
from fa4lab.kernels.compile import contract_mismatches  # noqa: E402
from fa4lab.kernels.device.arguments import KernelArgs  # noqa: E402
from fa4lab.limits import head_dims_for  # noqa: E402
from fa4lab.varlen import check_varlen  # noqa: E402

PAIRS = [(arch, d, dv) for arch in ("sm90", "sm100") for d, dv in head_dims_for(arch)]
FAMILIES = ("dense", "paged", "split", "varlen", "paged-varlen")


class Recorder:
    """Stands in for the compiled function of `key`: keeps the arguments of each call."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


@pytest.fixture
def recorded(monkeypatch):
    """(key, args) of every launch while the test runs, the kernels replaced by recorders."""
    calls = []

    def kernel_for(key, mods=None):
        rec = Recorder()
        calls.append((key, rec))
        return rec

    monkeypatch.setattr(launch, "kernel_for", kernel_for)
    return calls


def _tensors(d, dv, *, varlen=False, page_size=None, batch=3, sq=70, sk=200, hq=4, hkv=2):
    gen = torch.Generator().manual_seed(d * 7 + dv)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    lead_q = (batch * sq,) if varlen else (batch, sq)
    q = rand(*lead_q, hq, d)
    if page_size is None:
        lead_k = (batch * sk,) if varlen else (batch, sk)
        return q, rand(*lead_k, hkv, d), rand(*lead_k, hkv, dv), None
    pages = -(-sk // page_size)
    table = torch.randperm(batch * pages, generator=gen).view(batch, pages).to(torch.int32)
    return (q, rand(batch * pages, page_size, hkv, d), rand(batch * pages, page_size, hkv, dv),
            table)


def _launch(family, arch, d, dv):
    page_size = 16 if "paged" in family else None   # a divisor of every key block
    varlen = "varlen" in family
    q, k, v, table = _tensors(d, dv, varlen=varlen, page_size=page_size)
    if family == "split":
        return launch.partials(check_call(q, k, v), arch, 2)
    if not varlen:
        return launch.forward(check_call(q, k, v, causal=True, return_lse=True, num_splits=1,
                                         page_table=table), arch)
    batch = 3
    lens_q = torch.tensor([0, 1, 3 * 70 - 1], dtype=torch.int32)
    cu_q = torch.cat([torch.zeros(1, dtype=torch.int32), lens_q.cumsum(0).to(torch.int32)])
    if table is None:
        cu_k = torch.tensor([0, 200, 400, 600], dtype=torch.int32)
        lengths = check_varlen(q, k, v, cu_q, cu_k, None, None)
    else:
        used = torch.tensor([5, 0, 200], dtype=torch.int32)
        lengths = check_varlen(q, k, v, cu_q, None, None, None, used, table)
    assert lengths.batch == batch
    return launch.forward_varlen(check_call(q, k, v, causal=True, return_lse=True,
                                            page_table=table, lengths=lengths), arch)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("arch", "d", "dv"), PAIRS, ids=[f"{a}-{d}-{dv}" for a, d, dv in PAIRS])
def test_every_launch_path_keeps_the_kernel_contract(recorded, family, arch, d, dv):
    _launch(family, arch, d, dv)
    assert len(recorded) == 1
    key, rec = recorded[0]
    assert len(rec.calls) == 1, "one launch"
    contract = KernelArgs.fake(key)
    assert contract_mismatches(contract, list(rec.calls[0])) == []


def test_a_launch_that_breaks_the_contract_is_named(recorded):
    """The check can fail: the page table one row short of seqused_k, as a varlen launch
    with the contract's old shared batch symbol would see it, and a misaligned stride."""
    _launch("paged", "sm90", 128, 128)
    key, rec = recorded[0]
    args = list(rec.calls[0])
    contract = KernelArgs.fake(key)
    slot = {name: i for i, name in enumerate(KernelArgs._fields)}
    short = list(args)
    short[slot["page_table"]] = args[slot["page_table"]][:-1]
    assert any("page_table.shape[0]" in p for p in contract_mismatches(contract, short))
    wide = list(args)
    wide[slot["q"]] = torch.zeros(3, 70, 4, 129, dtype=torch.bfloat16)[..., :128]
    found = contract_mismatches(contract, wide)
    assert any("q.stride" in p for p in found), found
    missing = list(args)
    missing[slot["seqused_k"]] = None
    assert any("seqused_k" in p for p in contract_mismatches(contract, missing))
