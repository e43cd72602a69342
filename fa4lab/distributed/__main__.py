"""`python -m fa4lab.distributed bench ...`: the ring-attention benchmark
(fa4lab.distributed.bench)."""

import sys

from fa4lab.distributed.bench import run

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] != "bench":
        print("usage: python -m fa4lab.distributed bench [--help]", file=sys.stderr)
        sys.exit(2)
    sys.exit(run(sys.argv[2:]))
