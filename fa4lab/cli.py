"""`fa4lab doctor | plan | audit | bench | cache`.

Each subcommand's arguments live beside the code they drive: a module exposes
`add_cli(subparsers)` that adds its parser and sets `func`. Such modules import nothing heavy
(torch, cutlass) at import time, so `fa4lab --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module with add_cli(subparsers)
SUBCOMMANDS = {
    "plan": "fa4lab.plan_cli",
    "audit": "fa4lab.kernels.audit",
    "bench": "fa4lab.bench",
    "cache": "fa4lab.kernels.cache",
}


def _doctor(args) -> int:
    from fa4lab.environment import doctor_report

    print(doctor_report())
    return 0


def build_parser() -> argparse.ArgumentParser:
    from fa4lab import __version__

    parser = argparse.ArgumentParser(prog="fa4lab", description="FlashAttention-4 lab tools")
    parser.add_argument("--version", action="version", version=f"fa4lab {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="versions, GPU, and which tiers run here")
    doctor.set_defaults(func=_doctor)
    for module in SUBCOMMANDS.values():
        importlib.import_module(module).add_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
