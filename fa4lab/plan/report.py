"""The report of `fa4lab plan` (`fa4lab.plan_cli`) as data and as Markdown: the chosen plan,
the evidence behind it, its contract tables, a simulated timeline, the minimal validation and
the risks. `build_report(plan, recorded=...)` takes the measured figures of the plan's shape
from its caller (`fa4lab.bench.records.sweep_figures`): the plan layer reads no benchmark
record itself.
"""

from __future__ import annotations

from fa4lab.errors import PlanError


# ---- the report as data ----
def _published(plan) -> dict:
    """The FA4 paper's PUBLISHED B200 figure for this shape (`fa4lab.hardware`'s table), or
    its headline peak, labelled as such, with the calibration's prediction of that shape."""
    from fa4lab.hardware import PUBLISHED_FA4_B200, PUBLISHED_FA4_B200_FORWARD

    if plan.arch != "sm100":
        return {}
    s = plan.spec
    same = [p for p in PUBLISHED_FA4_B200_FORWARD
            if (p["head_dim"], p["causal"], p["seqlen"]) == (s.head_dim, s.causal, s.seqlen_q)]
    if same:
        p = same[0]
        return {"label": "PUBLISHED (not measured here)", "tflops": p["tflops"],
                "what": f"FA4 forward on B200 at this shape (hd{p['head_dim']}, "
                        f"{'causal' if p['causal'] else 'non-causal'}, seqlen {p['seqlen']})",
                "source": p["source"]}
    p = PUBLISHED_FA4_B200_FORWARD[0]
    return {"label": "PUBLISHED (not measured here)",
            "tflops": PUBLISHED_FA4_B200["peak_bf16_tflops"],
            "what": f"FA4 peak BF16 forward on B200 (hd{p['head_dim']}, "
                    f"{'causal' if p['causal'] else 'non-causal'}, seqlen {p['seqlen']}: not "
                    f"this shape; the calibration table compares the model there)",
            "source": PUBLISHED_FA4_B200["source"]}


def _calibration(plan, costs) -> dict:
    """Which calibration the prediction used and how far it was off where it was checked."""
    from fa4lab.plan.calibration import CALIBRATED, TOLERANCE, calibration_note

    if costs is not CALIBRATED.get(plan.arch):
        return {"calibrated": False, "note": "a cost model passed by the caller, not the "
                                             "chip's calibrated one"}
    return {"calibrated": True, "tolerance": TOLERANCE[plan.arch],
            "note": calibration_note(plan.arch)}


def _bottleneck(plan, costs, per_block: float) -> dict:
    t, hw = plan.tiles, plan.hardware
    eb = plan.spec.element_bytes
    demand = {
        "tensor": t.q_stage * sum(costs.mma_op_cycles(hw, m) for m in plan.mmas),
        "exp2 (MUFU/FMA)": t.q_stage * costs.softmax_cycles(
            hw, t.m_block * t.n_block, plan.exp2_emulation_fraction,
            softcap=bool(plan.spec.softcap)),
        "TMA K+V": costs.tma_cycles(t.n_block * (t.head_dim + t.head_dim_v) * eb),
    }
    top = max(demand, key=demand.get)
    return {"cycles_per_block": round(per_block, 1),
            "demand_per_block": {k: round(v, 1) for k, v in demand.items()},
            "bound": top, "efficiency_vs_bound": round(demand[top] / per_block, 3)}


def tile_summary(plan) -> dict:
    """The plan's tiles of one (batch, head) (one KV head with pack-GQA) by kind
    (`fa4lab.plan.throughput.tile_classes`, i.e. `fa4lab.tiling.classify_tiles`), the
    left-edge run of a sliding window's masked blocks (`fa4lab.tiling.n_block_left_masked_range`)
    and the share of the dense tiles and scores the mask skips."""
    from fa4lab import tiling
    from fa4lab.plan.throughput import tile_classes, workload

    tc, w = tile_classes(plan), workload(plan)
    kw = dict(seqlen_q=w.seqlen_q, seqlen_k=w.seqlen_k, m_block_size=w.m_block_size,
              n_block_size=w.n_block_size, causal=w.causal, qhead_per_kvhead=w.qhead_per_kvhead,
              window_size=w.window_size)
    left = sum(end - start for start, end in (tiling.n_block_left_masked_range(m, **kw)
                                              for m in range(w.num_m_blocks)))
    return {**tc.counts, "left_edge_masked": left, "tiles": tc.num_tiles,
            "m_block_size": w.m_block_size, "n_block_size": w.n_block_size,
            "skipped_fraction": round(tc.skipped_fraction, 4),
            "visible_fraction": round(tc.visible_element_fraction, 4)}


def _mask(plan, costs) -> dict:
    """The window in effect (causal is right = 0) and, when it hides keys, the predicted time
    without it (the spec itself, softcap and sink included, is in the plan's JSON)."""
    from fa4lab.plan.throughput import predict

    s = plan.spec
    out = {"effective_window": list(s.effective_window), "dense_seconds": None}
    if s.has_mask:
        dense = predict(plan, costs, s.with_(causal=False, window_size=(None, None)))
        out["dense_seconds"] = dense.seconds
    return out


def build_report(plan, costs=None, recorded: dict | None = None) -> dict:
    """The report as data; `recorded`: measured figures of the plan's shape (label, tflops
    by provider, ...: `fa4lab.bench.records.sweep_figures`), {} or None for none."""
    from fa4lab.plan.calibration import costs_for
    from fa4lab.plan.simulate import mutation_check, simulate, unobservable
    from fa4lab.plan.throughput import predict

    costs = costs or costs_for(plan.hardware)
    pred = predict(plan, costs)
    bc = pred.block_cycles
    n_sim = 6
    sim = simulate(plan, n_sim, 2, costs)   # two tiles where a CTA runs several
    hidden = unobservable(plan)
    mutations = {k: v or (f"not observable: {hidden[k]}" if k in hidden else "NOT CAUGHT")
                 for k, v in mutation_check(plan, costs=costs).items()}
    alternatives = _alternatives(plan, costs)
    better = [a for a in alternatives if a["tflops"] > pred.tflops * 1.02]
    if better:   # the model prefers another plan: the experiment tests the model against it
        exp = max(better, key=lambda a: a["tflops"])
    else:        # the model agrees with the chosen plan: predict the loss of a smaller tile
        order = ({"n_block": plan.tiles.n_block // 2}, {"kv_stage": plan.tiles.kv_stage - 1})
        picks = [a for o in order for a in alternatives if a["change"] == o]
        exp = picks[0] if picks else (alternatives[0] if alternatives else None)
    return {
        "prediction": {"tflops": round(pred.tflops, 1), "peak_tflops": round(pred.peak_tflops, 1),
                       "utilization": round(pred.utilization, 3), "tiles": pred.tiles,
                       "seconds": pred.seconds,
                       "tile_cycles": {"fixed": round(bc.fixed, 1),
                                       "per_block": round(bc.unmasked, 1),
                                       "per_masked_block": round(bc.masked, 1)},
                       "label": "PREDICTED by the calibrated cost model "
                                "(fa4lab.plan.simulate; see assumptions)"},
        "calibration": _calibration(plan, costs),
        "published": _published(plan),
        "recorded": recorded or {},
        "simulation": {"n_blocks": n_sim, "n_tiles": sim.n_tiles, "cycles": round(sim.cycles),
                       "deadlock": sim.deadlock, "hazards": [str(h) for h in sim.hazards],
                       "busy": {k: round(v, 3) for k, v in sim.busy().items()},
                       "mutations": mutations},
        "bottleneck": _bottleneck(plan, costs, bc.unmasked),
        "tiles": tile_summary(plan),
        "mask": _mask(plan, costs),
        "alternatives": alternatives,
        "experiment": exp,
        "assumptions": {k: getattr(costs, k) for k in sorted(vars(costs))},
    }


def _alternatives(plan, costs) -> list[dict]:
    """Neighbouring plans (one knob changed) that fit, with their predicted TFLOP/s."""
    from fa4lab.plan import plan_forward
    from fa4lab.plan.throughput import predict

    t = plan.tiles
    changes = [{"kv_stage": t.kv_stage - 1}, {"kv_stage": t.kv_stage + 1},
               {"n_block": t.n_block // 2}, {"n_block": t.n_block // 2, "kv_stage": t.kv_stage + 1},
               {"q_stage": t.q_stage - 1}, {"q_stage": t.q_stage + 1}]
    out = []
    for ch in changes:
        try:
            alt = plan_forward(plan.spec, plan.arch, **{**_overrides_of(plan), **ch})
        except PlanError:
            continue
        out.append({"change": ch, "tflops": round(predict(alt, costs).tflops, 1)})
    return out


def _overrides_of(plan) -> dict:
    t = plan.tiles
    packed = {"pack_gqa": True} if getattr(t, "pack_gqa", False) else {}
    return {"n_block": t.n_block, "q_stage": t.q_stage, "kv_stage": t.kv_stage, **packed}


# ---- Markdown ----
def _table(head: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def _mma_table(plan) -> str:
    """The plan's MMAs, forward or backward."""
    return _table(
        ["name", "m x n x k", "A", "B", "acc", "out", "instruction"],
        [[m.name, f"{m.m} x {m.n} x {m.k}", f"{m.a_dtype} ({m.a_source})",
          f"{m.b_dtype} ({m.b_source})", m.acc_dtype, m.out, f"`{m.instruction}`"]
         for m in plan.mmas])


def _smem_and_roles(plan, roles_cite: str = "") -> list[str]:
    """The SMEM and Roles sections of a forward or backward plan (`roles_cite`: a note the
    Roles heading cites)."""
    off = plan.smem.offsets()
    return [f"### SMEM ({plan.smem.total_bytes} of {plan.smem.limit_bytes} bytes per CTA)",
            _table(["region", "offset", "bytes x stages", "what"],
                   [[r.name, off[r.name], f"{r.bytes_per_stage} x {r.stages}"
                     + (f" (in {r.alias_of})" if r.alias_of else ""), r.what]
                    for r in plan.smem.regions]),
            f"### Roles ({plan.threads_per_cta} threads, {plan.registers_used} of "
            f"{plan.hardware.registers_per_sm} registers{roles_cite})",
            _table(["role", "warps", "setmaxnreg", "does"],
                   [[r.name, ",".join(map(str, r.warps)), r.registers, r.does]
                    for r in plan.roles])]


def contract_tables(plan) -> str:
    t = plan.tiles
    parts = ["### Tiles", _table(
        ["m_block", "n_block", "q_stage", "kv_stage", "cta_m", "head_dim", "head_dim_v",
         "tile order"],
        [[t.m_block, t.n_block, t.q_stage, t.kv_stage, t.cta_m, t.head_dim, t.head_dim_v,
          t.order]])]
    parts += ["### MMAs (per Q tile, per K/V block)", _mma_table(plan)]
    parts += [_tile_table(plan, tile_summary(plan))]
    if plan.tmem is not None:
        tm = plan.tmem
        parts += [f"### TMEM ({tm.total_cols} of {tm.capacity_cols} columns used, "
                  f"tcgen05.alloc {tm.alloc_cols})", _table(
                      ["region", "columns", "dtype", "alias of", "reuse safe after"],
                      [[f"{r.name}{r.stage}", f"{r.col_offset}-{r.col_end - 1}", r.dtype,
                        f"{r.alias_of}{r.stage}" if r.alias_of else "", f"`{r.reuse_guard}`"]
                       for r in tm.regions])]
    else:
        parts += ["### TMEM", "none on this arch: S, P and O live in the consumers' registers"]
    parts += _smem_and_roles(plan)
    bar_off = plan.barrier_offsets()
    parts += [f"### Barriers ({plan.barriers.mbarrier_count} mbarrier.init)", _table(
        ["barrier", "SMEM offset / id", "producer -> consumer", "arrivals", "stages",
         "tx bytes", "group", "guards"],
        [[f"`{b.name}`", bar_off[b.name] if b.kind == "mbarrier" else f"bar {b.named_id}",
          f"{b.producer} -> {b.consumer}", b.arrive_count, b.stages,
          b.tx_bytes or "", b.group + (" (named)" if b.kind == "named" else ""), b.guards]
         for b in plan.barriers.barriers])]
    return "\n\n".join(parts)


def _per(plan) -> str:
    return "(batch, KV head), pack-GQA" if plan.tiles.pack_gqa else "(batch, head)"


def _tile_table(plan, tiles: dict) -> str:
    return "\n\n".join([
        f"### Tile kinds (one {_per(plan)}; CTAs of {tiles['m_block_size']} rows x K/V blocks of "
        f"{tiles['n_block_size']} keys)",
        _table(["FULL", "TAIL", "MASKED", "of which left-edge", "SKIP", "tiles",
                "dense work skipped", "scores visible"],
               [[tiles["FULL"], tiles["TAIL"], tiles["MASKED"], tiles["left_edge_masked"],
                 tiles["SKIP"], tiles["tiles"], f"{tiles['skipped_fraction']:.1%}",
                 f"{tiles['visible_fraction']:.1%}"]])])


def side_text(x) -> str:
    return "none" if x is None else str(x)


def _mask_text(spec) -> str:
    """', causal', ', window (left, right)', ', softcap C', ', learnable sink' as set."""
    out = ", causal" if spec.causal else ""
    if spec.window_size != (None, None):
        left, right = spec.effective_window
        out += f", window ({side_text(left)}, {side_text(right)})"
    if spec.softcap:
        out += f", softcap {spec.softcap:g}"
    if spec.learnable_sink:
        out += ", learnable sink"
    return out


def _mask_lines(plan, rep: dict) -> list[str]:
    """The conclusion's lines on what the mask skips and what the softcap and sink cost."""
    s, tiles, mask = plan.spec, rep["tiles"], rep["mask"]
    out = []
    if mask["dense_seconds"]:
        left, right = mask["effective_window"]
        out.append(f"- Mask: effective window ({side_text(left)}, {side_text(right)}) "
                   f"(`fa4lab.spec`, none = unbounded); {tiles['SKIP']} of {tiles['tiles']} "
                   f"tiles per "
                   f"{_per(plan)} are never loaded, {tiles['skipped_fraction']:.0%} of the "
                   f"dense work (Tile kinds below); predicted "
                   f"{rep['prediction']['seconds'] * 1e3:.3g} ms against "
                   f"{mask['dense_seconds'] * 1e3:.3g} ms without the mask.")
    if s.softcap:
        out.append(f"- Softcap {s.softcap:g}: one MUFU tanh and one FMA more per score "
                   f"(`fa4lab.plan.costs.CostModel`).")
    if s.learnable_sink:
        out.append("- Learnable sink: one logit per query head joins each row's sum once, "
                   "after the last block; no per-block cost.")
    return out


def render_markdown(plan, rep: dict) -> str:
    s, t, hw = plan.spec, plan.tiles, plan.hardware
    pred = rep["prediction"]
    sim = rep["simulation"]
    shape = (f"batch {s.batch}, seqlen {s.seqlen_q}x{s.seqlen_k}, heads {s.heads_q}/{s.heads_kv} "
             f"(GQA {s.gqa_ratio}), head_dim {s.head_dim}, {s.dtype}"
             f"{_mask_text(s)}{', LSE' if s.return_lse else ''}")
    clean = not sim["deadlock"] and not sim["hazards"]
    muts = rep["simulation"]["mutations"].values()
    caught = sum(v != "NOT CAUGHT" and not v.startswith("not observable") for v in muts)
    hidden = sum(v.startswith("not observable") for v in muts)
    lines = [f"# fa4lab plan: {plan.arch} ({hw.name})", "", f"Spec: {shape}.", "",
             "## Conclusion", "",
             f"- CTA = {t.q_stage} Q tile(s) x {t.m_block} rows (cta_m {t.cta_m}), K/V blocks of "
             f"{t.n_block} rows through {t.kv_stage} buffers; {plan.threads_per_cta} threads in "
             f"{len(plan.roles)} roles; {plan.barriers.mbarrier_count} mbarriers.",
             (f"- TMEM {plan.tmem.total_cols}/{plan.tmem.capacity_cols} columns; " if plan.tmem
              else "- No TMEM (registers hold S, P, O); ")
             + f"SMEM {plan.smem.total_bytes}/{plan.smem.limit_bytes} bytes; registers "
             f"{plan.registers_used}/{hw.registers_per_sm}.",
             f"- Protocol: {'no deadlock, no hazard' if clean else 'PROBLEMS (see below)'} in "
             + (f"{sim['n_tiles']} work tiles of {sim['n_blocks']} blocks in one CTA (a "
                f"persistent CTA runs several, as the kernel does); " if sim["n_tiles"] > 1 else
                f"one work tile of {sim['n_blocks']} blocks (one per CTA, as the kernel runs); ")
             + f"removing any one of {len(rep['simulation']['mutations'])} barriers is caught in "
             f"{caught}" + (f" ({hidden} not observable by the simulator, see below)" if hidden
                            else "") + ".",
             f"- Predicted **{pred['tflops']:.0f} TFLOP/s** ({pred['utilization']:.0%} of the "
             f"{pred['peak_tflops']:.0f} TFLOP/s dense MMA peak), {pred['label']}."]
    lines += _mask_lines(plan, rep)
    cal = rep["calibration"]
    lines.append(f"- Calibration: {cal['note']}.")
    if rep["published"]:
        p = rep["published"]
        lines.append(f"- Compare: {p['what']} {p['tflops']} TFLOP/s, {p['label']} "
                     f"({p['source']}).")
    rec = rep["recorded"]
    if rec and rec.get("tflops"):
        nums = ", ".join(f"{k} {v:.0f}" for k, v in sorted(rec["tflops"].items()))
        lines.append(f"- Compare: {nums} TFLOP/s, {rec['label']}.")
    b = rep["bottleneck"]
    demand = ", ".join(f"{k} {v:.0f}" for k, v in b["demand_per_block"].items())
    lines += ["", "## Evidence and assumptions", "",
              "Evidence (hardware facts, `fa4lab.hardware`):", ""]
    lines += [f"- {src}" for src in hw.sources]
    lines += ["", "Assumptions (`fa4lab.plan.costs.CostModel`: fitted on the H200 or assumed, "
                  "`fa4lab.plan.calibration`):", ""]
    lines += [f"- {k} = {v}" for k, v in rep["assumptions"].items()]
    lines += [f"- {n}" for n in plan.notes]
    lines += ["", "## Contract", "", contract_tables(plan), "",
              "## Simulated timeline", "",
              f"- A work tile costs {pred['tile_cycles']['per_block']:.0f} cycles per K/V block "
              f"({pred['tile_cycles']['per_masked_block']:.0f} per masked block) "
              f"{_fixed_text(pred['tile_cycles']['fixed'])}; demand per block: {demand} cycles: "
              f"bound by {b['bound']} ({b['efficiency_vs_bound']:.0%} of it used).",
              "- Busy: " + ", ".join(f"{k} {v:.0%}" for k, v in sim["busy"].items()) + ".",
              "- Single-edge removals (first finding): " + "; ".join(
                  f"`{k}` {v.split(' + ')[0]}" for k, v in rep["simulation"]["mutations"].items())
              + "."]
    if not clean:
        lines += [f"- DEADLOCK: {d}" for d in sim["deadlock"]]
        lines += [f"- HAZARD: {h}" for h in sim["hazards"]]
    exp = rep["experiment"]
    if rep["alternatives"]:
        lines.append("- Neighbouring plans (predicted): " + "; ".join(
            f"{_change(a['change'])} {a['tflops']:.0f}" for a in rep["alternatives"]) + ".")
    if exp:
        ratio = exp["tflops"] / pred["tflops"] - 1
        exp_line = (
            f"Falsifiable experiment: with {_change(exp['change'])} the model predicts "
            f"{exp['tflops']:.0f} TFLOP/s against {pred['tflops']:.0f} ({ratio:+.0%}). Measure "
            f"both on {'a B200' if plan.arch == 'sm100' else 'an H200'} with `fa4lab bench`; if "
            f"the measured change has the other sign or is under half the predicted one, the "
            f"cost model (its TMA/L2 latency and bandwidth assumptions first) is wrong.")
    else:
        exp_line = "Falsifiable experiment: no neighbouring plan fits this spec."
    lines += ["", "## Minimal validation", "",
              "- Correctness: `fa4lab.attention` against the float64 reference "
              "(`fa4lab.reference`) on fresh random inputs: extreme logits, fully masked rows "
              "(causal, seqlen_q > seqlen_k: O = 0, LSE = -inf), tails, seqlen 1; tolerance twice "
              "PyTorch's same-dtype error plus a small atol.",
              f"- Boundaries: seqlen_k = {t.n_block - 1}, {t.n_block}, {t.n_block + 1} (the K/V "
              f"tail); seqlen_q = {t.cta_m - 1}, {t.cta_m + 1} (a partial CTA); GQA "
              f"{', '.join(map(str, sorted({1, 4, s.gqa_ratio})))}; the audit checks "
              f"{plan.barriers.mbarrier_count} mbarrier inits and {plan.smem.total_bytes} bytes "
              f"of SMEM against this plan.",
              *_mask_checks(s),
              f"- {exp_line}", "",
              "## Risks and fallbacks", ""]
    lines += [f"- {r}" for r in risks(plan)]
    return "\n".join(lines) + "\n"


def _mask_checks(spec) -> list[str]:
    """The minimal validation's line for a window, softcap or sink (none without them)."""
    window = spec.window_size != (None, None)
    cases = (["a window narrower than one K/V block", "both window edges inside one tile"]
             if window else [])
    if window or spec.learnable_sink:
        cases.append("rows that see no key (O = 0; LSE = "
                     + ("the sink's logit)" if spec.learnable_sink else "-inf)"))
    if spec.softcap:
        cases.append("scores far past the softcap")
    if not cases:
        return []
    return [f"- Options ({_mask_text(spec).lstrip(', ')}): the same checks against the "
            f"reference with the same options, and {', '.join(cases)}."]


def _change(change: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in change.items())


def _fixed_text(fixed: float) -> str:
    if fixed >= 0:
        return f"plus {fixed:.0f} per tile"
    return (f"minus {-fixed:.0f} per tile (a persistent CTA overlaps the next tile's loads with "
            f"this one's epilogue)")


def risks(plan) -> list[str]:
    out = []
    if plan.arch == "sm100":
        if plan.tiles.q_stage == 1:
            out += ["One Q tile per CTA (q_stage 1): a CTA's two S buffers ping-pong over key "
                    "blocks, so one softmax warpgroup must keep up with the tensor core alone "
                    "and the correction waits for every value MMA (Note [S ping-pong]); "
                    "seqlen_q below 128 leaves TMEM lanes idle as with two tiles."]
        else:
            from fa4lab.plan.sm100 import tmem_columns

            cols = tmem_columns(2, plan.tiles.n_block, 256)
            out += [f"head_dim 256 does not fit two Q tiles: {cols} TMEM columns > "
                    f"{plan.hardware.tmem_columns}. Its plan takes `--q-stage 1` (two S buffers "
                    f"over one Q tile); the Hopper-style plan is `--arch sm90`."]
        out += [
                "A GPU without tcgen05/TMEM (Hopper, Ada, consumer Blackwell sm_120) cannot run "
                "this plan: dispatch to the sm90 kernel on H100/H200, else to the reference.",
                ("The kernel is persistent (min(work tiles, SMs) CTAs looping over tiles): "
                 "q_empty and o_empty order a CTA's tiles (Note [persistent CTAs])."
                 if plan.protocol.persistent else
                 "This plan runs one CTA per work tile (O is staged in Q's bytes, or q_stage is "
                 "1): q_empty and o_empty are waited only on their released first phase.")]
    else:
        out += ["Registers: a consumer holds O, S and P in registers "
                f"({plan.role('consumer0').registers} per thread); a larger n_block spills "
                "(the audit reads spills from the cubin).",
                "setmaxnreg and wgmma need sm_90a exactly: other GPUs fall back to the reference."]
    out += ["The cost model's L2 bandwidth, TMA latency and TMEM bandwidth are assumptions: the "
            "predicted TFLOP/s is a model, checked by the experiment above.",
            "A shape over any budget raises PlanError naming the regions and an override that "
            "fits."]
    return out


# ---- CLI ----
# Note [paged blocks in the plan]
# How a paged K/V cache meets the plan's K/V blocks, from `fa4lab.varlen_tiles.key_block_pages` (one
# rule for the plan, notebook 02 and the gather): a page size that is a multiple of n_block
# serves whole blocks, each one contiguous box (what a TMA load of the block needs); a smaller
# page makes each block a gather of n_block / page_size pages; a size that does not divide
# n_block leaves some blocks straddling a page edge, a size the kernels refuse before launch.
# The kernels read the pages in place, one box per block or one per page of a gather (Note
# [paged key blocks] in fa4lab.kernels.device.paged).
def paged_section(plan, page_size: int, show: int = 4) -> dict:
    """The plan's K/V blocks over pages of `page_size` tokens, in page-table slots (a table in
    order: slot s is page s). Note [paged blocks in the plan]."""
    from fa4lab.varlen_tiles import key_block_pages

    n = plan.tiles.n_block
    blocks = key_block_pages(plan.spec.seqlen_k, page_size, n)
    pieces = [len(b) for b in blocks]
    if page_size % n == 0:
        path = (f"one page holds {page_size // n} whole K/V block(s): each block is one "
                f"contiguous box of its page (one TMA load)")
    elif n % page_size == 0:
        path = (f"each K/V block gathers {n // page_size} pages of {page_size} tokens (a gather "
                f"path, not one TMA box)")
    else:
        path = (f"{page_size} does not divide n_block {n} nor the reverse: "
                f"{sum(p > 1 for p in pieces)} of {len(blocks)} blocks straddle a page edge")
    return {"page_size": page_size, "n_block": n, "blocks": len(blocks),
            "max_pieces_per_block": max(pieces, default=0), "path": path,
            "first_blocks": [[list(p) for p in b] for b in blocks[:show]]}


def render_paged(sec: dict) -> str:
    lines = ["", f"## Paged K/V (pages of {sec['page_size']} tokens)", "",
             f"- {sec['blocks']} K/V blocks of {sec['n_block']} keys; {sec['path']}.",
             "- The kernels read the pages in place: one TMA box per block, or one per page "
             "of a gather; sizes that straddle are refused before launch (Note [paged blocks "
             "in the plan]).", "",
             "| K/V block | pieces (page-table slot: tokens [first, stop)) |", "|---|---|"]
    for j, pieces in enumerate(sec["first_blocks"]):
        lines.append(f"| {j} | " + ", ".join(f"slot {s}: [{a}, {b})" for s, _, a, b in pieces)
                     + " |")
    return "\n".join(lines)
