"""The model repository's messages and model versions on the wire (issue 22): each
decodes to what was encoded, and a malformed one is refused saying what is wrong."""

from __future__ import annotations

import numpy as np
import pytest

from ipuserve import protocol as p
from ipuserve.errors import ProtocolError


def test_repository_messages_round_trip() -> None:
    messages = [
        p.RepositoryCommand(b"r1", "index"),
        p.RepositoryCommand(b"r2", "load", "mlp", "2", replicas=2, workers=3),
        p.RepositoryCommand(b"r3", "unload", "mlp"),
        p.RepositoryReply(b"r4", (p.VersionState("mlp", "2", "READY", "", ("w1",), True),), "ok"),
        p.Host(4, 1, (p.Entry("mlp", "1", 2), p.Entry("bad", "1", problem="no .popef")), ()),
        p.Host(4, 3, (), (p.Hosted("mlp", "1", "LOADING", "w1/mlp/1", 1, 2),)),
        p.Load("mlp", "12", 2, 1),
        p.Unload("mlp", "12"),
    ]
    for message in messages:
        assert p.decode(message.encode()) == message


@pytest.mark.parametrize(
    ("frames", "message"),
    [
        ([p.envelope(p.Command.REPOSITORY, b"i"), b'{"action":"load"}'], "load needs a model"),
        (
            [p.envelope(p.Command.REPOSITORY, b"i"), b'{"action":"drop","model":"m"}'],
            "Invalid enum value 'drop' - at `$.action`",
        ),
        ([p.envelope(p.Command.LOAD), b'{"name":"m","version":"v1"}'], '$.version is "v1"'),
        ([p.envelope(p.Command.UNLOAD), b'{"name":"m","version":"0"}'], '$.version is "0"'),
        (
            [p.envelope(p.Command.HOST), b'{"ipus":-1,"free_ipus":0}'],
            "$.ipus is -1; it must be >= 0",
        ),
    ],
)
def test_a_malformed_control_message_is_refused_saying_why(
    frames: list[bytes], message: str
) -> None:
    with pytest.raises(ProtocolError) as info:
        p.decode(frames)
    assert message in str(info.value)


def test_requests_and_replies_carry_the_version() -> None:
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    tensors = p.Tensors.of({"x": x})
    request = p.Request(b"a", "mlp", tensors, 100.0, (), "2")
    got = p.decode(request.encode())
    assert isinstance(got, p.Request) and got.version == "2"
    batch = p.decode(p.Requests((request, p.Request(b"b", "mlp", tensors))).encode())
    assert isinstance(batch, p.Requests)
    assert [r.version for r in batch.requests] == ["2", None]
    reply = p.Reply(b"a", tensors, {"device_us": 1.0}, (), "3")
    got_reply = p.decode(reply.encode())
    assert isinstance(got_reply, p.Reply) and got_reply.version == "3"
    replies = p.decode(p.Replies((reply,)).encode())
    assert isinstance(replies, p.Replies) and replies.replies[0].version == "3"
    np.testing.assert_array_equal(replies.replies[0].tensors.arrays()["x"], x)


def test_a_model_spec_says_its_version() -> None:
    spec = p.ModelSpec("mlp", (), (), version="7", default_version="3")
    hello = p.decode(p.Hello("w", (spec,), 4).encode())
    assert isinstance(hello, p.Hello) and hello.models[0].key == ("mlp", "7")
    assert hello.models[0].default_version == "3"
    assert p.ModelSpec("m", (), ()).version == "1"  # a model file's one version
