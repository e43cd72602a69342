"""Every kernel family at every head-dim pair of the GPU's kernel (marker `gpu`).

A head dim or an option proven on one family only is how varlen at head_dim 96 once returned
NaN and garbage while dense attention at 96 and varlen at every other head dim were right. So
this grid is the product, read from `fa4lab.limits` (a new pair joins it by being built): the
five families a call can reach -- dense `fa4lab.attention`, packed `attention_varlen`, a paged
cache (`attention(page_table=)`), split-KV decode over it (`num_splits`), and chunked prefill
(`attention_varlen` with a page table and ragged query counts) -- each at every (head_dim,
head_dim_v) pair, causal, GQA 4, with empty and length-1 sequences and tails, against the
float64 reference under tests/kernel_checks.py's rule. The random crossings of every other
option are `make fuzz-gpu`'s (fa4lab.fuzz).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kernel_checks import check_kernel, check_sequences  # noqa: E402

pytestmark = pytest.mark.gpu

FAMILIES = ("dense", "varlen", "paged", "split", "chunked-prefill")
# (len_q, len_k) per sequence of the ragged families: empty, single rows, fewer keys than
# queries, tails of every tile size, one longer sequence.
LENGTHS = [(0, 40), (1, 1), (40, 40), (82, 1), (130, 0), (757, 269), (129, 1000)]


def _arch():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from fa4lab.kernels.launch import device_arch

    arch = device_arch(torch.cuda.current_device())
    if arch is None:
        pytest.skip(f"no fa4lab kernel for {torch.cuda.get_device_name()}")
    return arch


def _pairs():
    from fa4lab.limits import KERNEL_HEAD_DIMS

    return sorted({p for pairs in KERNEL_HEAD_DIMS.values() for p in pairs})


def _rand(gen, *shape):
    return torch.randn(*shape, device="cuda", generator=gen).to(torch.bfloat16)


def _paged(gen, lens_k, page_size, hkv, d, dv):
    """A cache of pages in random order (one spare) and each sequence's page row."""
    pages = max(1, -(-max(lens_k) // page_size))
    num = len(lens_k) * pages + 1
    table = torch.randperm(num, device="cuda", generator=gen)[:len(lens_k) * pages]
    return (_rand(gen, num, page_size, hkv, d), _rand(gen, num, page_size, hkv, dv),
            table.view(len(lens_k), pages).to(torch.int32))


def _ragged(family, d, dv, gen, hq=8, hkv=2):
    import fa4lab
    from fa4lab.reference import attention_varlen_reference
    from fa4lab.varlen import gather_paged, unpack

    lens_q, lens_k = [a for a, _ in LENGTHS], [b for _, b in LENGTHS]
    q = _rand(gen, sum(lens_q), hq, d)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32,
                        device="cuda")
    opts = dict(causal=True)
    if family == "varlen":
        k, v = _rand(gen, sum(lens_k), hkv, d), _rand(gen, sum(lens_k), hkv, dv)
        cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32,
                            device="cuda")
        args, kw = (q, k, v, cu_q, cu_k, None, None), {}
        ks, vs = unpack(k, cu_k), unpack(v, cu_k)
    else:
        k, v, table = _paged(gen, lens_k, 16, hkv, d, dv)
        used = torch.tensor(lens_k, dtype=torch.int32, device="cuda")
        args, kw = (q, k, v, cu_q, None, None, None), dict(seqused_k=used, page_table=table)
        ks, vs = (gather_paged(c, table, lens_k) for c in (k, v))
    out, lse = fa4lab.attention_varlen(*args, return_lse=True, **kw, **opts)
    ref, ref_lse = attention_varlen_reference(*args[:5], return_lse=True, **kw, **opts)
    full = dict(window_size=(None, None), softcap=0.0, learnable_sink=None, **opts)
    check_sequences(out, lse, ref, ref_lse, q, cu_q.tolist(), lens_k, lambda b: (ks[b], vs[b]),
                    full, what=f", {family} d {d}/{dv}")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("d", "dv"), _pairs(), ids=lambda p: str(p))
def test_every_family_at_every_head_dim_pair(family, d, dv):
    from fa4lab.kernels.launch import attention_on
    from fa4lab.limits import kernel_builds
    from fa4lab.varlen import gather_paged

    arch = _arch()
    if not kernel_builds(arch, d, dv):
        pytest.skip(f"the {arch} kernel does not build head dims ({d}, {dv})")
    gen = torch.Generator(device="cuda").manual_seed(d * 1000 + dv)
    if family in ("varlen", "chunked-prefill"):
        _ragged(family, d, dv, gen)
        return
    hq, hkv = 8, 2
    if family == "dense":
        q, k, v = _rand(gen, 2, 333, hq, d), _rand(gen, 2, 1027, hkv, d), _rand(gen, 2, 1027,
                                                                               hkv, dv)
        check_kernel(lambda *a, **kw: attention_on(arch, *a, **kw), q, k, v, causal=True)
        return
    # decode over a paged cache, one launch or split across CTAs
    q = _rand(gen, 3, 1, hq, d)
    kc, vc, table = _paged(gen, [900] * 3, 16, hkv, d, dv)
    ks, vs = (torch.stack(gather_paged(c, table, [table.shape[1] * 16] * 3)) for c in (kc, vc))
    splits = 3 if family == "split" else 1

    def paged(q_, k_, v_, **kw):
        return attention_on(arch, q_, kc, vc, page_table=table, num_splits=splits, **kw)

    check_kernel(paged, q, ks, vs, causal=False)


@pytest.mark.parametrize("view", ["misaligned", "last-dim-strided"])
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_varlen_views_the_kernel_cannot_read_are_copied(view, which):
    """A packed q, k or v that TMA cannot describe is copied first (Note [copied layouts] in
    fa4lab.canonical), as upstream does: the answer is the contiguous tensors' bit for bit."""
    import fa4lab

    _arch()
    gen = torch.Generator(device="cuda").manual_seed(5)
    t = {name: _rand(gen, 100, 2, 64) for name in "qkv"}
    cu = torch.tensor([0, 60, 100], dtype=torch.int32, device="cuda")
    want = fa4lab.attention_varlen(t["q"], t["k"], t["v"], cu, cu, 60, 60)
    if view == "misaligned":
        flat = torch.zeros(t[which].numel() + 1, dtype=torch.bfloat16, device="cuda")
        t[which] = flat[1:].view(100, 2, 64).copy_(t[which])
    else:
        t[which] = t[which].transpose(-1, -2).contiguous().transpose(-1, -2)
    got = fa4lab.attention_varlen(t["q"], t["k"], t["v"], cu, cu, 60, 60)
    assert torch.equal(got, want)
