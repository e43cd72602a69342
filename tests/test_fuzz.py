"""The fuzzer's CPU half (`fa4lab.fuzz`): its draws, their JSON, its judge and its command line.

No GPU and no compile: on CPU tensors `fa4lab.attention` is the float64 reference cast back to
the dtype, so a drawn case must pass there, and an answer broken on purpose (one row off, a
NaN, a row that sees no key not 0, an LSE off) must fail the judge. Exceptions are sorted as
Note [refusals] in fa4lab.fuzz.judge says. The GPU half is `make fuzz-gpu`.
"""

from __future__ import annotations

import json
import math
import shlex
import warnings

import pytest

torch = pytest.importorskip("torch")

from fa4lab.errors import InputError, PlanError  # noqa: E402
from fa4lab.fuzz import cases, cli, judge  # noqa: E402
from fa4lab.fuzz.cases import Case, draw_case, from_json, parse_replay, to_json  # noqa: E402
from fa4lab.fuzz.inputs import call, case_inputs  # noqa: E402
from fa4lab.limits import ALL_HEAD_DIMS, covering_head_dims  # noqa: E402

DRAWS = 300


@pytest.fixture(scope="module")
def drawn():
    return [draw_case(0, i) for i in range(DRAWS)]


def _cpu_call(case, inputs):
    from fa4lab.api import SlowReferenceWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowReferenceWarning)
        return call(case, inputs)


# ---- the draws -------------------------------------------------------------------------------

def test_a_case_is_a_pure_function_of_seed_and_index():
    alone = draw_case(3, 17)
    in_order = [draw_case(3, i) for i in range(18)][-1]
    assert alone == in_order == draw_case(3, 17)
    assert alone != draw_case(3, 18) and alone != draw_case(4, 17)
    a, b = (case_inputs(draw_case(5, 2, size="tiny"), "cpu") for _ in range(2))
    assert torch.equal(a.q, b.q) and torch.equal(a.v, b.v), "the values come from the case"


def test_the_draws_cover_every_axis(drawn):
    def seen(field):
        return {getattr(c, field) for c in drawn}

    assert seen("entry") == set(cases.ENTRIES)
    pairs = {(c.head_dim, c.head_dim_v) for c in drawn}
    assert {covering_head_dims("sm90", *p) for p in pairs} == set(ALL_HEAD_DIMS)
    assert pairs - set(ALL_HEAD_DIMS), "head dims the kernels run padded"
    assert any(c.seqused_q is not None for c in drawn)
    assert any(s is not None and s < 0 for c in drawn for s in c.window_size), "a negative side"
    assert {1, 2, 4, 8} <= seen("page_size"), "pages below a swizzle atom"
    assert seen("layout") == set(cases.LAYOUTS)
    assert seen("dtype") == {"bf16", "fp16"}
    for field in ("causal", "learnable_sink", "return_lse"):
        assert seen(field) == {False, True}, field
    assert {c.heads_q // c.heads_kv for c in drawn} == set(cases.GQA_RATIOS)
    assert seen("heads_kv") == {1, 2, 3, 4}
    sides = {(c.causal, tuple(s is not None for s in c.window_size)) for c in drawn}
    assert {(False, (True, False)), (False, (False, True)), (False, (True, True)),
            (True, (True, False))} <= sides
    assert any(c.window_size[0] not in (None, c.window_size[1]) and c.window_size[1] is not None
               for c in drawn), "an asymmetric window"
    assert seen("softcap") - {0.0} and seen("softmax_scale") - {None}
    assert seen("mod") - {None}
    assert {None, True, False} <= seen("pack_gqa")
    assert None in seen("num_splits") and any((n or 0) > 1 for n in seen("num_splits"))
    assert set(cases.PAGE_SIZES) < seen("page_size") - {None}, "and a size the kernels refuse"
    assert any(0 in c.seqlens_q for c in drawn) and any(0 in c.keys for c in drawn)
    assert any(1 in c.seqlens_q for c in drawn) and any(1 in c.keys for c in drawn)
    assert any(c.seqused_k is not None for c in drawn)
    assert any(max(c.seqlens_q + c.keys) > 2048 for c in drawn), "a long sequence, now and then"
    assert max(max(c.seqlens_q + c.seqlens_k) for c in drawn) <= 5000
    assert any(c.q_scale >= 30 for c in drawn), "extreme logits"
    assert any(c.entry == "dense" and c.causal and c.seqlens_q[0] > c.seqlens_k[0]
               for c in drawn), "rows that see no key"
    split = [c for c in drawn if c.entry == "paged_split"]
    assert split and all(c.seqlens_q[0] <= 4 for c in split), "decode shapes"


def test_the_cases_take_a_bounded_pool_of_kernel_configurations(drawn):
    """Note [a bounded pool of kernels]: the options that pick a kernel come from POOL_SIZE
    slots; configs=0 draws them per case."""
    def kernel(c):
        return (c.entry, c.dtype, covering_head_dims("sm90", c.head_dim, c.head_dim_v),
                c.causal, c.softcap > 0,
                tuple(s is not None for s in c.window_size), c.learnable_sink, c.return_lse,
                c.heads_q // c.heads_kv, c.pack_gqa, c.mod, c.page_size, c.num_splits is None)

    assert len({kernel(c) for c in drawn}) <= cases.POOL_SIZE
    free = [draw_case(0, i, configs=0) for i in range(100)]
    assert len({kernel(c) for c in free}) > cases.POOL_SIZE


def test_tiny_cases_stay_tiny():
    for i in range(200):
        c = draw_case(1, i, size="tiny")
        assert max(c.seqlens_q + c.seqlens_k) <= 64 and c.batch <= 3, c.describe()


# ---- JSON and replay -------------------------------------------------------------------------

def test_a_case_survives_json_and_the_replay_parser(drawn, tmp_path):
    for case in drawn[:50]:
        text = to_json(case)
        assert "\n" not in text and from_json(text) == case
    case = drawn[7]
    assert parse_replay(to_json(case)) == case
    record = tmp_path / "seed0-case7.json"
    record.write_text(json.dumps({"case": json.loads(to_json(case)), "verdict": "failure"}))
    assert parse_replay(str(record)) == case
    line = cli.replay_line(case, "cpu")
    words = shlex.split(line)
    assert words[:4] == ["python", "-m", "fa4lab.fuzz", "--replay"] and words[-2:] == [
        "--device", "cpu"]
    assert parse_replay(words[4]) == case
    for bad, says in (("{not json", "not valid JSON"), ("no/such/file.json", "nor a file"),
                      ('{"seed": 1, "colour": 2}', "not fields of a fuzz case"),
                      ('{"seed": 1}', "not a fuzz case")):
        with pytest.raises(ValueError, match=says):
            parse_replay(bad)


# ---- the judge -------------------------------------------------------------------------------

def test_small_drawn_cases_pass_on_the_cpu_reference_path():
    picked = {}
    for i in range(400):
        c = draw_case(2, i, size="tiny")
        picked.setdefault((c.entry, c.layout), c)
    assert {entry for entry, _ in picked} == set(cases.ENTRIES)
    for case in list(picked.values())[:18]:
        verdict = judge.run_case(case, "cpu")
        assert verdict.kind in ("pass", "refusal"), (case.describe(), verdict)
        assert verdict.kind == "pass" or "InputError" in verdict.message, verdict


# Dense, causal with seqlen_q > seqlen_k: the first 8 rows of every head see no key.
MASKED = Case(seed=0, index=0, entry="dense", dtype="bf16", head_dim=64, head_dim_v=64,
              heads_q=4, heads_kv=2, seqlens_q=(20, 20), seqlens_k=(12, 12), causal=True,
              data_seed=11, size="tiny")
VARLEN = Case(seed=0, index=1, entry="varlen", dtype="fp16", head_dim=128, head_dim_v=128,
              heads_q=4, heads_kv=1, seqlens_q=(5, 0, 9, 1), seqlens_k=(7, 3, 0, 1),
              learnable_sink=True, data_seed=12, size="tiny")


@pytest.mark.parametrize("case", [MASKED, VARLEN], ids=["dense", "varlen"])
def test_the_judge_fails_a_broken_answer(case):
    inputs = case_inputs(case, "cpu")
    out, lse = _cpu_call(case, inputs)
    assert judge.judge(case, inputs, (out, lse), (out.clone(), lse.clone())) == []

    def problems(edit_out=None, edit_lse=None):
        o, s = out.clone(), lse.clone()
        if edit_out:
            edit_out(o)
        if edit_lse:
            edit_lse(s)
        return " | ".join(judge.judge(case, inputs, (o, s)))

    row = (0, 10, 1) if case.entry == "dense" else (2, 1)        # a row that sees keys
    empty = (0, 3, 2) if case.entry == "dense" else (7, 0)       # a row that sees none
    lse_row = (0, 1, 10) if case.entry == "dense" else (1, 2)
    lse_empty = (0, 2, 3) if case.entry == "dense" else (0, 7)

    def at(index, value):
        def edit(t):
            t[index] = value
        return edit

    assert "error" in problems(edit_out=at(row, out[row] + 0.05))
    assert "NaN" in problems(edit_out=at(row + (0,), math.nan))
    assert "not exactly 0" in problems(edit_out=at(empty + (0,), 1e-3))
    assert "LSE error" in problems(edit_lse=at(lse_row, lse[lse_row] + 0.05))
    if case.entry == "dense":
        assert "other than -inf" in problems(edit_lse=at(lse_empty, 0.0))
    else:     # with a sink, a row that sees no key has the sink's logit, to the tolerance
        assert "LSE error" in problems(edit_lse=at(lse_empty, lse[lse_empty] - 1.0))
        assert "sequence 3" in problems(edit_out=at((14, 1), out[14, 1] + 0.05))
    other = out.clone()
    other[row] += 2 ** -6
    assert "two runs" in " ".join(judge.judge(case, inputs, (out, lse), (other, lse)))
    wrong = judge.judge(case, inputs, (out[..., :-1], lse))
    assert wrong and "expected" in wrong[0]


def _raise_in(filename: str, error: BaseException):
    """Raise `error` from a function whose code claims to live in `filename`."""
    scope = {"error": error}
    exec(compile("def f():\n    raise error\n", filename, "exec"), scope)
    try:
        scope["f"]()
    except BaseException as err:
        return err
    raise AssertionError("did not raise")


def test_refusals_failures_and_faults():
    """Note [refusals]: a documented fa4lab error raised before launch is a refusal; inside
    tvm_ffi or the DSL, or any other exception, a failure; a CUDA error a fault."""
    refused = judge.classify(_raise_in("fa4lab/spec.py", InputError("q has shape (1, 2)")))
    assert refused.kind == "refusal" and refused.message == "InputError: q has shape (1, 2)"
    assert judge.classify(_raise_in("fa4lab/plan/sm90.py", PlanError("too big"))).kind == \
        "refusal"
    inside = judge.classify(_raise_in("site-packages/nvidia_cutlass_dsl/cutlass/base.py",
                                      InputError("x")))
    assert inside.kind == "failure" and "inside the launch" in inside.problems[0]
    try:
        try:
            raise _raise_in("site-packages/tvm_ffi/core.py", RuntimeError("launch"))
        except RuntimeError as err:
            raise InputError("re-raised") from err
    except InputError as err:
        assert judge.classify(err).kind == "failure", "raised from an error of the launch"
    plain = judge.classify(_raise_in("fa4lab/spec.py", ValueError("bad")))
    assert plain.kind == "failure" and "not an fa4lab error" in plain.problems[0]
    fault = judge.classify(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert fault.kind == "fault"
    if hasattr(torch, "AcceleratorError"):
        try:
            raise torch.AcceleratorError("CUDA error: unspecified launch failure")
        except TypeError:       # its constructor is not public in every torch
            pass
        except torch.AcceleratorError as err:
            assert judge.classify(err).kind == "fault"


def test_run_case_sorts_what_the_call_raises(monkeypatch):
    case = draw_case(0, 3, size="tiny")
    for error, kind in ((InputError("page_size=48 does not fit"), "refusal"),
                        (TypeError("unexpected keyword"), "failure")):
        def raising(case, inputs, error=error):
            raise error

        monkeypatch.setattr(judge, "call", raising)
        verdict = judge.run_case(case, "cpu")
        assert verdict.kind == kind, verdict
        assert verdict.kind == "refusal" or verdict.traceback


# ---- the command line ------------------------------------------------------------------------

def test_refusal_key_groups_by_message_without_numbers():
    key = cli.refusal_key("PlanError: page_size=48 does not fit key blocks of 128 rows (sm90, "
                          "bf16, 1e-05, -3.5, 16-byte)")
    assert key == ("PlanError: page_size=N does not fit key blocks of N rows (sm90, bf16, N, "
                   "N, N-byte)")


def test_a_cuda_run_without_a_gpu_says_so(monkeypatch, capsys):
    import fa4lab.environment

    monkeypatch.setattr(fa4lab.environment, "gpu", lambda: None)
    assert cli.main(["--seconds", "20", "--seed", "0"]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "--device cpu" in err


def test_a_cpu_smoke_run_and_a_saved_failure(monkeypatch, capsys, tmp_path):
    assert cli.main(["--device", "cpu", "--seed", "4", "--cases", "5", "--out",
                     str(tmp_path)]) == 0
    said = capsys.readouterr().out
    assert "5 cases" in said and "0 failed" in said
    assert not list(tmp_path.glob("in-flight*.json"))

    def failing(case, device):
        return judge.Verdict("failure", ("error 0.5 > 2 x PyTorch's",))

    monkeypatch.setattr(judge, "run_case", failing)
    assert cli.main(["--device", "cpu", "--seed", "4", "--cases", "2", "--out",
                     str(tmp_path)]) == 1
    said = capsys.readouterr().out
    record = json.loads((tmp_path / "seed4-case1.json").read_text())
    assert record["verdict"] == "failure" and from_json(record) == draw_case(4, 1, size="tiny")
    assert record["replay"] in said and "FAILURE case 1" in said
