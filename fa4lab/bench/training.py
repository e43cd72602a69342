"""`fa4lab bench --training`: a small transformer trained with fa4lab's attention and with SDPA.

    from fa4lab.bench.training import TrainConfig, compare
    cmp = compare(TrainConfig.for_device("cuda"))
    cmp.verdict.within_noise, cmp.losses["fa4lab"], cmp.losses["sdpa"]

A decoder-only transformer (embedding, learned positions, `layers` pre-norm blocks of causal
self-attention and an MLP, a head tied to the embedding) is trained from one seed on one data
stream, once per attention: "fa4lab" calls `fa4lab.attention(q, k, v, causal=True)` on
(batch, seqlen, heads, head_dim) tensors, "sdpa" calls
`torch.nn.functional.scaled_dot_product_attention(is_causal=True)` on the transposed views, and
"sdpa-wide" is SDPA computed one precision up (Note [bf16 noise]). The data is a fixed random
Markov chain whose every sequence repeats its first half (`make_batches`): the first half is
learnt from bigram statistics, the second only by attending back, so the attention matters.
AdamW, bf16 autocast over float32 parameters (or float32 throughout), warm-up then cosine.

Constraints: on a GPU fa4lab's backward runs on Hopper only (sm90, head dims of
`fa4lab.limits.KERNEL_HEAD_DIMS`); on a CPU `fa4lab.attention` differentiates the float64
reference, slow but fine at the CPU config's sizes (`TrainConfig.for_device("cpu")`).
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from fa4lab.bench.records import (
    ERROR,
    FAILED,
    OK,
    TRAINING,
    TrainingResult,
    record_header,
    validate_record,
)

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
OURS, PEER, WIDE = "fa4lab", "sdpa", "sdpa-wide"
DTYPES = ("bf16", "fp32")


@dataclass(frozen=True)
class TrainConfig:
    """One training run's sizes and optimizer; `for_device` gives the defaults of a device."""

    layers: int = 4
    hidden: int = 512
    heads: int = 8
    heads_kv: int | None = None      # None: heads (no GQA)
    seqlen: int = 512
    batch: int = 16
    vocab: int = 256
    steps: int = 200
    lr: float = 3e-3
    weight_decay: float = 0.1
    warmup: int = 20
    seed: int = 0
    dtype: str = "bf16"              # "bf16": autocast over float32 params; "fp32" throughout
    device: str = "cuda"

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: choose from {DTYPES}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"hidden {self.hidden} must split into {self.heads} heads and "
                             f"heads into {self.kv_heads} K/V heads")
        for name in ("layers", "steps", "seqlen", "batch", "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def kv_heads(self) -> int:
        return self.heads_kv or self.heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @classmethod
    def for_device(cls, device: str, **overrides) -> TrainConfig:
        """The GPU config (4 layers, hidden 512 as 8 heads of 64, seqlen 512, batch 16, bf16),
        or on a CPU a tiny one (2 layers, hidden 64, seqlen 32, batch 16, 20 steps, float32:
        the reference attention is float64 and slow); `overrides` (None ignored) on top."""
        base = cls(device=device) if device.startswith("cuda") else cls(
            layers=2, hidden=64, heads=4, seqlen=32, batch=16, vocab=32, steps=20, warmup=4,
            lr=5e-3, dtype="fp32", device=device)
        return replace(base, **{k: v for k, v in overrides.items() if v is not None})


# ---- the attentions --------------------------------------------------------------------------
def fa4lab_attention(q, k, v):
    """(batch, seqlen, heads, head_dim) in and out."""
    import fa4lab

    return fa4lab.attention(q, k, v, causal=True)


def sdpa_attention(q, k, v):
    """SDPA on the (batch, heads, seqlen, head_dim) views of the same tensors."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                         v.transpose(1, 2), is_causal=True,
                                         enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


_WIDER = {torch.bfloat16: torch.float32, torch.float16: torch.float32,
          torch.float32: torch.float64}


def sdpa_wide_attention(q, k, v):
    """SDPA one precision up (bf16 -> float32, float32 -> float64), rounded back to q's dtype:
    the same attention, rounded differently (Note [bf16 noise])."""
    wide = _WIDER.get(q.dtype, q.dtype)
    with torch.autocast(q.device.type, enabled=False):
        out = sdpa_attention(q.to(wide), k.to(wide), v.to(wide))
    return out.to(q.dtype)


ATTENTIONS: dict[str, Attention] = {OURS: fa4lab_attention, PEER: sdpa_attention,
                                    WIDE: sdpa_wide_attention}


# ---- the model and the data ------------------------------------------------------------------
class Block(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x)); the attention is the model's `attend`."""

    def __init__(self, cfg: TrainConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.norm1, self.norm2 = nn.LayerNorm(cfg.hidden), nn.LayerNorm(cfg.hidden)
        self.qkv = nn.Linear(cfg.hidden, (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim,
                             bias=False)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.mlp = nn.Sequential(nn.Linear(cfg.hidden, 4 * cfg.hidden), nn.GELU(),
                                 nn.Linear(4 * cfg.hidden, cfg.hidden))

    def forward(self, x, attend: Attention):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim,
             self.kv_heads * self.head_dim], dim=-1)
        q = q.view(b, s, self.heads, self.head_dim)
        k, v = (t.view(b, s, self.kv_heads, self.head_dim) for t in (k, v))
        x = x + self.proj(attend(q, k, v).reshape(b, s, -1))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """Token and position embeddings, `layers` blocks, a final norm, the tied head."""

    def __init__(self, cfg: TrainConfig):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = nn.Parameter(0.02 * torch.randn(cfg.seqlen, cfg.hidden))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.hidden)
        nn.init.normal_(self.embed.weight, std=0.02)
        for blk in self.blocks:   # GPT-2's scaled init of the residual projections
            for lin in (blk.proj, blk.mlp[2]):
                nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * cfg.layers))
        self.attend: Attention = sdpa_attention

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for blk in self.blocks:
            x = blk(x, self.attend)
        return self.norm(x) @ self.embed.weight.t()


def make_batches(cfg: TrainConfig) -> torch.Tensor:
    """(steps, batch, seqlen + 1) int64 tokens on the CPU, from cfg.seed alone: a random Markov
    chain (each token has 4 successors, with random probabilities) run for half a sequence,
    then repeated, so the second half is predictable by attending back to the first."""
    g = torch.Generator().manual_seed(cfg.seed)
    successors = torch.randint(cfg.vocab, (cfg.vocab, 4), generator=g)
    probs = torch.softmax(2.0 * torch.randn(cfg.vocab, 4, generator=g), dim=-1)
    n, half = cfg.steps * cfg.batch, (cfg.seqlen + 2) // 2
    state = torch.randint(cfg.vocab, (n,), generator=g)
    chain = [state]
    for _ in range(half - 1):
        pick = torch.multinomial(probs[state], 1, generator=g).squeeze(1)
        state = successors[state, pick]
        chain.append(state)
    block = torch.stack(chain, dim=1)
    return torch.cat([block, block], dim=1)[:, : cfg.seqlen + 1].view(
        cfg.steps, cfg.batch, cfg.seqlen + 1)


def initial_state(cfg: TrainConfig) -> dict[str, torch.Tensor]:
    """The parameters every run starts from (CPU, float32), from cfg.seed alone."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        return TinyLM(cfg).state_dict()


# ---- one run ---------------------------------------------------------------------------------
def train(cfg: TrainConfig, attend: Attention, batches: torch.Tensor | None = None,
          state: Mapping[str, torch.Tensor] | None = None, *, name: str = "") -> TrainingResult:
    """Train `TinyLM(cfg)` with `attend` from `state` (default `initial_state(cfg)`) on
    `batches` (default `make_batches(cfg)`): the loss of every step. An exception is an
    "error" result, a non-finite loss a "failed" one, its note saying where."""
    batches = make_batches(cfg) if batches is None else batches
    model = TinyLM(cfg)
    model.load_state_dict(initial_state(cfg) if state is None else state)
    model.attend = attend
    model.to(cfg.device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                            weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup)
                                              * 0.5 * (1 + math.cos(math.pi * s / cfg.steps)))
    device = torch.device(cfg.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    losses, started, first_s = [], time.perf_counter(), None
    try:
        for step in range(cfg.steps):
            tokens = batches[step].to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.dtype == "bf16"):
                logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.detach())
            if step == 0:
                sync()
                first_s, started = time.perf_counter() - started, time.perf_counter()
        sync()
    except Exception as err:
        return TrainingResult(name, ERROR, note=f"step {len(losses)}: "
                                                f"{type(err).__name__}: {err}"[:300])
    wall = time.perf_counter() - started
    curve = torch.stack(losses).double().cpu().tolist()
    if not all(math.isfinite(x) for x in curve):
        bad = next(i for i, x in enumerate(curve) if not math.isfinite(x))
        return TrainingResult(name, FAILED, note=f"loss not finite from step {bad}")
    return TrainingResult(name, OK, curve, ms_per_step=1e3 * max(wall, 1e-9)
                          / max(cfg.steps - 1, 1), first_step_s=first_s)


# ---- the verdict -----------------------------------------------------------------------------
# Note [bf16 noise]
# Two attentions that compute the same function in bf16 round differently, and a training run
# carries the difference on: the loss curves part. "Within bf16 noise" must say how far apart
# two equally right attentions drift. The yardstick is a third run, "sdpa-wide": SDPA on q, k,
# v widened one precision (bf16 -> float32, float32 -> float64), its output rounded back: the
# same function, rounded once. noise(t) = |loss_wide - loss_sdpa| is the drift that one
# attention's own rounding causes; fa4lab passes when diff(t) = |loss_fa4lab - loss_sdpa| stays
# within FACTOR x that drift. fa4lab's rounding and SDPA's are independent, so they drift apart
# by ~sqrt(2) x one attention's rounding; FACTOR = 4 leaves room for chance. One step's loss
# difference is one projection of the parameters' difference (on that batch's gradient), as
# likely small as large, so both are averaged over a trailing window (a tenth of the run, at
# least MIN_WINDOW steps) and judged from the first full window on; the noise is its running
# maximum (a drift once reached shrinks back by chance only). A floor of float32's resolution
# of the loss (2^-23 x loss: the loss is a float32 mean) covers steps where both differences
# are zero (float32 on a CPU, where fa4lab's float64 reference rounds as sdpa-wide does).
# What it resolves: in float32 (the CPU test) a wrong attention, no causal mask or the softmax
# scale x 1.1, misses by orders of magnitude (tests/test_bench_training.py). In bf16 the curve
# is a coarser detector. Measured on a CPU (2 layers, hidden 64, seqlen 64, 80 steps, lr 3e-3
# and 1e-2, two seeds): equivalent attentions (SDPA's math backend, SDPA in fp16) peaked at
# 2.3x the noise, the scale x 1.1 at 2.3-6x (over FACTOR in 2 of 3 runs), x 1.02 at 1.9x: a
# pass says fa4lab trains as SDPA does to within what rounding hides, not that it is exact
# (the kernels' output and gradient checks say that).
FACTOR = 4.0
WINDOWS = 10
MIN_WINDOW = 4
RESOLUTION = 2.0 ** -23


def window_of(steps: int) -> int:
    return min(steps, max(MIN_WINDOW, steps // WINDOWS))


@dataclass(frozen=True)
class Verdict:
    within_noise: bool
    dtype: str
    worst_step: int          # the step where windowed diff / tolerance is largest
    worst_diff: float        # the windowed diff there
    worst_tol: float         # the tolerance there
    max_diff: float          # max over the run of |loss_fa4lab - loss_sdpa|
    max_noise: float         # max over the run of |loss_wide - loss_sdpa|
    rule: str
    windowed_diff: list[float]          # per step, what the rule compares
    tolerance: list[float | None]       # per step; None before the first full window


def verdict_line(v: Mapping) -> str:
    """One line of a verdict (a `Verdict` as a dict, as a record holds it)."""
    if "worst_step" not in v:
        return f"no verdict: {v.get('rule', '')}"
    say = "within" if v["within_noise"] else "NOT within"
    return (f"{say} {v['dtype']} noise: worst at step {v['worst_step']}, windowed |diff| "
            f"{v['worst_diff']:.2e} against a tolerance of {v['worst_tol']:.2e} (max |diff| "
            f"{v['max_diff']:.2e}, max noise {v['max_noise']:.2e})")


def _trailing_mean(xs: list[float], w: int) -> list[float]:
    return [sum(xs[max(0, i - w + 1): i + 1]) / (i + 1 - max(0, i - w + 1))
            for i in range(len(xs))]


def judge(ours: list[float], sdpa: list[float], wide: list[float], dtype: str,
          factor: float = FACTOR) -> Verdict:
    """Whether `ours` follows `sdpa` within the drift of `wide` (Note [bf16 noise])."""
    if not len(ours) == len(sdpa) == len(wide) > 0:
        raise ValueError(f"curves of {len(ours)}, {len(sdpa)}, {len(wide)} steps")
    w = window_of(len(sdpa))
    diff = _trailing_mean([abs(a - b) for a, b in zip(ours, sdpa)], w)
    noise = _trailing_mean([abs(a - b) for a, b in zip(wide, sdpa)], w)
    envelope = [max(noise[w - 1: i + 1], default=0.0) for i in range(len(noise))]
    tol = [factor * e + RESOLUTION * abs(s) for e, s in zip(envelope, sdpa)]
    judged = range(w - 1, len(sdpa))
    worst = max(judged, key=lambda i: diff[i] / tol[i] if tol[i] else float(diff[i] > 0))
    rule = (f"from step {w - 1} on, the trailing mean over {w} steps of |loss_fa4lab - "
            f"loss_sdpa| <= {factor:g} x the running max of the same mean of |loss_sdpa-wide - "
            f"loss_sdpa| + {RESOLUTION:.1e} x loss_sdpa (Note [bf16 noise] in "
            f"fa4lab.bench.training)")
    return Verdict(diff[worst] <= tol[worst], dtype, worst, diff[worst], tol[worst],
                   max(abs(a - b) for a, b in zip(ours, sdpa)),
                   max(abs(a - b) for a, b in zip(wide, sdpa)), rule,
                   [float(f"{x:.4g}") for x in diff],
                   [float(f"{x:.4g}") if i in judged else None for i, x in enumerate(tol)])


@dataclass
class Comparison:
    config: TrainConfig
    results: dict[str, TrainingResult]
    verdict: Verdict | None      # None when a run failed

    @property
    def losses(self) -> dict[str, list[float]]:
        return {name: r.losses for name, r in self.results.items()}


def compare(cfg: TrainConfig, attentions: Mapping[str, Attention] | None = None,
            *, on_run: Callable[[TrainingResult], None] | None = None) -> Comparison:
    """Train once per attention (default `ATTENTIONS`; "fa4lab", "sdpa" and "sdpa-wide" must be
    there) from the same init on the same data, and judge the fa4lab curve."""
    attentions = dict(ATTENTIONS if attentions is None else attentions)
    batches, state = make_batches(cfg), initial_state(cfg)
    results = {}
    from fa4lab.api import SlowReferenceWarning

    with warnings.catch_warnings():
        # on a CPU every fa4lab call is the float64 reference, as the run's device says
        warnings.simplefilter("ignore", SlowReferenceWarning)
        for name, attend in attentions.items():
            results[name] = train(cfg, attend, batches, state, name=name)
            if on_run:
                on_run(results[name])
    runs = [results[n] for n in (OURS, PEER, WIDE)]
    verdict = (judge(*(r.losses for r in runs), cfg.dtype)
               if all(r.status == OK for r in runs) else None)
    return Comparison(cfg, results, verdict)


# ---- the record ------------------------------------------------------------------------
def training_config(cfg: TrainConfig, wall_s: float | None = None) -> dict:
    """The record's config: the run's sizes and optimizer, the model and the data in words."""
    out = asdict(cfg) | {"heads_kv": cfg.kv_heads, "head_dim": cfg.head_dim}
    out["model"] = ("decoder-only: embedding + learned positions, pre-norm blocks (LayerNorm, "
                    "causal self-attention, MLP 4x GELU), tied head; AdamW (0.9, 0.95), "
                    "linear warm-up then cosine, grad clip 1.0")
    out["data"] = "random Markov chain (4 successors per token), each sequence's first half " \
                  "repeated (make_batches)"
    out["attentions"] = {OURS: "fa4lab.attention(q, k, v, causal=True)",
                         PEER: "F.scaled_dot_product_attention(is_causal=True), default backend",
                         WIDE: "the same one precision up, rounded back (Note [bf16 noise])"}
    if wall_s is not None:
        out["wall_s"] = round(wall_s, 1)
    return out


def make_training_record(cmp: Comparison, *, gpu_name: str, arch: str | None, command: str,
                         label: str | None = None, notes: str = "",
                         wall_s: float | None = None) -> dict:
    """A validated "training" record of a comparison (a failed run: within_noise false)."""
    record = record_header(TRAINING, gpu_name=gpu_name, arch=arch, command=command,
                           config=training_config(cmp.config, wall_s), notes=notes,
                           label=label or f"fa4lab training beside SDPA on {gpu_name}")
    record["results"] = [asdict(r) for r in cmp.results.values()]
    record["verdict"] = asdict(cmp.verdict) if cmp.verdict else {
        "within_noise": False, "rule": "a run failed: no curves to compare"}
    return validate_record(record)
