"""A varlen batch's index work done once for every layer that attends over it.

A model calls `fa4lab.attention_varlen` once per layer with the same cu_seqlens, seqused and
page table. `scheduler_metadata` (upstream FA4's name for the same idea) does the work those
tensors alone decide: upstream's forms made packed (`fa4lab.varlen_forms`), the value check
(`check_indices`, once), the launch's key counts and tile tables (one per kernel tiling, made
at the first call that needs it). `attention_varlen(..., scheduler_metadata=m)` then skips all
of it (Note [scheduler metadata]).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fa4lab.errors import InputError

# Note [scheduler metadata]
# A varlen call's host work grows with what it derives from the index tensors: the value
# check, the phantom sequences of seqused_q, the cu_seqlens and key counts of the launch and
# its tile table (Note [launch tile table] in fa4lab.varlen_tiles) are each a few small GPU ops,
# about 35 of them, 1.5 ms of host time per call on the H200's host where FA4's whole call
# takes 0.1-0.2 ms (torch profiler, 8 sequences). They depend on the index tensors only, so a
# `SchedulerMetadata` made once per batch holds them, and the calls that take it do none of
# that work. The contract, as upstream's: the index tensors passed with the metadata are the
# ones it was made from (the same objects: checked), unchanged since (not checked: their
# values are on the GPU; change one and make new metadata), and q, k, v have the shapes it was
# made for (checked). The tile tables are kept per kernel tiling (rows per CTA, causal,
# window), so layers that run different kernels share it too. Under torch.compile or another
# tracer the metadata is not used: the op derives what it needs itself (the same answer).


@dataclass(eq=False)
class SchedulerMetadata:
    """What `scheduler_metadata` derived from a batch's index tensors (Note [scheduler
    metadata]): the caller's tensors (`given`), the packed form's (`index`: cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, page_table, after seqused_q's phantom
    sequences), the shapes of the packed q, k, v, the checked `lengths` and the launch's
    per-tiling tables (`launch`, filled by `fa4lab.kernels.launch.forward_varlen`)."""

    given: tuple
    index: tuple
    shapes: tuple
    dense_q: tuple | None
    lengths: object
    launch: dict = field(default_factory=dict)

    def form_for(self, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                 page_table):
        """The call's `fa4lab.varlen_forms.VarlenForm` with this metadata's index tensors, or
        an InputError naming what differs from what it was made for."""
        from fa4lab.varlen_forms import VarlenForm, dense_kv, dense_q

        names = ("cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "page_table")
        for name, mine, theirs in zip(names, self.given, (cu_seqlens_q, cu_seqlens_k,
                                                            seqused_q, seqused_k, page_table)):
            if mine is not theirs:
                raise InputError(f"scheduler_metadata was made for another {name} (it takes "
                                 f"the same tensors it was made from, unchanged): pass that "
                                 f"one, or make new metadata with fa4lab.scheduler_metadata")
        q = dense_q(q, cu_seqlens_q, None)[0]
        k, v = dense_kv(k, v, cu_seqlens_k, None, page_table)[:2]
        got = tuple(tuple(t.shape) for t in (q, k, v))
        if got != self.shapes:
            raise InputError(f"scheduler_metadata was made for q, k, v of shapes {self.shapes} "
                             f"(packed), this call has {got}: make metadata for these shapes")
        return VarlenForm(q, k, v, *self.index, self.dense_q)


def scheduler_metadata(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                       max_seqlen_k=None, *, seqused_q=None, seqused_k=None, page_table=None,
                       check_indices: bool | str = "device") -> SchedulerMetadata:
    """The index work of `fa4lab.attention_varlen` on these arguments (the same names and
    forms), done once: pass the result as `attention_varlen(..., scheduler_metadata=...)` with
    the same index tensors for every layer of the batch (Note [scheduler metadata]). The values
    are checked here, as `check_indices` says (`attention_varlen`'s modes), and not again by
    the calls that take the metadata. q, k, v give the shapes (any layer's)."""
    from fa4lab.varlen import check_varlen
    from fa4lab.varlen_forms import varlen_form, with_seqused_q

    given = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table)
    form = varlen_form(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       seqused_q, seqused_k, page_table)
    q, k, v, cu_q, cu_k, max_q, max_k, used_k, table = form[:9]
    lengths = check_varlen(q, k, v, cu_q, cu_k, max_q, max_k, used_k, table,
                           check_indices=check_indices)
    if seqused_q is not None:
        cu_q, cu_k, used_k, table = with_seqused_q(q, cu_q, cu_k, seqused_q, used_k, table,
                                                   None if table is None else int(k.shape[1]))
        lengths = check_varlen(q, k, v, cu_q, cu_k, max_q, max_k, used_k, table,
                               check_indices=False)
    return SchedulerMetadata(given, (cu_q, cu_k, max_q, max_k, used_k, table),
                             tuple(tuple(t.shape) for t in (q, k, v)), form.dense_q, lengths)
