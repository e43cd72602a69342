"""Per-architecture facts the planner, the simulator and the benchmarks read, with sources.

Figures marked "published" come from vendor datasheets or papers; "measured" ones were measured
on the machine named, on the date given. Keep every hardware number here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass

from fa4lab.limits import arch_key


@dataclass(frozen=True)
class Hardware:
    name: str
    arch: str                      # "sm100" or "sm90"
    compute_capability: tuple[int, int]
    num_sms: int
    clock_ghz: float               # boost clock used to turn cycles into seconds
    smem_per_sm: int               # bytes
    smem_per_cta: int              # bytes one CTA may opt in to
    registers_per_sm: int          # 32-bit registers
    max_threads_per_cta: int
    tmem_lanes: int                # 0 where the chip has no tensor memory
    tmem_columns: int
    mma_flops_per_cycle: int       # dense 16-bit MMA FLOPs per SM per cycle
    exp2_per_cycle: int            # MUFU exp2 per SM per cycle
    smem_bytes_per_cycle: int      # shared-memory bandwidth per SM per cycle
    fma_per_cycle: int             # fp32 FMA lanes per SM per cycle (for the polynomial exp2)
    hbm_bytes_per_s: float
    sources: tuple[str, ...]

    @property
    def peak_mma_tflops(self) -> float:
        return self.mma_flops_per_cycle * self.num_sms * self.clock_ghz * 1e9 / 1e12

    @property
    def has_tmem(self) -> bool:
        return self.tmem_columns > 0


B200 = Hardware(
    name="NVIDIA B200", arch="sm100", compute_capability=(10, 0), num_sms=148, clock_ghz=1.85,
    smem_per_sm=228 * 1024, smem_per_cta=227 * 1024, registers_per_sm=64 * 1024,
    max_threads_per_cta=1024, tmem_lanes=128, tmem_columns=512,
    mma_flops_per_cycle=8192, exp2_per_cycle=16, smem_bytes_per_cycle=128, fma_per_cycle=128,
    hbm_bytes_per_s=8.0e12,
    sources=(
        "TMEM 128 lanes x 512 columns x 32 bit per SM, tcgen05.alloc in powers of two >= 32 "
        "columns: PTX ISA, tensor memory (tcgen05) chapter",
        "8192 dense 16-bit MMA FLOPs, 16 MUFU exp2, 128 B SMEM per SM per cycle: the FA4 blog's "
        "feeds and speeds (Tri Dao et al.)",
        "148 SMs, 228 KB SMEM per SM (227 KB per CTA), 64K registers per SM: CUDA programming "
        "guide, compute capability 10.0",
        "HBM3e 8 TB/s: NVIDIA B200 datasheet",
    ),
)

H200 = Hardware(
    name="NVIDIA H200", arch="sm90", compute_capability=(9, 0), num_sms=132, clock_ghz=1.83,
    smem_per_sm=228 * 1024, smem_per_cta=227 * 1024, registers_per_sm=64 * 1024,
    max_threads_per_cta=1024, tmem_lanes=0, tmem_columns=0,
    mma_flops_per_cycle=4096, exp2_per_cycle=16, smem_bytes_per_cycle=128, fma_per_cycle=128,
    hbm_bytes_per_s=4.8e12,
    sources=(
        "~989 dense bf16 TFLOP/s at boost (H100/H200 SXM datasheet) = 4096 FLOPs/cycle/SM "
        "at 132 SMs x 1.83 GHz",
        "16 MUFU exp2 per SM per cycle: CUDA programming guide, arithmetic instruction throughput",
        "132 SMs, 228 KB SMEM per SM (227 KB per CTA): CUDA programming guide, cc 9.0",
        "HBM3e 4.8 TB/s: NVIDIA H200 datasheet; measured here 4.27 TB/s device-to-device copy "
        "and 730-790 TFLOP/s bf16 GEMM 8192^3 (H200, 2026-11)",
    ),
)

# Note [H200 L2]
# The H200's L2 cache has two figures, given here only, each with its source (H200_L2_SOURCES):
# as the device reports it (torch.cuda.get_device_properties(0).L2_cache_size, which torch
# prints in MiB as "L2_cache_size=60MB"; tests/test_hardware_l2.py reads it on an H200 and fails
# if it differs from H200_L2_BYTES), and as the datasheets give it. NVIDIA's H200 datasheet has
# no L2 line; the H100 architecture whitepaper gives the full GH100 die, the chip the H200 uses,
# and the H100 SXM5, which enables less of it. The whitepaper's MB are binary, so the device
# and the full die agree. Everything else (the cold-L2 rotation of Note [cold L2] in
# fa4lab.bench.timing, the L2 sections of Note [L2 swizzle] in fa4lab.scheduling, notebook 07,
# benchmarks/README.md) reads H200_L2_BYTES or shows h200_l2_text().
H200_L2_BYTES = 60 * 1024 * 1024
H200_L2_SOURCES = (
    f"as the device reports it: torch.cuda.get_device_properties(0).L2_cache_size = "
    f"{H200_L2_BYTES} bytes on an H200",
    "as the datasheet gives it: none in NVIDIA's H200 datasheet; NVIDIA H100 Tensor Core GPU "
    "Architecture whitepaper: 60 MB for the full GH100 die the H200 uses, 50 MB on the H100 SXM5",
)


def h200_l2_text() -> str:
    """The H200's L2 in one line: the size and both figures' sources (Note [H200 L2])."""
    return f"H200 L2 {H200_L2_BYTES / 2**20:g} MiB: " + "; ".join(H200_L2_SOURCES)


BY_ARCH = {"sm100": B200, "sm90": H200}     # keyed by limits.arch_key, any spelling

# Published FA4 figures (labelled as such wherever they are shown): never measured here.
PUBLISHED_FA4_B200 = {
    "peak_bf16_tflops": 1613,
    "utilization": 0.71,
    "source": "FlashAttention-4 paper, arXiv 2603.05451 (B200, BF16 forward)",
}


# The FA4 paper's per-shape forward figures (B200, BF16), as far as they can be read: the paper
# gives them as bar charts, and only the headline maximum is stated in its text. That point is
# placed at the largest shape of upstream's benchmark (benchmarks/benchmark_attn.py: 32k tokens,
# hd128, hidden 2048) and taken non-causal: "up to" is the sweep's best point, and a causal
# run of the same shape is never faster (its diagonal tiles do masked work). Labelled
# PUBLISHED wherever shown (fa4lab.plan.calibration, `fa4lab plan`, notebook 07).
PUBLISHED_FA4_B200_FORWARD = (
    {"head_dim": 128, "causal": False, "seqlen": 32768, "batch": 1, "heads": 16,
     "tflops": PUBLISHED_FA4_B200["peak_bf16_tflops"],
     "source": PUBLISHED_FA4_B200["source"] + ": 'up to 1613 TFLOP/s' (abstract); shape "
               "attributed, see fa4lab.hardware"},
)


def hardware_for(arch: str) -> Hardware:
    return BY_ARCH[arch_key(arch)]


# Interconnect figures the ring-attention model reads (fa4lab.distributed.schedule, notebook 09):
# published peaks, per GPU and per direction, never measured here. NVLink 4 on the H200 SXM is
# 900 GB/s bidirectional; a ring sends one way to one neighbour, so half of it. Across nodes a
# DGX H200 has one ConnectX-7 (400 Gb/s InfiniBand NDR) per GPU.
INTERCONNECT = {
    "nvlink_h200": {
        "bytes_per_s": 450e9,
        "source": "NVIDIA H200 datasheet: NVLink 900 GB/s (bidirectional); 450 GB/s each way",
    },
    "ib_ndr": {
        "bytes_per_s": 50e9,
        "source": "NVIDIA DGX H200 datasheet: 8x ConnectX-7 400 Gb/s InfiniBand, one per GPU",
    },
}
