"""The identity of one compiled forward kernel, and its one name.

    from fa4lab.plan.key import KernelKey
    key = KernelKey("sm90", 128, 128, "bf16", causal=True, qhead_per_kvhead=4)
    key.name        # "sm90a-hd128-causal-gqa4-nolse-bf16-onetile"
    key.plan()      # the plan the kernel is compiled from
    key.disk_key    # where `fa4lab.kernels.cache` keeps it

A kernel bakes in what the call cannot change at run time: the arch, the head dims, the dtype,
the mask's kind (causal, which sides a window has: Note [runtime window] in
fa4lab.kernels.compile), the GQA ratio, the switches (LSE, softcap, learnable sink, persistent
CTAs, pack-GQA) and the layout (varlen, split-KV, paged and its page size). `KernelKey` is that
list and nothing else: the launch makes one per call (`fa4lab.call.Call.key` resolves the
defaults from the call's shape first), the kernel caches are keyed by it, and its `name` is
the one name a kernel has, in the disk cache and in the folder of its kept PTX and cubin
(`fa4lab.kernels.compile.compile_forward`, which adds what only an audit compiles: other tiles,
mutated barriers, mods).

`BackwardKey` is the same for one compiled backward kernel (`fa4lab.kernels.launch_backward`):
`fa4lab.call.Call.backward_key` makes it from a checked call, and `backward_unbuilt` is the one
list of what the backward kernels build.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from fa4lab.digest import digest
from fa4lab.limits import KERNEL_HEAD_DIMS
from fa4lab.spec import AttentionSpec


def config_name(spec: AttentionSpec, arch: str) -> str:
    """e.g. "sm100a-hd128-causal-gqa4-lse-bf16" ("hd192x128" when head_dim_v differs): what a
    compiled kernel of `spec` bakes in (`arch` as the compiler spells it, "sm90a" / "sm100a")."""
    s = spec
    hd = f"{s.head_dim}" + (f"x{s.head_dim_v}" if s.head_dim_v != s.head_dim else "")
    left, right = s.window_size     # its sides, not their sizes: Note [runtime window]
    window = ("L" if left is not None else "") + ("R" if right is not None else "")
    return (f"{arch}-hd{hd}-{'causal' if s.causal else 'full'}-gqa{s.qhead_per_kvhead}-"
            f"{'lse' if s.return_lse else 'nolse'}-{s.dtype}" + ("-softcap" if s.softcap else "")
            + (f"-window{window}" if window else "") + ("-sink" if s.learnable_sink else "")
            + ("-varlen" if s.varlen else "")
            + (f"-page{s.page_size}" if s.page_size is not None else "")
            + ("-splitkv" if s.split_kv else ""))


def switches_suffix(pack_gqa: bool, persistent: bool | None) -> str:
    """The name's tail for the two switches a spec does not hold."""
    return (("-packgqa" if pack_gqa else "")
            + {None: "", True: "-persistent", False: "-onetile"}[persistent])


@dataclass(frozen=True, slots=True)
class KernelKey:
    """One compiled forward kernel (see the module's doc). `arch` "sm90" or "sm100"; `dtype`
    "bf16" or "fp16"; `window_sides` (left, right): which sides a window has; `persistent`
    None where the arch decides (sm100) or a resolved bool (sm90)."""

    arch: str
    head_dim: int
    head_dim_v: int
    dtype: str
    causal: bool
    qhead_per_kvhead: int
    return_lse: bool = False
    softcap: bool = False
    window_sides: tuple[bool, bool] = (False, False)
    sink: bool = False
    persistent: bool | None = None
    pack_gqa: bool = False
    varlen: bool = False
    split_kv: bool = False
    page_size: int | None = None

    def spec(self) -> AttentionSpec:
        """A canonical spec of the key: one batch, one KV head, 128 rows, and sizes the plan
        ignores (a window side's size included) where the key holds none. Made once per key
        (its name, its disk key and its plan read it)."""
        return _canonical_spec(self)

    def plan(self):
        """The plan the kernel is compiled from: the canonical spec with the key's switches."""
        from fa4lab.plan.forward import plan_forward

        return plan_forward(self.spec(), arch=self.arch, pack_gqa=self.pack_gqa,
                            persistent=self.persistent)

    @property
    def name(self) -> str:
        """The kernel's one name (disk cache, kept artifacts): e.g.
        "sm90a-hd64-causal-gqa8-nolse-bf16-packgqa-onetile"."""
        return (config_name(self.spec(), self.arch + "a")
                + switches_suffix(self.pack_gqa, self.persistent))

    @property
    def disk_key(self) -> str:
        """Where `fa4lab.kernels.cache` files the compiled kernel."""
        return "fwd-" + digest(self.name)


@cache
def _canonical_spec(key: KernelKey) -> AttentionSpec:
    left, right = key.window_sides
    return AttentionSpec(1, 128, 128, key.qhead_per_kvhead, 1, key.head_dim, key.head_dim_v,
                         dtype=key.dtype, causal=key.causal, return_lse=key.return_lse,
                         softcap=1.0 if key.softcap else 0.0,
                         window_size=(0 if left else None, 1 if right else None),
                         learnable_sink=key.sink, varlen=key.varlen, split_kv=key.split_kv,
                         page_size=key.page_size)


# The (head_dim, head_dim_v) pairs each backward kernel builds, unpadded: the sm90 kernel the
# forward's (fa4lab.kernels.bwd_sm90); the sm100 kernel its plan's 1-CTA head dims whose column
# halves split evenly between its two compute warpgroups (fa4lab.kernels.bwd_sm100).
BACKWARD_HEAD_DIMS = {"sm90": KERNEL_HEAD_DIMS["sm90"], "sm100": ((64, 64), (128, 128))}


def backward_unbuilt(arch: str, head_dim: int, head_dim_v: int, qhead_per_kvhead: int = 1,
                     softcap: bool = False, window: tuple[bool, bool] = (False, False),
                     deterministic: bool = False) -> str | None:
    """What the backward kernel of `arch` does not build of a configuration, in words, or None:
    the one statement of it (a `BackwardKey` refuses it, and `fa4lab.kernels.launch_backward
    .unbuilt` names it to the user). The sm100 kernel builds MHA and GQA without a cap, a
    window or deterministic dQ so far (Note [sm100 backward, first version] in
    fa4lab.kernels.bwd_sm100)."""
    built = BACKWARD_HEAD_DIMS.get(arch)
    if built is None:
        return f"a backward kernel for {arch!r} (one is built for {', '.join(BACKWARD_HEAD_DIMS)})"
    dims = (head_dim, head_dim_v)
    if dims not in built:
        return f"head dims {dims} in the {arch} backward kernel (it builds {built})"
    if arch == "sm100":
        for what, on in (("softcap", softcap),
                         ("a sliding window", any(window)),
                         ("deterministic dQ", deterministic)):
            if on:
                return f"{what} in the sm100 backward kernel"
    return None


@dataclass(frozen=True)
class BackwardKey:
    """What one compiled backward kernel bakes in; every size, the scale, the cap's value and
    the window's sizes are runtime values (Note [runtime scale], Note [runtime window] in
    fa4lab.kernels.compile). Made from a checked call by `fa4lab.call.Call.backward_key`; a key
    the kernel does not build (`backward_unbuilt`) is a ValueError. The sm90 tiles are this
    class's table, the same for every key so far (Note [sm90 backward, first version] in
    fa4lab.kernels.bwd_sm90)."""

    head_dim: int
    head_dim_v: int
    dtype: str                          # "bf16" | "fp16"
    causal: bool
    qhead_per_kvhead: int
    softcap: bool = False               # capped scores (the cap is a runtime value)
    window: tuple[bool, bool] = (False, False)   # which sides of a window exist
    deterministic: bool = False         # Note [deterministic dQ] in fa4lab.kernels.bwd_sm90
    arch: str = "sm90"                  # "sm90" (bwd_sm90) | "sm100" (bwd_sm100, from its plan)

    # The sm90 kernel's tiles and threads (one table, read by the kernel and the host): query
    # rows per block, keys per block, threads per CTA, warps along M of each MMA. The sm100
    # kernel's come from its plan (`plan`).
    num_threads = 256
    warps_m = 4

    def __post_init__(self):
        lacks = backward_unbuilt(self.arch, self.head_dim, self.head_dim_v,
                                 self.qhead_per_kvhead, self.softcap, self.window,
                                 self.deterministic)
        if lacks is not None:
            raise ValueError(f"{lacks} is not built")

    @property
    def m_block(self) -> int:
        return self.plan().tiles.m_block if self.arch == "sm100" else 64

    @property
    def n_block(self) -> int:
        return self.plan().tiles.n_block if self.arch == "sm100" else 64

    def plan(self):
        """The sm100 kernel's `BackwardPlan` (fa4lab.plan.backward.plan_backward): every number
        of its kernel; the sizes in its spec are placeholders (the kernel's are runtime), its
        heads one KV head's group (the kernel's GQA ratio). Made once per key: every launch
        reads its tiles."""
        return _backward_plan(self)

    @property
    def name(self) -> str:
        side = "".join("lr"[i] for i, on in enumerate(self.window) if on)
        return (f"bwd-{self.arch}a-hd{self.head_dim}x{self.head_dim_v}-{self.dtype}"
                f"{'-causal' if self.causal else ''}-g{self.qhead_per_kvhead}"
                f"{'-softcap' if self.softcap else ''}{'-window' + side if side else ''}"
                f"{'-det' if self.deterministic else ''}")


@cache
def _backward_plan(key: BackwardKey):
    from fa4lab.plan.backward import plan_backward

    return plan_backward(AttentionSpec(1, 1024, 1024, key.qhead_per_kvhead, 1, key.head_dim,
                                       key.head_dim_v, dtype=key.dtype, causal=key.causal))
