"""Every constant the lesson, the planner, the kernels and the checks share, said once.

What each kernel builds ((head_dim, head_dim_v) pairs and dtypes per arch), which GPU runs which
kernel (capability -> arch), element sizes, the conditional-rescale threshold and the software exp2
coefficients. Modules import these names; none keeps a copy.
"""

from __future__ import annotations

import math

from fa4lab.errors import PlanError

# ---- which kernel runs where ------------------------------------------------------------------
# The (head_dim, head_dim_v) pairs each arch's kernel builds: the one table every entry point
# (input check, dispatch, planners, kernels, compile matrices, notebooks) reads. (192, 128) is
# DeepSeek's split of Q/K (192) and V (128). The sm100 planner plans any head dim whose S + O fit
# TMEM; the sm100 kernel of this lab builds these.
KERNEL_HEAD_DIMS: dict[str, tuple[tuple[int, int], ...]] = {
    "sm90": ((64, 64), (96, 96), (128, 128), (192, 128), (256, 256)),
    "sm100": ((64, 64), (96, 96), (128, 128), (192, 128), (256, 256)),
}
# Every pair some kernel builds, sorted.
ALL_HEAD_DIMS = tuple(sorted({p for pairs in KERNEL_HEAD_DIMS.values() for p in pairs}))
KERNEL_DTYPES = ("bf16", "fp16")
# Bytes per element: the 16-bit inputs and outputs, and the fp32 accumulators and statistics.
ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def arch_of_capability(capability: tuple[int, int]) -> str | None:
    """"sm100" for compute capability 10.x (B200), "sm90" for 9.0 (H100/H200), else None."""
    major, minor = capability
    if major == 10:
        return "sm100"
    if (major, minor) == (9, 0):
        return "sm90"
    return None


# Rows of one Q tile per arch (the MMA's M: one sm90 consumer warpgroup's wgmma, one sm100
# tcgen05 tile over the 128 TMEM lanes). The plans use them; pack-GQA needs whole head groups.
Q_TILE_ROWS = {"sm90": 64, "sm100": 128}


# Note [narrow windows pack]
# A Q tile of `rows` packed rows holds rows / g positions, an unpacked one `rows` positions; a
# window of span w = left + right + 1 keys makes each tile read about (positions + w) keys, of
# which w per row are seen. So packing cuts the keys a tile reads (and the scores the window
# then hides) by (rows + w) / (rows / g + w), large when w is narrow beside the tile. Measured on
# the H200 (benchmarks/2026-12-04_nvidia-h200_features-profile.txt, sink + window (128, 0),
# hd64, 64 / 8 heads, s4096): packed 0.376 ms, unpacked 0.406 ms (that gain 1.41); window
# (1024, 0), hd128, 16 / 4 heads, s8192: 0.288 / 0.286 ms (gain 1.05); packing costs 8-17%
# where it saves nothing (full causal, same GPT-OSS shape: 1.421 / 1.302 ms). The gain is
# counted at the arch's Q tile (Q_TILE_ROWS; a CTA's m_block is a multiple, where it only
# grows). Packing is the default from a gain of NARROW_WINDOW_PACK_GAIN on; on sm90 only, the
# one arch measured.
NARROW_WINDOW_PACK_GAIN = 1.25


# Note [sm90 packs head_dim 64]
# At head_dim 64 the sm90 kernel runs three consumers, a 192-row CTA (Note [sm90 tuning table]
# in fa4lab.plan.sm90), packed or not. A packed CTA holds 192 / g positions of g heads instead
# of 192 positions of one: the causal diagonal hides fewer of its scores, and each K/V block
# feeds g heads. Measured on the H200 (benchmarks/2026-12-04_nvidia-h200_sm90-tuning.txt, bf16,
# packed / unpacked ms, FA4 in the same process): GQA 16:1 s2048 b8 causal 0.341 / 0.365, 64 / 8
# heads s4096 b4 causal 1.221 / 1.288, with a learnable sink 1.218 / 1.281, non-causal 2.163 /
# 2.219; with a sink and window (128, 0), packed already by the narrow window, three consumers
# against the two packed tiles used to keep: 0.325 / 0.379. Packing wins at every GQA shape
# there, so on sm90 it is the default at these head dims. At head_dim 128 (two consumers, 128
# rows) it measured 0.5-1.7% slower at long prompts (16 / 4 heads s8192, causal and not), and
# packs only by the other two rules.
SM90_PACKED_HEAD_DIMS = (64,)


def narrow_window_gain(rows: int, qhead_per_kvhead: int, window: tuple) -> float:
    """(rows + w) / (rows / g + w): how many times fewer keys a packed Q tile of `rows` rows
    reads than an unpacked one under a window of span w (Note [narrow windows pack]); 1.0 when
    a side of the window is unbounded. `window`: (left, right), right = 0 under causal."""
    left, right = window
    if left is None or right is None:
        return 1.0
    span = max(1, left + right + 1)     # a negative side can leave no key to see (span <= 0)
    return (rows + span) / (rows / qhead_per_kvhead + span)


def pack_gqa_default(arch: str, qhead_per_kvhead: int, seqlen_q: int,
                     window: tuple = (None, None), head_dim: int | None = None) -> bool:
    """What `pack_gqa=None` (the API's default) means: pack when it takes fewer Q tiles, or on
    sm90 at the head dims of SM90_PACKED_HEAD_DIMS (Note [sm90 packs head_dim 64]), or on sm90
    when a narrow window makes packed tiles read far fewer keys (Note [narrow windows pack];
    `window` = (left, right), right = 0 under causal, None unbounded).

    Packing puts the g query heads of a KV head in one CTA's rows (a tile must hold whole groups:
    g divides the tile's rows), so the seqlen_q * g rows of a group fill ceil(seqlen_q * g /
    rows) tiles instead of g * ceil(seqlen_q / rows), each of which reads all of K/V. Decode
    (seqlen_q 1, g = 4 on Hopper) then takes 1 tile instead of 4 and runs at the HBM floor
    (H200: 259 us against 799 us unpacked, batch 32, 8192 keys, 32/8 heads, hd128). When both
    counts are equal (long prompts) the unpacked kernel is kept: at seqlen 8192, causal, it
    measured 612 TFLOP/s against 599 packed. Upstream FA4 packs whenever g > 1.
    """
    rows = Q_TILE_ROWS[arch]
    g = qhead_per_kvhead
    if g == 1 or rows % g:
        return False
    if -(-seqlen_q * g // rows) < g * -(-seqlen_q // rows):
        return True
    return arch == "sm90" and (head_dim in SM90_PACKED_HEAD_DIMS
                               or narrow_window_gain(rows, g, window) >= NARROW_WINDOW_PACK_GAIN)


def arch_key(arch: str) -> str:
    """"sm100" or "sm90" from any spelling of the two ("sm_90a", "SM100a", "sm90"): the one
    place an arch's name is read (the plan, the hardware table, the compile target). Any other
    name raises PlanError (a ValueError) naming the two."""
    key = str(arch).lower().replace("_", "").removesuffix("a")
    if key not in KERNEL_HEAD_DIMS:
        raise PlanError(f"unknown arch {arch!r}: fa4lab plans and builds kernels for 'sm100' "
                        f"(B200, tcgen05 + TMEM) and 'sm90' (H100/H200, wgmma), in any "
                        f"spelling ('sm_90a', 'sm100a')")
    return key


def head_dims_for(arch: str) -> tuple[tuple[int, int], ...]:
    """The (head_dim, head_dim_v) pairs the kernel of `arch` ("sm90"/"sm100", with or without
    the "a") builds."""
    return KERNEL_HEAD_DIMS[arch_key(arch)]


def kernel_builds(arch: str, head_dim: int, head_dim_v: int | None = None) -> bool:
    """Whether the kernel of `arch` builds (head_dim, head_dim_v); head_dim_v defaults to
    head_dim."""
    return (head_dim, head_dim if head_dim_v is None else head_dim_v) in head_dims_for(arch)


def equal_head_dims(arch: str | None = None) -> tuple[int, ...]:
    """The head dims built with head_dim_v == head_dim, by `arch`'s kernel or (None) by any."""
    pairs = ALL_HEAD_DIMS if arch is None else head_dims_for(arch)
    return tuple(d for d, dv in pairs if d == dv)


def head_dims_text(arch: str) -> str:
    """What `arch`'s kernel builds, in words: "64, 96, 128, 256 (head_dim_v == head_dim) and
    (192, 128)"."""
    equal = ", ".join(map(str, equal_head_dims(arch)))
    split = [f"({d}, {dv})" for d, dv in head_dims_for(arch) if d != dv]
    return f"{equal} (head_dim_v == head_dim)" + (f" and {', '.join(split)}" if split else "")


ARCH_GPUS = {"sm90": "H100/H200", "sm100": "B200"}


def covering_head_dims(arch: str, head_dim: int, head_dim_v: int | None = None
                       ) -> tuple[int, int] | None:
    """The built pair the kernel of `arch` runs (head_dim, head_dim_v) on: itself when built,
    else the smallest built pair at least as wide on both sides (the call zero-padded to it,
    Note [padded head dims] in fa4lab.canonical), None when none is (a side above 256)."""
    dv = head_dim if head_dim_v is None else head_dim_v
    covers = [(d, e) for d, e in head_dims_for(arch) if d >= head_dim and e >= dv]
    return min(covers, key=lambda p: (p[0] + p[1], p)) if covers else None


def unsupported_head_dims(arch: str, head_dim: int, head_dim_v: int) -> str:
    """The error for a (head_dim, head_dim_v) pair the kernel of `arch` does not build: what
    each kernel builds and, when a built pair covers it (`covering_head_dims`), that the API
    runs it zero-padded to that pair; else (a side above the widest built one) what to do."""
    key = arch_key(arch)
    built = "; ".join(f"{a} ({ARCH_GPUS[a]}): {head_dims_text(a)}" for a in KERNEL_HEAD_DIMS)
    cover = covering_head_dims(key, head_dim, head_dim_v)
    if cover is not None:
        return (f"(head_dim, head_dim_v) = ({head_dim}, {head_dim_v}) is not built by the {key} "
                f"kernel, which builds {head_dims_text(key)}; fa4lab.attention and "
                f"attention_varlen run it zero-padded to {cover} (Note [padded head dims] in "
                f"fa4lab.canonical), a plan or a kernel takes a built pair")
    widest = max(max(p) for p in head_dims_for(key))
    return (f"(head_dim, head_dim_v) = ({head_dim}, {head_dim_v}) is wider than any pair the "
            f"{key} kernel builds (each side at most {widest}; narrower pairs run zero-padded "
            f"to the smallest built pair that holds them). The kernels build {built}. Split the "
            f"heads, or use fa4lab.reference.attention_reference (float64, slow)")


# ---- paged K/V caches ------------------------------------------------------------------------
# A TMA copy writes SMEM from an address that is a multiple of 128 bytes. A gathered page's
# slice starts at row j * page_size of its stage, and a row of a swizzle atom is the swizzle's
# width: 128 bytes where the head dim is a multiple of 64 16-bit elements, 64 bytes at head_dim
# 96 (the widest swizzle 192-byte rows take). So pages at head_dim 96 hold an even number of
# keys: a page of one key there faulted on the H200 (misaligned address, found by the fuzzer).
TMA_SMEM_ALIGN_BYTES = 128
SWIZZLE_WIDTHS_BYTES = (128, 64, 32)


def swizzle_bytes(cols: int, element_bytes: int = ELEMENT_BYTES["bf16"]) -> int:
    """The width of the widest swizzle rows of `cols` elements take (what the kernels' SMEM
    layouts choose, cutlass's `get_smem_layout_atom`): 128, 64 or 32 bytes (16 without)."""
    return next((w for w in SWIZZLE_WIDTHS_BYTES if (cols * element_bytes) % w == 0), 16)


def min_gather_page(head_dim: int, head_dim_v: int,
                    element_bytes: int = ELEMENT_BYTES["bf16"]) -> int:
    """The smallest page a gather reads at these head dims: its SMEM slices start 128-byte
    aligned (1, or 2 at head_dim 96)."""
    return max(max(1, TMA_SMEM_ALIGN_BYTES // swizzle_bytes(c, element_bytes))
               for c in (head_dim, head_dim_v))


# Note [cp.async pages]
# The sm90 kernel reads pages smaller than CP_ASYNC_PAGES_BELOW tokens, and pages that no TMA read
# fits (neither a multiple nor a divisor of the key block: 24 at a block of 128, 100, 1000), not
# with TMA boxes issued by one thread but with cp.async: the producer warpgroup's 128 threads
# each copy 16-byte chunks of the block's rows, every row from its own page (upstream FA4's
# non-TMA paged loader; Note [cp.async gather] in fa4lab.kernels.device.page_rows). A row lands
# wherever the swizzled layout puts it, so no 128-byte alignment limits the page (pages of one
# key at head_dim 96 too) and a block may start and end anywhere in a page: every page size
# is read at the tuned key block. The TMA gather of one box per page ran at 0.19x FA4 with pages
# of 1 and 0.62x with pages of 4, 1.03x with pages of 16 (H200, prefill 4 x 4096 causal, hd128;
# benchmarks/2026-12-02_nvidia-h200_small-pages-seqused.txt): from 16 on it stays.
CP_ASYNC_PAGES_BELOW = {"sm90": 16}


def small_pages_by_cp_async(arch: str, page_size: int | None) -> bool:
    """Whether `arch`'s kernel copies pages of `page_size` tokens by cp.async whatever its key
    block: pages below CP_ASYNC_PAGES_BELOW (Note [cp.async pages])."""
    below = CP_ASYNC_PAGES_BELOW.get(arch_key(arch))
    return page_size is not None and below is not None and page_size < below


def page_loader(arch: str, page_size: int | None, n_block: int) -> str:
    """How `arch`'s kernel with key blocks of `n_block` rows reads a cache of `page_size`-token
    pages: "tma" (unpaged, one box per block, or a TMA gather of one box per page) or
    "cp.async" (Note [cp.async pages]): small pages, and on a kernel that has cp.async, pages
    no TMA read of the block fits."""
    if page_size is None or arch_key(arch) not in CP_ASYNC_PAGES_BELOW:
        return "tma"
    if small_pages_by_cp_async(arch, page_size) or not page_fits(page_size, n_block):
        return "cp.async"
    return "tma"


# A cp.async copy moves 16 bytes; a row of K or V is copied by the threads of one group, each
# taking chunks CP_ASYNC_ROW_CHUNK_BYTES apart (the widest span that divides both rows).
CP_ASYNC_COPY_BYTES = 16
CP_ASYNC_ROW_CHUNK_BYTES = 128
CP_ASYNC_THREADS = 128      # the sm90 producer warpgroup


def cp_async_row_threads(head_dim: int, head_dim_v: int,
                         element_bytes: int = ELEMENT_BYTES["bf16"]) -> int:
    """Producer threads that copy one K or V row together (8, or 4 at head_dim 96): each takes
    16 bytes of every span of gcd(row bytes, 128) bytes."""
    span = math.gcd(head_dim * element_bytes, head_dim_v * element_bytes,
                    CP_ASYNC_ROW_CHUNK_BYTES)
    return span // CP_ASYNC_COPY_BYTES


def cp_async_rows_per_pass(head_dim: int, head_dim_v: int,
                           element_bytes: int = ELEMENT_BYTES["bf16"]) -> int:
    """Rows one pass of the 128 producer threads copies (16, or 32 at head_dim 96): a key
    block read by cp.async is a whole number of passes."""
    return CP_ASYNC_THREADS // cp_async_row_threads(head_dim, head_dim_v, element_bytes)


def min_page(arch: str, head_dim: int, head_dim_v: int) -> int:
    """The smallest page `arch`'s kernel reads at these head dims: 1 where pages no TMA read
    fits go through cp.async (`page_loader`), else the TMA gather's `min_gather_page`."""
    if arch_key(arch) in CP_ASYNC_PAGES_BELOW:
        return 1
    return min_gather_page(head_dim, head_dim_v)


def page_fits(page_size: int, n_block: int, min_page: int = 1) -> bool:
    """Whether key blocks of `n_block` rows can read pages of `page_size` tokens: one TMA box
    per block (a multiple of n_block) or a gather of n_block / page_size pages per block (a
    divisor of n_block that is a multiple of `min_page`, `min_gather_page`: down to pages of
    one token). Note [paged key blocks] in fa4lab.kernels.device.paged."""
    return page_size % n_block == 0 or (n_block % page_size == 0 and page_size % min_page == 0)


def key_block_for_pages(n_block: int, page_size: int | None, step: int = 16,
                        min_page: int = 1) -> int:
    """The key block a plan takes for pages of `page_size`: its tuned `n_block` when the pages
    fit it, else the widest multiple of `step` below it that they fit (pages of 64, 128 or 256
    at head_dim 256, whose tuned blocks are 80 keys, take blocks of 64; pages of 24, blocks of
    96). A smaller block
    costs some speed, never an answer; `n_block` itself when no block fits (the kernel's
    check then names the page sizes that do)."""
    if page_size is None or page_fits(page_size, n_block, min_page):
        return n_block
    fits = [n for n in range(n_block - n_block % step, step - 1, -step)
            if page_fits(page_size, n, min_page)]
    return fits[0] if fits else n_block


# ---- the online softmax ---------------------------------------------------------------------
# FA4's threshold for conditional rescaling, in log2 units: the stale max is kept until the
# true max exceeds it by more than 2**8 = 256x (see notebook 01 and Note [conditional rescale]).
RESCALE_THRESHOLD = 8.0
# Each kernel's threshold.
# Note [rescale threshold by arch]: a stale max costs precision, since
# the row's largest P is then 2**x, x in (0, 8], rounded to 16 bits before P V, where a fresh
# max makes it exactly 1. The B200 pays it to keep the correction warpgroup's TMEM round trips
# off most blocks (as upstream FA4's sm100 kernel does). On Hopper O lives in the consumer's
# registers and a rescale is dv / 2 FMULs per thread (skipped for a warp whose rows all kept
# their max), so the sm90 kernel rescales whenever the max grows, as upstream's sm90 kernel
# does: at 8, its max error over 72 bf16 shapes on the H200 averaged 1.14-1.27x SDPA's (up to
# 2.2x), FA4's 1.00x (benchmarks/2026-12-02_nvidia-h200_precision.txt: the run, both
# thresholds and the speed of each).
RESCALE_THRESHOLDS = {"sm100": RESCALE_THRESHOLD, "sm90": 0.0}


# ---- software exp2 --------------------------------------------------------------------------
# 2**f ~ c0 + c1 f + c2 f**2 + c3 f**3 on [0, 1): the relative-error minimax cubic with c0 = 1
# pinned (p(0) = 1 bit for bit, so 2**n is exact at integers), in float32. The sm100 kernel's
# PTX (fa4lab.kernels.device.exp2) and its numpy replay, the lesson's `exp2_poly3`
# (fa4lab.online_softmax, whose `fit_exp2_poly3(exact_at_zero=True)` shows how it is fitted),
# use this tuple. See Note [software exp2] in fa4lab.online_softmax.
EXP2_POLY3 = (1.0, 0.69511664, 0.2276457, 0.07706641)
# Its measured max |p(f) / 2**f - 1| in float32 arithmetic over x in [-125, 8] (the range P is
# evaluated on with RESCALE_THRESHOLD = 8): about 2**-13.5, far below bf16's 2**-8 rounding of
# P. tests/test_online_softmax.py measures it.
EXP2_POLY3_MAX_REL_ERROR = 8.6e-05
# The range reduction's two constants: adding 1.5 * 2**23 with round-toward-minus-infinity
# leaves floor(x) in the low mantissa bits; inputs are clamped at -127, which gives +0.0.
EXP2_ROUND_MAGIC = 12582912.0
EXP2_CLAMP_LOW = -127.0
# The sm100 kernel runs it on f32x2 pairs (Note [packed exp2] in fa4lab.kernels.device.exp2):
# per PAIR of elements, the range reduction's add.rm, sub, sub are FADD2s and the cubic's Horner
# steps FFMA2s; the clamp (FMNMX) and the exponent insert (LEA) stay scalar, on the ALU pipe.
# The cost model (fa4lab.plan.costs) prices these, the audit counts them in the binary.
EXP2_PAIR_FADD2 = 3
EXP2_PAIR_FFMA2 = len(EXP2_POLY3) - 1
# The largest exp2_emulation_fraction the sm100 plan asks for: what the softmax holds in its
# registers without spills, measured on the compiled matrix (tests/test_compile_sm100.py). The
# packed balance (Note [packed exp2 cost] in fa4lab.plan.costs) asks for 7/16, which spilled 2-4
# instructions in the one-Q-tile plan and at head_dim 128 causal; 5/16 still spilled 3 at
# head_dim 64 with a softcap; 3/16, upstream FA4's non-causal hd128 figure, spills none.
SM100_EXP2_FRACTION_MAX = 3 / 16
