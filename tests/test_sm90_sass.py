"""The sm90 kernel's steady loop, read back from its SASS: the value wgmma's wait comes after the
softmax's exponentials (Note [sm90 wait after the softmax] in fa4lab.kernels.fwd_sm90), and the
loop keeps its pipeline state in uniform registers. Tier 1: compiles on the CPU."""

from __future__ import annotations

import pytest

from fa4lab.spec import AttentionSpec


def _steady_loop(head_dim: int, causal: bool, tmp_path):
    from fa4lab.kernels import binary, compile_forward

    spec = AttentionSpec(2, 8192, 8192, 2048 // head_dim, 2048 // head_dim, head_dim,
                         causal=causal)
    cf = compile_forward(spec, "sm90a", keep_dir=tmp_path)
    text = binary.sass(cf.cubin_path)
    span = binary.steady_loop(text)
    assert span is not None, "no loop with HGMMAs found in the sm90 kernel's SASS"
    return [(op.split()[-1], args) for addr, op, args in binary.sass_instructions(text)
            if span[0] <= addr <= span[1]]


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
