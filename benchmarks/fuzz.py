"""Fuzz the broker longer than CI does: the protocol fuzzer of tests/fuzz.

    python benchmarks/fuzz.py --messages 20000 --seed 7 [--socket frontend|backend|host]
                              [--nesting]

Starts a real broker and an ``add`` worker for each socket, sends N mutated messages
(frontend: REQUEST, REQUESTS, MODELS, PING, REPOSITORY, requests naming versions, and
garbage; backend: a misbehaving fake worker; host: a lying fake repository worker and
an admin loading, unloading and listing through the frontend), and prints every
invariant violated, tagged with the issue-16 finding it is (``tests/fuzz/engine.py``
KNOWN). ``--nesting``: the nesting, depth and shape-of-JSON mutations alone
(engine.NESTING_OPS). Exit status 1 if a violation is not a known finding.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.fuzz.engine import NESTING_OPS
from tests.fuzz.run import SOCKETS, fuzz
from tests.helpers import Processes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--socket", choices=SOCKETS, action="append")
    parser.add_argument("--nesting", action="store_true", help="only the nesting mutations")
    args = parser.parse_args()
    failed = False
    for socket in args.socket or SOCKETS:
        procs = Processes()
        started = time.monotonic()
        try:
            ops = NESTING_OPS if args.nesting else None
            report = fuzz(procs, socket, args.messages, args.seed, ops)
        finally:
            procs.close()
        print(report.summary())
        print(f"  {time.monotonic() - started:.1f} s")
        failed = failed or bool(report.unexpected())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
