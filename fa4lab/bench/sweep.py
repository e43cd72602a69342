"""What a `fa4lab bench` run covers: the shapes of the standard sweep and the providers' names.

Every point moves the same total tokens through the same hidden size: heads = hidden /
head_dim and batch = total_tokens / seqlen, with seqlen_q == seqlen_k and no GQA.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from fa4lab.limits import equal_head_dims
from fa4lab.spec import AttentionSpec, normalize_dtype

# ---- the standard sweep ---------------------------------------------------------------------
TOTAL_TOKENS = 16384
HIDDEN = 2048
# The sweep's own points, fixed so that records of different commits compare shape for shape.
HEAD_DIMS = (64, 128, 256)
SEQLENS = (1024, 2048, 4096, 8192, 16384)
QUICK_HEAD_DIMS = (128,)
QUICK_SEQLENS = (4096, 8192)
# A head dim that some fa4lab kernel builds with head_dim_v == head_dim, as the bench's shapes
# have (upstream FA4's tuned paths cover the same).
SUPPORTED_HEAD_DIMS = equal_head_dims()

# ---- providers ------------------------------------------------------------------------------
OURS = "fa4lab"
# fa4lab with pack_gqa=False: `--decode` measures it beside fa4lab's default (which packs the
# query heads of a KV head when GQA allows it); the sweep has no GQA, so it never runs there.
UNPACKED = "fa4lab-unpacked"
# fa4lab's kernel with its plan's `persistent` switch forced either way (Note [sm90 persistent
# CTAs] in fa4lab.plan.sm90): measured beside the default to choose it. Asked for by name only.
PERSISTENT = "fa4lab-persistent"
ONE_TILE = "fa4lab-onetile"
VARIANTS = (PERSISTENT, ONE_TILE)
PEERS = ("sdpa-flash", "sdpa-cudnn", "fa4")
PROVIDERS = (OURS, UNPACKED) + VARIANTS + PEERS
PROVIDER_LABELS = {
    OURS: "fa4lab",
    UNPACKED: "fa4lab, pack_gqa=False",
    PERSISTENT: "fa4lab, persistent CTAs",
    ONE_TILE: "fa4lab, one CTA per tile",
    "sdpa-flash": "PyTorch SDPA (flash)",
    "sdpa-cudnn": "PyTorch SDPA (cuDNN)",
    "fa4": "upstream FA4 (flash-attn-4)",
}


@dataclass(frozen=True)
class BenchShape:
    """One point of the sweep: q, k, v are (batch, seqlen, heads, head_dim); Sq == Sk."""

    head_dim: int
    seqlen: int
    causal: bool
    batch: int
    heads: int
    dtype: str = "bf16"

    @property
    def spec(self) -> AttentionSpec:
        return AttentionSpec(self.batch, self.seqlen, self.seqlen, self.heads, self.heads,
                             self.head_dim, dtype=self.dtype, causal=self.causal)

    @property
    def flops(self) -> float:
        return self.spec.flops()

    @property
    def key(self) -> tuple[int, bool, int]:
        return (self.head_dim, self.causal, self.seqlen)

    def label(self) -> str:
        mask = "causal" if self.causal else "full"
        return f"hd{self.head_dim} {mask} s{self.seqlen} (b{self.batch} h{self.heads})"


def parse_causal(value: str) -> tuple[bool, ...]:
    """'both' -> (False, True); 'true'/'false' -> one of them."""
    v = str(value).strip().lower()
    table = {"both": (False, True), "true": (True,), "false": (False,), "yes": (True,),
             "no": (False,), "1": (True,), "0": (False,)}
    if v not in table:
        raise ValueError(f"--causal {value!r}: use 'both', 'true' or 'false'")
    return table[v]


def sweep(head_dims: Iterable[int] = HEAD_DIMS, seqlens: Iterable[int] = SEQLENS,
          causal: Iterable[bool] = (False, True), *, total_tokens: int = TOTAL_TOKENS,
          hidden: int = HIDDEN, dtype: str = "bf16") -> list[BenchShape]:
    """The shapes of a sweep, ordered head_dim, causal, seqlen.

    heads = hidden // head_dim and batch = total_tokens // seqlen, so every point moves the same
    number of tokens and the same hidden size; a head_dim or seqlen that does not divide them
    is an error that says which values would.
    """
    dtype = normalize_dtype(dtype)
    head_dims, seqlens, causal = list(head_dims), list(seqlens), list(causal)
    if not head_dims or not seqlens or not causal:
        raise ValueError("empty sweep: give at least one --head-dim, one --seqlen and --causal")
    for name, value in (("total_tokens", total_tokens), ("hidden", hidden)):
        if int(value) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    shapes = []
    for d in head_dims:
        if d not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"--head-dim {d} is not supported: the kernels and peers are built "
                             f"for head_dim in {SUPPORTED_HEAD_DIMS}")
        if hidden % d:
            raise ValueError(f"--head-dim {d} does not divide --hidden {hidden} (heads = hidden /"
                             f" head_dim): choose a head_dim in "
                             f"{[x for x in SUPPORTED_HEAD_DIMS if hidden % x == 0]}")
        for c in causal:
            for s in seqlens:
                if s < 1 or total_tokens % s:
                    ok = [x for x in SEQLENS if total_tokens % x == 0]
                    raise ValueError(
                        f"--seqlen {s} does not divide --total-tokens {total_tokens} "
                        f"(batch = total_tokens / seqlen): choose a divisor such as {ok}, or "
                        f"change --total-tokens")
                shapes.append(BenchShape(d, s, bool(c), total_tokens // s, hidden // d, dtype))
    return shapes


def shape_for(head_dim: int, seqlen: int, causal: bool, *, total_tokens: int = TOTAL_TOKENS,
              hidden: int = HIDDEN, dtype: str = "bf16") -> BenchShape:
    """The standard-sweep shape at (head_dim, seqlen, causal)."""
    (shape,) = sweep([head_dim], [seqlen], [causal], total_tokens=total_tokens, hidden=hidden,
                     dtype=dtype)
    return shape
