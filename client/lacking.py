"""Which broker lacks which model: the client's memory of UNKNOWN_MODEL answers.

With several brokers, one may not serve a model another does (its workers never
joined it, or it has just restarted). Its UNKNOWN_MODEL sends the request to another
broker (:mod:`ipuserve.client.core`); without a memory, every later request for that
model could be placed on it again and cost that extra round trip for ever. So the
core leaves such a broker out of that model's placement until it has seen the broker
gain the model (the model in its MODELS_REPLY) or :data:`FORGET_AFTER_S` has passed
(the broker gains a model silently when a worker joins it). No I/O and no clock of
its own: the time comes in as an argument.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["FORGET_AFTER_S", "Lacking"]

#: how long a broker that answered UNKNOWN_MODEL for a model is left out of that
#: model's placement, unless its model list shows the model first: a worker that
#: joins it later is used within this while
FORGET_AFTER_S = 30.0


class Lacking:
    """(broker endpoint, model) pairs that answered UNKNOWN_MODEL, until when."""

    def __init__(self, forget_after_s: float = FORGET_AFTER_S) -> None:
        self._forget_after_s = forget_after_s
        self._until: dict[tuple[str, str], float] = {}

    def __len__(self) -> int:
        return len(self._until)

    def refused(self, endpoint: str, model: str, now: float) -> None:
        """The broker at ``endpoint`` answered UNKNOWN_MODEL for ``model`` at ``now``."""
        self._until[endpoint, model] = now + self._forget_after_s

    def lacks(self, endpoint: str, model: str, now: float) -> bool:
        """Whether to leave that broker out of the model's placement at ``now``."""
        until = self._until.get((endpoint, model))
        if until is None:
            return False
        if now < until:
            return True
        del self._until[endpoint, model]  # a bounded while: ask it again
        return False

    def serves(self, endpoint: str, models: Iterable[str]) -> None:
        """The broker at ``endpoint`` listed ``models`` (a MODELS_REPLY): it has them now."""
        for model in models:
            self._until.pop((endpoint, model), None)

    def forget(self, endpoint: str) -> None:
        """The endpoint's link is gone: nothing to remember of it."""
        for key in [key for key in self._until if key[0] == endpoint]:
            del self._until[key]
