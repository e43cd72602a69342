"""Notebook 01's exercises: one online-softmax block step, and merging two partial states.

Each check runs the student's function on small adversarial problems drawn fresh (GQA, tails,
extreme logits, rows that see no key, seqlen 1, FA4's rescale threshold and a max rising by
exactly it), compares it with `fa4lab.online_softmax` step by step, and the finished output
with the float64 reference.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from fa4lab import online_softmax as osm
from fa4lab.exercises._core import ExerciseFailed, call_student, fresh_rng
from fa4lab.reference import attention_reference, kv_head_index, visible_mask
from fa4lab.spec import LOG2E, resolve_scale

__all__ = ["check_update_state", "check_merge_states"]

_RTOL, _ATOL = 1e-9, 1e-12


@dataclass
class _Problem:
    """One head-major problem cut into K/V blocks: what a test feeds the state machine."""

    name: str
    q: np.ndarray          # (1, seqlen_q, heads_q, head_dim), as attention_reference takes
    k: np.ndarray
    v: np.ndarray
    causal: bool
    window_size: tuple
    block_n: int
    threshold: float
    reverse: bool = False  # visit the blocks from the last, as FA4 does under causal

    @property
    def scale_log2(self) -> float:
        return resolve_scale(None, self.q.shape[-1]) * LOG2E

    def blocks(self):
        """[(first key, end key, s, v_block)] in visit order; s is (heads_q, seqlen_q, n)."""
        sq, hq, hkv = self.q.shape[1], self.q.shape[2], self.k.shape[2]
        kv_of = kv_head_index(hq, hkv)
        qh = self.q[0].transpose(1, 0, 2)
        kh = self.k[0][:, kv_of].transpose(1, 0, 2)
        vh = self.v[0][:, kv_of].transpose(1, 0, 2)
        visible = visible_mask(sq, self.k.shape[1], self.causal, window_size=self.window_size)
        out = []
        for n0, n1 in osm.kv_blocks(self.k.shape[1], self.block_n):
            s = osm.score_block(qh, kh[:, n0:n1], visible[:, n0:n1])
            out.append((n0, n1, s, vh[:, n0:n1]))
        return out[::-1] if self.reverse else out

    def init(self) -> osm.SoftmaxState:
        return osm.init_state((self.q.shape[2], self.q.shape[1]), self.v.shape[-1],
                              self.scale_log2)

    def reference(self):
        """(out (heads, rows, d), lse (heads, rows)): the float64 reference over all keys."""
        out, lse = attention_reference(self.q, self.k, self.v, causal=self.causal,
                                       window_size=self.window_size, return_lse=True)
        return out[0].transpose(1, 0, 2), lse[0]


def _exact_threshold_rise(rng, threshold: float, *, seqlen_q: int = 3, heads_q: int = 2,
                          head_dim: int = 8, block_n: int = 4):
    """(q, k, v, (head, row)): scores in three key blocks where row `row` of head `head` has
    max exactly 0 in the first block and exactly `threshold / scale_log2` in the second, a rise
    of exactly `threshold` in log2 units, so the basis must stay (the rule is `>`, not `>=`).
    Another (head, row) rises by one float more (the basis must move); the rest are random.

    Each (head, row) reads its own coordinate of q (one-hot), so its scores are the keys' values
    there, exact in float64 (no rounding in q @ k^T)."""
    scale_log2 = resolve_scale(None, head_dim) * LOG2E
    rise = threshold / scale_log2
    if rise * scale_log2 != threshold:
        raise RuntimeError(f"no float64 score rises by exactly {threshold:g} in log2 units at "
                           f"head_dim {head_dim}: a bug in fa4lab's exercise, not in your answer")
    combos = heads_q * seqlen_q
    if combos > head_dim:
        raise ValueError(f"{combos} (head, row) pairs need head_dim >= {combos}")
    seqlen_k = 3 * block_n
    q = np.zeros((1, seqlen_q, heads_q, head_dim))
    k = np.zeros((1, seqlen_k, 1, head_dim))
    exact, above = (int(x) for x in rng.choice(combos, size=2, replace=False))
    for c in range(combos):
        head, row = divmod(c, seqlen_q)
        q[0, row, head, c] = 1.0
        scores = rng.uniform(-6.0, 0.0, seqlen_k) * 4.0
        if c in (exact, above):
            top = rise if c == exact else np.nextafter(rise, np.inf)
            scores[block_n:] += top          # block 0 below 0, blocks 1 and 2 below top
            scores[int(rng.integers(block_n))] = 0.0
            scores[block_n + int(rng.integers(block_n))] = top
        k[0, :, 0, c] = scores
    return q, k, rng.standard_normal((1, seqlen_k, 1, 3)), divmod(exact, seqlen_q)


def _problems(rng) -> list[_Problem]:
    """Small adversarial problems, fresh values each call (shapes fixed so messages read well)."""
    def rand(sq, sk, hq, hkv, d, dv, logit=1.0):
        q = rng.standard_normal((1, sq, hq, d)) * np.sqrt(logit)
        k = rng.standard_normal((1, sk, hkv, d)) * np.sqrt(logit)
        return q, k, rng.standard_normal((1, sk, hkv, dv))

    fa4 = osm.FA4_RESCALE_THRESHOLD
    rising = osm.adversarial_inputs("rising", seqlen_q=3, seqlen_k=40, heads_q=2, heads_kv=1,
                                    head_dim=8, magnitude=30.0, rng=rng)
    extreme = osm.adversarial_inputs("extreme", seqlen_q=4, seqlen_k=24, heads_q=2, heads_kv=1,
                                     head_dim=8, magnitude=1e4, rng=rng)
    none = (None, None)
    *exact, (head, row) = _exact_threshold_rise(rng, fa4)
    return [
        _Problem("random logits, GQA (4 query heads on 2 KV heads), tail block",
                 *rand(5, 23, 4, 2, 8, 3), False, none, 8, 0.0),
        _Problem(f"random logits x30, FA4's rescale_threshold={fa4:g}",
                 *rand(5, 23, 4, 2, 8, 3, logit=30.0), False, none, 8, fa4),
        _Problem("scores rising along the keys (every block raises the max)",
                 *rising, False, none, 8, 0.0),
        _Problem(f"scores rising along the keys, rescale_threshold={fa4:g}",
                 *rising, False, none, 8, fa4),
        _Problem("extreme logits (~1e4)", *extreme, False, none, 8, fa4),
        _Problem("causal with seqlen_q > seqlen_k (the first rows see no key), blocks from the "
                 "last", *rand(9, 5, 2, 1, 4, 2), True, none, 2, 0.0, reverse=True),
        _Problem("sliding window (3, 0): some blocks show a row nothing",
                 *rand(12, 12, 2, 2, 4, 2, logit=30.0), False, (3, 0), 4, fa4),
        _Problem("seqlen_q = seqlen_k = 1", *rand(1, 1, 1, 1, 4, 2), False, none, 1, 0.0),
        _Problem(f"head {head} row {row}'s max rises by exactly rescale_threshold={fa4:g} "
                 f"(log2 units) in the second block", *exact, False, none, 4, fa4),
    ]


def _state_of(got, name: str, where: str) -> osm.SoftmaxState:
    if isinstance(got, tuple) and got and isinstance(got[0], osm.SoftmaxState):
        got = got[0]   # the library's (state, BlockStep) is fine too
    if not all(hasattr(got, f) for f in ("row_max", "row_sum", "acc_o", "scale_log2")):
        raise ExerciseFailed(f"{name} ({where}) returned {type(got).__name__}, expected a "
                             f"SoftmaxState(row_max, row_sum, acc_o, scale_log2)")
    return got


def _first_mismatch(got, want, rtol=_RTOL, atol=_ATOL):
    """Index of the first element where got and want differ (NaN never matches), else None."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    same = np.isclose(got, want, rtol=rtol, atol=atol) | (np.isinf(want) & (got == want))
    bad = np.argwhere(~same)
    return None if bad.size == 0 else tuple(int(i) for i in bad[0])


def _compare_state(got: osm.SoftmaxState, want: osm.SoftmaxState, name: str, where: str,
                   hint: Callable[[str, tuple], str]) -> None:
    if got.scale_log2 != want.scale_log2:
        raise ExerciseFailed(f"{name} ({where}): scale_log2 is {got.scale_log2}, expected "
                             f"{want.scale_log2} -- keep the input state's scale_log2")
    for field in ("row_max", "row_sum", "acc_o"):
        g, w = np.asarray(getattr(got, field)), getattr(want, field)
        if g.shape != w.shape:
            raise ExerciseFailed(f"{name} ({where}): {field} has shape {g.shape}, expected "
                                 f"{w.shape} (heads, rows{', head_dim_v' if w.ndim == 3 else ''})")
        idx = _first_mismatch(g, w)
        if idx is not None:
            head, row = idx[0], idx[1]
            col = f", column {idx[2]}" if len(idx) == 3 else ""
            raise ExerciseFailed(f"{name} ({where}): head {head} row {row}{col}: {field} is "
                                 f"{g[idx]:.10g}, expected {w[idx]:.10g}\n  hint: "
                                 f"{hint(field, (head, row))}")


def _compare_final(state: osm.SoftmaxState, problem: _Problem, name: str) -> None:
    out, lse = osm.finalize(state)
    ref_out, ref_lse = problem.reference()
    for what, g, w in (("lse", lse, ref_lse), ("output", out, ref_out)):
        idx = _first_mismatch(g, w, rtol=1e-8, atol=1e-9)
        if idx is not None:
            raise ExerciseFailed(f"{name} ({problem.name}): after all blocks, {what} of head "
                                 f"{idx[0]} row {idx[1]} is {g[idx]:.10g}, the float64 reference "
                                 f"says {w[idx]:.10g}\n  hint: every step matched the library; "
                                 f"check that your state keeps float64")


def check_update_state(update_state: Callable, *, seed: int | None = None) -> str:
    """Grade `update_state(state, s, v_block, rescale_threshold=0.0) -> SoftmaxState`.

    Each block step is compared with `fa4lab.online_softmax.update_state` fed the same state;
    the student's own run, finalised, with the float64 reference. Raises ExerciseFailed naming
    the problem, block, head, row and field of the first difference; returns a summary.
    """
    rng, seed = fresh_rng(seed)
    name = "update_state"
    problems = _problems(rng)
    for p in problems:
        want = p.init()
        mine = p.init()
        for step, (n0, n1, s, vb) in enumerate(p.blocks()):
            where = (f"{p.name}; seed {seed}; step {step}, keys {n0}..{n1 - 1}, "
                     f"rescale_threshold={p.threshold:g}")
            before = want
            want, _ = osm.update_state(before, s, vb, rescale_threshold=p.threshold)
            got = call_student(update_state, name, copy.deepcopy(before), s.copy(), vb.copy(),
                               rescale_threshold=p.threshold)
            got = _state_of(got, name, where)

            def hint(field, hr, before=before, s=s, p=p, got=got):
                return _update_hint(field, hr, before, s, p, got)

            _compare_state(got, want, name, where, hint)
            mine = _state_of(call_student(update_state, name, mine, s.copy(), vb.copy(),
                                          rescale_threshold=p.threshold), name, where)
        _compare_final(mine, p, name)
    return (f"update_state: all {len(problems)} problems match the library step by step and "
            f"the float64 reference (seed {seed})")


def _update_hint(field, hr, before, s, p, got) -> str:
    """Why field `field` of (head, row) `hr` may be wrong, from what the student returned."""
    m_old, m_blk = before.row_max[hr], s[hr].max()
    if np.isnan(np.asarray(getattr(got, field))[hr]).any():
        return ("NaN: this row's basis or block max is -inf, and -inf - -inf is NaN; use a "
                "basis of 0 where row_max is -inf (Note [-inf minus -inf]) and keep alpha = 1 "
                "for a row that has seen no key")
    if field == "row_max":
        if np.isneginf(m_blk):
            return "this block shows the row no key (all scores -inf): keep the basis as it is"
        with np.errstate(invalid="ignore"):
            rise = (m_blk - m_old) * p.scale_log2
        if rise == p.threshold:
            return (f"this row's max rose by exactly rescale_threshold = {p.threshold:g} in "
                    f"log2 units (row_max {m_old:.10g}, block max {m_blk:.10g}, raw scores): "
                    f"that keeps the basis; it moves only when (block_max - row_max) * "
                    f"scale_log2 > rescale_threshold, strictly greater, not >=")
        return (f"the basis moves to the block max only when (block_max - row_max) * "
                f"scale_log2 > rescale_threshold ({p.threshold:g}), or when row_max is -inf; "
                f"here row_max was {m_old:.6g} and the block max is {m_blk:.6g} (raw scores), "
                f"a rise of {rise:.4g} in log2 units")
    if np.isfinite(m_old) and got.row_max[hr] != m_old:
        no_alpha = before.row_sum[hr] + np.exp2((s[hr] - got.row_max[hr]) * p.scale_log2).sum()
        if field == "row_sum" and np.isclose(got.row_sum[hr], no_alpha, rtol=1e-9):
            return ("the basis moved but the old row_sum was not rescaled: multiply it by "
                    "alpha = 2**((row_max_old - row_max_new) * scale_log2)")
    if field == "row_sum":
        return ("row_sum = alpha * row_sum + sum_j 2**((s_j - basis) * scale_log2): scores are "
                "raw (before softmax_scale), so multiply by scale_log2, and do not normalise "
                "inside the step (finalize divides once)")
    return ("acc_o = alpha * acc_o + P @ v_block with the same alpha and P as row_sum; did you "
            "rescale the old acc_o by alpha?")


def check_merge_states(merge_states: Callable, *, seed: int | None = None) -> str:
    """Grade `merge_states(a, b) -> SoftmaxState` (two partial states over disjoint keys).

    Each problem's keys are split in two; each half is streamed by the library; the student's
    merge (in both orders) must give the basis max(a.row_max, b.row_max), the library's
    row_sum and acc_o, and after `finalize` the float64 reference over all keys.
    """
    rng, seed = fresh_rng(seed)
    name = "merge_states"
    problems = _problems(rng)
    for p in problems:
        blocks = p.blocks()
        cut = int(rng.integers(0, len(blocks) + 1))    # 0 or all: one side saw no key at all
        halves = [p.init(), p.init()]
        for i, (_, _, s, vb) in enumerate(blocks):
            side = int(i >= cut)
            halves[side], _ = osm.update_state(halves[side], s, vb, rescale_threshold=p.threshold)
        for a, b, order in ((*halves, "a, b"), (*halves[::-1], "b, a")):
            where = (f"{p.name}; seed {seed}; merge({order}) where a holds the first {cut} of "
                     f"{len(blocks)} blocks visited and b the rest")
            got = call_student(merge_states, name, copy.deepcopy(a), copy.deepcopy(b))
            got = _state_of(got, name, where)
            want = osm.merge_states(a, b)

            def hint(field, hr, a=a, b=b, got=got):
                return _merge_hint(field, hr, a, b, got)

            _compare_state(got, want, name, where, hint)
            _compare_final(got, p, name)
    return (f"merge_states: all {len(problems)} problems (both orders) match the library and "
            f"the float64 reference (seed {seed})")


def _merge_hint(field, hr, a, b, got) -> str:
    """Why field `field` of (head, row) `hr` of the merged state may be wrong."""
    if np.isnan(np.asarray(getattr(got, field))[hr]).any():
        return ("NaN: a state that saw no key has row_max = -inf; give it weight 0 instead of "
                "computing 2**((-inf) - (-inf))")
    if field == "row_max":
        return "the merged basis is the larger of the two: np.maximum(a.row_max, b.row_max)"
    if field == "row_sum" and np.isclose(got.row_sum[hr], a.row_sum[hr] + b.row_sum[hr]):
        return ("you added the sums as they are, but they sit on different bases: weight each "
                "by 2**((its row_max - merged row_max) * scale_log2) first")
    return (f"weight each state's {field} by 2**((its row_max - merged row_max) * scale_log2) "
            f"(0 for a state whose row_max is -inf), then add; row_sum and acc_o take the same "
            f"weights")
