"""Notebook 02's exercises: the key blocks a query tile visits, and the kind of every tile.

Each check runs the student's function on a fixed set of awkward shapes (seqlen 1, seqlen_q >
seqlen_k, tails, windows) and on fresh random ones, and compares it with `fa4lab.tiling`
(`n_block_range`, `classify_tiles`) and with brute force over the element mask
(`fa4lab.reference.visible_mask`). No pack-GQA here: an M row is a query position.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fa4lab import tiling
from fa4lab.exercises._core import ExerciseFailed, call_student, fresh_rng
from fa4lab.reference import visible_mask
from fa4lab.spec import effective_window, normalize_mask
from fa4lab.tiling import TileKind

__all__ = ["check_n_block_range", "check_classify_tiles"]

# (seqlen_q, seqlen_k, m_block_size, n_block_size, causal, window_size): the shapes that break
# a first attempt; random ones follow.
FIXED_SHAPES = (
    (20, 12, 4, 4, True, (None, None)),      # notebook 02's example: seqlen_q > seqlen_k
    (12, 20, 4, 4, True, (None, None)),      # seqlen_q < seqlen_k: the diagonal shifts right
    (1, 1, 1, 1, True, (None, None)),
    (1, 1, 128, 128, False, (None, None)),
    (1, 300, 128, 128, True, (None, None)),  # decoding: one query sees every key
    (9, 5, 4, 2, True, (None, None)),        # tails in both directions
    (100, 1000, 64, 128, True, (256, 0)),
    (16, 16, 4, 4, False, (3, 0)),
    (16, 16, 4, 4, False, (0, 0)),           # only the diagonal
    (16, 16, 4, 4, False, (2, 3)),
    (16, 24, 4, 8, False, (None, 2)),
    (24, 16, 4, 8, False, (4, None)),
)


def _shapes(rng, count: int):
    """FIXED_SHAPES, then `count` random ones with at most 256 tiles (a Python loop per tile)."""
    yield from FIXED_SHAPES
    sizes = (1, 2, 3, 4, 8, 16, 32, 64, 128)
    made = 0
    while made < count:
        sq, sk = (int(x) for x in rng.integers(1, 200, size=2))
        bm, bn = (int(x) for x in rng.choice(sizes, size=2))
        if tiling.ceil_div(sq, bm) * tiling.ceil_div(sk, bn) > 256:
            continue
        causal = bool(rng.integers(2))
        left = None if rng.random() < 0.4 else int(rng.integers(0, 64))
        right = 0 if causal else (None if rng.random() < 0.4 else int(rng.integers(0, 64)))
        made += 1
        yield sq, sk, bm, bn, causal, (left, right)


def _label(sq, sk, bm, bn, causal, window) -> str:
    return (f"seqlen_q={sq}, seqlen_k={sk}, m_block_size={bm}, n_block_size={bn}, "
            f"causal={causal}, window_size={window}")


def _visible(sq, sk, causal, window, *, top_left=False) -> np.ndarray:
    """The element mask; top_left=True is the common mistake (diagonal from the top left)."""
    if not top_left:
        return visible_mask(sq, sk, causal, window_size=window)
    left, right = effective_window(causal, window)
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    mask = np.ones((sq, sk), dtype=bool)
    if right is not None:
        mask &= j <= i + right
    if left is not None:
        mask &= j >= i - left
    return mask


def _brute_range(visible: np.ndarray, m: int, bm: int, bn: int) -> tuple[int, int]:
    cols = np.flatnonzero(visible[m * bm:(m + 1) * bm].any(axis=0))
    return (0, 0) if cols.size == 0 else (int(cols[0]) // bn, int(cols[-1]) // bn + 1)


def _as_range(got, where: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in got)
    except (TypeError, ValueError):
        raise ExerciseFailed(f"n_block_range ({where}) returned {got!r}; return a pair "
                             f"(n_block_min, n_block_max) of ints") from None
    return lo, hi


def _empty_hint(got, want, m, sq, sk, bm, causal, window) -> str | None:
    """The hint when the expected range, or the answer, is empty or reversed; None otherwise."""
    convention = ("fa4lab.tiling's convention: empty is n_block_min == n_block_max ((0, 0) "
                  "when no row sees a key), never n_block_min > n_block_max; clamp the last "
                  "row's key end at 0 BEFORE the ceil-divide, n_block_max = ceil(max(end, 0) / "
                  "n_block_size), then n_block_min = min(n_block_min, n_block_max)")
    if want[0] == want[1]:
        _, right = effective_window(causal, window)
        last = min((m + 1) * bm, sq) - 1
        return (f"an empty range means the tile's rows see no key: its last row, {last}, sees "
                f"keys j <= row + (seqlen_k - seqlen_q) + right = {last + sk - sq + right} < 0 "
                f"(seqlen_q > seqlen_k under causal or a window's right side), so the kernel "
                f"visits no block and writes 0 (lse -inf) for these rows. {convention}")
    if got[0] > got[1]:
        return f"[{got[0]}, {got[1]}) is no range (n_block_min > n_block_max). {convention}"
    if got[0] == got[1]:
        return ("an empty range is only for a tile none of whose rows sees a key; here some "
                "do: check the bounds of the tile's first row (n_block_min) and last row "
                "(n_block_max)")
    return None


def check_n_block_range(n_block_range: Callable, *, seed: int | None = None,
                        random_shapes: int = 150) -> str:
    """Grade `n_block_range(m_block, *, seqlen_q, seqlen_k, m_block_size, n_block_size, causal,
    window_size=(None, None)) -> (n_block_min, n_block_max)`, half-open, (x, x) when empty.

    Every tile of every shape is compared with `fa4lab.tiling.n_block_range` and with the
    smallest block range holding every visible element. Raises ExerciseFailed on the first
    wrong tile; returns a summary.
    """
    rng, seed = fresh_rng(seed)
    tiles = 0
    for sq, sk, bm, bn, causal, window in _shapes(rng, random_shapes):
        visible = _visible(sq, sk, causal, window)
        for m in range(tiling.ceil_div(sq, bm)):
            want = tiling.n_block_range(m, seqlen_q=sq, seqlen_k=sk, m_block_size=bm,
                                        n_block_size=bn, causal=causal, window_size=window)
            brute = _brute_range(visible, m, bm, bn)
            if want != brute:
                raise RuntimeError(f"fa4lab.tiling.n_block_range gives {want} and the element "
                                   f"mask {brute} for m_block {m}, "
                                   f"{_label(sq, sk, bm, bn, causal, window)}: a bug in fa4lab, "
                                   f"not in your answer")
            where = f"m_block {m}, {_label(sq, sk, bm, bn, causal, window)}; seed {seed}"
            got = _as_range(call_student(n_block_range, "n_block_range", m, seqlen_q=sq,
                                         seqlen_k=sk, m_block_size=bm, n_block_size=bn,
                                         causal=causal, window_size=window), where)
            tiles += 1
            if got == want or (got[0] == got[1] and want[0] == want[1]):
                continue
            rows = f"rows {m * bm}..{min((m + 1) * bm, sq) - 1}"
            seen = ("see no key" if want[0] == want[1] else
                    f"see keys in blocks {want[0]}..{want[1] - 1}")
            raise ExerciseFailed(f"n_block_range ({where}): got [{got[0]}, {got[1]}), expected "
                                 f"[{want[0]}, {want[1]}): the tile's {rows} {seen}\n  hint: "
                                 f"{_range_hint(got, want, m, sq, sk, bm, bn, causal, window)}")
    return f"n_block_range: {tiles} tiles match fa4lab.tiling and the element mask (seed {seed})"


def _range_hint(got, want, m, sq, sk, bm, bn, causal, window) -> str:
    left, right = effective_window(causal, window)
    empty = _empty_hint(got, want, m, sq, sk, bm, causal, window)
    if got == _brute_range(_visible(sq, sk, causal, window, top_left=True), m, bm, bn):
        return ((empty + "\n  and " if empty else "") + "you aligned the diagonal at the top "
                "left; FA4 aligns it at the bottom right: query i sees keys up to i + "
                "(seqlen_k - seqlen_q) + right")
    if empty:
        return empty
    if right is not None and got == _brute_range(_visible(sq, sk, False, (left, None)), m, bm,
                                                 bn):
        return ("you ignored the right bound: causal=True means right = 0, and a window's "
                "right side limits the last row's keys too")
    if got[1] == want[1] + 1 and got[0] == want[0]:
        return "the range is half-open: n_block_max is one PAST the last block visited"
    if got[0] != want[0]:
        if left is None:
            return "without a window's left side every tile starts at block 0"
        return ("n_block_min comes from the tile's FIRST row: its first key is row + "
                "(seqlen_k - seqlen_q) - left, clamped at 0, floor-divided by n_block_size")
    if right is None:
        return "without a right side (no causal) the last row sees every key: ceil(seqlen_k / n)"
    return ("n_block_max comes from the tile's LAST row: it sees keys j < min(seqlen_k, row + "
            "(seqlen_k - seqlen_q) + right + 1); ceil-divide by n_block_size, clamping at 0 "
            "first (a row past seqlen_q is no row)")


def brute_force_kinds(sq, sk, bm, bn, causal, window) -> np.ndarray:
    """SKIP / FULL / MASKED per tile from the element mask: only in-bounds elements count."""
    visible = _visible(sq, sk, causal, window)
    kinds = np.full((tiling.ceil_div(sq, bm), tiling.ceil_div(sk, bn)), int(TileKind.SKIP))
    for m in range(kinds.shape[0]):
        for n in range(kinds.shape[1]):
            tile = visible[m * bm:(m + 1) * bm, n * bn:(n + 1) * bn]
            if tile.all():
                kinds[m, n] = TileKind.FULL
            elif tile.any():
                kinds[m, n] = TileKind.MASKED
    return kinds


def _three_kinds(kinds) -> np.ndarray:
    """TileKind values with TAIL counted as FULL (all its in-bounds elements are visible)."""
    kinds = np.array(kinds, dtype=np.int64)
    kinds[kinds == TileKind.TAIL] = TileKind.FULL
    return kinds


def _kind_name(k) -> str:
    try:
        return TileKind(int(k)).name
    except ValueError:
        return repr(k)


def check_classify_tiles(classify_tiles: Callable, *, seed: int | None = None,
                         random_shapes: int = 60) -> str:
    """Grade `classify_tiles(seqlen_q, seqlen_k, m_block_size, n_block_size, causal,
    window_size=(None, None))` -> (num_m_blocks, num_n_blocks) array of TileKind: SKIP (no
    visible in-bounds element), FULL (every in-bounds element visible; TAIL also accepted),
    MASKED (some visible, some not).

    Compared with `fa4lab.tiling.classify_tiles` (its TAIL counted as FULL) and with brute
    force over the element mask. Raises ExerciseFailed on the first wrong tile.
    """
    rng, seed = fresh_rng(seed)
    tiles = 0
    for shape in _shapes(rng, random_shapes):
        sq, sk, bm, bn, causal, window = shape
        want = _three_kinds(tiling.classify_tiles(sq, sk, bm, bn, causal,
                                                  window_size=window).kinds)
        brute = brute_force_kinds(*shape)
        if not np.array_equal(want, brute):
            raise RuntimeError(f"fa4lab.tiling.classify_tiles disagrees with the element mask "
                               f"for {_label(*shape)}: a bug in fa4lab, not in your answer")
        where = f"{_label(*shape)}; seed {seed}"
        got = call_student(classify_tiles, "classify_tiles", sq, sk, bm, bn, causal,
                           window_size=window)
        try:
            got = _three_kinds(got)
        except (TypeError, ValueError):
            raise ExerciseFailed(f"classify_tiles ({where}) returned {type(got).__name__}; "
                                 f"return an array of TileKind values") from None
        if got.shape != want.shape:
            raise ExerciseFailed(f"classify_tiles ({where}) returned shape {got.shape}, expected "
                                 f"{want.shape} = (ceil(seqlen_q / m_block_size), "
                                 f"ceil(seqlen_k / n_block_size))")
        tiles += want.size
        bad = np.argwhere(got != want)
        if bad.size:
            m, n = (int(x) for x in bad[0])
            raise ExerciseFailed(f"classify_tiles ({where}): tile (m_block {m}, n_block {n}) is "
                                 f"{_kind_name(got[m, n])}, expected {_kind_name(want[m, n])}: "
                                 f"{_witness(shape, m, n, want[m, n])}")
    return (f"classify_tiles: {tiles} tiles match fa4lab.tiling and the element mask "
            f"(seed {seed})")


def _witness(shape, m, n, kind) -> str:
    """Why the tile is what it is, from the element mask, plus a hint."""
    sq, sk, bm, bn, causal, window = shape
    causal, window = normalize_mask(causal, window)
    r0, c0 = m * bm, n * bn
    tile = _visible(sq, sk, causal, window)[r0:r0 + bm, c0:c0 + bn]
    bounds = f"in bounds: rows {r0}..{r0 + tile.shape[0] - 1}, keys {c0}..{c0 + tile.shape[1] - 1}"
    if kind == TileKind.SKIP:
        return (f"no in-bounds element is visible ({bounds})\n  hint: a tile is SKIP when no "
                f"row of it sees any of its keys; rows and keys past the end do not count")
    if kind == TileKind.FULL:
        return (f"every in-bounds element is visible ({bounds})\n  hint: only in-bounds "
                f"elements count: a tile that runs past seqlen_q or seqlen_k needs no mask for "
                f"that (its extra rows are dropped, the seqlen_k bound is cheap)")
    i, j = (int(x) for x in np.argwhere(~tile)[0])
    a, b = (int(x) for x in np.argwhere(tile)[0])
    return (f"row {r0 + i} does not see key {c0 + j} but row {r0 + a} sees key {c0 + b} "
            f"({bounds})\n  hint: query i sees key j iff i + d - left <= j <= i + d + right, "
            f"d = seqlen_k - seqlen_q (right = 0 under causal); a tile is MASKED when that "
            f"holds for some of its in-bounds elements but not all")
