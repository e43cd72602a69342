"""Notebook 06's exercise: a mask_mod for the Hopper kernel, chunked local attention.

`chunked_local_mask(chunk_size)` returns mask_mod(b, h, q_idx, kv_idx): query q_idx sees key
kv_idx only inside its own chunk of chunk_size positions (q_idx // chunk_size == kv_idx //
chunk_size, top-left positions as FlexAttention writes masks), and causal=True adds the
causal rule; Llama 4's local layers attend this way. The check grades it tier by tier as
`fa4lab.exercises.variants` describes: brute force over the element mask; the block table the
kernels skip blocks with (`fa4lab.mods_blocks`); the sm90 kernel's block walk; a compile for
sm_90a with the audit; and on a Hopper GPU the kernel itself against the float64 reference
(elsewhere the summary says why that tier was skipped).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fa4lab import mods as M
from fa4lab import tiling
from fa4lab.exercises._core import ExerciseFailed, fresh_rng
from fa4lab.exercises.variants import (
    COMPILE_SPEC,
    blockwise_attention,
    compile_and_audit,
    first_output_mismatch,
    graded_call,
    mod_of,
    numpy_world,
    try_mod,
)
from fa4lab.reference import attention_reference

__all__ = ["check_chunked_local_mask", "same_chunk"]

# (seqlen_q, seqlen_k, chunk_size): the shapes that break a first attempt; random ones follow.
FIXED_SHAPES = (
    (1, 1, 1), (1, 1, 4),                     # seqlen 1
    (7, 7, 3),                                # a tail chunk
    (300, 300, 64), (300, 300, 100),          # chunks across the sm90 tiles' boundaries
    (129, 129, 1),                            # every query alone with itself
    (37, 200, 16), (200, 37, 16),             # seqlen_q != seqlen_k both ways
    (256, 256, 128),                          # chunks = key blocks: whole blocks skipped
)


def same_chunk(seqlen_q: int, seqlen_k: int, chunk_size: int) -> np.ndarray:
    """Bool (seqlen_q, seqlen_k): query i and key j share a chunk (the exercise's mask)."""
    i, j = np.arange(seqlen_q)[:, None], np.arange(seqlen_k)[None, :]
    return i // chunk_size == j // chunk_size


def _shapes(rng, count: int):
    yield from FIXED_SHAPES
    for _ in range(count):
        sq, sk = (int(x) for x in rng.integers(1, 400, size=2))
        yield sq, sk, int(rng.choice((1, 2, 3, 5, 16, 64, 100, 128, 200, 500)))


def _label(sq, sk, c) -> str:
    return f"seqlen_q={sq}, seqlen_k={sk}, chunk_size={c}"


def _grid(batch: int, heads: int, sq: int, sk: int):
    """int64 index tensors shaped to broadcast over (batch, heads, sq, sk), as the reference."""
    import torch

    return (torch.arange(batch).view(-1, 1, 1, 1), torch.arange(heads).view(1, -1, 1, 1),
            torch.arange(sq).view(1, 1, -1, 1), torch.arange(sk).view(1, 1, 1, -1))


def _element_mask(mod, sq, sk, c, seed):
    """The student's mask on the whole (2, 3, sq, sk) grid: kind, dtype and shape checked."""
    import torch

    what = f"chunked_local_mask({c})"
    where = f"int64 index tensors of a (2, 3, {sq}, {sk}) grid"
    got = try_mod(mod, _grid(2, 3, sq, sk), what, where)
    if not isinstance(got, torch.Tensor):
        raise ExerciseFailed(f"{what} returned {type(got).__name__} {got!r} on {where}, not a "
                             f"tensor\n  hint: return the comparison itself (q_idx ... kv_idx); "
                             f"`if`, `and` and Python bools decide once for the whole grid")
    if got.dtype != torch.bool:
        raise ExerciseFailed(f"{what} returned dtype {got.dtype} on {where}: a mask_mod returns "
                             f"bool, True where the key is visible\n  hint: compare with == "
                             f"(a difference of chunk numbers is an int, 0 when they match)")
    try:
        return torch.broadcast_to(got, (2, 3, sq, sk)).numpy()
    except RuntimeError:
        raise ExerciseFailed(f"{what} returned shape {tuple(got.shape)} on {where}: it must "
                             f"broadcast to the grid (seed {seed})") from None


def _mask_hint(got, sq, sk, c) -> str:
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    want = same_chunk(sq, sk, c)
    if np.array_equal(got, want & (j <= i)) or np.array_equal(got, want & (j <= i + sk - sq)):
        return ("leave causality to causal=True: the mask_mod is the chunk rule alone (the "
                "kernel applies causal with its own bottom-right rule and skips blocks by it)")
    if np.array_equal(got, i % c == j % c):
        return "% gives a position's place inside its chunk; // gives the chunk's number"
    if np.array_equal(got, np.abs(i - j) < c) or np.array_equal(got, (i - j >= 0) & (i - j < c)):
        return ("that is a sliding window: with chunks, the first query of a chunk sees no key "
                "of the chunk before it")
    if any(np.array_equal(got, a // c == b // c) for a, b in ((i + 1, j), (i, j + 1),
                                                              (i - 1, j), (i, j - 1))):
        return ("off by one: chunk n holds positions n * chunk_size .. (n + 1) * chunk_size - "
                "1, so position p is in chunk p // chunk_size, no +1 or -1")
    return ("a query sees a key when both positions fall in the same chunk of chunk_size "
            "consecutive positions: give each position its chunk number, then compare the two")


def _check_elements(mod, rng, seed, random_shapes) -> int:
    checked = 0
    for sq, sk, c in _shapes(rng, random_shapes):
        got = _element_mask(mod(c), sq, sk, c, seed)
        want = same_chunk(sq, sk, c)
        bad = np.argwhere(got != want[None, None])
        checked += got.size
        if bad.size:
            b, h, i, j = (int(x) for x in bad[0])
            seen = "sees" if got[b, h, i, j] else "does not see"
            should = "should not" if got[b, h, i, j] else "should"
            raise ExerciseFailed(
                f"chunked_local_mask({c}) ({_label(sq, sk, c)}; seed {seed}): at batch {b}, "
                f"head {h}, query {i} {seen} key {j} but {should}: query {i} is in chunk "
                f"{i // c} (positions {i // c * c}..{i // c * c + c - 1}), key {j} in chunk "
                f"{j // c}\n  hint: {_mask_hint(got[b, h], sq, sk, c)}")
    return checked


def _check_table(km, sq, sk, c, seed) -> None:
    """The block table the kernels read (`fa4lab.mods_blocks.block_table`, sm90 tiles) against
    the element mask: every key block a row of the tile sees lies in [lo, hi); every block of
    [full_lo, full_hi) is visible whole."""
    from fa4lab.mods_blocks import block_table
    from fa4lab.plan import plan_forward

    spec = COMPILE_SPEC.with_(batch=1, seqlen_q=sq, seqlen_k=sk, heads_q=1, heads_kv=1)
    t = plan_forward(spec, arch="sm90", pack_gqa=False).tiles
    cta_m, n = t.cta_m, t.n_block
    table = block_table(km, (), batch=1, heads_q=1, seqlen_q=sq, seqlen_k=sk, cta_m=cta_m,
                        n_block=n, pack=1, device="cpu").numpy()
    visible = same_chunk(sq, sk, c)
    for m, (lo, hi, full_lo, full_hi) in enumerate(table):
        rows = visible[m * cta_m:(m + 1) * cta_m]
        for blk in range(tiling.num_n_blocks(sk, n)):
            part = rows[:, blk * n:(blk + 1) * n]
            where = (f"tile m_block {m} (rows {m * cta_m}..{m * cta_m + len(rows) - 1}), key "
                     f"block {blk}, {_label(sq, sk, c)}; seed {seed}")
            if part.any() and not lo <= blk < hi:
                raise ExerciseFailed(
                    f"the block table of chunked_local_mask({c}) skips a block a row sees "
                    f"({where}: [lo, hi) = [{lo}, {hi}))\n  hint: the table evaluates your "
                    f"mod on slices of rows; its answer must depend on (q_idx, kv_idx) only, "
                    f"not on how many indices it is given")
            if full_lo <= blk < full_hi and not part.all():
                raise ExerciseFailed(
                    f"the block table of chunked_local_mask({c}) lets the kernel skip the mask "
                    f"in a block some row does not see whole ({where})\n  hint: as above, the "
                    f"mod must give the same answer whatever slice of the grid it sees")


def _problems(rng):
    """(name, q, k, v, chunk_size): causal attention problems, float64 numpy, fresh values."""
    def rand(b, sq, sk, hq, hkv, d=8, mag=2.0):
        return (rng.standard_normal((b, sq, hq, d)) * mag, rng.standard_normal((b, sk, hkv, d))
                * mag, rng.standard_normal((b, sk, hkv, d)))

    return [
        ("GQA 4:2, chunks across tiles", *rand(2, 300, 300, 4, 2), 100),
        ("chunk = the key block: whole blocks skipped", *rand(1, 256, 256, 2, 1), 128),
        ("seqlen_q > seqlen_k: the first rows see no key", *rand(1, 200, 37, 2, 1), 16),
        ("seqlen 1", *rand(1, 1, 1, 1, 1), 4),
        ("extreme logits", *rand(1, 150, 150, 2, 2, mag=20.0), 64),
    ]


def _gpu_tier(factory, seed) -> str:
    """fa4lab.attention (the sm90 kernel) with the mask against the float64 reference, on a
    Hopper GPU; otherwise why not. FA4's rule: at most twice the error of PyTorch's SDPA in
    the same dtype (given the same mask) plus 1e-3; rows that see no key exactly 0."""
    from fa4lab import environment

    g = environment.gpu()
    if g is None or g.arch != "sm90" or not environment.has_cute_dsl():
        why = ("no CUDA GPU here" if g is None else
               f"{g.name} is not a Hopper GPU" if g.arch != "sm90" else
               "nvidia-cutlass-dsl is not installed")
        return f"GPU check skipped ({why}): the sm90 kernel runs on a Hopper GPU (H100/H200)"
    import torch
    import torch.nn.functional as F

    import fa4lab

    worst = 0.0
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for sq, sk, c in ((1000, 1000, 256), (300, 300, 100), (513, 1000, 64), (1000, 17, 16)):
        q = torch.randn(2, sq, 8, 128, device="cuda", generator=gen).bfloat16()
        k, v = (torch.randn(2, sk, 2, 128, device="cuda", generator=gen).bfloat16()
                for _ in range(2))
        mod = factory(c)
        out = fa4lab.attention(q, k, v, causal=True, mask_mod=mod)
        ref, lse = attention_reference(q, k, v, causal=True, mask_mod=mod, return_lse=True)
        seen = torch.isfinite(lse).transpose(1, 2)                     # (b, sq, h)
        mask = torch.as_tensor(same_chunk(sq, sk, c), device="cuda") & (
            torch.arange(sk, device="cuda")[None] <= torch.arange(sq, device="cuda")[:, None]
            + sk - sq)
        pt = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                            v.transpose(1, 2), attn_mask=mask,
                                            enable_gqa=True).transpose(1, 2)
        err = (out.double() - ref)[seen].abs().max().item() if seen.any() else 0.0
        tol = 2 * ((pt.double() - ref)[seen].abs().max().item() if seen.any() else 0.0) + 1e-3
        worst = max(worst, err)
        if err > tol or not (out[~seen] == 0).all():
            raise ExerciseFailed(
                f"chunked_local_mask({c}) on {g.name}: the sm90 kernel's error {err:.3g} "
                f"against the float64 reference (causal, {_label(sq, sk, c)}, bf16) exceeds "
                f"2 x SDPA's + 1e-3 = {tol:.3g}, or a row that sees no key is not 0 (seed "
                f"{seed})\n  hint: the CPU tiers passed, so this is worth reporting with the seed")
    return f"on {g.name} the sm90 kernel matches the float64 reference (max error {worst:.2g})"


def check_chunked_local_mask(chunked_local_mask: Callable, *, seed: int | None = None,
                             compile: bool = True, random_shapes: int = 20) -> str:
    """Grade `chunked_local_mask(chunk_size) -> mask_mod(b, h, q_idx, kv_idx)`: True iff
    q_idx // chunk_size == kv_idx // chunk_size (`same_chunk`).

    Tier 0: the element mask against brute force over fixed and random shapes (tails, seqlen 1,
    seqlen_q != seqlen_k; the first wrong (query, key) with a hint); its block table
    (`fa4lab.mods_blocks`, sm90 tiles) consistent with the element mask; causal attention
    problems through the float64 reference and through the sm90 kernel's block walk
    (`fa4lab.exercises.variants.blockwise_attention`). Tier 1: compiled for sm_90a on this CPU
    and audited (`compile=False` skips it). Tier 2: on a Hopper GPU, `fa4lab.attention`;
    elsewhere the summary says why it was skipped. Raises ExerciseFailed on the first failure.
    """
    rng, seed = fresh_rng(seed)

    def factory(c):
        return mod_of(chunked_local_mask, "chunked_local_mask", c, "mask_mod(b, h, q_idx, kv_idx)")

    elements = _check_elements(factory, rng, seed, random_shapes)
    numpy_world(factory(4), tuple(x.numpy() for x in _grid(1, 1, 5, 5)),
                "chunked_local_mask(4)")
    for sq, sk, c in FIXED_SHAPES:
        _check_table(M.kernel_mods(None, factory(c), ()), sq, sk, c, seed)
    problems = _problems(rng)
    for name, q, k, v, c in problems:
        mod = factory(c)
        what = f"chunked_local_mask({c})"
        want = graded_call(mod, what, f"{name}, fa4lab.reference (seed {seed})",
                           attention_reference, q, k, v, causal=True, mask_mod=mod,
                           return_lse=True)
        sim = graded_call(mod, what, f"{name}, the sm90 block walk (seed {seed})",
                          blockwise_attention, q, k, v, arch="sm90", causal=True,
                          km=M.kernel_mods(None, mod, ()))
        bad = first_output_mismatch(sim, want)
        if bad:
            raise ExerciseFailed(
                f"chunked_local_mask({c}) in the sm90 kernel's block walk ({name}, causal; "
                f"seed {seed}): {bad[1]}\n  hint: the element mask was right, so the walk's "
                f"block table must disagree with it: the mod must not depend on the slice of "
                f"the grid it is given")
    c = int(rng.choice((64, 100, 128)))
    tier1 = (compile_and_audit(M.kernel_mods(None, factory(c), ()), "sm90a",
                               f"chunked_local_mask({c})") if compile else
             "compile skipped (compile=False)")
    tier2 = _gpu_tier(factory, seed)
    return (f"chunked_local_mask: {elements} mask elements match brute force, the block tables "
            f"of {len(FIXED_SHAPES)} shapes and {len(problems)} causal problems in the sm90 "
            f"block walk match the float64 reference; {tier1}; {tier2} (seed {seed})")
