"""Figures for lesson 10 (the backward): the modelled cost of the three ways to accumulate dQ,
and the B200 backward plan's protocol table and simulated timeline.

    from fa4lab.viz.backward import plot_dq_schemes
    plot_dq_schemes([1024, 4096, 16384, 65536], at_seqlen=8192, head_dim=128)
    protocol_markdown(plan_backward(spec))                # each role's barrier ops, in order
    draw_backward_timeline(simulate(plan_backward(spec), 3, 1, costs_for("sm100")))

The numbers are `fa4lab.backward_budget.dq_costs` (Note [accumulating dQ]) and the protocol
simulator's (`fa4lab.plan.simulate`): MODELS, and the titles say so.
"""

from __future__ import annotations

from collections.abc import Sequence

from fa4lab.backward_budget import SCHEMES, dq_costs, step_bytes
from fa4lab.viz._live import subplots

__all__ = ["plot_dq_schemes", "protocol_markdown", "draw_backward_timeline"]

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


def protocol_markdown(plan) -> str:
    """A markdown table of the plan's protocol table: each role's program in order, barrier ops
    as `kind barrier[stage]`, work and MMAs in bold, a loop as `[trips x: ...]` (N query
    blocks, M of them masked, j the step, q the Q stages)."""
    rows = ["| role | program (barrier ops; **work**; `[N x: ...]` a loop over query blocks) |",
            "|---|---|"]
    for prog in plan.protocol.programs:
        rows.append(f"| {', '.join(prog.roles)} | {_program_text(prog.body)} |")
    return "\n".join(rows)


def _program_text(body) -> str:
    from fa4lab.plan.protocol import If, Loop, Op, Step, TileLoop, Unroll

    out = []
    for n in body:
        if isinstance(n, Op):
            stage = "" if n.stage == "0" else f"[{n.stage}]"
            out.append(f"{n.kind} `{n.barrier}`{stage}")
        elif isinstance(n, Step):
            out.append(f"**{n.what}**")
        elif isinstance(n, Loop):
            out.append(f"[{n.trips} x: {_program_text(n.body)}]")
        elif isinstance(n, Unroll):
            out.append(f"({n.count} x {n.var}: {_program_text(n.body)})")
        elif isinstance(n, If):
            out.append(f"(if {n.cond}: {_program_text(n.body)})")
        elif isinstance(n, TileLoop):
            out.append(f"[each work tile: {_program_text(n.body)}]")
    return ", ".join(out)


def draw_backward_timeline(sim, max_cycles: float | None = None):
    """`fa4lab.viz.plan.draw_timeline` of a backward plan's simulation (one key block walking
    `sim.n_blocks` query blocks), titled as the MODEL it is."""
    from fa4lab.viz.plan import draw_timeline

    status = "DEADLOCK" if sim.deadlock else (f"{len(sim.hazards)} hazard(s)" if sim.hazards
                                              else "no deadlock, no hazard")
    return draw_timeline(sim, max_cycles=max_cycles, title=(
        f"{sim.arch} backward, MODELLED: one key block x {sim.n_blocks} query blocks, "
        f"{sim.cycles:.0f} cycles; {status}"))
