"""The client's memory of UNKNOWN_MODEL answers, sans I/O: time comes in as an argument
(the end-to-end behaviour, with two real brokers, is in test_several_brokers.py)."""

from __future__ import annotations

from ipuserve.client.lacking import FORGET_AFTER_S, Lacking


def test_a_broker_that_lacked_a_model_is_asked_again_after_the_bounded_while() -> None:
    lacking = Lacking()
    lacking.refused("tcp://a:1", "mlp", now=100.0)
    assert lacking.lacks("tcp://a:1", "mlp", now=100.0 + FORGET_AFTER_S - 0.01)
    assert not lacking.lacks("tcp://a:1", "other", now=100.0)  # per model
    assert not lacking.lacks("tcp://b:1", "mlp", now=100.0)  # per broker
    assert not lacking.lacks("tcp://a:1", "mlp", now=100.0 + FORGET_AFTER_S)
    assert len(lacking) == 0  # forgotten, not kept for ever


def test_a_model_list_that_shows_the_model_clears_it_at_once() -> None:
    lacking = Lacking()
    lacking.refused("tcp://a:1", "mlp", now=0.0)
    lacking.refused("tcp://a:1", "bert", now=0.0)
    lacking.serves("tcp://a:1", ["mlp"])
    assert not lacking.lacks("tcp://a:1", "mlp", now=1.0)
    assert lacking.lacks("tcp://a:1", "bert", now=1.0)
    lacking.forget("tcp://a:1")  # its link is gone
    assert len(lacking) == 0
