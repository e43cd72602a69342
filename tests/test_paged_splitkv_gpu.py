"""Split-KV over a paged K/V cache in the sm90 kernel on a Hopper GPU (marker `sm90`).

With a page table the split kernel (`fa4lab.kernels.device.split`) reads its key blocks' pages
as the one-launch paged kernel does (Note [paged key blocks]), each split cutting its
sequence's own keys (seqused_k), and the combine kernel merges the float32 partials. Each case
is held to the float64 reference on fresh random inputs:
* the partials of `fa4lab.kernels.launch.partials(..., page_table=, seqused_k=)` against
  `fa4lab.splitkv.partial_attention_reference` of each sequence's gathered keys, for
  num_splits 3, 7 and 40 (more than any sequence's blocks): a split that sees no key of a row
  (an empty split of a short sequence, or a masked row) exactly 0 and -inf;
* `fa4lab.attention_varlen`'s paged decode, which splits a decode shape too small for the GPU
  (num_splits None), per sequence under tests/test_paged_decode_gpu.py's rule;
* `fa4lab.attention(q, k_cache, v_cache, page_table=, num_splits=n)` under FA4's rule
  (tests/kernel_checks.py) on the gathered K/V.
Grid (trimmed: one compile per (page size, mask kind)): pages of 16 and 64 (a gather of pages
per key block) and 128 (one TMA box per block), in random order with spare pages; ragged
seqused_k with sequences of 0 and 1 keys, keys ending on a page edge, inside the first page and
at every page's last key; GQA 8: decode (L = 1) and L = 4, causal with a window and a sink.
"""

from __future__ import annotations

import zlib

import pytest

torch = pytest.importorskip("torch")

from test_paged_decode_gpu import _check as check_paged_decode  # noqa: E402
from test_paged_decode_gpu import decode_inputs, ragged  # noqa: E402
from test_paged_gpu import _check as check_paged_attention  # noqa: E402
from test_paged_gpu import paged_inputs  # noqa: E402

pytestmark = pytest.mark.sm90

PAGE_SIZES = [16, 64, 128]
# L queries per sequence and the mask: decode, and L = 4 (speculative decode) bottom-right
# causal with a left window, whose splits before the window see no key.
CASES = {"decode": dict(L=1, causal=False, window_size=(None, None)),
         "L4-causal-window": dict(L=4, causal=True, window_size=(300, 0))}
HEADS_Q, HEADS_KV, HEAD_DIM = 64, 8, 128


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def ragged_with_one_key(batch, pages, page_size, seed) -> list[int]:
    """`ragged`'s key counts (0, every key, a page edge, inside the first page, ...) with the
    last sequence holding a single key."""
    return ragged(batch, pages, page_size, seed)[:-1] + [1]


@pytest.mark.parametrize("num_splits", [3, 7, 40])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_partials_are_each_sequences_reference_partials(page_size, case, num_splits):
    """Each split's float32 out and LSE against the float64 partials of the same key blocks of
    that sequence's seqused_k keys; some splits of the short sequences are empty."""
    from fa4lab.call import check_call
    from fa4lab.kernels import launch
    from fa4lab.splitkv import partial_attention_reference
    from fa4lab.varlen import gather_paged

    c = CASES[case]
    pages = 2048 // page_size
    used = ragged_with_one_key(9, pages, page_size, seed=page_size)
    q, k_cache, v_cache, table, _, seqused_k = decode_inputs(
        used, c["L"], pages, page_size, HEADS_Q, HEADS_KV, HEAD_DIM,
        seed=_seed(page_size, case, num_splits))
    q4 = q.view(len(used), c["L"], HEADS_Q, HEAD_DIM)
    call = check_call(q4, k_cache, v_cache, causal=c["causal"], window_size=c["window_size"],
                      page_table=table, seqused_k=seqused_k, arch="sm90")
    causal, window = call.spec.causal, call.window_size
    n_block = launch.cta_tiles(call.key("sm90", split_kv=True))[1]
    out_p, lse_p = launch.partials(call, "sm90", num_splits)
    assert out_p.shape == (num_splits, *q4.shape) and lse_p.shape == (num_splits, *q4.shape[:3])
    assert not torch.isnan(out_p).any() and not torch.isnan(lse_p).any()
    ks, vs = (gather_paged(cache, table, used) for cache in (k_cache, v_cache))
    empty_splits = 0
    for b, (k, v) in enumerate(zip(ks, vs)):
        where = f"sequence {b} (seqused_k {used[b]}, page {page_size}, {num_splits} splits)"
        if used[b] == 0:     # no key: every split is empty
            ref_p = torch.zeros_like(out_p[:, b], dtype=torch.float64)
            ref_lse = torch.full_like(lse_p[:, b], -float("inf"), dtype=torch.float64)
        else:
            ref_p, ref_lse = partial_attention_reference(
                q4[b:b + 1], k[None], v[None], num_splits=num_splits, n_block_size=n_block,
                causal=causal, window_size=window)
            ref_p, ref_lse = ref_p[:, 0], ref_lse[:, 0]
        empty = torch.isneginf(ref_lse)
        empty_splits += int(empty.flatten(1).all(dim=1).sum())
        assert torch.equal(torch.isneginf(lse_p[:, b]), empty), \
            f"{where}: the kernel's empty (-inf) partial LSEs are not the reference's"
        assert (out_p[:, b][empty] == 0).all(), f"{where}: a split that sees no key must write 0"
        seen = ~empty
        if not seen.any():
            continue
        lse_err = (lse_p[:, b].double() - ref_lse)[seen].abs()
        assert (lse_err <= 1e-3 + 1e-5 * ref_lse[seen].abs()).all(), \
            f"{where}: LSE error up to {lse_err.max().item():.3g}"
        # P is rounded to bf16 before P V (2^-9 relative): a few units of that times max |v|.
        err = (out_p[:, b].double() - ref_p)[seen].abs().max().item()
        assert err <= 4 * 2.0 ** -9 * v.abs().max().item() + 1e-3, f"{where}: error {err:.3g}"
    assert empty_splits > 0, "the case was meant to leave some splits empty"


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_varlen_paged_decode_splits_a_small_batch(page_size, case, monkeypatch):
    """attention_varlen's paged decode of 8 sequences (64 CTAs: less than a wave of an H200)
    over a cache of 8192 keys per sequence runs the split kernel (num_splits None chooses more
    than one) and the combine; every sequence holds to the reference, the sink included."""
    from fa4lab.kernels import launch

    c = CASES[case]
    pages = 8192 // page_size
    used = ragged_with_one_key(8, pages, page_size, seed=page_size + 1)
    inputs = decode_inputs(used, c["L"], pages, page_size, HEADS_Q, HEADS_KV, HEAD_DIM,
                           seed=_seed(page_size, case))
    splits = []
    partials = launch.partials

    def counted(*args, **kwargs):
        splits.append(args[2])          # num_splits
        return partials(*args, **kwargs)

    monkeypatch.setattr(launch, "partials", counted)
    sink = None
    if c["causal"]:
        sink = torch.linspace(-3.0, 3.0, HEADS_Q, device="cuda")
    check_paged_decode(*inputs, causal=c["causal"], window_size=c["window_size"],
                       learnable_sink=sink)
    assert len(splits) == 1 and splits[0] > 1, f"expected one split launch, got {splits}"


@pytest.mark.parametrize("num_splits", [2, 5, 40])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_attention_num_splits_over_pages(page_size, num_splits):
    """fa4lab.attention(..., page_table=, num_splits=n): decode with GQA 8 packed, full and
    causal with a learnable sink (the combine's), at 1000 keys rounded up to whole pages (40:
    more splits than key blocks, capped)."""
    pages = -(-1000 // page_size)
    inputs = paged_inputs(3, 1, pages, page_size, HEADS_Q, HEADS_KV, HEAD_DIM,
                          seed=_seed(page_size, num_splits))
    check_paged_attention(*inputs, causal=False, num_splits=num_splits)
    sink = torch.linspace(-2.0, 2.0, HEADS_Q, device="cuda")
    check_paged_attention(*inputs, causal=True, learnable_sink=sink, num_splits=num_splits)
