"""The default index check on the GPU (marker `gpu`; the kernels need sm90 or sm100).

`check_indices="device"` (Note [index check on the device] in fa4lab.indexcheck): the check
kernel's verdict equals the synchronous check's error on random good and bad index tensors;
a bad page id, cu_seqlens or seqused_k never faults and never writes outside the call's
outputs (each output is allocated inside sentinel-filled guards: `Guarded`), and the next
varlen / paged call, or `fa4lab.check_errors()`, raises an InputError naming the tensor and its
first bad index, with the values the call saw; a good call never synchronises and replays in a
CUDA graph. The CPU half (the kernel's logic replayed, the queue, the clamps): test_indexcheck.py.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kernel_checks import replays_in_a_cuda_graph  # noqa: E402
from test_indexcheck import _random_call  # noqa: E402

pytestmark = pytest.mark.gpu

I32 = torch.int32
PAD = 1 << 14          # guard elements on each side of an output (16-byte multiples)


def _drain():
    """Read every pending verdict, dropping their errors."""
    from fa4lab import check_errors, indexcheck
    from fa4lab.errors import InputError

    while indexcheck.pending():
        try:
            check_errors()
        except InputError:
            pass


@pytest.fixture(autouse=True)
def kernel_gpu():
    from fa4lab.kernels.launch import device_arch

    arch = device_arch(torch.cuda.current_device())
    if arch is None:
        pytest.skip(f"the kernels are built for sm90 / sm100; here: "
                    f"{torch.cuda.get_device_name()}")
    _drain()              # nothing pending from another test
    yield arch
    _drain()


class Guarded:
    """Every CUDA tensor `torch.empty` makes while active is a view into the middle of a buffer
    whose PAD elements on each side hold a sentinel; `check` synchronises (a fault raises
    there) and asserts every guard and every `inputs` tensor is as it was."""

    def __init__(self, monkeypatch, inputs=()):
        self.buffers, self.inputs = [], [(t, t.clone()) for t in inputs]
        real = torch.empty

        def empty(*size, dtype=None, device=None, **kw):
            t = real(*size, dtype=dtype, device=device, **kw)
            if not t.is_cuda or t.numel() == 0:
                return t
            buf = real(PAD + t.numel() + PAD, dtype=t.dtype, device=t.device)
            buf.fill_(3)
            self.buffers.append((buf, t.numel()))
            return buf[PAD:PAD + t.numel()].view(t.shape)

        monkeypatch.setattr(torch, "empty", empty)
        self.monkeypatch = monkeypatch

    def check(self):
        torch.cuda.synchronize()
        self.monkeypatch.undo()
        assert self.buffers, "no output was allocated through torch.empty"
        for buf, n in self.buffers:
            assert (buf[:PAD] == 3).all() and (buf[PAD + n:] == 3).all(), "a write outside out"
        for t, before in self.inputs:
            assert torch.equal(t, before), "an input changed"


def _decode(batch=6, L=1, pages_per_seq=8, page_size=16, hq=16, hkv=2, d=128, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    num_pages = batch * pages_per_seq + 3
    q = torch.randn(batch * L, hq, d, device="cuda", generator=g).to(torch.bfloat16)
    k, v = (torch.randn(num_pages, page_size, hkv, d, device="cuda", generator=g)
            .to(torch.bfloat16) for _ in range(2))
    table = torch.randperm(num_pages, device="cuda", generator=g)[
        :batch * pages_per_seq].view(batch, pages_per_seq).to(I32)
    cu_q = (torch.arange(batch + 1, device="cuda") * L).to(I32)
    used = torch.randint(1, pages_per_seq * page_size + 1, (batch,), device="cuda",
                         generator=g).to(I32)
    return q, k, v, cu_q, table, used


def _packed(lens, hq=8, hkv=2, d=128, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    lens_q, lens_k = [a for a, _ in lens], [b for _, b in lens]
    q = torch.randn(sum(lens_q), hq, d, device="cuda", generator=g).to(torch.bfloat16)
    k, v = (torch.randn(sum(lens_k), hkv, d, device="cuda", generator=g).to(torch.bfloat16)
            for _ in range(2))

    def cu(x):
        return torch.tensor([0, *np.cumsum(x).tolist()], dtype=I32, device="cuda")

    return q, k, v, cu(lens_q), cu(lens_k)


def _raises_later(words, call_next):
    """The InputError of an earlier call's bad indices, at `call_next()`."""
    from fa4lab.errors import InputError

    with pytest.raises(InputError, match=r"bad indices in an earlier call of .*" + words):
        call_next()


@pytest.mark.parametrize("page_size", [16, 128])
@pytest.mark.parametrize("bad", [10**6, -5, 2**31 - 1])
def test_a_bad_page_never_faults_and_the_next_call_raises(page_size, bad, monkeypatch):
    from fa4lab import attention_varlen

    q, k, v, cu_q, table, used = _decode(page_size=page_size, pages_per_seq=4)
    used.fill_(4 * page_size)
    table[2, 1] = bad
    guard = Guarded(monkeypatch, (q, k, v, cu_q, table, used))
    attention_varlen(q, k, v, cu_q, None, None, None, seqused_k=used, page_table=table,
                     return_lse=True)
    guard.check()
    good = table.clone()
    good[2, 1] = 0
    _raises_later(rf"page_table\[2, 1\] = {bad} is not a page of the cache \(num_pages = "
                  rf"{k.shape[0]}\)", lambda: attention_varlen(
                      q, k, v, cu_q, None, None, None, seqused_k=used, page_table=good))


# A sequence running past the packed total, or starting before the previous one's end, is
# clamped into the packed rows (Note [clamped lengths] in fa4lab.kernels.device.seqlen): the
# guard bands around out and lse stay untouched.
@pytest.mark.parametrize("cu_q, words", [
    ([0, 100, 5000], r"cu_seqlens_q's last entry is 5000 but the packed q have 300 tokens"),
    ([0, 250, 100], r"cu_seqlens_q decreases at index 2 \(cu_seqlens_q\[1\] = 250"),
    ([-2**31, 0, 300], r"cu_seqlens_q must start at 0, got cu_seqlens_q\[0\] = -2147483648"),
    ([0, 2**31 - 1, 300], r"cu_seqlens_q decreases at index 2"),
])
def test_bad_cu_seqlens_stay_inside_out(cu_q, words, monkeypatch):
    from fa4lab import attention_varlen, check_errors

    q, k, v, _, cu_k = _packed([(200, 300), (100, 50)])
    cu_q = torch.tensor(cu_q, dtype=I32, device="cuda")
    guard = Guarded(monkeypatch, (q, k, v, cu_q, cu_k))
    attention_varlen(q, k, v, cu_q, cu_k, None, None, causal=True, return_lse=True)
    guard.check()
    _raises_later(words, check_errors)


def test_bad_cu_seqlens_k_and_seqused_k_stay_inside_the_tensors(monkeypatch):
    from fa4lab import attention_varlen, check_errors

    q, k, v, cu_q, _ = _packed([(200, 300), (100, 50)])
    for cu_k, used, words in (
            ([0, 900, 350], None, r"cu_seqlens_k decreases at index 2"),
            ([0, 300, 350], [10**6, 5], r"seqused_k\[0\] = 1000000 but cu_seqlens_k gives it 300"),
            ([0, 300, 350], [3, -40], r"seqused_k\[1\] = -40")):
        cu_k = torch.tensor(cu_k, dtype=I32, device="cuda")
        used = None if used is None else torch.tensor(used, dtype=I32, device="cuda")
        guard = Guarded(monkeypatch, (q, k, v, cu_q, cu_k))
        attention_varlen(q, k, v, cu_q, cu_k, None, None, seqused_k=used, return_lse=True)
        guard.check()
        _raises_later(words, check_errors)


@pytest.mark.parametrize("used", [[10**6, 3, 5, 7, 9, 11], [-9, 3, 5, 7, 9, 11]])
def test_a_bad_seqused_k_over_pages_never_faults(used, monkeypatch):
    from fa4lab import attention_varlen, check_errors

    q, k, v, cu_q, table, _ = _decode(pages_per_seq=4)
    used = torch.tensor(used, dtype=I32, device="cuda")
    guard = Guarded(monkeypatch, (q, k, v, cu_q, table, used))
    attention_varlen(q, k, v, cu_q, None, None, None, seqused_k=used, page_table=table)
    guard.check()
    _raises_later(rf"seqused_k\[0\] = {used[0].item()} but its 4 pages of 16 hold 64 keys",
                  check_errors)


def test_a_bad_chunked_prefill_never_faults(kernel_gpu, monkeypatch):
    """Ragged query counts over pages: the paged varlen launch (sm90) or one call per
    sequence."""
    from fa4lab import attention_varlen, check_errors

    q, k, v, _, table, used = _decode(batch=3, L=40, pages_per_seq=8)
    cu_q = torch.tensor([0, 10, 100, 120], dtype=I32, device="cuda")
    table[1, 0] = -3
    guard = Guarded(monkeypatch, (q, k, v, cu_q, table))
    attention_varlen(q[:120], k, v, cu_q, None, None, None, seqused_k=used, page_table=table,
                     causal=True)
    guard.check()
    _raises_later(r"page_table\[1, 0\] = -3", check_errors)


def test_dense_paged_attention_checks_on_the_device(monkeypatch):
    from fa4lab import attention, check_errors

    _, k, v, _, table, _ = _decode(batch=4, pages_per_seq=4)
    q = torch.randn(4, 1, 16, 128, device="cuda").to(torch.bfloat16)
    table[3, 3] = k.shape[0]
    guard = Guarded(monkeypatch, (q, k, v, table))
    attention(q, k, v, page_table=table)
    guard.check()
    _raises_later(r"fa4lab.attention .*page_table\[3, 3\] = " + str(k.shape[0]), check_errors)


def test_the_message_names_the_values_the_call_saw():
    """The verdict is read on the device when the check runs: a table fixed after the call
    does not change the message."""
    from fa4lab import attention_varlen, check_errors

    q, k, v, cu_q, table, used = _decode()
    bad = table.clone()
    bad[0, 0] = 777
    attention_varlen(q, k, v, cu_q, None, None, None, seqused_k=used, page_table=bad)
    bad.copy_(table)        # queued after the check: the verdict keeps 777
    _raises_later(r"page_table\[0, 0\] = 777", check_errors)


def test_the_device_verdict_is_the_synchronous_error():
    """Random good and bad index tensors: check_indices="device" then check_errors() raises
    exactly the synchronous check's message, or nothing where it passes."""
    from fa4lab import check_errors
    from fa4lab.errors import InputError
    from fa4lab.varlen import check_varlen

    rng = np.random.default_rng(99)
    broken = 0
    for case in range(300):
        call = _random_call(rng, paged=bool(case % 2))
        call = {n: t.cuda() if isinstance(t, torch.Tensor) else t for n, t in call.items()}
        try:
            check_varlen(**call, check_indices=True)
            want = None
        except InputError as e:
            want = str(e)
        check_varlen(**call, check_indices="device")
        try:
            check_errors()
            got = None
        except InputError as e:
            got = str(e).split("): ", 1)[1]
        assert got == want, f"case {case}"
        broken += want is not None
    assert broken > 50


def test_many_ctas_give_the_first_broken_entry():
    """A table of 64 x 4096 slots runs 256 CTAs: the verdict is the smallest broken entry of
    the first broken rule whichever CTA saw it, and the scratch is reset for the next check."""
    from fa4lab import check_errors
    from fa4lab.errors import InputError
    from fa4lab.varlen import check_paged

    q = torch.zeros(64, 1, 2, 64, device="cuda", dtype=torch.bfloat16)
    cache = torch.zeros(50, 16, 1, 64, device="cuda", dtype=torch.bfloat16)
    table = torch.randint(0, 50, (64, 4096), dtype=I32, device="cuda")
    for entries, words in (([(63, 4095), (40, 7), (40, 9)], r"page_table\[40, 7\] = -1"),
                           ([(63, 4095)], r"page_table\[63, 4095\] = -1"), ([], None)):
        bad = table.clone()
        for b, s in entries:
            bad[b, s] = -1
        for _ in range(3):          # the same slot reused: its scratch reset each time
            check_paged(q, cache, cache, bad)
            if words is None:
                check_errors()
                continue
            with pytest.raises(InputError, match=words):
                check_errors()


def test_more_checks_than_slots_wait_for_the_oldest():
    from fa4lab import check_errors, indexcheck
    from fa4lab.varlen import check_varlen

    q, k, v, cu_q, cu_k = _packed([(5, 5), (7, 9)])
    for _ in range(indexcheck.POOL_SLOTS + 10):
        check_varlen(q, k, v, cu_q, cu_k, None, None, check_indices="device")
    assert indexcheck.pending() <= indexcheck.POOL_SLOTS
    check_errors()
    assert indexcheck.pending() == 0


def test_the_default_check_never_synchronises_and_replays_in_a_cuda_graph():
    from fa4lab import attention_varlen

    q, k, v, cu_q, cu_k = _packed([(70, 300), (1, 996), (129, 0)])
    _, _, _, cu_q2, cu_k2 = _packed([(1, 996), (199, 300), (0, 0)])
    buf_q, buf_k = cu_q.clone(), cu_k.clone()

    def call():
        return attention_varlen(q, k, v, buf_q, buf_k, 300, 1296, causal=True,
                                return_lse=True)

    replays_in_a_cuda_graph(call, (buf_q, buf_k), [(cu_q, cu_k), (cu_q2, cu_k2)])
