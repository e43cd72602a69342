"""Figures for lesson 10 (the backward): the modelled cost of the three ways to accumulate dQ.

    from fa4lab.viz.backward import plot_dq_schemes
    plot_dq_schemes([1024, 4096, 16384, 65536], at_seqlen=8192, head_dim=128)

The numbers are `fa4lab.backward_budget.dq_costs`: a MODEL (Note [accumulating dQ]), and the
titles say so.
"""

from __future__ import annotations

from collections.abc import Sequence

from fa4lab.backward_budget import SCHEMES, dq_costs, step_bytes
from fa4lab.viz._live import subplots

__all__ = ["plot_dq_schemes"]

_STYLE = {"atomic": ("C0", "o", "-"), "deterministic": ("C3", "s", "--"),
          "separate pass": ("C2", "^", "-")}


def plot_dq_schemes(seqlens: Sequence[int], *, at_seqlen: int = 8192, head_dim: int = 128,
                    block_m: int = 128, block_n: int = 128):
    """Two panels, one (batch, head), no mask. Left: the global-memory bytes of ONE key block's
    walk over the query blocks at `at_seqlen`, by what they carry, per scheme (the separate
    pass's K/V re-reads are its dQ kernel's, per step as well). Right: the modelled time over the
    atomic scheme's (`DqCost.relative_time`) against the sequence length."""
    part = step_bytes(head_dim, block_m=block_m, block_n=block_n)
    m_blocks = dq_costs(at_seqlen, head_dim=head_dim, block_m=block_m,
                        block_n=block_n)["atomic"].base_steps
    mib = m_blocks / 2.0 ** 20
    loads = part["q"] + part["dout"] + part["lse_d"]
    stacks = {                          # scheme: [(what, bytes per step)]
        "atomic": [("Q, dO, LSE, D loads", loads), ("dQ partial, fp32 reduce-add",
                                                     part["dq_partial"])],
        "deterministic": [("Q, dO, LSE, D loads", loads), ("dQ partial, fp32 reduce-add",
                                                           part["dq_partial"]),
                          ("semaphore", 8)],
        "separate pass": [("Q, dO, LSE, D loads", loads), ("K, V re-read (dQ pass)",
                                                           part["kv_reread"])],
    }
    colors = {"Q, dO, LSE, D loads": "0.7", "dQ partial, fp32 reduce-add": "C0",
              "semaphore": "C3", "K, V re-read (dQ pass)": "C2"}
    fig, (left, right) = subplots(1, 2, figsize=(10.5, 3.8))
    seen = set()
    for x, scheme in enumerate(SCHEMES):
        bottom = 0.0
        for what, b in stacks[scheme]:
            label = None if what in seen else what
            seen.add(what)
            left.bar(x, b * mib, bottom=bottom, color=colors[what], edgecolor="white",
                     label=label)
            bottom += b * mib
        left.text(x, bottom * 1.01, f"{bottom:.2f} MiB", ha="center", va="bottom", fontsize=8)
    left.set_xticks(range(len(SCHEMES)), SCHEMES)
    left.set_ylabel(f"MiB per key block ({m_blocks} steps)")
    left.set_ylim(0, 3.0 * loads * mib)
    left.set_title(f"one key block's traffic at seqlen {at_seqlen} (MODEL)", fontsize=10)
    left.legend(fontsize=7, frameon=False, loc="upper center", ncol=2)
    costs = [dq_costs(s, head_dim=head_dim, block_m=block_m, block_n=block_n) for s in seqlens]
    for scheme in SCHEMES:
        color, marker, ls = _STYLE[scheme]
        right.plot(seqlens, [c[scheme].relative_time for c in costs], color=color, ls=ls,
                   marker=marker, ms=4, label=scheme)
    right.set_xscale("log", base=2)
    right.set_ylim(0.9, 2.1)
    right.set_xlabel("seqlen (queries = keys)")
    right.set_ylabel("time / atomic scheme's")
    right.set_title("relative time (MODEL: ASSUMED MMA-bound;\ndeterministic: no run-ahead)",
                    fontsize=10)
    right.grid(alpha=0.3)
    right.legend(fontsize=7, frameon=False)
    fig.suptitle(f"accumulating dQ: head_dim {head_dim}, {block_m} x {block_n} tiles, bf16",
                 fontsize=10)
    fig.tight_layout()
    return fig
