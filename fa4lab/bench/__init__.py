"""`fa4lab bench`: forward-attention throughput of fa4lab beside its peers, in one process.

What it measures: the standard sweep (total tokens 16384, hidden 2048, so
heads = hidden / head_dim and batch = total_tokens / seqlen; bf16; head_dim 64/128/256;
seqlen 1k..16k; causal and not), for each provider:

    fa4lab       `fa4lab.attention` (the sm90 kernel on Hopper, the sm100 kernel on B200)
    sdpa-flash   torch SDPA restricted to SDPBackend.FLASH_ATTENTION
    sdpa-cudnn   torch SDPA restricted to SDPBackend.CUDNN_ATTENTION
    fa4          upstream FlashAttention-4 (`flash_attn.cute.interface.flash_attn_func`,
                 pip package flash-attn-4), when installed

plus the device's dense bf16 GEMM rate (8192^3 torch.matmul) as the ceiling.
TFLOP/s = AttentionSpec.flops() / time = 4*B*H*Sq*Sk*D, halved for causal.
`--host-overhead` measures instead the host time of one tiny call per provider: a dense call,
and varlen and paged calls at batch 1, 32 and 256 (fa4lab's default call first, beside its
check_indices=True / False variants and upstream FA4's flash_attn_varlen_func).
`--features` measures each attention option (windows, softcap, a learnable sink, ALiBi and
relative-bias score_mods, document and prefix-LM mask_mods) at hd128 seqlen 8192, then the
attention of served models at their own shapes (GPT-OSS sink + window, MLA (192, 128), Mistral
window, GQA 16:1, Gemma-2 softcap), for fa4lab (its default call, the headline row), upstream
FA4 (where it has the option), PyTorch SDPA with materialized masks and FlexAttention, TFLOP/s
counting only the visible (query, key) pairs.
`--backward` measures the attention backward alone (the forward run once before timing) at
hd 64 and 128, seqlen 2048, 8192 and 16384, causal and not, 16k tokens and hidden 2048: fa4lab
(`fa4lab.attention`'s autograd, the headline row, and its kernel from the saved out and lse),
upstream FA4's autograd and SDPA's (cuDNN, flash), each set of gradients checked first
(`fa4lab.acceptance.gradient_violations`), TFLOP/s counting 2.5x the forward's FLOPs.
`--decode` measures a GQA decode (batch 32, seqlen_q 1, seqlen_k 8192, heads 32/8, hd128) and a
GQA prefill (batch 1, seqlen 8192, causal) for fa4lab (default and pack_gqa=False, named
`fa4lab-unpacked`), upstream FA4 and SDPA, each against the shape's HBM floor (the bytes K, V,
q and out must move, at the copy bandwidth measured in the same run).
`--training` trains a small decoder-only transformer (4 layers, bf16 autocast, 200 steps) with
fa4lab's attention, with SDPA and with SDPA one precision up, from one seed on one data stream,
and says whether fa4lab's loss curve follows SDPA's within the drift that rounding alone causes.

Constraints: timing needs a CUDA GPU (and triton for `triton.testing.do_bench`; without it a
CUDA-event timer with the same cold-L2 rule is used and the record says so). On a CPU the
command prints what it would run and the latest recorded results from `benchmarks/`, and
exits 0. Every provider's output is checked against the float64 reference before it is timed;
a provider that fails the check is reported as "failed" and not timed; one that raises is
reported as "error" with its message; one that is not installed is reported as "missing";
one that cannot express a feature, or that the run's time budget left out, as "skipped".
The sweep always continues.

How to run:

    fa4lab bench                       # the standard sweep, record saved in benchmarks/
    fa4lab bench --quick               # hd128, seqlen 4096 and 8192 only
    fa4lab bench --head-dim 128 --seqlen 4096 --causal true --plot out.png
    fa4lab bench --host-overhead       # host time per call, fa4lab / FA4 / SDPA
    fa4lab bench --decode              # GQA decode and prefill against the HBM floor
    fa4lab bench --features --plot f.png   # each attention option beside FA4 and PyTorch
    fa4lab bench --serving             # varlen prefill, paged and split-KV decode
    fa4lab bench --backward            # the attention backward beside FA4 and SDPA
    fa4lab bench --training            # loss curves, fa4lab beside SDPA, within bf16 noise?

The modules, one concept each:

    sweep           the shapes of a run and the providers' names
    providers       a runner per provider (fa4lab, SDPA, upstream FA4)
    check           the check against the float64 reference before timing
    timing          median time with a cold L2, the spin-up, the GEMM ceiling
    measure         the one check-then-time loop, run time limits; one plan's tiles
    host_overhead   host time per call on a tiny shape
    decode          GQA decode and prefill shapes, the HBM floor
    features        the attention options, their calls, visible FLOPs, the plan of a run
    pytorch_peers   SDPA with materialized masks and FlexAttention, per feature
    features_cli    `fa4lab bench --features`
    serving         varlen prefill, paged decode and split-KV decode beside FA4 and PyTorch
    serving_cli     `fa4lab bench --serving`: its table, bars and command
    backward        the attention backward: its cases, providers, gradient check, record
    backward_cli    `fa4lab bench --backward`
    training        a small transformer trained per attention, the bf16-noise verdict
    training_cli    `fa4lab bench --training`: its table, record and plot
    results         the rows of a record, one dataclass per kind, and their statuses
    records         the JSON records in benchmarks/ (benchmarks/README.md has the format)
    table           TFLOP/s tables and fa4lab/peer ratios
    cli             `fa4lab bench ...`
"""

from __future__ import annotations

from fa4lab.bench.check import (
    ATOL,
    CHECK_HEADS,
    OPTIONS,
    CheckSlice,
    check_output,
    reference_slice,
)
from fa4lab.bench.cli import (
    add_cli,
    describe_run,
    main_args,
    plan_of_decode,
    plan_of_run,
    recorded_decode_summary,
    recorded_summary,
)
from fa4lab.bench.decode import (
    COPY_BYTES,
    DECODE_PROVIDERS,
    CopyBandwidth,
    GqaShape,
    copy_bandwidth,
    decode_config,
    describe_decode_run,
    floor_us,
    format_decode_table,
    gqa_shapes,
    make_decode_record,
    make_gqa_inputs,
    measure_gqa_shape,
    run_decode,
)
from fa4lab.bench.features import (
    ALL_FEATURES,
    FEATURE_NAMES,
    FEATURE_PROVIDERS,
    Feature,
    FeatureCall,
    FeatureCase,
    PlannedRow,
    feature_call,
    feature_cases,
    feature_flops,
    features_named,
    make_features_record,
    measure_feature,
    plan_features,
    run_features,
    visible_pairs,
    why_not,
)
from fa4lab.bench.features_cli import plan_of_features, recorded_features_summary
from fa4lab.bench.host_overhead import (
    HOST_SHAPE,
    HostCase,
    format_host_table,
    host_calls,
    host_cases,
    make_host_record,
    measure_host_cases,
    measure_host_overhead,
)
from fa4lab.bench.measure import (
    TIMEOUT_EXIT,
    Measurement,
    PlanMeasurement,
    RunGuard,
    check_then_time,
    make_inputs,
    measure_plan,
    measure_shape,
    run_sweep,
    run_with_progress,
    simulated_tflops,
)
from fa4lab.bench.providers import (
    Provider,
    Runner,
    resolve_providers,
    sdpa_runner,
    short_error,
    to_bhsd,
)
from fa4lab.bench.records import (
    BACKWARD,
    BENCHMARKS_DIR,
    DECODE,
    ERROR,
    FAILED,
    FEATURES,
    HOST_OVERHEAD,
    MISSING,
    NEIGHBOURS,
    OK,
    RECORD_KINDS,
    SCHEMA,
    SERVING,
    SKIPPED,
    STATUSES,
    TRAINING,
    DecodeResult,
    FeatureResult,
    HostResult,
    NeighbourResult,
    Result,
    ServingResult,
    TrainingResult,
    backward_results_of,
    decode_results_of,
    default_record_path,
    feature_results_of,
    git_commit,
    host_results_of,
    latest_record,
    load_record,
    load_records,
    make_record,
    neighbour_results_of,
    recorded_tflops,
    results_of,
    save_record,
    serving_results_of,
    training_results_of,
    validate_record,
    versions,
)
from fa4lab.bench.sweep import (
    HEAD_DIMS,
    HIDDEN,
    OURS,
    PEERS,
    PROVIDER_LABELS,
    PROVIDERS,
    QUICK_HEAD_DIMS,
    QUICK_SEQLENS,
    SEQLENS,
    SUPPORTED_HEAD_DIMS,
    TOTAL_TOKENS,
    UNPACKED,
    BenchShape,
    parse_causal,
    shape_for,
    sweep,
)
from fa4lab.bench.table import (
    FeatureRatios,
    TableRow,
    feature_ratios,
    format_features_table,
    format_table,
    geomean_ratios,
    providers_in,
    ratio_table,
)
from fa4lab.bench.timing import (
    GEMM_SIZE,
    REP_MS,
    WARMUP_MS,
    gemm_tflops,
    hbm_bytes,
    time_ms,
    timer_name,
)

__all__ = [
    "ALL_FEATURES", "FEATURES", "FEATURE_NAMES", "FEATURE_PROVIDERS", "OPTIONS", "SKIPPED",
    "TIMEOUT_EXIT", "Feature", "FeatureCall", "FeatureCase", "FeatureRatios", "FeatureResult",
    "Measurement", "PlannedRow", "RunGuard", "check_then_time", "feature_call", "feature_cases",
    "feature_flops", "feature_ratios", "feature_results_of", "features_named",
    "format_features_table", "make_features_record", "measure_feature", "plan_features",
    "plan_of_features", "recorded_features_summary", "run_features", "run_with_progress",
    "visible_pairs", "why_not",
    "COPY_BYTES", "DECODE", "DECODE_PROVIDERS", "UNPACKED", "CopyBandwidth", "DecodeResult",
    "GqaShape", "copy_bandwidth", "decode_config", "decode_results_of", "describe_decode_run",
    "floor_us", "format_decode_table", "gqa_shapes", "hbm_bytes", "make_decode_record",
    "make_gqa_inputs", "measure_gqa_shape", "plan_of_decode", "recorded_decode_summary",
    "run_decode",
    "ATOL", "BENCHMARKS_DIR", "CHECK_HEADS", "ERROR", "FAILED", "GEMM_SIZE", "HEAD_DIMS",
    "HIDDEN", "HOST_OVERHEAD", "HOST_SHAPE", "MISSING", "OK", "OURS", "PEERS",
    "PROVIDERS", "PROVIDER_LABELS", "QUICK_HEAD_DIMS", "QUICK_SEQLENS", "RECORD_KINDS",
    "REP_MS", "SCHEMA", "SEQLENS", "STATUSES", "SUPPORTED_HEAD_DIMS", "TOTAL_TOKENS",
    "WARMUP_MS", "BenchShape", "CheckSlice", "HostResult", "PlanMeasurement", "Provider",
    "Result", "Runner", "TableRow", "add_cli", "check_output", "default_record_path",
    "describe_run", "format_host_table", "format_table", "gemm_tflops", "geomean_ratios",
    "git_commit", "HostCase", "host_calls", "host_cases", "measure_host_cases",
    "host_results_of", "latest_record", "load_record",
    "load_records", "main_args", "make_host_record", "make_inputs", "make_record",
    "measure_host_overhead", "measure_plan", "measure_shape", "parse_causal", "plan_of_run",
    "providers_in", "ratio_table", "recorded_summary", "recorded_tflops", "reference_slice",
    "resolve_providers", "results_of", "run_sweep", "save_record", "sdpa_runner", "shape_for",
    "short_error", "simulated_tflops", "sweep", "time_ms", "timer_name", "to_bhsd",
    "validate_record", "versions",
    "NEIGHBOURS", "NeighbourResult", "neighbour_results_of",
    "SERVING", "ServingResult", "serving_results_of",
    "BACKWARD", "backward_results_of",
    "TRAINING", "TrainingResult", "training_results_of",
]
