"""The varlen kernel on a Hopper GPU (marker `sm90`): `fa4lab.attention_varlen` in one launch.

Each sequence is held to tests/kernel_checks.py's rule against the float64
`attention_varlen_reference`: max error at most twice the error of PyTorch's own 16-bit
attention of that sequence (`torch_same_dtype`) plus ATOL (one output ulp with extreme logits);
rows that see no key exactly 0 with LSE -inf (the sink's logit with a sink); no NaN; LSE to
1e-3 + 1e-5 |lse|; two runs bit for bit. The whole output is compared, every sequence's first
and last rows included, so a tile that wrote past its sequence's end (into the next one) fails.

Batches (trimmed; each (head_dim, causal, window sides, softcap, sink) is one compile, every
batch of lengths and window size a runtime argument): empty sequences on either side, length-1
sequences, seqlen_q > seqlen_k and < seqlen_k per sequence, tails, a long sequence beside short
ones; GQA 4; seqused_k below cu_seqlens_k's lengths (0 included); logits of 1e4.
"""

from __future__ import annotations

import functools
import math

import pytest

torch = pytest.importorskip("torch")

from kernel_checks import (  # noqa: E402
    ATOL,
    check_sequences,
    output_ulp_atol,
    replays_in_a_cuda_graph,
)

pytestmark = pytest.mark.sm90

# (len_q, len_k) per sequence: empty both ways, single rows, seqlen_q > seqlen_k (causal leaves
# the top rows without a key), tails of m_block and n_block, a long sequence among short ones.
BATCHES = [
    [(0, 5), (1, 1), (130, 0), (17, 1000), (1000, 17), (0, 0), (300, 777)],
    [(1, 300), (64, 64), (129, 128), (1, 1), (2000, 2500), (5, 3)],
    [(1000, 4097)],
]


def _batch(lengths, hq, hkv, d, seed, dtype=torch.bfloat16, q_scale=1.0):
    """Packed q, k, v (standard normal, q times q_scale) and the int32 cu_seqlens."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    lq, lk = [a for a, _ in lengths], [b for _, b in lengths]
    q = torch.randn(sum(lq), hq, d, device="cuda", generator=g) * q_scale
    k = torch.randn(sum(lk), hkv, d, device="cuda", generator=g)
    v = torch.randn(sum(lk), hkv, d, device="cuda", generator=g)

    def cu(lens):
        return torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()),
                            dtype=torch.int32, device="cuda")

    return q.to(dtype), k.to(dtype), v.to(dtype), cu(lq), cu(lk)


def _check(q, k, v, cu_q, cu_k, *, seqused_k=None, causal=False, window_size=(None, None),
           softcap=0.0, learnable_sink=None, atol=ATOL):
    from fa4lab import attention_varlen
    from fa4lab.reference import attention_varlen_reference

    cq, ck = cu_q.tolist(), cu_k.tolist()
    lens_q = [b - a for a, b in zip(cq, cq[1:])]
    lens_k = seqused_k.tolist() if seqused_k is not None else [b - a for a, b in zip(ck, ck[1:])]
    opts = dict(causal=causal, window_size=window_size, softcap=softcap,
                learnable_sink=learnable_sink)

    def run():
        return attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                seqused_k=seqused_k, return_lse=True, **opts)

    (out, lse), (out2, lse2) = run(), run()
    assert torch.equal(out, out2) and torch.equal(lse, lse2), "two runs differ"
    ref, ref_lse = attention_varlen_reference(q, k, v, cu_q, cu_k, seqused_k=seqused_k,
                                              return_lse=True, **opts)
    check_sequences(out, lse, ref, ref_lse, q, cq, lens_k,
                    lambda b: (k[ck[b]:ck[b] + lens_k[b]], v[ck[b]:ck[b] + lens_k[b]]), opts,
                    atol=atol)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_varlen_batches(head_dim, causal):
    for i, lengths in enumerate(BATCHES):
        _check(*_batch(lengths, 8, 2, head_dim, seed=9000 + 10 * head_dim + i), causal=causal)


@pytest.mark.parametrize("causal,window", [(False, (50, None)), (False, (30, 70)),
                                           (True, (100, 0)), (False, (None, 1))])
def test_varlen_windows(causal, window):
    for i, lengths in enumerate(BATCHES[:2]):
        _check(*_batch(lengths, 8, 2, 128, seed=9100 + i), causal=causal, window_size=window)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_softcap_and_sink(causal):
    g = torch.Generator(device="cuda").manual_seed(9200)
    sink = torch.randn(8, device="cuda", generator=g) * 2
    sink[1:4] = torch.tensor([30.0, -math.inf, -30.0], device="cuda")
    for i, lengths in enumerate(BATCHES[:2]):
        batch = _batch(lengths, 8, 2, 128, seed=9210 + i)
        _check(*batch, causal=causal, softcap=30.0)
        _check(*batch, causal=causal, learnable_sink=sink, window_size=(40, None))


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_seqused_k(causal):
    """seqused_k caps each sequence's keys (0 included); the keys past it are never seen."""
    lengths = BATCHES[0]
    q, k, v, cu_q, cu_k = _batch(lengths, 8, 2, 128, seed=9300)
    used = torch.tensor([min(lk, u) for (_, lk), u in zip(lengths, [3, 1, 0, 600, 5, 0, 777])],
                        dtype=torch.int32, device="cuda")
    _check(q, k, v, cu_q, cu_k, seqused_k=used, causal=causal)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_varlen_extreme_logits(head_dim):
    q, k, v, cu_q, cu_k = _batch(BATCHES[1], 8, 2, head_dim, seed=9400, q_scale=100.0)
    for causal in (False, True):
        _check(q, k, v, cu_q, cu_k, causal=causal, atol=output_ulp_atol(v, "bf16"))


def test_varlen_matches_one_call_per_sequence_bit_for_bit():
    """The varlen kernel computes each tile as the padded kernel computes that sequence alone
    (same plan, same blocks in the same order; the next sequence's rows a tile reads are masked
    keys, P = 0 exactly, or rows never stored): the outputs agree exactly."""
    from fa4lab import attention, attention_varlen

    q, k, v, cu_q, cu_k = _batch(BATCHES[1], 8, 2, 128, seed=9500)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for causal in (False, True):
        out, lse = attention_varlen(q, k, v, cu_q, cu_k, 2000, 2500, causal=causal,
                                    return_lse=True)
        for b in range(len(cq) - 1):
            o_b, lse_b = attention(q[None, cq[b]:cq[b + 1]], k[None, ck[b]:ck[b + 1]],
                                   v[None, ck[b]:ck[b + 1]], causal=causal, return_lse=True,
                                   pack_gqa=False)
            assert torch.equal(out[cq[b]:cq[b + 1]], o_b[0]), (causal, b)
            assert torch.equal(lse[:, cq[b]:cq[b + 1]], lse_b[0]), (causal, b)


def test_varlen_without_keys_and_one_compile():
    """A batch with no key at all (total_k 0) gives O = 0, LSE -inf; new lengths compile
    nothing new."""
    from fa4lab import attention_varlen
    from fa4lab.kernels import launch

    q, k, v, cu_q, cu_k = _batch([(3, 0), (0, 0), (70, 0)], 8, 2, 128, seed=9600)
    out, lse = attention_varlen(q, k, v, cu_q, cu_k, 70, 0, return_lse=True)
    assert (out == 0).all() and (lse == -math.inf).all()
    attention_varlen(*_batch(BATCHES[0], 8, 2, 128, seed=9601), 1000, 1000)
    misses = launch.stats()["misses"]
    attention_varlen(*_batch(BATCHES[1], 8, 2, 128, seed=9602), 2000, 2500)
    assert launch.stats()["misses"] == misses, "new lengths compiled a new kernel"


def test_varlen_never_waits_for_the_gpu_and_replays_in_a_cuda_graph():
    """The launch reads no length on the host (Note [reading the lengths] in fa4lab.varlen):
    with check_indices=False or "device" (the default) the call never synchronises, and a CUDA
    graph captured once (the check skips itself in a capture) replays other lengths with the
    same totals, an empty sequence and the padding rows of the tile table included, as eager
    calls compute them."""
    from fa4lab import attention_varlen

    first = BATCHES[1]
    second = [(0, 996), (2000, 2000), (64, 0), (130, 0), (5, 0), (1, 0)]
    q, k, v, cu_q, cu_k = _batch(first, 8, 2, 128, seed=9700)
    _, _, _, cu_q2, cu_k2 = _batch(second, 8, 2, 128, seed=9701)
    assert (cu_q2[-1], cu_k2[-1]) == (cu_q[-1], cu_k[-1])
    _check(q, k, v, cu_q2, cu_k2, causal=True)          # eager, against the reference
    buf_q, buf_k = cu_q.clone(), cu_k.clone()
    settings = [(cu_q, cu_k), (cu_q2, cu_k2)]
    # The default device check never waits (Note [index check on the device] in
    # fa4lab.indexcheck); check_indices=True reads the values once: it synchronises.
    for check in (False, "device", True):
        call = functools.partial(attention_varlen, q, k, v, buf_q, buf_k, 2000, 2500,
                                 causal=True, return_lse=True, check_indices=check)
        replays_in_a_cuda_graph(call, (buf_q, buf_k), settings, synchronises=check is True)
