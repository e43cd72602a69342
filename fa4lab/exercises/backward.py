"""Notebook 10's exercise: one (query block, key block) step of the FlashAttention backward.

The student's `backward_step(q, k, v, dout, lse, d_row, softmax_scale, visible)` returns the
tile's (dq, dk, dv), as `fa4lab.backward_blocks.backward_step` does. The check cuts small
adversarial problems (tails, a non-default scale, a causal diagonal block, rows that see no key,
logits far above 0) into blocks, compares the student's step with the library's block by block,
and names the first wrong element with what was expected and the likely mistake (each typical
mistake is recomputed and compared); then it runs the whole block walk with the student's step
and compares it with the float64 reference backward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from fa4lab import backward_blocks as bb
from fa4lab.exercises._core import ExerciseFailed, GradingError, call_student, fresh_rng
from fa4lab.reference import attention_reference, visible_mask
from fa4lab.reference_backward import attention_backward_reference

__all__ = ["check_backward_step"]

_RTOL, _ATOL = 1e-9, 1e-11
_NAME = "backward_step"


@dataclass
class _Problem:
    """One head of attention: (seqlen, dim) arrays, cut into block_m x block_n tiles."""

    name: str
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    dout: np.ndarray
    causal: bool
    scale: float
    block_m: int
    block_n: int

    def four(self, x):
        return x[None, :, None, :]           # (batch, seqlen, heads, dim), the reference's

    def forward(self):
        out, lse = attention_reference(self.four(self.q), self.four(self.k), self.four(self.v),
                                       causal=self.causal, softmax_scale=self.scale,
                                       return_lse=True)
        return out[0, :, 0], lse[0, 0]

    def visible(self):
        return visible_mask(len(self.q), len(self.k), self.causal)


def _problems(rng) -> list[_Problem]:
    def rand(sq, sk, d, dv, logit=1.0):
        q = rng.standard_normal((sq, d)) * np.sqrt(logit)
        k = rng.standard_normal((sk, d)) * np.sqrt(logit)
        return q, k, rng.standard_normal((sk, dv)), rng.standard_normal((sq, dv))

    # the square problem first: a transposed product fails there on its values, not its shape
    return [
        _Problem("causal 8 x 8 in square 4 x 4 blocks (the diagonal blocks hide keys)",
                 *rand(8, 8, 4, 4), True, 0.5, 4, 4),
        _Problem("7 queries x 9 keys in 3 x 4 blocks (tails), head_dim 4, head_dim_v 3, "
                 "softmax_scale 0.7", *rand(7, 9, 4, 3), False, 0.7, 3, 4),
        _Problem("causal, 6 queries x 4 keys: rows 0 and 1 see no key (their LSE is -inf)",
                 *rand(6, 4, 4, 2), True, 0.5, 3, 2),
        _Problem("logits far above 0 (scores in the thousands)",
                 *rand(4, 6, 4, 3, logit=4000.0), False, 0.5, 4, 3),
    ]


# The typical mistakes: what a student's step computes instead, and the hint that names it.
def _step(q, k, v, dout, lse, d_row, scale, visible, *, mistake: str | None = None):
    """The library's step with one typical mistake made (`mistake` a key of _HINTS)."""
    s = (1.0 if mistake == "unscaled_s" else scale) * (q @ k.T)
    seen = np.isfinite(lse)
    show = (np.ones_like(visible) if mistake == "unmasked" else visible) & seen[:, None]
    p = np.zeros_like(s)
    if mistake == "block_softmax":                  # normalised over this block's keys only
        masked = np.where(show, s, -np.inf)
        top = np.max(masked, axis=1, keepdims=True)
        e = np.exp(masked - np.where(np.isfinite(top), top, 0.0))
        total = e.sum(axis=1, keepdims=True)
        p = np.divide(e, total, out=p, where=total > 0)
    else:
        p[show] = np.exp((s - np.where(seen, lse, 0.0)[:, None])[show])
    dv = p @ dout if mistake == "p_not_transposed" else p.T @ dout
    dp = dout @ v.T
    d = {"no_d": 0.0, "plus_d": -d_row[:, None], "d_by_column": d_row[None, :]}.get(
        mistake, d_row[:, None])
    ds = p * (dp - d)
    g = 1.0 if mistake == "unscaled_grads" else scale
    dq = g * (ds @ k)
    dk = g * (ds @ q if mistake == "ds_not_transposed" else ds.T @ q)
    return dq, dk, dv


_HINTS = {
    "no_d": "did you subtract D = rowsum(dO * O) (d_row) before multiplying by P? "
            "dS = P * (dP - D[:, None])",
    "plus_d": "dS = P * (dP - D): D is subtracted, not added",
    "d_by_column": "D is one number per query ROW: subtract d_row[:, None] (the same D along "
                   "a row's keys), not d_row[None, :]",
    "block_softmax": "P comes from the saved LSE: P = exp(S - LSE[:, None]) on visible keys. A "
                     "softmax over this block's keys divides by the block's sum, not the whole "
                     "row's: the LSE already normalises over every key of the row",
    "unscaled_s": "S = softmax_scale * Q K^T: the saved LSE is of the scaled scores",
    "unmasked": "keys the mask hides have P = 0: use `visible`",
    "unscaled_grads": "S = softmax_scale * Q K^T, so the chain rule gives dQ = softmax_scale * "
                      "dS K and dK = softmax_scale * dS^T Q",
    "p_not_transposed": "dV = P^T dO: key j's row of dV sums P[:, j] * dO over the query rows",
    "ds_not_transposed": "dK = softmax_scale * dS^T Q: key j's row sums dS[:, j] * Q over the "
                         "query rows",
}
_DS_MISTAKES = ("no_d", "plus_d", "d_by_column")
_SQUARE_ONLY = ("d_by_column", "p_not_transposed", "ds_not_transposed")
_GENERIC = {
    "dv": "dV = P^T dO with P = exp(softmax_scale * Q K^T - LSE[:, None]) where visible, 0 "
          "elsewhere; dV's row j belongs to key j",
    "dq": "dQ = softmax_scale * dS K, with dP = dO V^T and dS = P * (dP - D[:, None])",
    "dk": "dK = softmax_scale * dS^T Q (your dQ matched, so dS is right: check dK's transpose "
          "and scale)",
}
_WHAT = {"dq": "dQ", "dk": "dK", "dv": "dV"}


def _close(got, want) -> np.ndarray:
    return np.isclose(got, want, rtol=_RTOL, atol=_ATOL)


def _as_grads(got, shapes, where: str):
    try:
        arrays = [np.asarray(x, dtype=np.float64) for x in got]
    except (TypeError, ValueError):
        arrays = None
    if arrays is None or len(arrays) != 3:
        raise ExerciseFailed(f"{_NAME} ({where}) returned {type(got).__name__}; return "
                             f"(dq, dk, dv), three arrays of shapes {shapes[0]}, {shapes[1]}, "
                             f"{shapes[2]}")
    for field, a, shape in zip(("dq", "dk", "dv"), arrays, shapes):
        if a.shape != shape:
            rows = "query rows" if field == "dq" else "keys"
            raise ExerciseFailed(f"{_NAME} ({where}): {_WHAT[field]} has shape {a.shape}, "
                                 f"expected {shape} (one row per {rows[:-1]} of the block: "
                                 f"{shape[0]} {rows})")
    return arrays


def _diagnose(field, got, args, square, lse, r) -> str:
    if not np.isfinite(got).all():
        if field in ("dq",) and not np.isfinite(lse[r]):
            return (f"query row {r} sees no key at all (its LSE is -inf), so S - LSE is +inf "
                    f"and exp of it inf or NaN: set P to 0 on rows whose LSE is -inf (Note "
                    f"[masked rows in the backward] in fa4lab.reference_backward)")
        if not np.isfinite(lse).all():
            return ("a row of this block sees no key (LSE -inf): exp(S - LSE) is inf or NaN "
                    "there; give such rows P = 0, and compute exp only where visible")
        return ("your result has inf or NaN where the library's is finite: compute P as "
                "exp(S - LSE) in one exp (exp(S) / exp(LSE) overflows when scores are large)")
    index = {"dq": 0, "dk": 1, "dv": 2}[field]
    for mistake, hint in _HINTS.items():
        if mistake in _SQUARE_ONLY and not square:
            continue
        with np.errstate(all="ignore"):
            alt = _step(*args, mistake=mistake)[index]
        if alt.shape == got.shape and _close(got, alt).all():
            return f"row {r} of dS differs: {hint}" if mistake in _DS_MISTAKES else hint
    return _GENERIC[field]


def check_backward_step(backward_step: Callable, *, seed: int | None = None) -> str:
    """Grade `backward_step(q, k, v, dout, lse, d_row, softmax_scale, visible) -> (dq, dk, dv)`.

    Each tile of small adversarial problems is compared with `fa4lab.backward_blocks.
    backward_step`; then the block walk with the student's step is compared with the float64
    reference backward. Raises ExerciseFailed at the first wrong element (problem, blocks, row,
    field, got, expected, hint); returns a summary.
    """
    rng, seed = fresh_rng(seed)
    problems = _problems(rng)
    tiles = 0
    for p in problems:
        out, lse = p.forward()
        d_all = bb.row_d(p.dout, out)
        visible = p.visible()
        for j, blocks in bb.block_pairs(visible, p.block_m, p.block_n):
            for i in blocks:
                rows = slice(i * p.block_m, (i + 1) * p.block_m)
                keys = slice(j * p.block_n, (j + 1) * p.block_n)
                args = (p.q[rows], p.k[keys], p.v[keys], p.dout[rows], lse[rows], d_all[rows],
                        p.scale, visible[rows, keys])
                r0, k0 = rows.start, keys.start
                m, n = len(args[0]), len(args[1])
                where = (f"{p.name}; seed {seed}; query block {i} (rows {r0}..{r0 + m - 1}), "
                         f"key block {j} (keys {k0}..{k0 + n - 1})")
                mine = tuple(np.array(a, copy=True) if isinstance(a, np.ndarray) else a
                             for a in args)
                got = call_student(backward_step, _NAME, *mine)
                for name, a, b in zip(("q", "k", "v", "dout", "lse", "d_row", "softmax_scale",
                                       "visible"), args, mine):
                    if not np.array_equal(a, b, equal_nan=True):
                        raise ExerciseFailed(f"{_NAME} ({where}): your function changed its "
                                             f"input {name} in place; the kernel's tiles are "
                                             f"read again by the next step: compute into new "
                                             f"arrays")
                want = bb.backward_step(*args)
                got = _as_grads(got, [w.shape for w in want], where)
                for field in ("dv", "dq", "dk"):
                    idx = {"dq": 0, "dk": 1, "dv": 2}[field]
                    g, w = got[idx], want[idx]
                    bad = np.argwhere(~_close(g, w))
                    if bad.size == 0:
                        continue
                    r, c = (int(x) for x in bad[0])
                    hint = _diagnose(field, g, args, m == n, lse[rows], r)
                    if field == "dq":
                        at = (f"row {r} (query {r0 + r}) of dQ, column {c} (dQ's row {r} is "
                              f"softmax_scale * dS[{r}] K)")
                    else:
                        at = f"row {r} (key {k0 + r}) of {_WHAT[field]}, column {c}"
                    raise ExerciseFailed(f"{_NAME} ({where}): {at}: got {g[r, c]:.10g}, "
                                         f"expected {w[r, c]:.10g}\n  hint: {hint}")
                tiles += 1
    _check_walk(backward_step, problems[0], seed)
    return (f"{_NAME}: {tiles} tiles of {len(problems)} problems match the library's step, and "
            f"the block walk with your step matches the float64 reference backward (seed {seed})")


def _check_walk(backward_step: Callable, p: _Problem, seed: int) -> None:
    """The whole problem through `backward_blockwise` with the student's step, against the
    float64 reference backward."""
    four = [p.four(x) for x in (p.q, p.k, p.v, p.dout)]

    def step(*args):
        return call_student(backward_step, _NAME, *args)

    got = bb.backward_blockwise(*four, causal=p.causal, softmax_scale=p.scale,
                                block_m=p.block_m, block_n=p.block_n, step=step)
    want = attention_backward_reference(*four, causal=p.causal, softmax_scale=p.scale)
    lib = bb.backward_blockwise(*four, causal=p.causal, softmax_scale=p.scale,
                                block_m=p.block_m, block_n=p.block_n)
    for field, g, w, lb in zip(("dq", "dk", "dv"), got, want, lib):
        if not np.allclose(lb, w, rtol=1e-9, atol=1e-11):
            raise GradingError(f"the library's block walk differs from the float64 reference "
                               f"in {_WHAT[field]}: a bug in fa4lab, not in your answer")
        bad = np.argwhere(~np.isclose(g, w, rtol=1e-9, atol=1e-11))
        if bad.size:
            row = int(bad[0][1])
            raise ExerciseFailed(f"{_NAME} ({p.name}; seed {seed}; the whole walk): "
                                 f"{_WHAT[field]} of row {row} differs from the float64 "
                                 f"reference backward although each tile matched alone\n  "
                                 f"hint: does your function keep state between calls? Each "
                                 f"step must depend only on its arguments")
