"""score_mod / mask_mod compiled into the sm90 kernel, on a Hopper GPU (marker `sm90`), against
the float64 reference with the same mods.

FA4's rule as in tests/kernel_checks.py: the kernel's max error against the float64 reference is
at most twice the error of attention written in eager PyTorch in the inputs' 16-bit dtype with
the same mods (SDPA cannot call a score_mod) plus ATOL; rows that see no key give exactly 0 and
LSE -inf; nothing is NaN; LSE within 1e-3 + 1e-5 * |lse|; two runs agree bit for bit.

Grid (trimmed: every mod configuration is a compile of its own, ~15 s): each ready-made mod
with tails on both sides; mods with causal, GQA and pack-GQA (the query head of a packed row);
extreme scores; a mask_mod that leaves rows with no key; softcap then score_mod; block skipping
by the mask_mod's block table (many documents, CTAs whose rows see nothing, an aux tensor edited
in place); and the launch cache (a lambda re-created per call compiles once).
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from kernel_checks import ATOL, make_inputs, output_ulp_atol  # noqa: E402

from fa4lab import mods  # noqa: E402

pytestmark = pytest.mark.sm90

PAIRS = [(17, 1000), (1000, 17), (1000, 1000)]   # tails of the Q tile and of the key blocks


def _eager_same_dtype(q, k, v, *, causal, softcap, km, aux):
    """Attention with the mods in eager PyTorch, in q's dtype: scores, cap, the score_mod's
    result, softmax and P V each rounded to 16 bits; bottom-right causal."""
    b, sq, hq, d = q.shape
    sk, g = k.shape[1], hq // k.shape[2]
    kk, vv = (x.repeat_interleave(g, dim=2).transpose(1, 2) for x in (k, v))
    s = (q.transpose(1, 2) @ kk.transpose(-1, -2)) * d ** -0.5
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    dev = q.device
    bi = torch.arange(b, device=dev)[:, None, None, None]
    hi = torch.arange(hq, device=dev)[None, :, None, None]
    qi = torch.arange(sq, device=dev)[None, None, :, None]
    ki = torch.arange(sk, device=dev)[None, None, None, :]
    if km.score_mod is not None:
        s = km.score(s.float(), bi, hi, qi, ki, aux).to(q.dtype)
    visible = torch.ones((1, 1, sq, sk), dtype=torch.bool, device=dev)
    if causal:
        visible = visible & (ki <= qi + sk - sq)
    if km.mask_mod is not None:
        visible = visible & km.mask(bi, hi, qi, ki, aux)
    s = s.masked_fill(~visible, -math.inf)
    return (torch.softmax(s, dim=-1) @ vv).transpose(1, 2)


def _check(q, k, v, *, causal=False, softcap=0.0, pack_gqa=False, score_mod=None,
           mask_mod=None, aux_tensors=None, atol=ATOL):
    from fa4lab.kernels.launch import attention_sm90
    from fa4lab.reference import attention_reference

    opts = dict(causal=causal, softcap=softcap, score_mod=score_mod, mask_mod=mask_mod,
                aux_tensors=aux_tensors)

    def run():
        return attention_sm90(q, k, v, return_lse=True, pack_gqa=pack_gqa, **opts)

    (out, lse), (out2, lse2) = run(), run()
    assert torch.equal(out, out2) and torch.equal(lse, lse2), "two runs differ"
    ref, ref_lse = attention_reference(q, k, v, return_lse=True, **opts)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    seen = torch.isfinite(ref_lse)
    seen_rows = seen.transpose(1, 2)
    assert (out[~seen_rows] == 0).all(), "a row that sees no key must be exactly 0"
    assert (lse[~seen] == -math.inf).all(), "a row that sees no key must have LSE -inf"
    if not seen.any():
        return
    km, aux = mods.check_mods(score_mod, mask_mod, aux_tensors, q.device)
    pt = _eager_same_dtype(q, k, v, causal=causal, softcap=softcap, km=km, aux=aux)
    err = (out.double() - ref)[seen_rows].abs().max().item()
    pt_err = (pt.double() - ref)[seen_rows].nan_to_num(0.0).abs().max().item()
    assert err <= 2 * pt_err + atol, f"kernel error {err:.3g} > 2 x eager error {pt_err:.3g}"
    lse_err = (lse.double() - ref_lse)[seen].abs()
    assert (lse_err <= 1e-3 + 1e-5 * ref_lse[seen].abs()).all(), \
        f"LSE error up to {lse_err.max().item():.3g}"


def _slopes(heads):
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)],
                        device="cuda")


# ---- the ready-made mods ---------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_alibi(head_dim, causal):
    score_mod, aux = mods.alibi(_slopes(8))
    for i, (sq, sk) in enumerate(PAIRS):
        q, k, v = make_inputs(2, sq, sk, 8, 8, head_dim, torch.bfloat16, seed=10 + i)
        _check(q, k, v, causal=causal, score_mod=score_mod, aux_tensors=aux)


@pytest.mark.parametrize("per_head", [False, True])
def test_relative_bias(per_head):
    radius = 40
    shape = (8, 2 * radius + 1) if per_head else (2 * radius + 1,)
    g = torch.Generator(device="cuda").manual_seed(3)
    table = torch.randn(shape, device="cuda", generator=g) * 2
    score_mod, aux = mods.relative_bias(table)
    for i, (sq, sk) in enumerate(PAIRS):
        q, k, v = make_inputs(1, sq, sk, 8, 2, 128, torch.bfloat16, seed=20 + i)
        _check(q, k, v, causal=True, score_mod=score_mod, aux_tensors=aux)


@pytest.mark.parametrize("causal", [False, True])
def test_document_mask(causal):
    s = 1000
    g = torch.Generator(device="cuda").manual_seed(4)
    bounds = torch.randint(0, s, (6,), device="cuda", generator=g)
    doc_ids = (torch.arange(s, device="cuda")[:, None] >= bounds[None]).sum(1).int()
    mask_mod, aux = mods.document_mask(doc_ids)
    for i, (sq, sk) in enumerate([(s, s), (17, s), (1, s)]):
        q, k, v = make_inputs(2, sq, sk, 8, 8, 128, torch.bfloat16, seed=30 + i)
        _check(q, k, v, causal=causal, mask_mod=mask_mod, aux_tensors=aux)


def test_prefix_lm():
    mask_mod, _ = mods.prefix_lm(300)
    q, k, v = make_inputs(2, 1000, 1000, 8, 8, 128, torch.bfloat16, seed=40)
    _check(q, k, v, mask_mod=mask_mod)
    lengths = torch.tensor([0, 777], dtype=torch.int32, device="cuda")
    mask_mod, aux = mods.prefix_lm(lengths)
    _check(q, k, v, mask_mod=mask_mod, aux_tensors=aux)


# ---- mods with causal, GQA and pack-GQA ------------------------------------------------------

def _head_and_position(b, h, q_idx, kv_idx):
    """A mask that depends on the query head and both positions: a packed row's head and
    q_idx must be (kv * g + r % g, r // g)."""
    return (kv_idx <= q_idx - h) | (h == 3)


@pytest.mark.parametrize("pack_gqa", [False, True])
@pytest.mark.parametrize("gqa", [2, 8])
def test_mods_with_gqa_and_pack_gqa(gqa, pack_gqa):
    score_mod, aux = mods.alibi(_slopes(8))
    for i, (sq, sk) in enumerate([(1, 1000), (17, 1000), (1000, 1000)]):
        q, k, v = make_inputs(2, sq, sk, 8, 8 // gqa, 128, torch.bfloat16, seed=50 + i)
        _check(q, k, v, causal=True, pack_gqa=pack_gqa, score_mod=score_mod,
               mask_mod=_head_and_position, aux_tensors=aux)


def test_softcap_then_score_mod():
    """Note [order of score transforms]: the score_mod sees the capped score."""
    def halve_far(score, b, h, q_idx, kv_idx):
        return mods.where(kv_idx + 64 < q_idx, score * 0.5, score)

    for i, (sq, sk) in enumerate(PAIRS):
        q, k, v = make_inputs(2, sq, sk, 8, 2, 128, torch.bfloat16, seed=60 + i, q_scale=4.0)
        _check(q, k, v, causal=True, softcap=20.0, score_mod=halve_far)


def test_extreme_scores():
    """Logits of a few hundred plus biases up to 2e4: rows are one-hot (Note [extreme logits]
    in tests/kernel_checks.py)."""
    score_mod, aux = mods.alibi(torch.full((8,), 20.0, device="cuda"))
    q, k, v = make_inputs(2, 1000, 1000, 8, 8, 128, torch.bfloat16, seed=70, q_scale=300.0)
    _check(q, k, v, score_mod=score_mod, aux_tensors=aux, atol=output_ulp_atol(v, "bf16"))


def test_a_mask_mod_can_leave_rows_without_keys():
    def late_rows_most_heads(b, h, q_idx, kv_idx):
        return (q_idx >= 300) & (h != 5)

    for pack_gqa in (False, True):
        q, k, v = make_inputs(2, 1000, 1000, 8, 2, 128, torch.bfloat16, seed=80)
        _check(q, k, v, causal=True, pack_gqa=pack_gqa, mask_mod=late_rows_most_heads)


# ---- block skipping: Note [mask_mod block table] in fa4lab.tiling ---------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_many_documents_skip_most_blocks(causal):
    """40 documents of random lengths in 2048 keys (a 2-D per-batch-row table as well): most
    key blocks of every CTA are skipped, the rest masked or FULL by the block table."""
    s = 2048
    g = torch.Generator(device="cuda").manual_seed(5)
    bounds = torch.randint(0, s, (2, 39), device="cuda", generator=g)
    doc_ids = (torch.arange(s, device="cuda")[None, :, None] >= bounds[:, None]).sum(-1).int()
    for i, ids in enumerate((doc_ids[0], doc_ids)):
        mask_mod, aux = mods.document_mask(ids.contiguous())
        q, k, v = make_inputs(2, s, s, 4, 4, 128, torch.bfloat16, seed=85 + i)
        _check(q, k, v, causal=causal, mask_mod=mask_mod, aux_tensors=aux)


def test_a_mask_mod_that_hides_every_key_from_some_rows():
    """Rows [300, 700) see no key under any head (whole CTAs with an empty table row), and a
    mod that hides everything from everyone."""
    def middle_rows_hidden(b, h, q_idx, kv_idx):
        return (q_idx < 300) | (q_idx >= 700)

    def nothing(b, h, q_idx, kv_idx):
        return kv_idx < 0

    for pack_gqa in (False, True):
        q, k, v = make_inputs(2, 1000, 1000, 8, 2, 128, torch.bfloat16, seed=86)
        _check(q, k, v, pack_gqa=pack_gqa, mask_mod=middle_rows_hidden)
        _check(q, k, v, causal=True, pack_gqa=pack_gqa, mask_mod=nothing)


def test_an_aux_tensor_changed_in_place_rebuilds_the_table():
    """Note [block table cache]: the table follows doc_ids edited in place."""
    s = 1000
    doc_ids = (torch.arange(s, device="cuda") // 100).int()
    mask_mod, aux = mods.document_mask(doc_ids)
    q, k, v = make_inputs(1, s, s, 4, 4, 128, torch.bfloat16, seed=87)
    _check(q, k, v, mask_mod=mask_mod, aux_tensors=aux)
    doc_ids.copy_((torch.arange(s, device="cuda") // 333).int())
    _check(q, k, v, mask_mod=mask_mod, aux_tensors=aux)


# ---- the launch path -------------------------------------------------------------------------

def _bias(c):
    return lambda score, b, h, q_idx, kv_idx: score - c * (q_idx - kv_idx) / 1000.0


def test_a_lambda_per_call_compiles_once_and_a_new_value_once_more():
    """Note [mods in the kernels]: keyed by code and captured values."""
    import fa4lab
    from fa4lab.kernels import launch

    q, k, v = make_inputs(1, 300, 300, 4, 4, 64, torch.bfloat16, seed=90)
    before = launch.stats()["misses"]
    outs = [fa4lab.attention(q, k, v, causal=True, score_mod=_bias(1.0)) for _ in range(3)]
    assert launch.stats()["misses"] == before + 1
    assert all(torch.equal(outs[0], o) for o in outs)
    other = fa4lab.attention(q, k, v, causal=True, score_mod=_bias(50.0))
    assert launch.stats()["misses"] == before + 2
    assert not torch.equal(outs[0], other)
    _check(q, k, v, causal=True, score_mod=_bias(50.0))
