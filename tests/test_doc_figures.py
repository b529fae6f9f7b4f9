"""The figures the docs give for the code's constants, read from the constants.

docs/deploy.md once said re-resolution takes 5 s long after it became 2 s: a figure
copied into prose drifts silently. Each row here names a constant and the sentences
that quote it (``{}`` where the figure goes), so changing the constant fails this
test until the docs say the new figure. Measured figures (a benchmark's, a test
run's) are history, not constants, and are not listed.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ipuserve.broker.config import BrokerConfig
from ipuserve.broker.loop import LIVE_AFTER_S
from ipuserve.broker.timers import COMPACT_MIN
from ipuserve.client.config import ClientConfig
from ipuserve.client.lacking import FORGET_AFTER_S
from ipuserve.discovery import REFRESH_INTERVAL_S
from ipuserve.worker.credit import REBALANCE_S

DOCS = Path(__file__).resolve().parent.parent / "docs"


def seconds(value: float) -> str:
    """2.0 -> "2", 0.25 -> "0.25": as the docs write a figure."""
    return f"{value:g}"


#: (figure as the docs write it, doc file, sentences with "{}" for the figure)
QUOTED: list[tuple[str, str, list[str]]] = [
    (
        seconds(REFRESH_INTERVAL_S),
        "deploy.md",
        [
            "the worker re-resolves it every {} s and whenever it loses a broker",
            "on their next re-resolution (every {} s)",
            "re-resolve the name every {} s and on connection loss",
            "on their next re-resolution (at most {} s)",
            "both re-resolve the name on the loss and every {} s",
        ],
    ),
    (
        seconds(REFRESH_INTERVAL_S),
        "protocol.md",
        ["they re-resolve every {} s", "re-resolved every {} s, whenever a link loses"],
    ),
    (seconds(FORGET_AFTER_S), "protocol.md", ["until its MODELS_REPLY lists the model or {} s"]),
    (seconds(REBALANCE_S), "protocol.md", ["reconsidered every {} s"]),
    (seconds(LIVE_AFTER_S), "deploy.md", ["turned (heartbeat timer) within {} s"]),
    (seconds(LIVE_AFTER_S), "protocol.md", ["heartbeat timer fired within {} s"]),
    (
        seconds(ClientConfig().deadline_grace_s * 1000),
        "protocol.md",
        ["waits `deadline_grace_s` ({} ms) longer"],
    ),
    (seconds(BrokerConfig().orphan_ms / 1000), "protocol.md", ["for `--orphan-ms` ({} s)"]),
    (f"{COMPACT_MIN:,}", "benchmarks.md", ["rebuild (never below {} entries)"]),
]


@pytest.mark.parametrize(("figure", "doc", "sentences"), QUOTED)
def test_the_docs_quote_the_constant(figure: str, doc: str, sentences: list[str]) -> None:
    text = " ".join((DOCS / doc).read_text().split())  # sentences may wrap
    for sentence in sentences:
        assert sentence.format(figure) in text, f"docs/{doc}: {sentence.format(figure)!r}"


def test_no_other_re_resolution_figure_is_given() -> None:
    """Every "re-resolve ... every/at most N s" in docs/ is the constant (a measured
    comparison with an older interval says "when names were re-resolved")."""
    said = re.compile(r"re-resol\w*[^.;]{0,40}?\b(?:every|at most) (\d+(?:\.\d+)?) s")
    for path in sorted(DOCS.glob("*.md")):
        text = " ".join(path.read_text().split())
        for found in said.finditer(text):
            if "when names were re-resolved" in text[found.start() - 20 : found.end()]:
                continue
            assert found.group(1) == seconds(REFRESH_INTERVAL_S), (path.name, found.group(0))
