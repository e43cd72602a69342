"""The fuzzer's judge: run one case, and say whether it passed, was refused, failed or faulted.

`run_case(case, device)` builds the case's inputs, calls its entry point twice (each call
followed by `torch.cuda.synchronize()` inside the try, so a fault surfaces at its case) and
holds the result to the acceptance rule (`fa4lab.acceptance`) against the float64 reference:
`fa4lab.reference.attention_reference` of the dense (or gathered) K/V for `fa4lab.attention`,
`attention_varlen_reference` sequence by sequence for `fa4lab.attention_varlen`, with the
yardsticks of tests/kernel_checks.py (`same_dtype_yardstick` for a dense call,
`torch_same_dtype` per sequence). The two calls must agree bit for bit.

Note [refusals]
    A call that raises is a refusal only when the exception is one of fa4lab's documented
    errors (`fa4lab.errors.Fa4labError`: InputError, InputTypeError, PlanError,
    UnsupportedArchError, ModCompileError, ...) raised before launch: no frame of its
    traceback (or of the exceptions it was raised from) inside tvm_ffi or the CuTe DSL
    (`raised_in_launch`). Anything else -- a TypeError, a ValueError, an error of the DSL's
    compile, one raised inside the launch -- is a failure: a caller could not have known what
    was wrong from fa4lab's documented errors. A CUDA error (`is_cuda_fault`: an illegal
    address, a launch failure; after it the context is dead) is a fault: the run stops there.
    A CUDA error after which the context still runs work (`context_alive`: a launch refused
    for its configuration) is a failure, and the run goes on. On a GPU a call that falls back
    to the float64 reference (`SlowReferenceWarning`) fails: no kernel ran.
"""

from __future__ import annotations

import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import PurePath

from fa4lab.acceptance import (
    ATOL,
    LSE_ATOL,
    LSE_RTOL,
    output_ulp_atol,
    rule_violations,
    same_dtype_yardstick,
    torch_same_dtype,
)
from fa4lab.errors import Fa4labError
from fa4lab.fuzz.inputs import call, case_inputs
from fa4lab.mods import one_line

__all__ = ["Verdict", "classify", "context_alive", "is_cuda_fault", "judge", "raised_in_launch",
           "run_case"]

# Path components of the code a launch runs: a frame there means the launch had begun.
LAUNCH_PACKAGES = frozenset({"tvm_ffi", "cutlass", "nvidia_cutlass_dsl"})
# What a CUDA error says, whichever layer raises it.
_FAULT_TEXTS = ("CUDA error", "cudaError", "CUDA_ERROR", "illegal memory access",
                "unspecified launch failure", "device-side assert")
DENSE_ENTRIES = ("dense", "paged", "paged_split")


@dataclass(frozen=True)
class Verdict:
    """kind: "pass", "refusal", "failure" or "fault"; problems: what failed, one sentence
    each; message: a refusal's "ErrorType: message"; traceback: a failing exception's."""

    kind: str
    problems: tuple[str, ...] = ()
    message: str = ""
    traceback: str = ""
    seconds: float = 0.0


def raised_in_launch(err: BaseException) -> bool:
    """Whether `err`, or an exception it was raised from, passed through tvm_ffi or the DSL."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        for frame, _ in traceback.walk_tb(err.__traceback__):
            if LAUNCH_PACKAGES & set(PurePath(frame.f_code.co_filename).parts):
                return True
        err = err.__cause__ or err.__context__
    return False


def is_cuda_fault(err: BaseException) -> bool:
    """A CUDA error (torch.AcceleratorError, or an error whose message is one): after it the
    context is dead. fa4lab's own errors never are."""
    import torch

    if isinstance(err, Fa4labError):
        return False
    accelerator = getattr(torch, "AcceleratorError", None)
    if accelerator is not None and isinstance(err, accelerator):
        return True
    return any(text in str(err) for text in _FAULT_TEXTS)


def context_alive() -> bool:
    """Whether the CUDA context still runs work: a sticky error (an illegal address, a trap)
    makes every later call fail, a launch refused for its configuration does not."""
    import torch

    try:
        (torch.ones(1, device="cuda") + 1).item()
        torch.cuda.synchronize()
    except Exception:
        return False
    return True


def _said(err: BaseException) -> str:
    return f"{type(err).__name__}: {one_line(err)}"


def classify(err: BaseException) -> Verdict:
    """The verdict on a call that raised `err` (Note [refusals])."""
    text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    if is_cuda_fault(err):
        return Verdict("fault", (f"CUDA fault: {_said(err)}",), traceback=text)
    if isinstance(err, Fa4labError):
        if not raised_in_launch(err):
            return Verdict("refusal", message=_said(err))
        return Verdict("failure", (f"raised inside the launch: {_said(err)}",), traceback=text)
    return Verdict("failure", (f"raised {_said(err)} (not an fa4lab error)",), traceback=text)


def _guarded(fn, device: str):
    """fn()'s result (synchronised on a GPU), or the Verdict on what it raised."""
    import torch

    from fa4lab.api import SlowReferenceWarning

    with warnings.catch_warnings():
        warnings.simplefilter("error" if device != "cpu" else "ignore", SlowReferenceWarning)
        try:
            result = fn()
            if device != "cpu":
                torch.cuda.synchronize()
        except Exception as err:
            return classify(err)
    return result


def _same_bits(a, b) -> bool:
    """Equal tensors, NaN where the other has NaN (None only beside None)."""
    import torch

    if a is None or b is None:
        return a is b
    return (a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.isnan(), b.isnan())
            and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0)))


def run_case(case, device: str = "cuda") -> Verdict:
    """The verdict on `case` run on `device` ("cuda" or "cpu", where fa4lab computes the float64
    reference): see the module docstring."""
    start = time.perf_counter()

    def verdict(v: Verdict) -> Verdict:
        if v.kind == "fault" and device != "cpu" and context_alive():
            v = Verdict("failure", (*v.problems, "(the CUDA context survived it)"),
                        traceback=v.traceback)
        return Verdict(v.kind, v.problems, v.message, v.traceback, time.perf_counter() - start)

    try:
        inputs = case_inputs(case, device)
    except Exception as err:
        if is_cuda_fault(err):
            return verdict(classify(err))
        return verdict(Verdict("failure", (f"making the inputs raised {_said(err)} (a fuzzer "
                                           f"bug)",), traceback=traceback.format_exc()))
    runs = []
    for _ in range(2):
        got = _guarded(lambda: call(case, inputs), device)
        if isinstance(got, Verdict):
            return verdict(got)
        runs.append(got)
    try:
        problems = judge(case, inputs, *runs)
        if device != "cpu":
            import torch

            torch.cuda.synchronize()
    except Exception as err:
        if is_cuda_fault(err):
            return verdict(classify(err))
        return verdict(Verdict("failure", (f"checking the result raised {_said(err)}",),
                               traceback=traceback.format_exc()))
    return verdict(Verdict("failure", tuple(problems)) if problems else Verdict("pass"))


def judge(case, inputs, first, second=None) -> list[str]:
    """What of the acceptance rule the result `first` (out, lse or None) of `case` on
    `inputs` breaks (empty: it passes); `second`, a second run's result, must equal it."""
    problems = []
    if second is not None and not (_same_bits(first[0], second[0])
                                   and _same_bits(first[1], second[1])):
        problems.append("two runs on the same inputs differ")
    check = _judge_dense if case.entry in DENSE_ENTRIES else _judge_varlen
    return problems + check(case, inputs, *first)


def _options(case, inputs) -> dict:
    return dict(causal=case.causal, softmax_scale=case.softmax_scale,
                window_size=tuple(case.window_size), softcap=case.softcap,
                learnable_sink=inputs.learnable_sink)


def _atol(case, v) -> float:
    """ATOL, or one output ulp with extreme logits (Note [extreme logits] in
    fa4lab.acceptance)."""
    return output_ulp_atol(v, case.dtype) if case.q_scale > 1.0 else ATOL


def _shape_problems(out, lse, q, want_out: tuple, want_lse: tuple | None) -> list[str]:
    import torch

    problems = []
    if tuple(out.shape) != want_out or out.dtype != q.dtype:
        problems.append(f"out is {tuple(out.shape)} {out.dtype}, expected {want_out} {q.dtype}")
    if want_lse is not None and (lse is None or tuple(lse.shape) != want_lse
                                 or lse.dtype != torch.float32):
        got = None if lse is None else (tuple(lse.shape), lse.dtype)
        problems.append(f"lse is {got}, expected {want_lse} torch.float32")
    return problems


def _sees_dense(case, inputs, batch: int, sq: int, sk: int, device):
    """(batch, sq, heads_q) bool: the rows that see a key (causal, window and mask_mod)."""
    import torch

    from fa4lab.mods import check_mods
    from fa4lab.reference import visible_mask

    hq = case.heads_q
    mask = torch.as_tensor(visible_mask(sq, sk, case.causal, window_size=tuple(
        case.window_size)), device=device)
    if inputs.mask_mod is None:
        return mask.any(1)[None, :, None].expand(batch, sq, hq)
    mods, aux = check_mods(None, inputs.mask_mod, inputs.aux_tensors, device)
    idx = [torch.arange(n, device=device).view([n if i == j else 1 for j in range(4)])
           for i, n in enumerate((batch, hq, sq, sk))]
    visible = torch.broadcast_to(mask[None, None] & mods.mask(*idx, aux), (batch, hq, sq, sk))
    return visible.any(-1).transpose(1, 2)


def _judge_dense(case, inputs, out, lse) -> list[str]:
    """The rule on a `fa4lab.attention` result: check_kernel's, on the dense (or gathered)
    K/V."""
    import torch

    from fa4lab.reference import attention_reference
    from fa4lab.varlen import gather_paged, paged_seqlen_k

    q, k, v = inputs.q, inputs.k, inputs.v
    batch, sq, hq, _ = q.shape
    if inputs.page_table is not None:
        keys = [paged_seqlen_k(k, inputs.page_table)] * batch
        k, v = (torch.stack(gather_paged(c, inputs.page_table, keys)) for c in (k, v))
    problems = _shape_problems(out, lse, q, (batch, sq, hq, v.shape[-1]),
                               (batch, hq, sq) if case.return_lse else None)
    if problems:
        return problems
    options = dict(_options(case, inputs), score_mod=inputs.score_mod,
                   mask_mod=inputs.mask_mod, aux_tensors=inputs.aux_tensors)
    ref, ref_lse = attention_reference(q, k, v, return_lse=True, **options)
    sees = _sees_dense(case, inputs, batch, sq, k.shape[1], q.device)
    pt = same_dtype_yardstick(q, k, v, **options) if sees.any() else None
    rows = (lse.transpose(1, 2), ref_lse.transpose(1, 2)) if lse is not None else (None, None)
    return rule_violations(out, ref, sees, pt, lse=rows[0], ref_lse=rows[1],
                           atol=_atol(case, v))


def _sequence_reference(q_b, k_b, v_b, options):
    """float64 (out, lse (heads, rows)) of one sequence's rows on its keys."""
    from fa4lab.reference import attention_reference

    out, lse = attention_reference(q_b[None], k_b[None], v_b[None], return_lse=True, **options)
    return out[0], lse[0]


def _unused_rows(out, lse, inputs, rows: slice, b: int) -> list[str]:
    """Rows past a sequence's seqused_q: 0, and LSE -inf or the sink's logit."""
    import torch

    problems = []
    if rows.stop > rows.start:
        if not (out[rows] == 0).all():
            problems.append(f"sequence {b}: rows past seqused_q are not 0")
        if lse is not None:
            sink = inputs.learnable_sink
            want = (torch.full_like(lse[:, rows], -float("inf")) if sink is None
                    else sink[:, None].float().expand_as(lse[:, rows]))
            if not torch.allclose(lse[:, rows], want, atol=LSE_ATOL, rtol=LSE_RTOL):
                problems.append(f"sequence {b}: LSE past seqused_q is not -inf (or the sink)")
    return problems


def _judge_varlen(case, inputs, out, lse) -> list[str]:
    """The rule on an `attention_varlen` result: check_sequences', sequence by sequence."""
    import torch

    from fa4lab.reference import attention_varlen_reference, visible_mask
    from fa4lab.varlen import check_varlen, sequence_kv

    q, k, v = inputs.q, inputs.k, inputs.v
    total_q, hq, _ = q.shape
    problems = _shape_problems(out, lse, q, (total_q, hq, v.shape[-1]),
                               (hq, total_q) if case.return_lse else None)
    if problems:
        return problems
    index = dict(seqused_k=inputs.seqused_k, page_table=inputs.page_table)
    lengths = check_varlen(q, k, v, inputs.cu_seqlens_q, inputs.cu_seqlens_k, None, None,
                           **index)
    options = _options(case, inputs)
    ref, ref_lse = attention_varlen_reference(q, k, v, inputs.cu_seqlens_q,
                                              inputs.cu_seqlens_k, return_lse=True, **index,
                                              **options)
    cu, atol = lengths.cu_seqlens_q, _atol(case, v)
    for b, ((k_b, v_b), lk) in enumerate(zip(sequence_kv(lengths, k, v, inputs.page_table),
                                             lengths.seqlens_k)):
        lq = cu[b + 1] - cu[b]
        if case.seqused_q is not None:      # its first rows; the rest give what no key gives
            used = min(max(case.seqused_q[b], 0), lq)
            problems += _unused_rows(out, lse, inputs, slice(cu[b] + used, cu[b + 1]), b)
            if used and lk:
                ref[cu[b]:cu[b] + used], rows_lse = _sequence_reference(
                    q[cu[b]:cu[b] + used], k_b, v_b, options)
                ref_lse[:, cu[b]:cu[b] + used] = rows_lse
            lq = used
        if lq == 0:
            continue
        rows = slice(cu[b], cu[b] + lq)
        sees = torch.zeros(lq, dtype=torch.bool, device=q.device)
        if lk:
            sees = torch.as_tensor(visible_mask(lq, lk, case.causal, window_size=tuple(
                case.window_size)).any(axis=1), device=q.device)
        sees = sees[:, None].expand(lq, hq)
        pt = torch_same_dtype(q[rows][None], k_b[None], v_b[None], **options)[0] \
            if sees.any() else None
        lse_rows = (lse[:, rows].T, ref_lse[:, rows].T) if lse is not None else (None, None)
        problems += rule_violations(out[rows], ref[rows], sees, pt, lse=lse_rows[0],
                                    ref_lse=lse_rows[1], atol=atol,
                                    where=f"sequence {b} (len_q {lq}, len_k {lk}): ")
    return problems
