"""`fa4lab bench --training` on a CPU: the CPU config trained with fa4lab's attention (the
float64 reference and its backward) and with SDPA gives the same curve within the noise; a wrong
attention (no causal mask, the softmax scale x 1.1) is caught; the record validates, loads and
plots; the command runs with --device cpu and says what it would do without it."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from fa4lab.bench import TRAINING, load_records, training_results_of, validate_record
from fa4lab.bench.training import (
    ATTENTIONS,
    FACTOR,
    TrainConfig,
    compare,
    initial_state,
    judge,
    make_batches,
    make_training_record,
    train,
    verdict_line,
    window_of,
)
from fa4lab.cli import main
from fa4lab.environment import gpu

CPU = TrainConfig.for_device("cpu")     # 2 layers, hidden 64, seqlen 32, 20 steps, float32


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices: one thread is as fast as two, and far faster where the cores are shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def comparison():
    return compare(CPU)


def test_the_cpu_config_is_tiny_and_the_gpu_config_a_kernel_shape():
    assert (CPU.layers, CPU.hidden, CPU.seqlen, CPU.steps, CPU.dtype) == (2, 64, 32, 20, "fp32")
    cfg = TrainConfig.for_device("cuda", steps=None, layers=2)
    assert (cfg.layers, cfg.steps, cfg.dtype, cfg.head_dim) == (2, 200, "bf16", 64)
    with pytest.raises(ValueError, match="heads"):
        TrainConfig(hidden=64, heads=4, heads_kv=3)
    with pytest.raises(ValueError, match="steps"):
        TrainConfig.for_device("cpu", steps=0)


def test_same_seed_same_data_and_init_and_the_second_half_repeats_the_first():
    a, b = make_batches(CPU), make_batches(CPU)
    assert a.shape == (CPU.steps, CPU.batch, CPU.seqlen + 1) and torch.equal(a, b)
    assert not torch.equal(a, make_batches(replace(CPU, seed=1)))
    half = (CPU.seqlen + 2) // 2
    assert torch.equal(a[..., half:], a[..., : CPU.seqlen + 1 - half])
    s1, s2 = initial_state(CPU), initial_state(CPU)
    assert all(torch.equal(s1[k], s2[k]) for k in s1)


def test_fa4lab_and_sdpa_curves_agree_and_the_loss_falls(comparison):
    losses, v = comparison.losses, comparison.verdict
    assert {r.status for r in comparison.results.values()} == {"ok"}
    assert v is not None and v.within_noise, verdict_line(vars(v))
    for curve in losses.values():
        assert len(curve) == CPU.steps
        # from ln(vocab) at init to well below it: the chain and the repeat are learnt
        assert curve[0] == pytest.approx(math.log(CPU.vocab), abs=0.2)
        assert sum(curve[-5:]) / 5 < curve[0] - 0.5
    # float32: fa4lab's float64 reference rounds once, as sdpa-wide does
    assert v.max_diff < 1e-4


def _sdpa_wrong(*, causal=True, scale=1.0):
    def attend(q, k, v):
        return F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
            scale=scale / math.sqrt(q.shape[-1])).transpose(1, 2)
    return attend


@pytest.mark.parametrize("wrong", [dict(causal=False), dict(scale=1.1)],
                         ids=["not-causal", "scale-x1.1"])
def test_a_wrong_attention_is_caught(comparison, wrong):
    bad = train(CPU, _sdpa_wrong(**wrong), name="wrong")
    losses = comparison.losses
    v = judge(bad.losses, losses["sdpa"], losses["sdpa-wide"], CPU.dtype)
    assert not v.within_noise and v.worst_diff > v.worst_tol
    assert verdict_line(vars(v)).startswith("NOT within fp32 noise")


def test_the_rule_on_synthetic_curves():
    base = [3.0 - 0.01 * i for i in range(40)]
    wobble = [x + 1e-3 * (-1) ** i for i, x in enumerate(base)]
    assert window_of(40) == 4 and window_of(200) == 20 and window_of(3) == 3
    assert judge(wobble, base, wobble, "bf16").within_noise
    # FACTOR x the noise passes, twice that fails
    assert judge([x + 0.9 * FACTOR * 1e-3 for x in base], base, wobble, "bf16").within_noise
    assert not judge([x + 2 * FACTOR * 1e-3 for x in base], base, wobble, "bf16").within_noise
    # no noise at all: only float32's resolution of the loss
    assert judge(base, base, base, "fp32").within_noise
    assert not judge([x + 1e-5 for x in base], base, base, "fp32").within_noise
    with pytest.raises(ValueError, match="steps"):
        judge(base, base[:-1], base, "bf16")


def test_gqa_trains_with_both_attentions():
    cfg = replace(CPU, heads=4, heads_kv=2, steps=6)
    cmp = compare(cfg)
    assert cmp.verdict.within_noise, verdict_line(vars(cmp.verdict))


def test_the_record_validates_saves_loads_and_plots(comparison, tmp_path):
    from fa4lab.bench import save_record
    from fa4lab.viz.training import plot_training

    rec = make_training_record(comparison, gpu_name="cpu", arch=None, command="test")
    assert rec["kind"] == TRAINING and rec["verdict"]["within_noise"] is True
    assert rec["config"]["steps"] == CPU.steps and rec["config"]["head_dim"] == 16
    save_record(rec, tmp_path / "t.json")
    (loaded,) = load_records(tmp_path, kinds=(TRAINING,))
    assert [r.provider for r in training_results_of(loaded)] == ["fa4lab", "sdpa", "sdpa-wide"]
    assert load_records(tmp_path) == []        # not a throughput record
    plot_training(loaded).savefig(tmp_path / "t.png")
    for spoil, match in ((lambda r: r["results"][0]["losses"].pop(), "losses"),
                         (lambda r: r["results"][1]["losses"].__setitem__(0, float("nan")),
                          "finite"),
                         (lambda r: r.pop("verdict"), "verdict"),
                         (lambda r: r["verdict"].pop("within_noise"), "within_noise"),
                         (lambda r: r["results"][2].__setitem__("ms_per_step", None),
                          "ms_per_step")):
        bad = json.loads(json.dumps(rec))
        spoil(bad)
        with pytest.raises(ValueError, match=match):
            validate_record(bad)


def test_a_run_that_raises_is_recorded_as_an_error():
    def raises(q, k, v):
        raise RuntimeError("no kernel")

    cmp = compare(replace(CPU, steps=2), {**ATTENTIONS, "fa4lab": raises})
    assert cmp.results["fa4lab"].status == "error" and "no kernel" in cmp.results["fa4lab"].note
    assert cmp.verdict is None
    rec = make_training_record(cmp, gpu_name="cpu", arch=None, command="test")
    assert rec["verdict"]["within_noise"] is False


def test_the_command_trains_on_the_cpu_and_saves_where_asked(tmp_path, capsys):
    out = tmp_path / "train.json"
    assert main(["bench", "--training", "--device", "cpu", "--steps", "6", "--json",
                 str(out)]) == 0
    text = capsys.readouterr().out
    assert "| step | loss fa4lab | loss sdpa | abs diff |" in text
    assert "within fp32 noise" in text and f"record saved: {out}" in text
    rec = validate_record(json.loads(out.read_text()))
    assert rec["config"]["steps"] == 6
    assert rec["command"] == f"fa4lab bench --json {out} --training --steps 6 --device cpu"
    assert out.with_suffix(".png").exists()


@pytest.mark.skipif(gpu() is not None, reason="checks the CPU path of the command")
def test_the_command_without_a_gpu_says_what_it_would_run(capsys):
    assert main(["bench", "--training"]) == 0
    text = capsys.readouterr().out
    assert "no CUDA GPU visible" in text and "4-layer decoder" in text and "200 steps" in text
    assert main(["bench", "--training", "--device", "cuda"]) == 2
    assert main(["bench", "--training", "--seqlen", "64"]) == 2
    assert main(["bench", "--decode", "--layers", "3"]) == 2
    assert main(["bench", "--training", "--serving"]) == 2


def test_the_command_with_the_gpu_faked(monkeypatch, tmp_path, capsys):
    """The GPU path (the GPU's name and arch in the record, --plot, --strict) with the device
    faked and the CPU config trained: the flow is tested here, not the kernels."""
    from fa4lab import environment
    from fa4lab.bench import training

    monkeypatch.setattr(environment, "gpu", lambda: environment.GpuInfo("Fake H200", (9, 0)))
    asked = []

    def for_device(device, **overrides):
        asked.append(device)
        return replace(CPU, **{k: v for k, v in overrides.items() if v is not None})

    monkeypatch.setattr(training.TrainConfig, "for_device", staticmethod(for_device))
    out, plot = tmp_path / "r.json", tmp_path / "curves.png"
    argv = ["bench", "--training", "--steps", "5", "--layers", "1", "--json", str(out),
            "--plot", str(plot), "--strict"]
    assert main(argv) == 0 and asked == ["cuda"]
    text = capsys.readouterr().out
    assert "fa4lab bench --training on Fake H200" in text and f"plot saved: {plot}" in text
    rec = validate_record(json.loads(out.read_text()))
    assert (rec["gpu"], rec["arch"], rec["config"]["layers"]) == ("Fake H200", "sm90", 1)
    assert plot.exists()
    monkeypatch.setattr(training, "ATTENTIONS", {**ATTENTIONS,
                                                 "fa4lab": _sdpa_wrong(causal=False)})
    assert main(argv[:-5] + ["--no-save", "--strict"]) == 1   # not within the noise
    assert "NOT within fp32 noise" in capsys.readouterr().out
