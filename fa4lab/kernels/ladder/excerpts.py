"""Annotated excerpts of the kernels' source: a few lines, read from the source, each captioned
with the barrier edge or TMEM region of the plan it implements (notebook 05).

    from fa4lab.kernels.ladder.excerpts import barrier_excerpt, tmem_excerpt, markdown
    from fa4lab.kernels.fwd_sm100 import FlashForwardSm100 as K
    markdown(barrier_excerpt(plan, K.mma, "commit s_full"),
             tmem_excerpt(plan, K.tmem_tensors, "tmem_s_offset[i]", "S"))

An excerpt is found by an anchor -- a literal piece of one source line (a barrier site such as
"wait s_full", a `# ladder: mma` comment) -- never by line numbers, and it is never a copy: the
lines are read from the module when the notebook runs. An anchor that is no longer in the
source raises `ExcerptMissing`, naming the function and the anchor, so a notebook cannot
silently show stale code.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path

import fa4lab

_ROOT = Path(fa4lab.__file__).resolve().parent.parent
_VERBS = {"wait": "waits", "arrive": "arrives on", "commit": "commits (tcgen05.commit)",
          "cp_async_arrive": "arrives on once its cp.async copies land",
          "expect_tx": "arms (expect_tx)", "sync": "syncs on (bar.sync)",
          "named_arrive": "arrives on (bar.arrive)"}


class ExcerptMissing(LookupError):
    """An excerpt's anchor is not (or not that many times) in the source it names."""


@dataclass(frozen=True)
class Excerpt:
    where: str                  # "fa4lab/kernels/fwd_sm100.py:512-514 (FlashForwardSm100.mma)"
    lines: tuple[str, ...]
    caption: str

    def __str__(self) -> str:
        return f"# {self.caption}\n# {self.where}\n" + "\n".join(self.lines)

    def _repr_markdown_(self) -> str:
        return markdown(self)


def markdown(*excerpts: Excerpt) -> str:
    """The excerpts as markdown: each caption in bold, where it is, the lines as Python."""
    return "\n\n".join(f"**{e.caption}** -- `{e.where}`\n```python\n" + "\n".join(e.lines)
                       + "\n```" for e in excerpts)


def _source(obj) -> tuple[list[str], int, str]:
    obj = inspect.unwrap(obj)      # a @cute.jit method: the function it wraps
    lines, first = inspect.getsourcelines(obj)
    path = Path(inspect.getsourcefile(obj)).resolve()
    try:
        path = path.relative_to(_ROOT)
    except ValueError:
        pass
    return [ln.rstrip("\n") for ln in lines], first, f"{path.as_posix()}"


def _find(lines, anchor: str, obj, occurrence: int) -> int:
    hits = [i for i, ln in enumerate(lines) if anchor in ln]
    if len(hits) <= occurrence:
        raise ExcerptMissing(
            f"{obj.__qualname__}: anchor {anchor!r} found {len(hits)} time(s), occurrence "
            f"{occurrence} asked for; the source changed -- update the excerpt's anchor "
            f"(fa4lab.kernels.ladder.excerpts)")
    return hits[occurrence]


def _dedent(lines) -> tuple[str, ...]:
    pad = min((len(ln) - len(ln.lstrip()) for ln in lines if ln.strip()), default=0)
    return tuple(ln[pad:] for ln in lines)


def _whole_calls(lines, lo: int, hi: int) -> tuple[int, int]:
    """[lo, hi) widened until no call is open at either end: a continuation line at the top
    pulls in the line that opened its call, an open call at the bottom its closing lines."""
    def depth(a, b):
        return sum(ln.count("(") - ln.count(")") for ln in lines[a:b])

    while lo > 0 and min(depth(lo, k) for k in range(lo + 1, hi + 1)) < 0:
        lo -= 1
    while hi < len(lines) and depth(lo, hi) > 0:
        hi += 1
    return lo, hi


def lines_at(obj, anchor: str, caption: str, before: int = 0, after: int = 0,
             occurrence: int = 0) -> Excerpt:
    """The line of `obj`'s source holding `anchor` (its `occurrence`-th), with `before` lines
    above and `after` below, widened to whole calls (`_whole_calls`)."""
    lines, first, path = _source(obj)
    i = _find(lines, anchor, obj, occurrence)
    lo, hi = _whole_calls(lines, max(0, i - before), min(len(lines), i + after + 1))
    return Excerpt(f"{path}:{first + lo}-{first + hi - 1} ({obj.__qualname__})",
                   _dedent(lines[lo:hi]), caption)


def between(obj, start: str, end: str, caption: str) -> Excerpt:
    """The lines of `obj`'s source from the one holding `start` to the one holding `end`
    (widened to whole calls)."""
    lines, first, path = _source(obj)
    i = _find(lines, start, obj, 0)
    lo, hi = _whole_calls(lines, i, i + _find(lines[i:], end, obj, 0) + 1)
    return Excerpt(f"{path}:{first + lo}-{first + hi - 1} ({obj.__qualname__})",
                   _dedent(lines[lo:hi]), caption)


def barrier_caption(plan, site: str) -> str:
    """'commits (tcgen05.commit) s_full[i] (mma -> softmax0,softmax1): <what it guards>' for a
    site "commit s_full" of `plan`'s protocol table; a site of two ops ("wait kv_empty;
    expect_tx kv_full") gets both, joined by ' | '."""
    if ";" in site:
        return " | ".join(barrier_caption(plan, op.strip()) for op in site.split(";"))
    kind, name = site.split()
    b = plan.barriers.barrier(name)
    index = "" if b.stages == 1 else ("[ring]" if b.ring else "[i]")
    return f"{_VERBS[kind]} {name}{index} ({b.producer} -> {b.consumer}): {b.guards}"


def barrier_excerpt(plan, obj, site: str, before: int = 0, after: int = 0,
                    occurrence: int = 0) -> Excerpt:
    """The barrier op `site` ("wait s_full", "arrive p_ready", "commit o_final", or the two ops
    of one call, "wait kv_empty; expect_tx kv_full") as the kernel issues it through
    `self.sites` (fa4lab.kernels.protocol), captioned with its edge."""
    return lines_at(obj, f'"{site}"', barrier_caption(plan, site), before, after, occurrence)


def tmem_caption(plan, region: str) -> str:
    """'TMEM S_i: S_0 columns [0, 128), S_1 columns [128, 256), fp32' from plan.tmem."""
    regions = [r for r in plan.tmem.regions if r.name == region]
    if not regions:
        raise ExcerptMissing(f"the plan has no TMEM region {region!r}; it has "
                             f"{sorted({r.name for r in plan.tmem.regions})}")
    spans = ", ".join(f"{r.name}_{r.stage} columns [{r.col_offset}, {r.col_end})"
                      for r in regions)
    alias = f", over {regions[0].alias_of}" if regions[0].alias_of else ""
    return f"TMEM {region}_i: {spans}, {regions[0].dtype}{alias}"


def tmem_excerpt(plan, obj, anchor: str, region: str, before: int = 0, after: int = 0,
                 occurrence: int = 0) -> Excerpt:
    """The lines holding `anchor` captioned with TMEM region `region` ("S", "P", "O") of the
    plan: its columns per stage."""
    return lines_at(obj, anchor, tmem_caption(plan, region), before, after, occurrence)
