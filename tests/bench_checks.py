"""What the bench tests share (tests/test_bench*.py): the command run in this process, its
parsed arguments, the mark for its CPU path, and stand-ins (no upstream FA4, a recording
varlen call)."""

from __future__ import annotations

import sys

import pytest

from fa4lab.environment import gpu

needs_no_gpu = pytest.mark.skipif(gpu() is not None, reason="checks the CPU path of the command")


def run_bench(argv: list[str]) -> int:
    """`fa4lab bench ARGV` in this process, through the one command-line entry."""
    from fa4lab.cli import main

    return main(["bench", *argv])


def parse_bench(argv: list[str]):
    """The arguments `fa4lab bench ARGV` parses to (before the dispatcher adds the defaults)."""
    import argparse

    from fa4lab import bench

    parser = argparse.ArgumentParser()
    bench.add_cli(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench"] + argv)


def no_upstream_fa4(monkeypatch):
    """Upstream FA4 not installed, whatever this environment has."""
    from fa4lab.bench import providers

    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", None)
    monkeypatch.setattr(providers, "package_version", lambda dist: None)


def recording_varlen(monkeypatch):
    """fa4lab.attention_varlen replaced by the float64 reference (cast back), recording each
    call's keyword arguments beyond those every runner passes."""
    from fa4lab import api
    from fa4lab.reference import attention_varlen_reference

    seen = []

    def fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
             seqused_k=None, page_table=None, causal=False, softmax_scale=None, **kw):
        seen.append(kw)
        return attention_varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                          seqused_k=seqused_k, page_table=page_table,
                                          causal=causal, softmax_scale=softmax_scale).to(q.dtype)

    monkeypatch.setattr(api, "attention_varlen", fake)
    return seen
