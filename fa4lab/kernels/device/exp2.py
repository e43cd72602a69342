"""exp2 on the FMA units: FA4's software exponential for part of the softmax (device code).

Why: on B200 one SM does 8192 MMA FLOPs but only 16 MUFU exp2 per cycle, so for a 128x128x128
tile the exponentials cost as much as both MMAs. FA4 moves a fraction of the exp2 calls
(`plan.exp2_emulation_fraction`) onto the 128-lane FMA pipe with a polynomial.

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
    * x is clamped at -127: then floor = -127 and f = 0, so the add gives the bits of
      1.0 - 127 * 2^23 = 0x00000000, i.e. +0.0 exactly. A masked score (-inf) therefore gives
      P = 0 exactly, as MUFU.EX2 does. The softmax never calls it with x > 8 (see Note
      [conditional rescale] in fa4lab.kernels.device.softmax), far below the 2^127 overflow.

`fa4lab.online_softmax.exp2_poly3` is the same bit-level recipe in numpy, so CPU tests check the
arithmetic the device code performs (tests/test_sm100_exp2.py); `online_softmax.emulated_pairs`
says which pairs of a score row take it.
"""

from __future__ import annotations

import numpy as np

# 2^f ~ 1 + C1 f + C2 f^2 + C3 f^3 on [0, 1): the lab's one set of coefficients (fa4lab.limits).
from fa4lab.limits import EXP2_CLAMP_LOW as CLAMP_LOW
from fa4lab.limits import EXP2_POLY3
from fa4lab.limits import EXP2_ROUND_MAGIC as ROUND_MAGIC


def _f32_hex(x: float) -> str:
    return "0f" + np.float32(x).view(np.uint32).item().to_bytes(4, "big").hex().upper()


# PTX for one element. $0 = 2^($1). Only FMA-pipe instructions: max, add.rm, sub, fma, shl, add.
EXP2_POLY3_PTX = (
    "{\n\t"
    ".reg .f32 xc, r, fl, fr, p;\n\t"
    ".reg .b32 e, pb;\n\t"
    f"max.ftz.f32 xc, $1, {_f32_hex(CLAMP_LOW)};\n\t"
    f"add.rm.ftz.f32 r, xc, {_f32_hex(ROUND_MAGIC)};\n\t"
    f"sub.ftz.f32 fl, r, {_f32_hex(ROUND_MAGIC)};\n\t"
    "sub.ftz.f32 fr, xc, fl;\n\t"
    f"fma.rn.ftz.f32 p, fr, {_f32_hex(EXP2_POLY3[3])}, {_f32_hex(EXP2_POLY3[2])};\n\t"
    f"fma.rn.ftz.f32 p, p, fr, {_f32_hex(EXP2_POLY3[1])};\n\t"
    f"fma.rn.ftz.f32 p, p, fr, {_f32_hex(EXP2_POLY3[0])};\n\t"
    "mov.b32 e, r;\n\t"
    "shl.b32 e, e, 23;\n\t"
    "mov.b32 pb, p;\n\t"
    "add.s32 pb, pb, e;\n\t"
    "mov.b32 $0, pb;\n\t"
    "}\n"
)


def exp2_poly3(x):
    """Device function: 2^x on the FMA pipe (Note [exp2 by Cody-Waite + degree-3 polynomial])."""
    from cutlass import Float32
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T

    return Float32(
        llvm.inline_asm(
            T.f32(),
            [Float32(x).ir_value()],
            EXP2_POLY3_PTX,
            "=f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )
