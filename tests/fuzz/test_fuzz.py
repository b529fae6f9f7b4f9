"""The protocol fuzzer in CI: 2,000 mutated messages on each broker socket (and 2,000
of a fake repository worker and an admin: tests/fuzz/hosts.py), fixed seed.

Every invariant of issue 16 is checked on every run (tests/fuzz/engine.py lists them);
a violation fails the test unless it is exactly a finding still listed in
``engine.KNOWN`` (a broker bug being fixed): the report printed shows those too.
``python benchmarks/fuzz.py --messages N --seed S`` runs the same fuzzer longer.
"""

from __future__ import annotations

import pytest

from tests.fuzz.engine import KNOWN
from tests.fuzz.run import SOCKETS, fuzz
from tests.helpers import Processes

MESSAGES = 2000
SEED = 16


@pytest.mark.parametrize("socket", SOCKETS)
def test_fuzz_keeps_the_invariants(processes: Processes, socket: str) -> None:
    report = fuzz(processes, socket, MESSAGES, SEED)
    print(report.summary())
    assert report.sent >= MESSAGES
    assert report.probes >= MESSAGES // 500
    unexpected = report.unexpected()
    assert not unexpected, "\n".join(f"{v.invariant}: {v.detail}" for v in unexpected[:20])


def test_known_findings_name_issue_16() -> None:
    """Each tolerated finding says what it is, so that it can be found and removed."""
    assert all("issue 16" in why for why in KNOWN.values())
