"""Values the compiler cannot see through: a zero from inline assembly (device code).

Shared by the sm90 and sm100 kernels. Note [opaque zero]: `opaque_zero()` is 0 from a
side-effecting `mov`, so the compiler can neither fold it nor move it out of a loop. Two uses:

* sm100 MMA warp: operands offset by it are rebuilt in each work tile instead of being hoisted
  out of the tile loop and kept live across it (Note [operand descriptors per tile] in
  fa4lab.kernels.fwd_sm100);
* sm90 consumers: the value wgmma's wait sits behind a branch on it, which every thread takes,
  so the wait is a basic block of its own that ptxas cannot move up among the exponentials
  (Note [sm90 wait after the softmax] in fa4lab.kernels.fwd_sm90); and inside the persistent
  tile loop the branches on the thread index (the first warp issues the O store, a quad's first
  thread writes LSE) compare against it, so the compiler cannot unswitch the loop on them and
  run the warps of one warpgroup through two copies of its wgmmas (which must be one
  instruction for the whole warpgroup).
"""

from __future__ import annotations

from cutlass import Int32


def opaque_zero() -> Int32:
    """0, from an instruction the compiler cannot look through or move out of a loop."""
    from cutlass._mlir import ir
    from cutlass._mlir.dialects import llvm

    return Int32(llvm.inline_asm(ir.IntegerType.get_signless(32), [], "mov.u32 $0, 0;", "=r",
                                 has_side_effects=True, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT))
