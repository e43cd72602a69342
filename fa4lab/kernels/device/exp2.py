"""exp2 on the FMA units: FA4's software exponential for part of the softmax (device code).

Why: on B200 one SM does 8192 MMA FLOPs but only 16 MUFU exp2 per cycle, so for a 128x128x128
tile the exponentials cost as much as both MMAs. FA4 moves a fraction of the exp2 calls
(`plan.exp2_emulation_fraction`) onto the 128-lane FMA pipe with a polynomial, two elements at
a time (`exp2_poly3_x2`).

Note [exp2 by Cody-Waite + degree-3 polynomial]
    2^x = 2^floor(x) * 2^f with f = x - floor(x) in [0, 1).
    * floor(x) without a convert: adding 1.5 * 2^23 with round-toward-minus-infinity leaves
      floor(x) in the low mantissa bits of the sum (valid for |x| < 2^22); subtracting the
      constant back gives floor(x) as a float, and f = x - floor(x) exactly.
    * 2^f ~ p(f) = 1 + c1 f + c2 f^2 + c3 f^3 (Horner: three FMAs). The constant term is
      exactly 1, so p(0) = 1.0 bit for bit, and p(1) < 2, so p(f) stays in [1, 2).
      The coefficients are fa4lab.limits.EXP2_POLY3; max relative error 8.6e-5 (about
      2^-13.5, limits.EXP2_POLY3_MAX_REL_ERROR), far below bf16/fp16 rounding of P (2^-8, 2^-11).
    * 2^floor(x): shifting the rounded sum left by 23 moves floor(x) into the exponent field;
      one integer add scales p(f) by it.
    * x is clamped at -127 (limits.EXP2_CLAMP_LOW): then floor = -127 and f = 0, so the add
      gives the bits of 1.0 - 127 * 2^23 = 0x00000000, i.e. +0.0 exactly. A masked score (-inf)
      therefore gives P = 0 exactly, as MUFU.EX2 does. The softmax never calls it with x > 8
      (see Note [conditional rescale] in fa4lab.kernels.device.softmax), far below the 2^127
      overflow.

Note [packed exp2]
    sm_100 issues fp32 add, sub, mul and fma on a pair of registers as one instruction (PTX
    `add/sub/fma.f32x2`, SASS FADD2 / FFMA2). The softmax computes P in pairs of a row anyway
    (the scale-subtract is one FFMA2 per pair), so the polynomial runs on the pair: per pair,
    limits.EXP2_PAIR_FADD2 = 3 FADD2 (add.rm, sub, sub) and limits.EXP2_PAIR_FFMA2 = 3 FFMA2
    (Horner), i.e. three FMA-pipe instructions per element where the scalar form took six. The
    clamp has no f32x2 form (FMNMX, per element), and the exponent insert is integer work (shl +
    add.s32, which ptxas fuses into one LEA on the ALU pipe; add.u32 would become an IMAD on the
    FMA pipe). Packing changes no lane's arithmetic: each lane rounds as the scalar instruction
    does, so `fa4lab.online_softmax.exp2_poly3` replays both. fa4lab.plan.costs prices the
    packed form (Note [packed exp2 cost] there); the audit counts the FADD2.RM (one per pair),
    FADD2 and FFMA2 of the binary against the plan's emulated pairs. Upstream FA4's
    `ex2_emulation_2` (flash_attn/cute/utils.py) is the same recipe.
    The row sum of P is packed too: the step adds each pair of P into REDUCE_CHAINS running
    f32x2 sums (`fa4lab.kernels.device.softmax.chain_into`, as upstream FA4's `fadd_reduce`),
    joins them by a tree and adds the two lanes once at the end: n_block / 2 - 1 FADD2 and one
    FADD per row and block step.

`fa4lab.online_softmax.exp2_poly3` is the same bit-level recipe in numpy, so CPU tests check the
arithmetic the device code performs (tests/test_sm100_exp2.py); `online_softmax.emulated_pairs`
says which pairs of a score row take it.
"""

from __future__ import annotations

# 2^f ~ 1 + C1 f + C2 f^2 + C3 f^3 on [0, 1): the lab's one set of coefficients (fa4lab.limits).
from fa4lab.limits import EXP2_CLAMP_LOW, EXP2_POLY3, EXP2_ROUND_MAGIC

# PTX for one element's exponent insert: $0 = bits($2) + (bits($1) << 23), with $1 the rounded
# sum (floor(x) in its low bits) and $2 = p(f) in [1, 2). add.s32, not add.u32: Note [packed exp2].
EXPONENT_INSERT_PTX = (
    "{\n\t"
    ".reg .b32 e, pb;\n\t"
    "mov.b32 e, $1;\n\t"
    "shl.b32 e, e, 23;\n\t"
    "mov.b32 pb, $2;\n\t"
    "add.s32 pb, pb, e;\n\t"
    "mov.b32 $0, pb;\n\t"
    "}\n"
)


def _insert_exponent(rounded, p):
    from cutlass import Float32
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T

    return Float32(
        llvm.inline_asm(
            T.f32(),
            [Float32(rounded).ir_value(), Float32(p).ir_value()],
            EXPONENT_INSERT_PTX,
            "=f,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


def exp2_poly3_x2(x, y):
    """Device function: (2^x, 2^y) on the FMA pipe, as f32x2 pairs (Note [exp2 by Cody-Waite +
    degree-3 polynomial], Note [packed exp2])."""
    import cutlass.cute as cute
    from cutlass import Float32

    def both(c):
        return Float32(c), Float32(c)

    low = Float32(EXP2_CLAMP_LOW)
    xy = (cute.arch.fmax(x, low, ftz=True), cute.arch.fmax(y, low, ftz=True))
    magic = both(EXP2_ROUND_MAGIC)
    rounded = cute.arch.add_packed_f32x2(xy, magic, rnd="rm", ftz=True)
    floor = cute.arch.sub_packed_f32x2(rounded, magic, ftz=True)
    frac = cute.arch.sub_packed_f32x2(xy, floor, ftz=True)
    p = both(EXP2_POLY3[-1])
    for c in reversed(EXP2_POLY3[:-1]):     # Horner: one FFMA2 per coefficient below the top
        p = cute.arch.fma_packed_f32x2(p, frac, both(c), ftz=True)
    return _insert_exponent(rounded[0], p[0]), _insert_exponent(rounded[1], p[1])
