"""The rows of a bench record: one dataclass per record kind's result (`Result` for the
throughput sweep and the backward, `HostResult`, `DecodeResult`, `ServingResult`,
`FeatureResult`, `NeighbourResult`, `TrainingResult`), each with its `from_dict`, and the
statuses a row may have. `fa4lab.bench.records` reads and writes the records that hold them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

# Status of one (provider, shape) cell. "skipped": the provider is here but was not run, and
# the note says why (it cannot express the feature, or the run's time budget was spent).
OK, FAILED, ERROR, MISSING, SKIPPED = "ok", "failed", "error", "missing", "skipped"
STATUSES = (OK, FAILED, ERROR, MISSING, SKIPPED)

class _Row:
    """A row of a record: its status is one of STATUSES."""

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r} is not one of {STATUSES}")


@dataclass
class Result(_Row):
    """One provider on one shape. tflops/ms are None unless status == 'ok'."""

    provider: str
    head_dim: int
    seqlen: int
    causal: bool
    batch: int
    heads: int
    dtype: str = "bf16"
    status: str = OK
    tflops: float | None = None
    ms: float | None = None
    max_err: float | None = None     # max |out - reference| on the checked slice
    tol: float | None = None         # the tolerance it was held to
    first_call_s: float | None = None  # wall time of the first call (includes any compile)
    note: str = ""

    @property
    def key(self) -> tuple[int, bool, int]:
        return (self.head_dim, self.causal, self.seqlen)

    @classmethod
    def for_shape(cls, provider: str, shape, **kw) -> Result:
        """The result of `provider` on a `BenchShape`."""
        return cls(provider, shape.head_dim, shape.seqlen, shape.causal, shape.batch,
                   shape.heads, shape.dtype, **kw)

    @classmethod
    def from_dict(cls, d: dict) -> Result:
        return _from_dict(cls, d, ("provider", "head_dim", "seqlen", "causal", "batch", "heads",
                                   "status"))


@dataclass
class HostResult(_Row):
    """One provider's host time per call on one case (`fa4lab bench --host-overhead`: a dense
    call, or a varlen / paged call at one batch). The times are None unless status == 'ok'."""

    provider: str
    status: str = OK
    mean_us: float | None = None      # all timed calls: issue time / (calls x repeats)
    median_us: float | None = None    # median over the repeats of each repeat's mean
    repeats_us: list[float] = field(default_factory=list)   # each repeat's mean
    note: str = ""
    case: str = "dense"               # "dense", "varlen b32", "paged b256" (HostCase.name)
    shape: str = ""                   # the case's shape, as the table shows it

    @classmethod
    def from_dict(cls, d: dict) -> HostResult:
        return _from_dict(cls, d, ("provider", "status"))


@dataclass
class DecodeResult(_Row):
    """One provider on one GQA shape of `fa4lab bench --decode`. The times and rates are None
    unless status == 'ok'; x_floor also when no bandwidth was measured."""

    provider: str
    shape: str              # "decode" or "prefill": which of the mode's shapes
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    causal: bool
    dtype: str = "bf16"
    status: str = OK
    us: float | None = None          # median microseconds per call
    x_floor: float | None = None     # us / floor_us: 1.0 is the HBM floor
    floor_us: float | None = None    # hbm_bytes at the run's measured bandwidth
    hbm_bytes: int | None = None     # bytes the call must move: K and V once, q and out
    gbps: float | None = None        # hbm_bytes / us, GB/s (1e9 bytes)
    tflops: float | None = None      # AttentionSpec.flops() / us
    max_err: float | None = None     # the check before timing, as in Result
    tol: float | None = None
    first_call_s: float | None = None
    note: str = ""

    @classmethod
    def from_dict(cls, d: dict) -> DecodeResult:
        return _from_dict(cls, d, ("provider", "shape", "batch", "seqlen_q", "seqlen_k",
                                   "heads_q", "heads_kv", "head_dim", "causal", "status"))


@dataclass
class ServingResult(_Row):
    """One provider on one case of `fa4lab bench --serving` (a varlen prefill, a paged decode
    at one page size, a split-KV decode at one batch). The times and rates are None unless
    status == 'ok'; x_floor also when no bandwidth was measured. The case's lengths are in the
    record's config."""

    provider: str
    scenario: str           # "varlen-prefill", "paged-decode", "splitkv-decode", "paged-prefill"
    case: str               # e.g. "paged-decode p16", "splitkv-decode b2"
    batch: int              # sequences
    heads_q: int
    heads_kv: int
    head_dim: int
    causal: bool
    total_q: int            # query rows of all sequences
    total_k: int            # keys all sequences attend to (seqused_k applied)
    max_seqlen_k: int
    page_size: int | None = None     # paged-decode only
    dtype: str = "bf16"
    status: str = OK
    us: float | None = None          # median microseconds per call
    x_floor: float | None = None     # us / floor_us: 1.0 is the HBM floor
    floor_us: float | None = None    # hbm_bytes at the run's measured bandwidth
    hbm_bytes: int | None = None     # K/V attended once, q and out once
    gbps: float | None = None        # hbm_bytes / us, GB/s (1e9 bytes)
    tflops: float | None = None      # flops / us
    flops: float | None = None       # 2 x (head_dim + head_dim_v) x visible pairs x heads_q
    max_err: float | None = None     # the check before timing, as in Result
    tol: float | None = None
    first_call_s: float | None = None
    note: str = ""

    @classmethod
    def from_dict(cls, d: dict) -> ServingResult:
        return _from_dict(cls, d, ("provider", "scenario", "case", "batch", "heads_q",
                                   "heads_kv", "head_dim", "causal", "total_q", "total_k",
                                   "max_seqlen_k", "status"))


@dataclass
class FeatureResult(_Row):
    """One provider on one feature of `fa4lab bench --features` (one attention option at the
    mode's shape). us/tflops are None unless status == 'ok'; tflops counts only the visible
    (query, key) pairs (Note [visible FLOPs] in `fa4lab.bench.features`)."""

    provider: str
    feature: str            # e.g. "window-1024-0": `fa4lab.bench.features.ALL_FEATURES` names
    batch: int
    seqlen: int
    heads: int
    head_dim: int
    causal: bool
    dtype: str = "bf16"
    status: str = OK
    us: float | None = None          # median microseconds per call
    tflops: float | None = None      # flops / us
    flops: float | None = None       # 2 (head_dim + head_dim_v) batch heads visible pairs
    max_err: float | None = None     # the check before timing, as in Result
    tol: float | None = None
    first_call_s: float | None = None   # first call: compile, mask/block-mask building, check
    note: str = ""
    heads_kv: int | None = None      # None (records before GQA features): heads
    head_dim_v: int | None = None    # None: head_dim

    def shape_label(self) -> str:
        """e.g. "b4 s4096 h64/8 hd64", "b4 s4096 h16/16 hd(192, 128)"."""
        dv = self.head_dim_v or self.head_dim
        hd = f"hd{self.head_dim}" if dv == self.head_dim else f"hd({self.head_dim}, {dv})"
        return f"b{self.batch} s{self.seqlen} h{self.heads}/{self.heads_kv or self.heads} {hd}"

    @classmethod
    def from_dict(cls, d: dict) -> FeatureResult:
        return _from_dict(cls, d, ("provider", "feature", "batch", "seqlen", "heads",
                                   "head_dim", "causal", "status"))


@dataclass
class NeighbourResult(_Row):
    """One sm90/sm100 plan (tile overrides) on the one shape of `fa4lab bench --neighbours`.
    ms/tflops are None unless status == 'ok'; `default` marks the plan fa4lab ships."""

    n_block: int
    kv_stage: int
    q_stage: int
    default: bool
    head_dim: int
    seqlen: int
    causal: bool
    batch: int
    heads: int
    dtype: str = "bf16"
    provider: str = "fa4lab"
    status: str = OK
    ms: float | None = None
    tflops: float | None = None
    max_err: float | None = None
    tol: float | None = None
    first_call_s: float | None = None   # compile + first call
    note: str = ""

    @property
    def overrides(self) -> dict[str, int]:
        return {"n_block": self.n_block, "kv_stage": self.kv_stage, "q_stage": self.q_stage}

    @classmethod
    def from_dict(cls, d: dict) -> NeighbourResult:
        return _from_dict(cls, d, ("n_block", "kv_stage", "q_stage", "default", "head_dim",
                                   "seqlen", "causal", "batch", "heads", "status"))


@dataclass
class TrainingResult(_Row):
    """One attention's run of `fa4lab bench --training` (`fa4lab.bench.training`): the loss at
    every step. losses and the times are empty / None unless status == 'ok'."""

    provider: str           # "fa4lab", "sdpa", "sdpa-wide" (`fa4lab.bench.training.ATTENTIONS`)
    status: str = OK
    losses: list[float] = field(default_factory=list)   # the training loss of each step
    ms_per_step: float | None = None   # wall time of the steps after the first, synchronized
    first_step_s: float | None = None  # the first step (compiles included)
    note: str = ""

    @classmethod
    def from_dict(cls, d: dict) -> TrainingResult:
        return _from_dict(cls, d, ("provider", "status"))


def _from_dict(cls, d: dict, required: tuple[str, ...]):
    if not isinstance(d, dict):
        raise ValueError(f"a result is a JSON object, got {d!r}")
    missing = [n for n in required if n not in d]
    if missing:
        raise ValueError(f"result {d} lacks {missing}")
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in names})
