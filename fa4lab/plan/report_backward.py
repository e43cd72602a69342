"""The report of `fa4lab plan --backward`: the planner's five outputs for the B200 backward
(`fa4lab.plan.backward`), as data (`build_backward_report`) and as Markdown
(`render_backward_markdown`): the conclusion; evidence and assumptions; the contract tables and
the simulated timeline; the validation and one falsifiable experiment; the risks and fallback.

Every cycle and TFLOP/s figure here is MODELLED: the forward's calibrated cost model
(`fa4lab.plan.costs.costs_for`, fitted on an H200, B200 rates from published figures) run on
the backward's protocol table. No backward kernel of this plan exists, and no backward was
timed on a B200 for it; the report says so wherever it prints a number.
"""

from __future__ import annotations

from fa4lab.hardware import PUBLISHED_FA4_B200
from fa4lab.plan.report import _mask_text, _mma_table, _smem_and_roles, _table

SIM_BLOCKS = 6          # query blocks of the simulated key block (the timeline)
STEADY = (4, 8)         # query blocks of the two runs whose difference is one step's cost

# Note [implied edges]
# Removing one barrier of the backward's table and simulating (fa4lab.plan.simulate.
# mutation_check) shows what the edge protects. Two edges protect nothing the others do not
# already order, in this table's order of ops; upstream has both, and so does the table:
#   lse_empty: the load warp refills LSE stage j % 2 after it waited q_empty for the same
#     stage, which dK_j commits, and dK_j waited ds_ready, which the compute warps arrive on
#     after they read LSE_j. A load order that fetches LSE before Q needs the edge.
#   ds_empty: the compute warps write dS_j+1 to SMEM after dp_full of step j + 1, a
#     tcgen05.commit issued after the dQ_j MMA that reads dS_j, and a commit tracks every MMA
#     issued before it. An MMA order that issues dQ_j after dP^T_j+1 needs the edge.
IMPLIED = {
    "lse_empty": "implied: q_empty of the same stage follows dK_j, which follows ds_ready, "
                 "which follows the read of LSE_j (Note [implied edges])",
    "ds_empty": "implied: dp_full of the next step commits after the dQ MMA that reads dS "
                "(Note [implied edges])",
}


def steady_cycles(plan, costs) -> dict:
    """One step's modelled cycles (the difference of two runs, STEADY query blocks apart), the
    extra of a masked step, and a key block's fixed cycles (its loads, prologue, epilogue)."""
    from fa4lab.plan.simulate import simulate

    lo, hi = STEADY
    short, long_ = (simulate(plan, n, 1, costs).cycles for n in STEADY)
    masked = simulate(plan, hi, 1, costs, masked_blocks=hi).cycles
    step = (long_ - short) / (hi - lo)
    return {"per_step": step, "per_masked_step": step + (masked - long_) / hi,
            "fixed": short - lo * step}


def demand(plan, costs) -> dict[str, float]:
    """Each unit's cycles per step if it ran alone: the tensor pipe (five MMAs, each at the
    slower of its FLOPs and its SMEM operand reads), the MUFU (P's exp2), the TMA loads (Q,
    dO, LSE and D rows) and the dQ reduce-adds."""
    hw, t = plan.hardware, plan.tiles
    eb, m = plan.spec.element_bytes, t.m_block
    loads = m * (t.head_dim + t.head_dim_v) * eb + 2 * m * 4
    return {"tensor": sum(costs.mma_op_cycles(hw, x) for x in plan.mmas),
            "exp2 (MUFU)": costs.softmax_cycles(hw, m * t.n_block, 0.0),
            "TMA loads": costs.tma_cycles(loads),
            "dQ reduce-adds": costs.tma_cycles(m * t.head_dim * 4)}


def key_block_steps(plan) -> list[tuple[int, int]]:
    """(query blocks, of which masked) of every key block of one (batch, head), from the
    forward's tile classes (`fa4lab.tiling.classify_tiles`: a key block visits the query
    blocks whose tile it shares with any visible score)."""
    from fa4lab import tiling

    s, t = plan.spec, plan.tiles
    tc = tiling.classify_tiles(s.seqlen_q, s.seqlen_k, t.m_block, t.n_block, s.causal,
                               window_size=s.window_size)
    visit = tc.kinds != int(tiling.TileKind.SKIP)
    return [(int(visit[:, j].sum()), int((visit[:, j] & tc.needs_element_mask[:, j]).sum()))
            for j in range(visit.shape[1])]


def predict_backward(plan, costs, cycles: dict) -> dict:
    """Modelled seconds and TFLOP/s of the whole backward (the 2.5 x forward FLOPs convention of
    the backward tables in the project's benchmarks): every key block's CTA costs its fixed
    cycles plus its steps, the CTAs spread evenly over the SMs (ASSUMED: no tail, no L2 or HBM
    limit). The kernels before and after it (D = rowsum(dO * O), dQ_accum to dQ) are not
    counted."""
    from fa4lab.plan.throughput import useful_flops

    s, hw = plan.spec, plan.hardware
    blocks = key_block_steps(plan)
    per_head = sum(cycles["fixed"] + (n - mk) * cycles["per_step"]
                   + mk * cycles["per_masked_step"] for n, mk in blocks if n)
    ctas = sum(1 for n, _ in blocks if n) * s.batch * s.heads_q
    longest = max((cycles["fixed"] + n * cycles["per_masked_step"] for n, _ in blocks if n),
                  default=0.0)
    total = max(per_head * s.batch * s.heads_q / hw.num_sms, longest)
    seconds = total / (hw.clock_ghz * 1e9)
    flops = 2.5 * useful_flops(s)
    return {"seconds": seconds, "tflops": flops / seconds / 1e12 if seconds else 0.0,
            "ctas": ctas, "steps": sum(n for n, _ in blocks) * s.batch * s.heads_q,
            "peak_tflops": hw.peak_mma_tflops}


def build_backward_report(plan, costs=None) -> dict:
    """The report as data: the simulation, the modelled step and throughput, the barrier
    mutations, the 2-CTA table and the experiment."""
    from fa4lab.plan.calibration import calibration_note
    from fa4lab.plan.costs import costs_for
    from fa4lab.plan.protocol_bwd_sm100 import pair_mma_table
    from fa4lab.plan.simulate import mutation_check, simulate, unobservable

    costs = costs or costs_for(plan.hardware)
    sim = simulate(plan, SIM_BLOCKS, 1, costs)
    hidden = unobservable(plan)
    mutations = {k: v or (f"not observable: {hidden[k]}" if k in hidden else
                          IMPLIED.get(k, "NOT CAUGHT"))
                 for k, v in mutation_check(plan, costs=costs).items()}
    cycles = steady_cycles(plan, costs)
    need = demand(plan, costs)
    bound = max(need, key=need.get)
    pair = pair_mma_table(plan, costs)
    one = sum(max(r["mma_cycles"], r["smem_cycles_1cta"]) for r in pair)
    two = sum(max(r["mma_cycles"], r["smem_cycles_2cta"]) for r in pair)
    tensor = [(s.label, round(s.start), round(s.end)) for s in sim.spans if s.lane == "tensor"]
    mma_waits: dict[str, int] = {}
    for s in sim.spans:
        if s.lane == "mma" and s.kind == "wait":
            name = s.label.split()[-1].split("[")[0]
            mma_waits[name] = mma_waits.get(name, 0) + round(s.end - s.start)
    return {
        "label": "MODELLED: the forward's calibrated cost model on this protocol table; no "
                 "backward was timed on a B200",
        "calibration": calibration_note(plan.arch),
        "simulation": {"n_blocks": SIM_BLOCKS, "cycles": round(sim.cycles),
                       "deadlock": sim.deadlock, "hazards": [str(h) for h in sim.hazards],
                       "busy": {k: round(v, 3) for k, v in sim.busy().items()},
                       "tensor": tensor, "mma_waits": mma_waits, "mutations": mutations},
        "cycles": {k: round(v, 1) for k, v in cycles.items()},
        "demand": {k: round(v, 1) for k, v in need.items()},
        "bound": bound, "efficiency_vs_bound": round(need[bound] / cycles["per_step"], 3),
        "prediction": {k: (round(v, 1) if k == "tflops" else v)
                       for k, v in predict_backward(plan, costs, cycles).items()},
        "pair": pair,
        "experiment": {"tensor_1cta": round(one, 1), "tensor_2cta": round(two, 1),
                       "predicted_gain": round(one / two - 1, 3)},
        "assumptions": {k: getattr(costs, k) for k in BACKWARD_COSTS},
    }


# ---- Markdown ----
def contract_tables(plan, rep: dict) -> str:
    from fa4lab.backward_budget import tmem_table_markdown

    t = plan.tiles
    parts = ["### Tiles", _table(
        ["n_block (keys per CTA)", "m_block (queries per step)", "q_stage", "do_stage",
         "head_dim", "head_dim_v", "dQ reduce-adds", "cta_group"],
        [[t.n_block, t.m_block, t.q_stage, t.do_stage, t.head_dim, t.head_dim_v,
          f"{t.dq_chunks} x {t.dq_chunk} columns, {t.dq_stages} buffers", t.cta_group]])]
    parts += ["### MMAs (per step: one key block x one query block)", _mma_table(plan)]
    tm = plan.tmem
    parts += [f"### TMEM ({tm.total_cols} of {tm.capacity_cols} columns, tcgen05.alloc "
              f"{tm.alloc_cols}; `fa4lab.backward_budget.backward_tmem`)",
              tmem_table_markdown((t.head_dim,))]
    parts += _smem_and_roles(plan, "; Note [backward registers]")
    bar_off = plan.barrier_offsets()
    parts += [f"### Barriers ({plan.barriers.mbarrier_count} mbarrier.init; Note [the "
              f"backward's protocol])", _table(
        ["barrier", "SMEM offset / id", "producer -> consumer", "arrivals", "stages",
         "tx bytes", "guards"],
        [[f"`{b.name}`", bar_off[b.name] if b.kind == "mbarrier" else f"bar {b.named_id}",
          f"{b.producer} -> {b.consumer}", b.arrive_count, b.stages, b.tx_bytes or "",
          b.guards] for b in plan.barriers.barriers])]
    parts += ["### One CTA or a pair (MODELLED per CTA per step; Note [the backward's 2-CTA "
              "MMA])", _table(
        ["MMA", "MMA cycles", "SMEM bytes, 1 CTA", "SMEM cycles, 1 CTA", "SMEM bytes, pair",
         "SMEM cycles, pair"],
        [[r["mma"], r["mma_cycles"], r["smem_bytes_1cta"], r["smem_cycles_1cta"],
          r["smem_bytes_2cta"], r["smem_cycles_2cta"]] for r in rep["pair"]])]
    return "\n\n".join(parts)


# The cost model's constants the backward's steps read (`_steps` in
# fa4lab.plan.protocol_bwd_sm100); the others are the forward softmax's.
BACKWARD_COSTS = ("barrier_latency", "fma_ops_per_masked_score", "issue_cycles",
                  "l2_bytes_per_cycle", "mma_efficiency", "tma_latency", "tmem_bytes_per_cycle")


def _timeline(rep: dict) -> list[str]:
    sim, c = rep["simulation"], rep["cycles"]
    busy = ", ".join(f"{k} {v:.0%}" for k, v in sim["busy"].items())
    order = "; ".join(f"{label} {a}-{b}" for label, a, b in sim["tensor"][:9])
    tensor = sim["tensor"]
    span = tensor[-1][2] - tensor[0][1]
    idle = span - sum(b - a for _, a, b in tensor)
    waits = ", ".join(f"`{k}` {v}" for k, v in sorted(sim["mma_waits"].items(),
                                                          key=lambda kv: -kv[1]))
    need = ", ".join(f"{k} {v:.0f}" for k, v in rep["demand"].items())
    return [
        f"- One key block walking {sim['n_blocks']} query blocks: {sim['cycles']} cycles "
        f"(MODELLED). A step costs {c['per_step']:.0f} cycles ({c['per_masked_step']:.0f} "
        f"masked), plus {c['fixed']:.0f} per key block (K/V loads, the first S^T and dP^T, "
        f"the epilogue).",
        f"- Demand per step if each unit ran alone: {need} cycles: bound by {rep['bound']} "
        f"({rep['efficiency_vs_bound']:.0%} of the step).",
        f"- The tensor pipe, in issue order (cycles): {order}, ...",
        f"- Tensor pipe idle between its first and last MMA: {idle} of {span} cycles; the MMA "
        f"warp's waits, in cycles (it issues ahead, so a wait idles the pipe only once its "
        f"queue is empty): {waits}.",
        f"- Busy: {busy}.",
        "- Single-edge removals (first finding): " + "; ".join(
            f"`{k}` {v.split(' + ')[0]}" for k, v in sim["mutations"].items()) + ".",
    ]


def render_backward_markdown(plan, rep: dict) -> str:
    s, t, hw = plan.spec, plan.tiles, plan.hardware
    sim, pred, exp = rep["simulation"], rep["prediction"], rep["experiment"]
    shape = (f"batch {s.batch}, seqlen {s.seqlen_q}x{s.seqlen_k}, heads {s.heads_q}/{s.heads_kv} "
             f"(GQA {s.gqa_ratio}), head_dim {s.head_dim}, {s.dtype}{_mask_text(s)}")
    clean = not sim["deadlock"] and not sim["hazards"]
    muts = sim["mutations"]
    caught = [k for k, v in muts.items() if v != "NOT CAUGHT" and not v.startswith(
        ("not observable", "implied"))]
    implied = [k for k, v in muts.items() if v.startswith("implied")]
    hidden = [k for k, v in muts.items() if v.startswith("not observable")]
    lines = [
        f"# fa4lab plan --backward: {plan.arch} ({hw.name})", "", f"Spec: {shape}.", "",
        "## Conclusion", "",
        f"- One CTA per key block of {t.n_block} keys, walking query blocks of {t.m_block} "
        f"rows: five tcgen05 MMAs per step (S^T = K Q^T, dP^T = V dO^T, dV += P^T dO, "
        f"dK += dS^T Q, dQ = dS K), cta_group::{t.cta_group}; {plan.threads_per_cta} threads "
        f"in {len(plan.roles)} roles; {plan.barriers.mbarrier_count} mbarriers.",
        f"- TMEM {plan.tmem.total_cols}/{plan.tmem.capacity_cols} columns (S, dV, dP, dK; P "
        f"over S, dS and dQ over dP); SMEM {plan.smem.total_bytes}/{plan.smem.limit_bytes} "
        f"bytes; registers {plan.registers_used}/{hw.registers_per_sm}.",
        f"- Protocol: {'no deadlock, no hazard' if clean else 'PROBLEMS (see below)'} in one "
        f"key block of {sim['n_blocks']} query blocks; removing any one of {len(muts)} "
        f"barriers is caught in {len(caught)}"
        + (f", implied by the others in {len(implied)} ({', '.join(implied)})" if implied
           else "")
        + (f", not observable in {len(hidden)} ({', '.join(hidden)})" if hidden else "") + ".",
        f"- MODELLED: {rep['cycles']['per_step']:.0f} cycles per step, bound by "
        f"{rep['bound']}; about {pred['tflops']:.0f} TFLOP/s for this shape (2.5 x the "
        f"forward's FLOPs; {pred['tflops'] / pred['peak_tflops']:.0%} of the "
        f"{pred['peak_tflops']:.0f} TFLOP/s dense MMA peak). {rep['label']}: an upper bound "
        f"from the protocol alone (no L2 or HBM limit, CTAs spread evenly). For scale: "
        f"FA4's forward peaks at {PUBLISHED_FA4_B200['peak_bf16_tflops']} TFLOP/s on a B200 "
        f"(PUBLISHED, {PUBLISHED_FA4_B200['source']}); no backward figure is published in this "
        f"project's sources.",
        f"- One CTA, not a pair: upstream FA4 pairs CTAs (cta_group::2) from head_dim 128 on. "
        f"In this model a step's tensor pipe takes {exp['tensor_1cta']:.0f} cycles with one "
        f"CTA and {exp['tensor_2cta']:.0f} with a pair ({exp['predicted_gain']:+.0%}): the "
        f"pair halves each CTA's shared-memory reads of Q and dO (the table below).",
        "", "## Evidence and assumptions", "",
        "Evidence (hardware facts, `fa4lab.hardware`):", ""]
    lines += [f"- {src}" for src in hw.sources]
    lines += ["- Upstream FA4's sm100 backward (flash_attn/cute/flash_bwd_sm100.py): 128 x 128 "
              "tiles, Q_stage 2 and dO_stage 1, warps 0-3 reduce dQ, 4-11 compute, 12 MMA, "
              "13 load; the TMEM offsets S, dV, dP, dK (Note [the backward's TMEM]); the "
              "registers of Note [backward registers]; dQ by TMA reduce-adds of 32 columns; "
              "interface.py: 2-CTA from head_dim 128. Its 1-CTA shared storage is 232448 bytes "
              "(a comment in `__call__`), what this plan's layout gives at head_dim 128.",
              "", f"Assumptions (MODELLED; {rep['calibration']}):", ""]
    lines += [f"- {k} = {v} (`fa4lab.plan.costs.CostModel`)"
              for k, v in rep["assumptions"].items()]
    lines += ["- dS = P (dP - D): 3 FMA-pipe operations per score (ASSUMED); exp2 all on the "
              "MUFU.",
              "- Key blocks' CTAs spread evenly over the SMs, no L2 or HBM limit (ASSUMED); "
              "the D = rowsum(dO * O) and dQ conversion kernels are not counted.",
              *[f"- {n}" for n in plan.notes],
              "", "## Contract", "", contract_tables(plan, rep), "",
              "### Simulated timeline (MODELLED)", "", *_timeline(rep)]
    if not clean:
        lines += [f"- DEADLOCK: {d}" for d in sim["deadlock"]]
        lines += [f"- HAZARD: {h}" for h in sim["hazards"]]
    lines += [
        "", "## Validation and one falsifiable experiment", "",
        "- Correctness of a kernel built from this plan: dQ, dK, dV against the float64 "
        "reference backward (`fa4lab.reference_backward`) on fresh random inputs, with FA4's "
        "rule (at most twice PyTorch's same-dtype error plus a small atol); rows that see no "
        "key (causal, seqlen_q > seqlen_k: LSE = -inf, gradients 0, not NaN); extreme logits.",
        f"- Boundaries: seqlen_k = {t.n_block - 1}, {t.n_block + 1} (a key block's tail: dK "
        f"and dV rows past seqlen_k are not stored); seqlen_q = {t.m_block - 1}, "
        f"{t.m_block + 1} (a query block's tail: its dQ rows are not added); GQA 1 and 4; "
        f"causal and not; the dQ order: two runs differ only in dQ's last bits (Note [dQ's "
        f"order of additions]).",
        "- The plan itself (tests/test_plan_backward.py): TMEM equals "
        "`backward_tmem`, SMEM and registers fit, every barrier has producers and waiters, no "
        "deadlock or hazard over 1..8 query blocks, each barrier's removal caught, implied or "
        "unobservable.",
        f"- Falsifiable experiment: on a B200, time upstream FA4's backward at head_dim 128, "
        f"seqlen 8192, non-causal, with its 2-CTA MMA (the default) and with "
        f"`FA_DISABLE_2CTA=1` (one CTA, this plan's shape). This model predicts "
        f"{exp['predicted_gain']:+.0%} for the pair (its tensor pipe takes the slower of an "
        f"MMA's FLOPs and its SMEM reads, and at mma_efficiency "
        f"{rep['assumptions']['mma_efficiency']} the FLOPs are slower). If the pair is more "
        f"than 10% faster, the model's overlap of SMEM reads with the MMA is wrong and this "
        f"1-CTA plan leaves that much on the table: plan the pair.",
        "", "## Risks and fallback", ""]
    lines += [f"- {r}" for r in risks(plan, rep)]
    return "\n".join(lines) + "\n"


def risks(plan, rep: dict) -> list[str]:
    t, sm = plan.tiles, plan.smem
    spare = sm.limit_bytes - sm.total_bytes
    out = [f"SMEM: {spare} bytes to spare of {sm.limit_bytes}"
           + (" (none: a second dO stage, or any region more, does not fit at this head_dim)"
              if spare < 1024 else "") + f"; TMEM {plan.tmem.total_cols} of "
           f"{plan.tmem.capacity_cols} columns: no second S or dP buffer at head_dim "
           f"{t.head_dim}.",
           "(192, 128) and (256, 256) have no plan: their accumulators exceed 512 TMEM columns "
           "in this 1-CTA layout (Note [the backward's 2-CTA MMA]). Fallback there, and for "
           "every shape until a kernel is built from this plan: fa4lab has no GPU backward "
           "(fa4lab.attention raises GradientNotSupportedError on CUDA tensors that require "
           "grad); train with torch.nn.functional.scaled_dot_product_attention or upstream "
           "FA4, differentiate on CPU with the float64 reference.",
           "dQ is summed by reduce-adds in arrival order: not bit-reproducible run to run; a "
           "deterministic order costs up to a pipeline fill (Note [accumulating dQ]).",
           "Two edges are implied by the others in this order (Note [implied edges]); a kernel "
           "that reorders its loads or MMAs must keep them, as the table does.",
           "Three TMEM reuses rest on the tensor pipe's issue order, without a barrier (Note "
           "[the backward's protocol]), as the forward's P over S does.",
           "A key block that no query block sees (causal with seqlen_q < seqlen_k, a window) "
           "must still store zero dK and dV; the table assumes at least one step.",
           "GQA: the query heads of a KV head add into one dK and dV; upstream then stores "
           "them in fp32 with reduce-adds and converts afterwards (`dKV_postprocess`), an "
           "epilogue this table does not have (it stores 16-bit dK and dV once).",
           "No sm90 backward plan: plan_backward(spec, 'sm90') raises PlanError.",
           "Every cycle and TFLOP/s here is MODELLED, the forward's cost model fitted on an "
           "H200; the backward's own constants (dS's FMA count, the reduce-adds' L2 cost) were "
           "never timed: the experiment above tests the most consequential one."]
    return out


def report_section(markdown: str, title: str) -> str:
    """The part of a rendered report under the heading that starts with `title` ("Conclusion",
    "One CTA or a pair"), up to the next heading of its level or above."""
    lines = markdown.splitlines()
    for i, line in enumerate(lines):
        level = len(line) - len(line.lstrip("#"))
        if level and line[level:].strip().startswith(title):
            end = next((k for k in range(i + 1, len(lines))
                        if 0 < len(lines[k]) - len(lines[k].lstrip("#")) <= level), len(lines))
            return "\n".join(lines[i:end]).strip() + "\n"
    raise KeyError(f"no section {title!r} in the report")
