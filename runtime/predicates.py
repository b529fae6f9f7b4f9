"""Predicates that decide, per anchor, how the Session binds callbacks and PopEF data.

Spec section 10.2.1. A predicate maps an :class:`~ipuserve.runtime.popef.Anchor`
to a policy. ``anchor_callbacks.*`` build :data:`AnchorCallbackPredicate` s for
``Session.setUserInputHandler`` / ``setUserOutputHandler``;
``popef_data_usage.*`` build :data:`PopefDataUsagePredicate` s for
``SessionConfig.pred_tensor_data``.

Note: the spec's text for ``andBind`` repeats ``orBind``'s ("accept when one of
the predicates accepts"); we implement the conjunction its name and its
"Conjunction operator" heading promise: accept only when every predicate accepts.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Generic, TypeVar

from ipuserve.runtime.popef.types import Anchor, Model, ProgramFlow


class AnchorCallbackPolicy(enum.Enum):
    BIND_USER_CB = 0
    BIND_EMPTY_CB = 1
    SKIP_CB = 2


class PopefDataUsagePolicy(enum.Enum):
    USE_POPEF_DATA_IF_ANY = 0
    USE_USER_DATA = 1


P = TypeVar("P", AnchorCallbackPolicy, PopefDataUsagePolicy)
Predicate = Callable[[Anchor], P]
AnchorCallbackPredicate = Callable[[Anchor], AnchorCallbackPolicy]
PopefDataUsagePredicate = Callable[[Anchor], PopefDataUsagePolicy]

null_anchor_callback_predicate: AnchorCallbackPredicate | None = None
null_popef_data_usage_predicate: PopefDataUsagePredicate | None = None


@dataclass(frozen=True)
class AnchorWithPolicy(Generic[P]):
    """``anchor`` is an anchor name (or the Anchor itself)."""

    anchor: str | Anchor
    policy: P

    @property
    def name(self) -> str:
        return self.anchor.name() if isinstance(self.anchor, Anchor) else self.anchor


@dataclass(frozen=True)
class ProgramsWithPolicy(Generic[P]):
    programsIndexes: Sequence[int]
    policy: P


def _by_programs(programs: Sequence[int], accept: P, reject: P) -> Callable[[Anchor], P]:
    wanted = frozenset(programs)
    return lambda anchor: accept if wanted.intersection(anchor.programs()) else reject


class PredicateFactories(Generic[P]):
    """The predicate factories of one policy type, with that type's default policies.

    Used as a namespace: ``anchor_callbacks.predProgramFlowMain(flow)``.
    """

    def __init__(self, accept: P, reject: P) -> None:
        self._accept: P = accept
        self._reject: P = reject

    def _pick(self, accept: P | None, reject: P | None) -> tuple[P, P]:
        return (
            self._accept if accept is None else accept,
            self._reject if reject is None else reject,
        )

    def predProgramFlowLoad(
        self, flow: ProgramFlow, accept_policy: P | None = None, reject_policy: P | None = None
    ) -> Callable[[Anchor], P]:
        return _by_programs(flow.load(), *self._pick(accept_policy, reject_policy))

    def predProgramFlowMain(
        self, flow: ProgramFlow, accept_policy: P | None = None, reject_policy: P | None = None
    ) -> Callable[[Anchor], P]:
        return _by_programs(flow.main(), *self._pick(accept_policy, reject_policy))

    def predProgramFlowSave(
        self, flow: ProgramFlow, accept_policy: P | None = None, reject_policy: P | None = None
    ) -> Callable[[Anchor], P]:
        return _by_programs(flow.save(), *self._pick(accept_policy, reject_policy))

    def predProgramNotAssigned(
        self, accept_policy: P | None = None, reject_policy: P | None = None
    ) -> Callable[[Anchor], P]:
        accept, reject = self._pick(accept_policy, reject_policy)
        return lambda anchor: reject if anchor.programs() else accept

    def predNonScalarType(
        self, accept_policy: P | None = None, reject_policy: P | None = None
    ) -> Callable[[Anchor], P]:
        accept, reject = self._pick(accept_policy, reject_policy)
        return lambda anchor: accept if anchor.tensorInfo().shape() else reject

    def predProgramIndexes(
        self, programs: Sequence[int] | Sequence[ProgramsWithPolicy[P]], *policies: P, **named: P
    ) -> Callable[[Anchor], P]:
        """``(indexes, accept, reject)`` or, C++'s other overload, ``(groups, reject)``."""
        if programs and isinstance(programs[0], ProgramsWithPolicy):
            groups = [g for g in programs if isinstance(g, ProgramsWithPolicy)]
            reject = policies[0] if policies else named.get("reject_policy", self._reject)
            return _grouped(groups, reject)
        indexes = [int(i) for i in programs if not isinstance(i, ProgramsWithPolicy)]
        accept = policies[0] if policies else named.get("accept_policy", self._accept)
        reject = policies[1] if len(policies) > 1 else named.get("reject_policy", self._reject)
        return _by_programs(indexes, accept, reject)

    def predAnchorsPolicies(
        self, policies: Sequence[AnchorWithPolicy[P]], reject_policy: P | None = None
    ) -> Callable[[Anchor], P]:
        by_name = {p.name: p.policy for p in policies}
        reject = self._reject if reject_policy is None else reject_policy
        return lambda anchor: by_name.get(anchor.name(), reject)

    @staticmethod
    def andBind(
        accept_policy: P, reject_policy: P, *preds: Callable[[Anchor], P]
    ) -> Callable[[Anchor], P]:
        return lambda a: (
            accept_policy if all(p(a) == accept_policy for p in preds) else reject_policy
        )

    @staticmethod
    def orBind(
        accept_policy: P, reject_policy: P, *preds: Callable[[Anchor], P]
    ) -> Callable[[Anchor], P]:
        return lambda a: (
            accept_policy if any(p(a) == accept_policy for p in preds) else reject_policy
        )


def _grouped(groups: Sequence[ProgramsWithPolicy[P]], reject: P) -> Callable[[Anchor], P]:
    def predicate(anchor: Anchor) -> P:
        for group in groups:
            if set(group.programsIndexes).intersection(anchor.programs()):
                return group.policy
        return reject

    return predicate


anchor_callbacks = PredicateFactories(
    AnchorCallbackPolicy.BIND_USER_CB, AnchorCallbackPolicy.BIND_EMPTY_CB
)
popef_data_usage = PredicateFactories(
    PopefDataUsagePolicy.USE_USER_DATA, PopefDataUsagePolicy.USE_POPEF_DATA_IF_ANY
)
#: The spec's C++ namespace, for code written against it:
#: ``predicate_factory.anchor_callbacks.predProgramFlowMain(flow)``.
predicate_factory = SimpleNamespace(
    anchor_callbacks=anchor_callbacks, popef_data_usage=popef_data_usage
)


def ringSizeMultForProgs(
    programs: Sequence[int],
    selected_ring_size_multiplier: int,
    others_ring_size_multiplier: int = 1,
) -> Callable[[Anchor], int]:
    """Ring-buffer multiplier for anchors owned by ``programs``; ``others`` for the rest."""
    wanted = frozenset(programs)
    return lambda anchor: (
        selected_ring_size_multiplier
        if wanted.intersection(anchor.programs())
        else others_ring_size_multiplier
    )


def ringSizeMultForMainProgs(
    model: Model, main_ring_size_multiplier: int, load_save_ring_size_multiplier: int = 1
) -> Callable[[Anchor], int]:
    return ringSizeMultForProgs(
        model.metadata.programFlow().main(),
        main_ring_size_multiplier,
        load_save_ring_size_multiplier,
    )


ring_size_multiplier_factory = SimpleNamespace(
    ringSizeMultForProgs=ringSizeMultForProgs, ringSizeMultForMainProgs=ringSizeMultForMainProgs
)
