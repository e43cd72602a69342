"""The protocol audit catches a broken binary, naming the barrier and the role.

Compiled mutations (marked `compile`): the sm100 kernel built with one wait dropped, or two
adjacent arrives swapped, through `compile_forward(..., mutation=Mutation(...))`; and the
unmutated binary audited against a plan with another kv_stage, or with the stats mailbox laid
out elsewhere. Below them, the PTX parsers and the checks of named barrier ids (computed per
thread) and of the mailbox offset on small hand-written snippets (no compile).
"""

from __future__ import annotations

import pytest

from fa4lab.kernels import binary, ptx_flow
from fa4lab.plan import plan_forward
from fa4lab.spec import AttentionSpec

SPEC = AttentionSpec(2, 300, 700, 8, 8, 128, causal=True, return_lse=True)
_compiled = {}


def _compile(mutation, tmp_path_factory):
    pytest.importorskip("cutlass")
    from fa4lab.kernels import compile_forward

    if mutation not in _compiled:
        _compiled[mutation] = compile_forward(SPEC, "sm100a", mutation=mutation,
                                              keep_dir=tmp_path_factory.mktemp("mut"))
    return _compiled[mutation]


def _failures(plan, ptx):
    from fa4lab.kernels.protocol_audit import protocol_rows

    return [r for r in protocol_rows(plan, ptx) if not r.ok]


@pytest.mark.slow
@pytest.mark.compile
def test_unmutated_binary_passes(tmp_path_factory):
    cf = _compile(None, tmp_path_factory)
    assert _failures(cf.plan, cf.ptx) == []


@pytest.mark.slow
@pytest.mark.compile
def test_dropped_wait_is_named(tmp_path_factory):
    from fa4lab.kernels.protocol import Mutation

    plan = plan_forward(SPEC, "sm100")
    site = plan.protocol.sites("mma", 2)[14]
    assert (site.kind, site.barrier, site.stage) == ("wait", "o_rescaled", 1)
    cf = _compile(Mutation("drop", "mma", 14), tmp_path_factory)
    bad = _failures(cf.plan, cf.ptx)
    assert [r.name for r in bad] == ["protocol: mma"]
    assert "the table has wait o_rescaled[1]" in bad[0].note and "mma op 14" in bad[0].note


@pytest.mark.slow
@pytest.mark.compile
def test_dropped_p_part_wait_is_named(tmp_path_factory):
    """Note [split P hand-off]: a value MMA issued without waiting for the first part of P."""
    from fa4lab.kernels.protocol import Mutation

    plan = plan_forward(SPEC, "sm100")
    site = plan.protocol.sites("mma", 2)[13]
    assert (site.kind, site.barrier, site.stage) == ("wait", "p_part", 1)
    cf = _compile(Mutation("drop", "mma", 13), tmp_path_factory)
    bad = _failures(cf.plan, cf.ptx)
    assert [r.name for r in bad] == ["protocol: mma"]
    assert "the table has wait p_part[1]" in bad[0].note and "mma op 13" in bad[0].note


@pytest.mark.slow
@pytest.mark.compile
def test_swapped_arrives_are_named(tmp_path_factory):
    from fa4lab.kernels.protocol import Mutation

    plan = plan_forward(SPEC, "sm100")
    first, second = plan.protocol.sites("epilogue", 2)[2:4]
    assert (str(first), str(second)) == ("arrive o_empty[0]", "arrive o_empty[1]")
    cf = _compile(Mutation("swap", "epilogue", 2), tmp_path_factory)
    bad = _failures(cf.plan, cf.ptx)
    assert [r.name for r in bad] == ["protocol: epilogue"]
    assert ("epilogue op 2: the binary has arrive o_empty[1], the table has arrive o_empty[0]"
            in bad[0].note)


@pytest.mark.slow
@pytest.mark.compile
def test_late_p_part_arrive_is_named(tmp_path_factory):
    """Note [split P hand-off]: the softmax's p_part arrive issued after its p_ready arrive
    (the first part handed over only with the whole of P)."""
    from fa4lab.kernels.protocol import Mutation

    plan = plan_forward(SPEC, "sm100")
    first, second = plan.protocol.sites("softmax0", 2)[4:6]
    assert (str(first), str(second)) == ("arrive p_part[0]", "arrive p_ready[0]")
    cf = _compile(Mutation("swap", "softmax0", 4), tmp_path_factory)
    bad = _failures(cf.plan, cf.ptx)
    assert [r.name for r in bad] == ["protocol: softmax0"]
    assert ("softmax0 op 4: the binary has arrive p_ready[0], the table has arrive p_part[0]"
            in bad[0].note)


@pytest.mark.slow
@pytest.mark.compile
def test_stage_count_mismatch_is_named(tmp_path_factory):
    """The binary (kv_stage 3) against a plan with kv_stage 2: the ring's barriers fail."""
    cf = _compile(None, tmp_path_factory)
    other = plan_forward(SPEC, "sm100", kv_stage=2)
    bad = {r.name: r for r in _failures(other, cf.ptx)}
    assert "init kv_full" in bad and "init kv_empty" in bad
    assert "load -> mma" in bad["init kv_full"].note
    assert len(bad["init kv_full"].expected) == 2   # the plan's two stages, not found there


@pytest.mark.slow
@pytest.mark.compile
def test_stats_mailbox_offset_is_read_from_the_binary(tmp_path_factory):
    """sScale, the softmax -> correction mailbox, is at plan.smem's `stats` offset; a plan that
    lays the mailbox out before O fails on both regions."""
    import dataclasses

    from fa4lab.kernels.protocol_audit import protocol_rows
    from fa4lab.plan.smem import SmemPlan

    cf = _compile(None, tmp_path_factory)
    row = next(r for r in protocol_rows(cf.plan, cf.ptx) if r.name == "SMEM offset stats")
    assert row.ok and row.found == cf.plan.smem.offsets()["stats"], row
    regions = {r.name: r for r in cf.plan.smem.regions}
    order = ("q", "kv", "stats", "o", "barriers", "tmem_ptr")
    smem = SmemPlan.build(tuple(regions[n] for n in order), cf.plan.smem.limit_bytes)
    assert smem.offsets()["barriers"] == cf.plan.smem.offsets()["barriers"]
    bad = _failures(dataclasses.replace(cf.plan, smem=smem), cf.ptx)
    assert [r.name for r in bad] == ["SMEM offset o", "SMEM offset stats"]
    assert bad[1].expected == smem.offsets()["stats"] and bad[1].found == row.found


# ---- parsers on hand-written PTX (no compile) ----
PTX = """
.extern .shared .align 1024 .b8 __dynamic_shmem__0[];
	mov.b32 	%r1, __dynamic_shmem__0;
	shfl.sync.idx.b32 	%r8, %r1, 0, 31, -1;
	add.s32 	%r9, %r8, 1024;
	mov.b32 	%r3, 128;
	mbarrier.init.shared.b64 	[%r9], %r3;
	mbarrier.init.shared.b64 	[%r8+1032], 1;
	bar.sync 	0;
	@%p1 bra 	$L__BB0_9;
	// begin inline asm
	// fa4lab-proto load wait full[0]
	// end inline asm
	mbarrier.try_wait.parity.shared.b64 P1, [%r9], 1, 10000000;
	bra.uni 	$L__BB0_3;
$L__BB0_9:
	// begin inline asm
	// fa4lab-proto mma sync tmem[0]
	// end inline asm
	barrier.sync 	1, 416;
	bar.arrive 	2, 256;
	ret;
$L__BB0_3:
	add.s32 	%r20, %r8, %r21;
	// begin inline asm
	// fa4lab-proto load arrive empty[ring]
	// end inline asm
	mbarrier.arrive.shared.b64 %rd1, [%r20+1032], %r3;
	@%p2 bra 	$L__BB0_3;
	bra.uni 	$L__BB0_9;
"""


def test_addresses_resolve_from_the_dynamic_smem_base():
    assert binary.mbarrier_inits(PTX) == [(1024, 128), (1032, 1)]
    addr = binary.SmemAddresses(PTX)
    assert addr.operand("[%r9]") == (1024, False)
    assert addr.operand("[%r20+1032]") == (1032, True)    # plus a run-time index
    assert addr.operand("[%r99]") is None


def test_barrier_ops_kinds_ids_and_forms():
    ops = [(o.kind, o.opcode, o.offset, o.named_id, o.threads) for o in binary.barrier_ops(PTX)
           if o.kind != "marker"]
    assert ops == [("sync", "bar.sync", None, 0, None),
                   ("wait", "mbarrier.try_wait.parity.shared.b64", 1024, None, None),
                   ("sync", "barrier.sync", None, 1, 416),
                   ("named_arrive", "bar.arrive", None, 2, 256),
                   ("arrive", "mbarrier.arrive.shared.b64", 1032, None, None)]
    markers = [o.marker for o in binary.barrier_ops(PTX) if o.kind == "marker"]
    assert markers[0] == ("load", "wait", "full", "0")


def test_loops_and_program_order_follow_control_flow():
    lines = PTX.splitlines()
    loops = ptx_flow.ptx_loops(PTX)
    arrive = next(i for i, ln in enumerate(lines) if "mbarrier.arrive" in ln)
    wait = next(i for i, ln in enumerate(lines) if "try_wait" in ln)
    sync = next(i for i, ln in enumerate(lines) if "barrier.sync \t1" in ln or
                ln.strip().startswith("barrier.sync"))
    assert loops[arrive] == "$L__BB0_3" and loops[wait] is None and loops[sync] is None
    order = ptx_flow.program_order(PTX)
    # $L__BB0_9 is laid out before the loop but runs after it (the loop branches to it).
    assert order.index(wait) < order.index(arrive) < order.index(sync)


# The sm90 epilogue's named barrier: one per consumer warpgroup, its id computed at run time
# from the warp index (as the compiler folds `epilogue0's id + consumer index`).
NAMED_PTX = """
	mov.u32 	%r2, %tid.x;
	shr.u32 	%r132, %r2, 5;
	shfl.sync.idx.b32 	%r3, %r132, 0, 31, -1;
	shr.u32 	%r28, %r3, 2;
	add.s32 	%r29, %r28, 1;
	@%p1 mov.b32 	%r30, 7;
	// begin inline asm
	// fa4lab-proto consumer sync epilogue{c}[0]
	// end inline asm
	barrier.sync 	%r28, 128;
"""


def test_thread_values_follow_the_id_register_to_the_thread_index():
    values = binary.ThreadValues(NAMED_PTX)
    assert [values.value("%r28", t) for t in (0, 127, 128, 255, 256, 383)] == [0, 0, 1, 1, 2, 2]
    assert values.value("%r29", 200) == 2 and values.value("5", 0) == 5
    assert values.value("%r30", 0) is None           # a guarded definition: unknown
    assert values.formula("%r28") == "(%tid.x >> 5) >> 2"
    op = next(o for o in binary.barrier_ops(NAMED_PTX) if o.kind == "sync")
    assert (op.named_id, op.named_operand, op.threads) == (None, "%r28", 128)


def _sm90_rows(ptx, shift=0):
    import dataclasses

    from fa4lab.kernels.protocol_audit import protocol_rows
    from fa4lab.plan.barriers import BarrierGraph

    plan = plan_forward(SPEC, "sm90")
    bars = tuple(dataclasses.replace(b, named_id=b.named_id + shift)
                 if b.name.startswith("epilogue") else b for b in plan.barriers.barriers)
    plan = dataclasses.replace(plan, protocol=plan.protocol.with_barriers(BarrierGraph(bars)))
    return {r.name: r for r in protocol_rows(plan, ptx)}


def test_epilogue_ids_are_checked_per_consumer():
    rows = _sm90_rows(NAMED_PTX)
    named = rows["named barrier ids"]
    assert named.ok and named.found == {"epilogue0": 1, "epilogue1": 2}
    assert "(%tid.x >> 5) >> 2" in named.note and "the table: epilogue0's id 1 + c" in named.note
    assert "epilogue" not in rows["markers claim their barrier op"].note
    # The table's base id moved (2, 3): the binary's ids (1, 2) no longer match.
    rows = _sm90_rows(NAMED_PTX, shift=1)
    assert not rows["named barrier ids"].ok
    claim = rows["markers claim their barrier op"].note
    assert "sync epilogue{c}[0]: barrier id %r28 is consumer0 1, consumer1 2;" in claim
    assert "the table has epilogue0 2, epilogue1 3" in claim
    # An id the PTX does not determine is reported, not accepted.
    rows = _sm90_rows(NAMED_PTX.replace("barrier.sync \t%r28", "barrier.sync \t%r30"))
    assert "consumer0 unresolved" in rows["markers claim their barrier op"].note


MAILBOX_PTX = """
	mov.b32 	%r1, __dynamic_shmem__0;
	st.shared.b32 	[%r1+163840], %r5;
	// begin inline asm
	// fa4lab-proto softmax0 wait stats_empty[0]
	// end inline asm
	mbarrier.try_wait.parity.shared.b64 P1, [%r1+231584], 1, 10000000;
	add.s32 	%r33, %r1, %r7;
	st.shared.b32 	[%r33+OFFSET], %r6;
	// begin inline asm
	// fa4lab-proto softmax0 arrive stats_full[0]
	// end inline asm
	mbarrier.arrive.shared.b64 %rd1, [%r1+231568], %r8;
	// begin inline asm
	// fa4lab-proto correction wait stats_full[0]
	// end inline asm
	mbarrier.try_wait.parity.shared.b64 P1, [%r1+231568], 0, 10000000;
	ld.shared.b32 	%r9, [%r33+230400];
"""


def test_stats_offset_is_read_from_the_mailbox_accesses():
    from fa4lab.kernels.protocol_audit import protocol_rows

    plan = plan_forward(SPEC, "sm100")
    at = plan.smem.offsets()["stats"]
    assert at == 229376
    rows = {r.name: r for r in protocol_rows(plan, MAILBOX_PTX.replace("OFFSET", str(at)))}
    row = rows["SMEM offset stats"]
    # The st.shared into sO (163840) before the marker is not the mailbox's.
    assert row.ok and row.found == at, row
    assert "1 st.shared / 1 ld.shared" in row.note
    rows = {r.name: r for r in protocol_rows(plan, MAILBOX_PTX.replace("OFFSET", str(at - 16)))}
    row = rows["SMEM offset stats"]
    assert not row.ok and row.found == at - 16 and "outside" in row.note


# A persistent kernel's shape (Note [persistent CTAs] in fa4lab.plan.sm100): a tile loop around
# a block loop, the inner loop laid out after the outer loop's latch.
NESTED_PTX = """
	mov.u32 	%r1, 0;
$L__BB1_1:
	// tile loop header
	add.s32 	%r2, %r1, 1;
	bra.uni 	$L__BB1_3;
$L__BB1_2:
	// tile loop latch
	setp.lt.s32 	%p1, %r1, %r9;
	@%p1 bra 	$L__BB1_1;
	bra.uni 	$L__BB1_9;
$L__BB1_3:
	// block loop body
	add.s32 	%r3, %r3, 1;
	setp.lt.s32 	%p2, %r3, %r8;
	@%p2 bra 	$L__BB1_3;
	bra.uni 	$L__BB1_2;
$L__BB1_9:
	ret;
"""


def test_nested_loops_name_the_innermost():
    """Each line's loop is its innermost one: the block loop's lines are not the tile loop's, so
    the audit can match each table loop (TileLoop, Loop) to one PTX loop."""
    lines = NESTED_PTX.splitlines()
    loops = ptx_flow.ptx_loops(NESTED_PTX)

    def at(text):
        return loops[next(i for i, ln in enumerate(lines) if text in ln)]

    assert at("tile loop header") == at("tile loop latch") == "$L__BB1_1"
    assert at("block loop body") == "$L__BB1_3"
    assert at("mov.u32") is None and at("ret;") is None


# A paged gather's copies as a run-time loop (Note [paged key blocks] in
# fa4lab.kernels.device.paged): the piece's SMEM offset strength-reduced to a register stepped
# through the stage, and the loop's latch a conditional branch with the code after the loop
# falling through it.
GATHER_PTX = """
.extern .shared .align 1024 .b8 __dynamic_shmem__0[];
	mov.b32 	%r1, __dynamic_shmem__0;
	ld.param.u32 	%r11, [param_0];
	add.s32 	%r12, %r1, %r11;
	mov.b32 	%r13, 4096;
	add.s32 	%r13, %r13, -1024;
	add.s32 	%r14, %r1, %r13;
	mov.b32 	%r5, 8192;
$L__BB2_1:
	// gather loop body
	add.s32 	%r6, %r1, %r5;
	st.shared.u32 	[%r6], %r7;
	add.s32 	%r5, %r5, 2048;
	setp.lt.s32 	%p1, %r5, 24576;
	@%p1 bra 	$L__BB2_1;
	// after the gather loop
	mbarrier.arrive.shared.b64 	%rd1, [%r1+1032];
	ret;
"""


def test_a_loop_offset_is_bounded_below_by_its_start():
    """An offset set from an immediate and stepped by non-negative immediates is at least its
    start; any other definition (a load, a negative step) leaves the dynamic part's 0."""
    addr = binary.SmemAddresses(GATHER_PTX)
    assert addr.floor("%r5") == 8192
    assert addr.operand("[%r6]") == (8192, True)
    assert addr.operand("[%r6+512]") == (8704, True)
    assert addr.floor("%r11") == 0 and addr.operand("[%r12]") == (0, True)
    assert addr.floor("%r13") == 0 and addr.operand("[%r14]") == (0, True)


def test_a_conditional_latch_ends_its_loop():
    """The code after a loop whose latch is a conditional branch falls through it and is not
    part of the loop (nor before it in program order)."""
    lines = GATHER_PTX.splitlines()
    loops = ptx_flow.ptx_loops(GATHER_PTX)
    body = next(i for i, ln in enumerate(lines) if "gather loop body" in ln)
    latch = next(i for i, ln in enumerate(lines) if "bra" in ln)
    after = next(i for i, ln in enumerate(lines) if "mbarrier.arrive" in ln)
    assert loops[body] == loops[latch] == "$L__BB2_1"
    assert loops[after] is None
    order = ptx_flow.program_order(GATHER_PTX)
    assert order.index(body) < order.index(latch) < order.index(after)
