"""The sm90 kernel's steady loop, read back from its SASS: the value wgmma's wait comes after the
softmax's exponentials (Note [sm90 wait after the softmax] in fa4lab.kernels.fwd_sm90), and the
loop keeps its pipeline state in uniform registers. Tier 1: compiles on the CPU."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest

from fa4lab.spec import AttentionSpec


@functools.cache
def _sass(head_dim: int, causal: bool) -> str:
    from fa4lab.kernels import binary, compile_forward

    spec = AttentionSpec(2, 8192, 8192, 2048 // head_dim, 2048 // head_dim, head_dim,
                         causal=causal)
    with tempfile.TemporaryDirectory() as keep:
        return binary.sass(compile_forward(spec, "sm90a", keep_dir=Path(keep)).cubin_path)


def _loop(text: str, span) -> list[tuple[str, str]]:
    from fa4lab.kernels import binary

    return [(op.split()[-1], args) for addr, op, args in binary.sass_instructions(text)
            if span[0] <= addr <= span[1]]


def _steady_loop(head_dim: int, causal: bool, tmp_path=None):
    from fa4lab.kernels import binary

    text = _sass(head_dim, causal)
    span = binary.steady_loop(text)
    assert span is not None, "no loop with HGMMAs found in the sm90 kernel's SASS"
    return _loop(text, span)


@pytest.mark.slow
@pytest.mark.compile
@pytest.mark.parametrize("head_dim,causal", [(128, False), (64, True)])
def test_value_wgmma_wait_follows_the_exponentials(head_dim, causal, tmp_path):
    loop = _steady_loop(head_dim, causal, tmp_path)
    exps = [i for i, (op, _) in enumerate(loop) if op == "MUFU.EX2"]
    waits = [i for i, (op, args) in enumerate(loop)
             if op == "WARPGROUP.DEPBAR.LE" and args.replace(" ", "").endswith("0x0")]
    assert len(exps) >= 64 and waits, (
        f"hd{head_dim}: expected the steady loop to hold the block's MUFU.EX2s and a "
        f"'WARPGROUP.DEPBAR.LE gsb0, 0x0'; found {len(exps)} and {len(waits)}")
    assert min(waits) > max(exps), (
        f"hd{head_dim}: the value wgmma's wait is instruction {min(waits)} of the loop, before "
        f"the last exp2 ({max(exps)}): the softmax no longer overlaps the value wgmma -- is "
        f"the wait still behind its branch on an opaque zero (Note [sm90 wait after the "
        f"softmax])?")
    r2ur = sum(op == "R2UR" for op, _ in loop)
    assert r2ur == 0, (
        f"hd{head_dim}: {r2ur} R2UR in the steady loop: the pipeline state left the uniform "
        f"registers -- is the rescale branch still voted per warp (OnlineSoftmax.needs_rescale)?")


@pytest.mark.slow
@pytest.mark.compile
def test_masked_blocks_mask_by_bitmask():
    """A causal kernel's diagonal blocks set their predicates from bitmasks (R2P), not by a
    compare per score (Note [bitmask masking] in fa4lab.kernels.device.mask): the masked
    block loop, the innermost HGMMA loop before the steady one, holds R2Ps and far fewer
    ISETPs than the 64 scores a thread holds at head_dim 64 (three consumers, 128 keys)."""
    from fa4lab.kernels import binary

    text = _sass(64, True)
    steady = binary.steady_loop(text)
    insts = binary.sass_instructions(text)
    loops = []
    for addr, op, args in insts:
        target = op.startswith("@") and op.endswith(" BRA") and args.split("0x")[-1]
        if target and int(target.split()[0].rstrip(";"), 16) < addr:
            start = int(target.split()[0].rstrip(";"), 16)
            body = _loop(text, (start, addr))
            if any(o.startswith("HGMMA") for o, _ in body) and addr < steady[0]:
                loops.append(body)
    assert loops, "no masked block loop (an HGMMA loop before the steady one) in the SASS"
    masked = loops[-1]
    isetp = sum(o.startswith("ISETP") for o, _ in masked)
    r2p = sum(o == "R2P" for o, _ in masked)
    assert r2p > 0 and isetp < 16, (
        f"the masked block loop holds {r2p} R2P and {isetp} ISETP: the mask is compared score "
        f"by score again (apply_limits without a column pattern?)")
