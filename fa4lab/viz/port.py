"""The port table of notebook 06: how each B200 role and TMEM region maps onto Hopper.

Rows of (what, sm100 plan, sm90 plan), read from the two plans the kernels are built from; the
notebook renders them as a markdown table:

    from fa4lab.viz.port import port_table
    port_table(AttentionSpec(1, 4096, 4096, 16, 16, 128, causal=True))
"""

from __future__ import annotations

from fa4lab.plan import plan_forward

WARPGROUP_THREADS = 128   # a wgmma is issued by a warpgroup of four warps


def port_table(spec) -> list[tuple[str, str, str]]:
    """How each B200 role and TMEM region maps onto Hopper: rows (what, sm100 plan, sm90 plan).

    Read from the two plans `plan_forward(spec, "sm100")` and `plan_forward(spec, "sm90")`, so
    the numbers are the ones the kernels are built from.
    """
    b, h = plan_forward(spec, arch="sm100"), plan_forward(spec, arch="sm90")
    tb, th = b.tiles, h.tiles
    cons = [r for r in h.roles if r.name.startswith("consumer")]
    cons_names = " + ".join(f"{r.name} (warps {r.warps[0]}-{r.warps[-1]}, {r.registers} regs)"
                            for r in cons)

    def role(plan, name):
        r = plan.role(name)
        ws = f"warp {r.warps[0]}" if len(r.warps) == 1 else f"warps {r.warps[0]}-{r.warps[-1]}"
        return f"{name} ({ws}, {r.registers} regs)"

    def tmem(name):
        regs = [r for r in b.tmem.regions if r.name == name]
        cols = ", ".join(f"{name}{r.stage}: cols {r.col_offset}-{r.col_offset + r.columns - 1}"
                         for r in regs)
        alias = f" (aliases {regs[0].alias_of}, {regs[0].dtype})" if regs[0].alias_of else ""
        return cols + alias

    per_thread = WARPGROUP_THREADS  # one consumer warpgroup owns an m_block x N accumulator
    s_regs = th.m_block * th.n_block // per_thread
    o_regs = th.m_block * th.head_dim_v // per_thread
    rows = [
        ("threads per CTA", f"{b.threads_per_cta} ({len(b.roles)} roles)",
         f"{h.threads_per_cta} ({len(h.roles)} roles)"),
        ("query rows per CTA", f"{tb.cta_m} = {tb.q_stage} Q tiles x {tb.m_block}",
         f"{th.cta_m} = {th.q_stage} consumers x {th.m_block} (wgmma M)"),
        ("key block / K,V stages", f"n_block {tb.n_block}, kv_stage {tb.kv_stage}",
         f"n_block {th.n_block}, kv_stage {th.kv_stage} (separate K and V rings)"),
        ("S = Q K^T", tmem("S") + " (TMEM, fp32)",
         f"registers: {s_regs} fp32 per consumer thread"),
        ("P (softmax output)", tmem("P"),
         f"registers: {s_regs // 2} x 32-bit per thread, the A operand of the value wgmma"),
        ("O accumulator", tmem("O") + " (TMEM, fp32)",
         f"registers: {o_regs} fp32 per consumer thread"),
        ("TMEM allocation", f"{b.tmem.alloc_cols} columns", "none (Hopper has no TMEM)"),
        ("issue the MMAs", role(b, "mma") + ": tcgen05.mma for both Q tiles",
         f"each consumer issues its own wgmma; turns via named barriers "
         f"{', '.join(x.name for x in h.barriers.barriers if x.kind == 'named')}"),
        ("softmax", role(b, "softmax0") + " + " + role(b, "softmax1"), cons_names),
        ("rescale O (correction)", role(b, "correction") + ": O in TMEM, when the max grew > "
         f"{b.rescale_threshold:g}", "the consumer itself, O in registers, when the max grew "
         f"> {h.rescale_threshold:g} (Note [rescale threshold by arch] in fa4lab.limits)"),
        ("exp2", f"MUFU + polynomial on FMA (fraction {b.exp2_emulation_fraction:g})",
         "MUFU only"),
        ("loads (TMA)", role(b, "load"), role(h, "load") + ": warp 0 issues, the rest idle"),
        ("epilogue (O store)", role(b, "epilogue") + " from SMEM staged by correction",
         "each consumer: stmatrix to SMEM, one warp issues the TMA store"),
        ("mbarriers", f"{b.barriers.mbarrier_count}", f"{h.barriers.mbarrier_count}"),
        ("dynamic SMEM (plan)", f"{b.smem.total_bytes} B", f"{h.smem.total_bytes} B"),
    ]
    return rows
