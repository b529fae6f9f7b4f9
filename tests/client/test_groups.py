"""What a link knows of its broker's groups (client/groups.py): asked for, learned,
and used to size the groups the turn batch forms."""

from __future__ import annotations

import numpy as np

from ipuserve import protocol as wire
from ipuserve.client.groups import ASK_EVERY_S, REFRESH_S, GroupRules


def test_group_rules_ask_again_soon_for_an_unlisted_model_and_now_and_then_anyway() -> None:
    """A model that joined later is asked about within ASK_EVERY_S; the listing of known
    models is refreshed every REFRESH_S (the broker's advice follows the device)."""
    rules = GroupRules()
    assert rules.ask_now(100.0, listed=False)
    assert not rules.ask_now(100.0 + ASK_EVERY_S / 2, listed=False)
    assert rules.ask_now(100.0 + ASK_EVERY_S, listed=False)
    asked = 100.0 + ASK_EVERY_S
    assert not rules.ask_now(asked + REFRESH_S / 2, listed=True)
    assert rules.ask_now(asked + REFRESH_S, listed=True)


def test_group_rules_group_only_what_the_broker_listed() -> None:
    spec = wire.ModelSpec(
        "m",
        (wire.TensorSpec("x", "float32", (4, 2)),),
        (wire.TensorSpec("y", "float32", (4, 2)),),
        4,
        0,
    )
    request = wire.Request(b"r", "m", wire.Tensors.of({"x": np.zeros((2, 2), np.float32)}))
    rules = GroupRules()
    assert rules.members(request) == 1  # not listed yet
    rules.learn([wire.ModelInfo(spec, 0, (), group_samples=8)])
    assert rules.knows("m") and rules.members(request) == 4  # 8 samples, 2 a request
    rules.learn([wire.ModelInfo(spec, 0, (), group_samples=0)])
    assert rules.members(request) == 1  # listed as taking no groups
    rules.learn([])
    assert not rules.knows("m")  # a listing says what the broker serves now
