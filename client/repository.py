"""The model repository's commands as a client sends them and waits on them, with no I/O.

A broker answers ``load`` and ``unload`` at once, with its index as it stands
(docs/repository.md); the caller who wants the state reached asks ``index`` again
until it is. That wait is written once here, as a generator of steps (the sans-I/O
shape of :mod:`ipuserve.client.core`): it yields :class:`Ask` (send this command,
send me its answer) and :class:`Pause` (wait this long), and returns the last index.
:class:`~ipuserve.client.Client` drives it with blocking calls and ``time.sleep``,
:class:`~ipuserve.client.AsyncClient` with ``await``; neither repeats the rules:

* **load** is done when the version is READY (on at least ``workers`` workers when
  given); it fails when the version goes UNAVAILABLE with a reason, unless that is
  still the state the broker answered the load with (its hosts have not reported the
  load yet: the index a broker answers a load with may still say "not loaded").
* **unload** is done when every version it named (or, named none, every version of
  the model that was hosted when it was sent) is gone from the index or UNAVAILABLE.
* A wait past its ``timeout`` raises :class:`DeadlineExceeded` naming the state it
  last saw and why.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any

import msgspec

from ipuserve import protocol as wire
from ipuserve.errors import (
    DeadlineExceeded,
    InvalidInputError,
    UnavailableError,
    UnknownModelError,
)
from ipuserve.limits import version_problem
from ipuserve.protocol.control import Action

__all__ = [
    "LOAD_TIMEOUT_S",
    "Ask",
    "Pause",
    "RepositoryIndex",
    "Stepper",
    "check_version",
    "index_steps",
    "load_steps",
    "unload_steps",
]

#: how long load_model/unload_model wait for the state by default (a load of the
#: simulated IPUs takes a second or two; a real device's much longer)
LOAD_TIMEOUT_S = 120.0
#: the first pause between two ``index`` questions, doubled up to the last
_FIRST_PAUSE_S = 0.02
_LONGEST_PAUSE_S = 0.5
#: the states of a version that is (or is becoming) served
_HOSTED = ("READY", "LOADING", "UNLOADING")


@dataclass(frozen=True)
class RepositoryIndex:
    """What a broker said: every version its workers' repositories hold, with its state
    (``models``, each a :class:`~ipuserve.protocol.VersionState`: name, version, state,
    reason, workers, default), and what the command did (``message``)."""

    models: tuple[wire.VersionState, ...]
    message: str = ""

    def __iter__(self) -> Iterator[wire.VersionState]:
        return iter(self.models)

    def __len__(self) -> int:
        return len(self.models)

    def versions(self, name: str) -> list[wire.VersionState]:
        """``name``'s versions, oldest first."""
        return sorted((v for v in self.models if v.name == name), key=lambda v: int(v.version))

    def find(self, name: str, version: str) -> wire.VersionState | None:
        return next((v for v in self.models if (v.name, v.version) == (name, version)), None)

    def to_json(self) -> dict[str, Any]:
        return {"models": [msgspec.to_builtins(v) for v in self.models], "message": self.message}


@dataclass(frozen=True)
class Ask:
    """Send a REPOSITORY command; the driver sends back its :class:`RepositoryIndex`."""

    action: Action
    model: str | None = None
    version: str | None = None
    replicas: int | None = None
    workers: int | None = None

    def command(self, request_id: bytes) -> wire.RepositoryCommand:
        return wire.RepositoryCommand(
            request_id, self.action, self.model, self.version, self.replicas, self.workers
        )


@dataclass(frozen=True)
class Pause:
    """Wait this long before the next step (the driver sends back None)."""

    seconds: float


Steps = Generator[Ask | Pause, RepositoryIndex | None, RepositoryIndex]
Step = Ask | Pause
#: called with each index seen while waiting and the seconds waited so far
OnProgress = Callable[[RepositoryIndex, float], None]


class Stepper:
    """Steps as a driver walks them: :meth:`next` with the last step's answer gives the
    next step, or None when they are over (:attr:`result` holds the index then)."""

    def __init__(self, steps: Steps) -> None:
        self._steps = steps
        self.result: RepositoryIndex | None = None

    def next(self, answer: RepositoryIndex | None) -> Step | None:
        try:
            return self._steps.send(answer)
        except StopIteration as over:
            self.result = over.value
            return None


def check_version(version: Any) -> str | None:
    """A version as the wire carries it (a whole number >= 1, as a string), or None
    (the model's default); an int is taken as its digits. Anything else is refused."""
    if version is None:
        return None
    if isinstance(version, int) and not isinstance(version, bool):
        version = str(version)
    problem = version_problem(version)
    if problem is not None:
        raise InvalidInputError(f"a version {problem}")
    return str(version)


def index_steps() -> Steps:
    answer = yield Ask("index")
    assert answer is not None
    return answer


def load_steps(
    ask: Ask, *, wait: bool, timeout_s: float | None, on_progress: OnProgress | None = None
) -> Steps:
    """Send the load ``ask``; with ``wait``, ask ``index`` until it is done (module
    docstring). A load that named no version waits for the latest the index lists."""
    first = yield ask
    assert first is not None and ask.model is not None
    if not wait:
        return first
    name = ask.model
    version = ask.version or _latest(first, name)
    before = first.find(name, version)
    stale = None if before is None else (before.state, before.reason)

    def done(index: RepositoryIndex) -> bool:
        nonlocal stale
        now = index.find(name, version)
        if now is None:
            raise UnknownModelError(f"no repository lists {name} version {version} any more")
        if (now.state, now.reason) != stale:
            stale = None  # the hosts reported since: what the index says is the load's
        if now.state == "UNAVAILABLE" and stale is None:
            raise UnavailableError(f"{name} version {version} did not load: {now.reason}")
        return now.state == "READY" and len(now.workers) >= (ask.workers or 1)

    what = f"version {version} READY"
    return (yield from _until(done, first, name, what, timeout_s, on_progress))


def unload_steps(
    ask: Ask, *, wait: bool, timeout_s: float | None, on_progress: OnProgress | None = None
) -> Steps:
    """Send the unload ``ask``; with ``wait``, ask ``index`` until it is done (module
    docstring)."""
    first = yield ask
    assert first is not None and ask.model is not None
    if not wait:
        return first
    name = ask.model
    versions = (
        [ask.version]
        if ask.version
        else [v.version for v in first.versions(name) if v.state in _HOSTED]
    )

    def done(index: RepositoryIndex) -> bool:
        states = (index.find(name, version) for version in versions)
        return all(v is None or v.state == "UNAVAILABLE" for v in states)

    what = f"version {' and '.join(versions) or '(none)'} unloaded"
    return (yield from _until(done, first, name, what, timeout_s, on_progress))


def _until(
    done: Callable[[RepositoryIndex], bool],
    index: RepositoryIndex,
    name: str,
    what: str,
    timeout_s: float | None,
    on_progress: OnProgress | None,
) -> Steps:
    """Ask ``index`` with growing pauses until ``done`` says so or ``timeout_s`` passed;
    the index then, with the command's ``message`` (what it did: the later answers
    are the index's, which say nothing)."""
    message = index.message
    start = time.monotonic()
    pause = _FIRST_PAUSE_S
    while not done(index):
        waited = time.monotonic() - start
        if on_progress is not None:
            on_progress(index, waited)
        if timeout_s is not None and waited >= timeout_s:
            raise DeadlineExceeded(
                f"waited {timeout_s:g} s for {name} {what}; {_last_seen(index, name)}"
            )
        yield Pause(pause if timeout_s is None else min(pause, timeout_s - waited))
        pause = min(pause * 2, _LONGEST_PAUSE_S)
        answer = yield Ask("index")
        assert answer is not None
        index = answer
    if on_progress is not None:
        on_progress(index, time.monotonic() - start)
    return dataclasses.replace(index, message=message)


def _latest(index: RepositoryIndex, name: str) -> str:
    """The largest version of ``name`` the index lists (what a load that names none
    loads, docs/repository.md)."""
    versions = index.versions(name)
    if not versions:
        raise UnknownModelError(f"the broker's index lists no version of {name}")
    return versions[-1].version


def _last_seen(index: RepositoryIndex, name: str) -> str:
    """What the index said of ``name`` last, for a timeout's message."""
    seen = [
        f"version {v.version} {v.state}" + (f" ({v.reason})" if v.reason else "")
        for v in index.versions(name)
    ]
    return "the index says " + ("; ".join(seen) if seen else f"nothing of {name}")
