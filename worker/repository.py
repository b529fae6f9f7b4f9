"""A model repository: ``REPO/NAME/VERSION/*.popef`` and an optional ``REPO/NAME/config.toml``.

What a repository worker (:mod:`ipuserve.worker.host`) loads from, laid out as
docs/repository_layout.md says. :func:`scan` reads the directory into one
:class:`RepoEntry` per version; a version that cannot be served -- no model file, a
file that does not read, a ``config.toml`` that does not parse or holds an unknown
field -- is still an entry, with its ``problem``: it is reported (HOST's
``Entry.problem``) and never stops the others from loading. A problem names files
relative to the repository's root (:meth:`Repository.relative`): it travels to every
broker and, through the gateway's index, to its clients, and where the repository sits
on this machine is none of theirs.

A scan checks each version's model files the way a load would (they read, the model
has no conditional execution, its batching dimension exists) and remembers the
outcome by the files' size and modification time, so scanning again -- on every LOAD
-- re-reads only what changed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from ipuserve import protocol as wire
from ipuserve.errors import IpuserveError
from ipuserve.limits import MAX_VERSION_DIGITS, VERSION_PATTERN, is_version, name_problem
from ipuserve.protocol.envelope import bounded

log = logging.getLogger(__name__)

CONFIG_FILE = "config.toml"
MODEL_SUFFIX = ".popef"


class ModelConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``REPO/NAME/config.toml``: how every version of NAME is served (all optional).

    ``replicas``: IPUs a load takes by default (one replica each); ``batching_dim``,
    ``batch_policy``, ``batch_timeout_ms``: as ``ipuserve worker``'s options of those
    names; ``credit``: requests a worker of this model holds at once (its queue limit;
    default: what the runner can hold); ``default_version``: pins the version requests
    that name none go to (default: the latest version served); ``workers``: how many
    workers a load places it on by default."""

    replicas: Annotated[int, Meta(ge=1, le=1024)] = 1
    batching_dim: Annotated[int, Meta(ge=0)] | None = None
    batch_policy: Literal["adaptive", "eager", "fixed"] = "adaptive"
    batch_timeout_ms: Annotated[float, Meta(gt=0)] | None = None
    credit: Annotated[int, Meta(ge=1)] | None = None
    default_version: (
        Annotated[int, Meta(ge=1, lt=10**MAX_VERSION_DIGITS)]
        | Annotated[str, Meta(pattern=VERSION_PATTERN)]
        | None
    ) = None
    workers: Annotated[int, Meta(ge=1, le=1024)] = 1

    @property
    def pinned(self) -> str | None:
        """``default_version`` as the wire spells versions (a string)."""
        return None if self.default_version is None else str(self.default_version)


@dataclass(frozen=True, slots=True)
class RepoEntry:
    """One version in the repository: its model files, its model's config, the IPUs one
    replica takes, or why it cannot be served (``problem``)."""

    name: str
    version: str
    files: tuple[Path, ...] = ()
    config: ModelConfig = field(default_factory=ModelConfig)
    ipus_per_replica: int = 1
    problem: str = ""

    @property
    def key(self) -> tuple[str, str]:
        return self.name, self.version

    def wire(self) -> wire.Entry:
        return wire.Entry(
            self.name,
            self.version,
            self.config.replicas,
            bounded(self.problem),
            self.ipus_per_replica,
            self.config.workers,
        )


#: a version's files as (path, size, mtime_ns), and its model's config: what a check's
#: outcome is remembered by
_Stamp = tuple[tuple[tuple[str, int, int], ...], "ModelConfig"]


class Repository:
    """A repository directory and its last scan; :meth:`scan` again to see changes.
    Thread-safe: a scan may run on any thread."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._lock = threading.Lock()
        self._entries: dict[tuple[str, str], RepoEntry] = {}
        #: each version's files -> (IPUs per replica, problem), from earlier checks
        self._checked: dict[_Stamp, tuple[int, str]] = {}

    @property
    def entries(self) -> list[RepoEntry]:
        """The last scan's entries, by name then version (as numbers)."""
        with self._lock:
            return sorted(self._entries.values(), key=lambda e: (e.name, int(e.version)))

    def get(self, name: str, version: str) -> RepoEntry | None:
        with self._lock:
            return self._entries.get((name, version))

    def latest(self, name: str) -> str | None:
        """The largest version of ``name`` in the last scan (broken or not)."""
        versions = [int(e.version) for e in self.entries if e.name == name]
        return str(max(versions)) if versions else None

    def scan(self) -> list[RepoEntry]:
        """Read the directory again; the entries (a missing root: none, and a warning)."""
        found: dict[tuple[str, str], RepoEntry] = {}
        try:
            model_dirs = sorted(p for p in self.root.iterdir() if p.is_dir())
        except OSError as exc:
            log.warning("cannot read the model repository %s: %s", self.root, exc)
            model_dirs = []
        for model_dir in model_dirs:
            if model_dir.name.startswith("."):
                continue
            try:
                for entry in self._model(model_dir):
                    found[entry.key] = entry
            except OSError as exc:  # a scan never fails: the directory is skipped
                log.warning("repository: cannot read %s: %s", model_dir, exc)
        for key, entry in found.items():
            if entry.problem:
                found[key] = dataclasses.replace(entry, problem=self.relative(entry.problem))
        with self._lock:
            self._entries = found
        return self.entries

    def relative(self, text: str) -> str:
        """``text`` with every path under the root written relative to it (the root
        itself as "."), as the absolute or the given spelling of the root has it."""
        for root in sorted({str(self.root), str(self.root.resolve())}, key=len, reverse=True):
            text = text.replace(root + os.sep, "").replace(root, ".")
        return text

    def _model(self, model_dir: Path) -> list[RepoEntry]:
        name = model_dir.name
        if (why := name_problem(name)) is not None:
            log.warning("repository: %s is no model name (a model name %s); skipped", name, why)
            return []
        versions = []
        for path in sorted(model_dir.iterdir()):
            if path.is_dir() and is_version(path.name):  # a directory "1\n" is none
                versions.append(path)
            elif path.is_dir() and not path.name.startswith("."):
                log.warning("repository: %s is no version (a positive integer); skipped", path)
        if not versions:
            log.warning("repository: %s holds no version directory (NAME/1/...)", model_dir)
        config, problem = read_config(model_dir / CONFIG_FILE)
        return [self._version(name, path, config, problem) for path in versions]

    def _version(self, name: str, path: Path, config: ModelConfig, problem: str) -> RepoEntry:
        try:
            return self._read_version(name, path, config, problem)
        except OSError as exc:  # e.g. removed while we read it
            return RepoEntry(name, path.name, config=config, problem=f"cannot read {path}: {exc}")

    def _read_version(self, name: str, path: Path, config: ModelConfig, problem: str) -> RepoEntry:
        files = tuple(sorted(p for p in path.iterdir() if p.suffix == MODEL_SUFFIX and p.is_file()))
        if not problem and not files:
            problem = f"no {MODEL_SUFFIX} file in {path}"
        ipus = 1
        if not problem:
            ipus, problem = self._check(name, files, config)
        return RepoEntry(name, path.name, files, config, ipus, problem)

    def _check(self, name: str, files: tuple[Path, ...], config: ModelConfig) -> tuple[int, str]:
        stamp = tuple((str(p), (st := p.stat()).st_size, st.st_mtime_ns) for p in files)
        found = self._checked.get((stamp, config))
        if found is None:
            found = self._checked[(stamp, config)] = check_model(files, config)
            if found[1]:
                log.warning("repository: %s/%s: %s", name, files[0].parent.name, found[1])
        return found


def read_config(path: Path) -> tuple[ModelConfig, str]:
    """A model's config (defaults if there is no file), and why it is broken ("" if not)."""
    if not path.exists():
        return ModelConfig(), ""
    try:
        with path.open("rb") as f:
            return msgspec.convert(tomllib.load(f), ModelConfig), ""
    except (OSError, tomllib.TOMLDecodeError, msgspec.ValidationError) as exc:
        return ModelConfig(), f"{path}: {exc}"


def check_model(files: tuple[Path, ...], config: ModelConfig) -> tuple[int, str]:
    """What a load would find wrong with these model files: (IPUs per replica, problem)."""
    from ipuserve.runtime import popef  # the runtime only where a model is read
    from ipuserve.worker.model_checks import check_unconditional, choose_batching_dim

    if config.batch_policy == "fixed" and not config.batch_timeout_ms:
        return 1, "batch_policy fixed needs batch_timeout_ms > 0 (its window)"
    try:
        model = popef.load_model([str(p) for p in files])
        check_unconditional(model)
        choose_batching_dim(model, config.batching_dim)
    except IpuserveError as exc:
        return 1, str(exc)
    except Exception as exc:  # whatever a file may hold: an entry's problem, not a crash
        return 1, f"{type(exc).__name__}: {exc}"
    return model.metadata.numIpus(), ""
