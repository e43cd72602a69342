"""The sm90 kernel compiles for sm_90a on a CPU (fake tensors), and its block ranges match
`fa4lab.tiling`. Tier 1: no GPU needed, nvidia-cutlass-dsl required."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fa4lab import tiling
from fa4lab.kernels import scheduler
from fa4lab.spec import AttentionSpec


@given(sq=st.integers(1, 3000), sk=st.integers(1, 3000), cta_m=st.sampled_from([64, 128]),
       n=st.sampled_from([80, 128, 176]), causal=st.booleans(), data=st.data())
@settings(max_examples=300, deadline=None)
def test_block_ranges_match_tiling(sq, sk, cta_m, n, causal, data):
    m = data.draw(st.integers(0, tiling.num_m_blocks(sq, cta_m) - 1))
    kw = dict(seqlen_q=sq, seqlen_k=sk, m_block_size=cta_m, n_block_size=n, causal=causal)
    lo, hi = tiling.n_block_range(m, **kw)
    mask_lo, _ = tiling.n_block_masked_range(m, **kw)
    assert lo == 0
    assert scheduler.n_block_max(m, cta_m, n, sq, sk, causal) == hi
    full = min(scheduler.n_block_full_end(m, cta_m, n, sq, sk, causal), hi)
    assert full == mask_lo


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_compiles_for_sm90a(head_dim, causal):
    pytest.importorskip("cutlass")
    from fa4lab.kernels.fwd_sm90 import FlashForwardSm90
    from fa4lab.kernels.runtime import fake_compile

    spec = AttentionSpec(2, 300, 700, 8, 2, head_dim, causal=causal, return_lse=causal)
    compiled = fake_compile(spec, "sm90a", FlashForwardSm90)
    assert compiled is not None
