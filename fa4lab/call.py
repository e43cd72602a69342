"""`check_call`: the one validation of a forward call, and the `Call` it returns.

    call = check_call(q, k, v, causal=True, window_size=(256, 0))
    call.spec              # the sized AttentionSpec: shapes, dtype, the mask in its one form
    call.for_kernel("sm90")  # the same call in the form the sm90 kernel builds (padded, copied)
    call.key("sm90")       # the KernelKey of the kernel that runs it
    call.backward_key("sm90")  # the BackwardKey of the backward kernel that differentiates it

Every forward entry point (`fa4lab.attention`, `attention_varlen`, their torch ops, the
one-arch `fa4lab.kernels.launch.attention_sm90` / `attention_sm100`, ring attention) calls
`check_call` once; what comes after takes the `Call` and checks nothing of it again. The launch
path reads its configuration from `Call.key` (a `fa4lab.plan.key.KernelKey`: the kernel's
identity) and its runtime values from the Call (`fa4lab.kernels.device.arguments.KernelArgs.of`).
The module sits at the plan's layer: a Call makes the plan layer's KernelKey, and nothing below
the plan imports it. See Note [one check per call].
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fa4lab.errors import InputError, InputTypeError, check_qkv_kinds, check_same_device
from fa4lab.plan.key import BackwardKey, KernelKey
from fa4lab.spec import (
    AttentionSpec,
    check_kernel_layout,
    check_qkv_shapes,
    check_sink_shape,
    check_tensors,
    spec_of,
)

# Note [one check per call]
# A call's arguments take one form after the entry point: `check_call` validates the tensors
# and every option once and describes the call by a sized `AttentionSpec` (whose construction
# is the options' check: the window in `normalize_mask`'s form, the scale, the cap, the head
# counts). `Call.for_kernel` brings the tensors to the form the kernel builds (Note [padded
# head dims] and Note [copied layouts] in fa4lab.canonical) and checks what the kernel needs
# besides the math once: bf16/fp16, a covered (head_dim, head_dim_v) pair, CUDA tensors.
# `Call.key` reads the kernel's identity off the spec (`fa4lab.plan.key.KernelKey`: which
# sides the window has, not their sizes), and `KernelArgs.of` the runtime values (the window's
# sizes, clamped: Note [runtime window] in fa4lab.kernels.compile). No later step re-checks a
# value or re-derives the mask: where one seems to need it, it reads the Call.
# An empty call (no query row or no key: Note [empty calls] in fa4lab.canonical) is checked
# the same way and flagged `empty`; its spec describes the options on one row and one key, the
# sizes AttentionSpec can hold, and nothing plans or launches it.


@dataclass(frozen=True)
class Call:
    """A checked forward call: its tensors and the sized spec that describes them.

    q, k, v as given (dense (batch, seqlen, heads, d), packed (total, heads, d) with
    `lengths`, or a paged cache with `page_table`); `spec` its AttentionSpec: batch, seqlen_q
    and seqlen_k (a paged cache's keys per sequence; a varlen batch's longest sequences), the
    head counts and dims, dtype (q's where it is 16-bit, the kernels' dtypes; a float32/64
    call, which only the reference runs, says "bf16" as `AttentionSpec.from_tensors` does),
    the mask in `normalize_mask`'s form, softmax_scale (None: 1/sqrt(head_dim)), softcap,
    whether a sink comes, return_lse, varlen and page_size. `sink` the (heads_q,) float32
    learnable sink or None; `seqused_k` a padded launch's key counts (int32 (batch,)) or None;
    `lengths` a varlen call's `fa4lab.varlen.VarlenLengths`. The switches: pack_gqa and
    persistent None (choose) or a bool, num_splits None (choose) or >= 1; `mods` the
    `fa4lab.mods.KernelMods` of a score_mod / mask_mod (None without) and `aux` their aux
    tensors. `empty`: no query row or no key (Note [one check per call])."""

    q: object
    k: object
    v: object
    spec: AttentionSpec
    sink: object = None
    page_table: object = None
    seqused_k: object = None
    lengths: object = None
    pack_gqa: bool | None = None
    persistent: bool | None = None
    num_splits: int | None = None
    mods: object = None
    aux: tuple = ()
    empty: bool = False

    @property
    def window_size(self) -> tuple[int | None, int | None]:
        """The window in `fa4lab.spec.normalize_mask`'s form (with `spec.causal`)."""
        return self.spec.window_size

    def options(self) -> dict:
        """The mask and scoring options as `fa4lab.attention`'s keywords (causal,
        softmax_scale, window_size, softcap, learnable_sink), checked: for another call with
        this call's options (a batch run one sequence at a time, the reference)."""
        s = self.spec
        return dict(causal=s.causal, softmax_scale=s.softmax_scale, window_size=s.window_size,
                    softcap=s.softcap, learnable_sink=self.sink)

    def for_kernel(self, arch: str, pad: bool = True) -> Call:
        """This call in the form the `arch` kernel builds, checked once for what the kernel
        needs besides the math: bf16/fp16 inputs; with `pad` (the API) head dims the kernel
        does not build zero-padded to the smallest built pair that holds them and views TMA
        cannot read copied (`fa4lab.canonical.for_kernel`), without it (the one-arch entry
        points) a built pair and a TMA-readable layout required; CUDA tensors. The spec
        follows the tensors (padded head dims, the scale explicit where padding would change
        its default). Raises what `check_call` raises, naming the kernel's need."""
        import torch

        from fa4lab.limits import kernel_builds, unsupported_head_dims

        q, k, v = self.q, self.k, self.v
        if q.dtype not in (torch.bfloat16, torch.float16):
            raise InputTypeError(f"the GPU kernels take bfloat16 or float16, got {q.dtype}; "
                                 f"cast with q.to(torch.bfloat16) (or run on CPU tensors for "
                                 f"the reference)")
        scale = self.spec.softmax_scale
        if pad:
            from fa4lab.canonical import for_kernel

            q, k, v, scale = for_kernel(arch, q, k, v, scale)
        elif not kernel_builds(arch, q.shape[-1], v.shape[-1]):
            raise InputError(unsupported_head_dims(arch, q.shape[-1], v.shape[-1]))
        check_kernel_layout(q=q, k=k, v=v)
        if not q.is_cuda:
            raise InputError(f"q is on {q.device}: the {arch} kernel needs CUDA tensors; move "
                             f"them with .cuda()")
        if q is self.q and k is self.k and v is self.v:
            return self
        spec = self.spec.with_(head_dim=q.shape[-1], head_dim_v=v.shape[-1],
                               softmax_scale=scale)
        return replace(self, q=q, k=k, v=v, spec=spec)

    def key(self, arch: str, split_kv: bool = False) -> KernelKey:
        """The `KernelKey` of the `arch` kernel that runs this call: the spec without its
        sizes, and the switches resolved for its shape -- pack_gqa None by
        `fa4lab.limits.pack_gqa_default` (never for varlen), on sm90 persistent None by
        `fa4lab.plan.sm90.persistent_default`. `split_kv`: the split-KV kernel, which returns
        no LSE and takes no sink (the combine gives both: `fa4lab.splitkv`)."""
        from fa4lab.limits import pack_gqa_default

        s = self.spec
        g = s.qhead_per_kvhead
        if s.varlen:
            packed = False
        elif self.pack_gqa is None:
            packed = pack_gqa_default(arch, g, s.seqlen_q, s.effective_window, s.head_dim)
        else:
            packed = self.pack_gqa and g > 1
        persistent = self.persistent
        if persistent is None and arch == "sm90":
            from fa4lab.plan.sm90 import persistent_default

            persistent = persistent_default(s.head_dim, s.head_dim_v, s.causal, s.seqlen_q,
                                            s.seqlen_k,
                                            ragged=s.varlen or s.page_size is not None)
        left, right = s.window_size
        return KernelKey(arch, s.head_dim, s.head_dim_v, s.dtype, s.causal, g,
                         s.return_lse and not split_kv, bool(s.softcap),
                         (left is not None, right is not None),
                         s.learnable_sink and not split_kv, persistent, packed, s.varlen,
                         bool(split_kv), s.page_size)

    def backward_key(self, arch: str = "sm90", deterministic: bool = False) -> BackwardKey:
        """The `BackwardKey` of the `arch` backward kernel on this call, read off the spec (its
        dtype, mask and GQA ratio as checked here; which sides the window has). For a Call in
        the kernel's form (`for_kernel`: a kernel dtype); `deterministic` orders dQ's additions
        (Note [deterministic dQ] in fa4lab.kernels.bwd_sm90). ValueError where the kernel does
        not build it (`fa4lab.plan.key.backward_unbuilt`)."""
        s = self.spec
        left, right = s.window_size
        return BackwardKey(s.head_dim, s.head_dim_v, s.dtype, s.causal, s.qhead_per_kvhead,
                           bool(s.softcap), (left is not None, right is not None),
                           bool(deterministic), arch)


def check_switches(pack_gqa=None, persistent=None, deterministic=False) -> None:
    """pack_gqa and persistent None (choose), True or False; deterministic a bool (the forward
    is deterministic whatever it says: it is accepted for upstream's signature)."""
    for name, value in (("pack_gqa", pack_gqa), ("persistent", persistent)):
        if value is not None and not isinstance(value, bool):
            raise InputTypeError(f"{name} must be None (choose), True or False, got {value!r}")
    if not isinstance(deterministic, bool):
        raise InputTypeError(f"deterministic must be True or False, got {deterministic!r}")


def _check_sink(learnable_sink, q) -> None:
    import torch

    if not isinstance(learnable_sink, torch.Tensor):
        raise InputTypeError(f"learnable_sink must be a torch.Tensor of shape (heads_q,) or "
                             f"None, got {type(learnable_sink).__name__}; wrap it with "
                             f"torch.as_tensor(sink, dtype=torch.float32, device=q.device)")
    check_sink_shape(learnable_sink, q.shape[-2])
    if learnable_sink.dtype != torch.float32:
        raise InputTypeError(f"learnable_sink has dtype {learnable_sink.dtype}: the sink "
                             f"logits are float32; cast with learnable_sink.float()")
    check_same_device("learnable_sink", learnable_sink.device, "q", q.device)


def check_call(q, k, v, *, causal=False, softmax_scale=None, window_size=(None, None),
               softcap=0.0, learnable_sink=None, return_lse=False, pack_gqa=None,
               persistent=None, deterministic=False, num_splits=None, score_mod=None,
               mask_mod=None, aux_tensors=None, page_table=None, seqused_k=None,
               lengths=None, arch: str | None = None, check_indices="device") -> Call:
    """The one input check of a forward call; returns the `Call` (Note [one check per call]).

    Checks: the switches (`check_switches`), num_splits (`fa4lab.splitkv.check_num_splits`),
    the mods and their aux tensors (`fa4lab.mods.check_mods`, none with split-KV); q, k, v
    torch tensors of one floating dtype on one device with shapes that agree: dense
    (`fa4lab.spec.check_qkv_shapes`), a paged cache with `page_table` (its shapes and table:
    `fa4lab.varlen.check_paged`, first) or a varlen batch whose `lengths`
    (`fa4lab.varlen.check_varlen`'s, made by the caller: they sit above the spec) are given;
    learnable_sink None or a float32 (heads_q,) tensor on q's device; then the options as the
    spec checks them (a positive finite scale, window_size a pair of ints or None agreeing
    with causal, softcap 0.0 or positive and finite). With `arch` ("sm90" / "sm100") the Call
    comes back in that kernel's form without padding (`Call.for_kernel(arch, pad=False)`: a
    built head-dim pair, TMA-readable layouts, CUDA tensors). Raises TypeError or ValueError
    saying what is wrong and what to do; reads no tensor value (a paged table's values are
    checked as `fa4lab.varlen.check_paged` says, in `check_indices`' mode: a second Call of
    one call's tensors, as the backward's, passes False)."""
    from fa4lab.splitkv import check_num_splits

    check_switches(pack_gqa, persistent, deterministic)
    num_splits = check_num_splits(num_splits)
    if lengths is not None:           # fa4lab.varlen.check_varlen checked the layout
        batch, seqlen_q, seqlen_k = lengths.batch, lengths.max_seqlen_q, lengths.max_seqlen_k
        no_keys = (k.shape[0] == 0) if page_table is None else (page_table.shape[1] == 0)
        empty = q.shape[0] == 0 or no_keys
    elif page_table is not None:
        from fa4lab.varlen import check_paged

        seqlen_k = check_paged(q, k, v, page_table, check_indices=check_indices)
        batch, seqlen_q = q.shape[0], q.shape[1]
        empty = q.numel() == 0 or seqlen_k == 0
    else:
        check_tensors(q, k, v)
        check_qkv_shapes(q, k, v)
        batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
        empty = q.numel() == 0 or seqlen_k == 0
    check_qkv_kinds(q, k, v)
    if learnable_sink is not None:
        _check_sink(learnable_sink, q)
    spec = spec_of(batch=max(int(batch), 1), seqlen_q=max(int(seqlen_q), 1),
                   seqlen_k=max(int(seqlen_k), 1), heads_q=q.shape[-2], heads_kv=k.shape[-2],
                   head_dim=q.shape[-1], head_dim_v=v.shape[-1],
                   dtype=q.dtype if "float16" in str(q.dtype) else "bf16", causal=causal,
                   softmax_scale=softmax_scale, return_lse=return_lse,
                   window_size=window_size, softcap=softcap,
                   learnable_sink=learnable_sink is not None, varlen=lengths is not None,
                   page_size=None if page_table is None else k.shape[1])
    mods, aux = None, ()
    if score_mod is not None or mask_mod is not None or aux_tensors is not None:
        from fa4lab.mods import check_mods, refuse_split_with_mods

        mods, aux = check_mods(score_mod, mask_mod, aux_tensors, q.device)
        refuse_split_with_mods(num_splits not in (None, 1), bool(mods), num_splits)
        mods = mods if mods else None
    call = Call(q, k, v, spec, learnable_sink, page_table, seqused_k, lengths, pack_gqa,
                persistent, num_splits, mods, aux, bool(empty))
    return call if arch is None else call.for_kernel(arch, pad=False)
