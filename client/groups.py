"""What one broker said about its models' groups, for the turn batch to form groups by.

A client forms each group once, and the broker carries it as it is (a group it
cannot take is refused, never cut: ``ipuserve.grouping``). So before grouping
requests for a model, a client must know, from that broker, whether the model takes
groups and how many samples one job should hold: its MODELS_REPLY lists both
(``ModelInfo.spec`` and ``ModelInfo.group_samples``). A link asks for it after each
PONG (a connection, a new epoch) and, while it sends batches, at most every
``ASK_EVERY_S`` for a model it knows nothing about (one that joined later) and every
``REFRESH_S`` otherwise: the broker's advice follows the device time its workers
report, so a model found cheap gets bigger groups. Every MODELS_REPLY the link
reads, a user's ``models()`` included, updates it. Until a model is listed, its
requests leave one by one.
"""

from __future__ import annotations

from collections.abc import Iterable

from ipuserve import protocol as wire
from ipuserve.grouping import members_per_group

#: The request id of the MODELS a link sends for itself (a user's are 8 bytes long).
MODELS_PROBE = b"group-rules"
#: Shortest time between two such MODELS for models the broker did not list.
ASK_EVERY_S = 1.0
#: Shortest time between two such MODELS while every model sent to was listed.
REFRESH_S = 2.0


class GroupRules:
    """One broker's models, as its last MODELS_REPLY listed them."""

    __slots__ = ("_asked", "_models")

    def __init__(self) -> None:
        self._models: dict[str, wire.ModelInfo] = {}
        self._asked = float("-inf")

    def learn(self, models: Iterable[wire.ModelInfo]) -> None:
        """A MODELS_REPLY from this link's broker: what it lists now, nothing older."""
        self._models = {info.spec.name: info for info in models}

    def knows(self, model: str) -> bool:
        return model in self._models

    def members(self, request: wire.Request) -> int:
        """The most requests like ``request`` (its model, its tensors' shapes) one group
        may hold: 1 while the broker has not listed the model, or it takes no groups."""
        info = self._models.get(request.model)
        if info is None or not info.group_samples:
            return 1
        spec = info.spec
        member_samples = spec.samples(t.shape for t in request.tensors.specs)
        return members_per_group(spec, member_samples, info.group_samples)

    def ask_now(self, now: float, listed: bool) -> bool:
        """Whether to ask the broker for its models again (and, if so, count it asked),
        sending requests for models all ``listed`` already, or not."""
        if now - self._asked < (REFRESH_S if listed else ASK_EVERY_S):
            return False
        self._asked = now
        return True
