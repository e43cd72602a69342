"""The bench's tables: TFLOP/s per provider and shape, and fa4lab's ratio to each peer; the
same per feature for `fa4lab bench --features` (ratios to FA4 and to the faster PyTorch peer)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from fa4lab.bench.features import (
    FA4,
    FEATURE_CALLS,
    FEATURE_NAMES,
    FEATURE_PROVIDERS,
    PYTORCH,
)
from fa4lab.bench.records import OK, FeatureResult, Result
from fa4lab.bench.sweep import OURS, PROVIDERS
from fa4lab.bench.timing import GEMM_SIZE


def providers_in(results: Iterable[Result]) -> list[str]:
    """The providers of `results`, fa4lab first, then the peers in their usual order."""
    seen = []
    for r in results:
        if r.provider not in seen:
            seen.append(r.provider)
    order = {p: i for i, p in enumerate(PROVIDERS)}
    return sorted(seen, key=lambda p: order.get(p, len(order)))


@dataclass
class TableRow:
    head_dim: int
    causal: bool
    seqlen: int
    cells: dict[str, Result] = field(default_factory=dict)
    ratios: dict[str, float | None] = field(default_factory=dict)   # ours / peer


def ratio_table(results: Sequence[Result], *, ours: str = OURS) -> list[TableRow]:
    """One row per shape (head_dim, causal, seqlen) with each provider's result and the ratio of
    `ours` to every other provider (None where either side has no measurement)."""
    rows: dict[tuple, TableRow] = {}
    for r in results:
        row = rows.setdefault(r.key, TableRow(r.head_dim, r.causal, r.seqlen))
        row.cells[r.provider] = r
    peers = [p for p in providers_in(results) if p != ours]
    for row in rows.values():
        mine = row.cells.get(ours)
        for p in peers:
            other = row.cells.get(p)
            ok = (mine is not None and other is not None and mine.status == OK
                  and other.status == OK and other.tflops)
            row.ratios[p] = mine.tflops / other.tflops if ok else None
    return [rows[k] for k in sorted(rows)]


def geomean_ratios(rows: Sequence[TableRow]) -> dict[str, float | None]:
    """Geometric mean of ours/peer over the shapes where both were measured."""
    peers = sorted({p for row in rows for p in row.ratios})
    out = {}
    for p in peers:
        vals = [row.ratios[p] for row in rows if row.ratios.get(p)]
        out[p] = math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None
    return out


def _cell(r: Result | None) -> str:
    if r is None:
        return "-"
    if r.status == OK:
        return f"{r.tflops:.0f}" if r.tflops >= 10 else f"{r.tflops:.3g}"
    return r.status


def format_table(results: Sequence[Result], *, ours: str = OURS,
                 gemm_tflops: float | None = None) -> str:
    """A markdown table: TFLOP/s per provider (or its status) and ours/peer ratios."""
    rows = ratio_table(results, ours=ours)
    provs = providers_in(results)
    peers = [p for p in provs if p != ours]
    has_ours = ours in provs
    head = ["head_dim", "causal", "seqlen"] + provs
    if has_ours:
        head += [f"{ours}/{p}" for p in peers]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [str(row.head_dim), "yes" if row.causal else "no", str(row.seqlen)]
        cells += [_cell(row.cells.get(p)) for p in provs]
        if has_ours:
            cells += ["-" if row.ratios.get(p) is None else f"{row.ratios[p]:.2f}" for p in peers]
        lines.append("| " + " | ".join(cells) + " |")
    if has_ours and rows:
        gm = geomean_ratios(rows)
        parts = [f"{ours}/{p} {gm[p]:.2f}" if gm.get(p) else f"{ours}/{p} -" for p in peers]
        lines.append("")
        lines.append("geometric mean over shapes measured by both: " + ", ".join(parts))
    if gemm_tflops:
        lines.append(f"dense bf16 GEMM {GEMM_SIZE}^3 (ceiling), same run: {gemm_tflops:.0f} "
                     f"TFLOP/s")
    notes = [f"- {r.provider} {'causal' if r.causal else 'full'} hd{r.head_dim} s{r.seqlen}: "
             f"{r.status}: {r.note}" for r in results if r.status != OK and r.note]
    if notes:
        lines += ["", "not measured:"] + _dedupe_notes(notes)
    return "\n".join(lines)


def _dedupe_notes(notes: list[str], limit: int = 12) -> list[str]:
    # A missing provider repeats the same note on every shape: say it once.
    seen, out = set(), []
    for n in notes:
        prov, _, rest = n.partition(" ")
        reason = rest.split(": ", 2)[-1]
        if (prov, reason) in seen:
            continue
        seen.add((prov, reason))
        out.append(n)
    return out[:limit] + ([f"- ... {len(out) - limit} more"] if len(out) > limit else [])


# ---- fa4lab bench --features -------------------------------------------------------------------
@dataclass
class FeatureRatios:
    """fa4lab's speed over FA4 and over the faster PyTorch peer on one feature (> 1: fa4lab
    is faster); None where a side was not measured."""

    feature: str
    fa4lab_tflops: float | None = None
    over_fa4: float | None = None
    over_pytorch: float | None = None
    best_pytorch: str | None = None
    cells: dict[str, FeatureResult] = field(default_factory=dict)


def feature_ratios(results: Sequence[FeatureResult]) -> list[FeatureRatios]:
    """One FeatureRatios per feature, in the order of `fa4lab.bench.features.ALL_FEATURES`."""
    by: dict[str, FeatureRatios] = {}
    for r in results:
        by.setdefault(r.feature, FeatureRatios(r.feature)).cells[r.provider] = r
    order = {n: i for i, n in enumerate(FEATURE_NAMES)}
    out = []
    for name in sorted(by, key=lambda n: order.get(n, len(order))):
        row = by[name]
        ok = {p: c for p, c in row.cells.items() if c.status == OK and c.tflops}
        mine = ok.get(OURS)
        if mine:
            row.fa4lab_tflops = mine.tflops
            if FA4 in ok:
                row.over_fa4 = mine.tflops / ok[FA4].tflops
            torch_ok = [p for p in PYTORCH if p in ok]
            if torch_ok:
                row.best_pytorch = max(torch_ok, key=lambda p: ok[p].tflops)
                row.over_pytorch = mine.tflops / ok[row.best_pytorch].tflops
        out.append(row)
    return out


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def format_features_table(results: Sequence[FeatureResult]) -> str:
    """Markdown: one row per (feature, provider) with the shape and dtype, the call (fa4lab's
    default call first: Note [the headline row] in `fa4lab.bench.serving`), us, TFLOP/s and
    fa4lab's speed over it; then fa4lab/FA4 and fa4lab/best PyTorch per feature; then the rows
    not measured."""
    lines = ["| feature | shape | dtype | provider | call | us | TFLOP/s | fa4lab/this |",
             "|---|---|---|---|---|---|---|---|"]
    order = {p: i for i, p in enumerate(FEATURE_PROVIDERS)}
    ratios = feature_ratios(results)
    for row in ratios:
        mine = row.cells.get(OURS)
        for p in sorted(row.cells, key=lambda p: order.get(p, len(order))):
            r = row.cells[p]
            head = (f"| {row.feature} | {r.shape_label()} | {r.dtype} | {p} | "
                    f"{FEATURE_CALLS.get(p, '')} |")
            if r.status != OK:
                lines.append(f"{head} {r.status} | - | - |")
                continue
            speed = (mine.tflops / r.tflops if mine is not None and mine.status == OK
                     else None)
            lines.append(f"{head} {r.us:.1f} | {r.tflops:.0f} | {_num(speed, '.2f')} |")
    lines += ["", f"{OURS} (call: default) is fa4lab.attention with the feature's options and "
                  f"nothing else; {FA4} gets the same options and the same q, k, v.",
              "", "| feature | fa4lab TFLOP/s | fa4lab/FA4 | fa4lab/best PyTorch |",
              "|---|---|---|---|"]
    for row in ratios:
        best = (f"{row.over_pytorch:.2f} ({row.best_pytorch})" if row.over_pytorch is not None
                else "-")
        lines.append(f"| {row.feature} | {_num(row.fa4lab_tflops, '.0f')} | "
                     f"{_num(row.over_fa4, '.2f')} | {best} |")
    notes: list[str] = []
    for r in results:
        if r.status != OK and r.note:
            n = f"- {r.provider} {r.feature}: {r.status}: {r.note}"
            if n not in notes:
                notes.append(n)
    if notes:
        lines += ["", "not measured:"] + notes
    return "\n".join(lines)
