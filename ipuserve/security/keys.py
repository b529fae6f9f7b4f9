"""CurveZMQ keys on disk: generate a pair, load one, name it in a log.

Files are pyzmq's (and czmq's) certificate format, so ``zmq.auth.load_certificate``
and every ZeroMQ tool read them: ``NAME.key`` holds the public key only and may be
copied anywhere; ``NAME.key_secret`` holds both keys and is created mode 0600.

A key given to an API may be a path to such a file, or the key itself: 40 Z85
characters (what the files hold) or 32 raw bytes. Inside ipuserve a key is always
carried as its 40 Z85 bytes, the form libzmq's socket options take.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85

from ipuserve.errors import ConfigError

log = logging.getLogger(__name__)

#: suffixes pyzmq's create_certificates gives the two files
PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
#: a CurveZMQ key is 32 bytes, 40 characters in Z85
RAW_KEY_BYTES = 32
Z85_KEY_BYTES = 40
#: hex digits of a fingerprint: enough to tell keys apart in a log, too few to be a key
FINGERPRINT_CHARS = 12

#: what a caller may pass as a key: a file, or the key itself
KeySource = str | os.PathLike[str] | bytes


@dataclass(frozen=True)
class KeyPair:
    """A CurveZMQ key pair, each key as its 40 Z85 bytes."""

    public: bytes
    secret: bytes

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.public)

    def __repr__(self) -> str:  # never print a secret key, not even in a traceback
        return f"KeyPair(public={self.public.decode()!r}, secret=<hidden>)"


@dataclass(frozen=True)
class KeyFiles:
    """Where :func:`generate_keypair` wrote a pair."""

    public: Path
    secret: Path


def fingerprint(public_key: bytes | str) -> str:
    """A short name of a public key for logs: the first hex digits of its SHA-256.

    Takes the key as Z85 (bytes or str) or raw bytes; the same key gives the same
    fingerprint in either form, so logs of the broker and of ``ipuserve keys show``
    agree."""
    raw = _raw(public_key.encode() if isinstance(public_key, str) else public_key, "key")
    return hashlib.sha256(raw).hexdigest()[:FINGERPRINT_CHARS]


def generate_keypair(name: str, directory: Path | str = ".") -> KeyFiles:
    """Write a new pair as ``directory/NAME.key`` and ``directory/NAME.key_secret``.

    The secret file is mode 0600 from the moment it has its final name: pyzmq writes
    it with the umask's mode, so the pair is made in a private (0700) folder, the
    mode fixed, and only then linked into place. Existing files are never
    overwritten (a rotation makes a pair under a new name): ConfigError instead.
    """
    folder = Path(directory)
    problem = key_name_problem(name)
    if problem is not None:
        raise ConfigError(f"key name {name!r} {problem}")
    if not folder.is_dir():
        raise ConfigError(f"cannot write keys into {folder}: not a directory")
    target = KeyFiles(folder / f"{name}{PUBLIC_SUFFIX}", folder / f"{name}{SECRET_SUFFIX}")
    for path in (target.public, target.secret):
        if path.exists():
            raise ConfigError(f"{path} exists; keys are never overwritten (use a new name)")
    try:
        private = Path(tempfile.mkdtemp(prefix=".keys-", dir=folder))
    except OSError as exc:
        raise ConfigError(f"cannot write keys into {folder}: {exc.strerror or exc}") from exc
    try:
        public, secret = zmq.auth.create_certificates(private, name)
        os.chmod(secret, 0o600)
        os.chmod(public, 0o644)
        _link_new(Path(secret), target.secret)
        try:
            _link_new(Path(public), target.public)
        except ConfigError:
            target.secret.unlink()  # half a pair is worse than none
            raise
    finally:
        shutil.rmtree(private, ignore_errors=True)
    return target


def key_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a key pair's files (None when it can)."""
    if not name or name.startswith("."):
        return "must be non-empty and not start with '.'"
    if not all(c.isalnum() or c in "-_." for c in name):
        return "may hold only letters, digits, '-', '_' and '.'"
    return None


def load_secret_key(source: KeySource) -> KeyPair:
    """The pair of a ``.key_secret`` file, or of a secret key given as bytes (its
    public half is derived from it, so one secret is all a component needs)."""
    if isinstance(source, bytes):
        secret = _z85(source, "secret key")
        return KeyPair(public=zmq.curve_public(secret), secret=secret)
    _warn_if_readable_by_others(Path(source))
    public, secret_or_none = _read_certificate(Path(source))
    if secret_or_none is None:
        raise ConfigError(
            f"{source} holds no secret key (a public {PUBLIC_SUFFIX} file?); "
            f"give the {SECRET_SUFFIX} file"
        )
    secret = _z85(secret_or_none, f"secret key in {source}")
    if zmq.curve_public(secret) != public:
        raise ConfigError(f"{source}: its public key does not belong to its secret key")
    return KeyPair(public=public, secret=secret)


def load_public_key(source: KeySource) -> bytes:
    """The public key (40 Z85 bytes) of a ``.key`` or ``.key_secret`` file, or of a
    key given as bytes."""
    if isinstance(source, bytes):
        return _z85(source, "public key")
    public, _secret = _read_certificate(Path(source))
    return public


def _warn_if_readable_by_others(path: Path) -> None:
    """A secret key others can read is as good as published: say so (as ssh does),
    but go on, since a container's secret mount may be shared on purpose."""
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError:
        return  # _read_certificate names the problem
    if mode & 0o077:
        log.warning(
            "secret key file %s has mode %o: others on this host can read it (chmod 600 %s)",
            path,
            mode,
            path,
        )


def _read_certificate(path: Path) -> tuple[bytes, bytes | None]:
    """The keys in a certificate file; every way it can be wrong is a ConfigError
    naming the file (pyzmq raises OSError or ValueError, or returns a bad key)."""
    if not path.is_file():
        raise ConfigError(f"key file {path} does not exist or is not a file")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read key file {path}: {exc}") from exc
    return _z85(public, f"public key in {path}"), secret


def _z85(key: bytes, what: str) -> bytes:
    """``key`` as 40 Z85 bytes, given either form; ConfigError if it is neither."""
    return z85.encode(_raw(key, what))


def _raw(key: bytes, what: str) -> bytes:
    if len(key) == RAW_KEY_BYTES:
        return key
    if len(key) == Z85_KEY_BYTES:
        try:
            return z85.decode(key)
        except (ValueError, KeyError, IndexError) as exc:
            raise ConfigError(f"{what} is not a valid Z85 key") from exc
    raise ConfigError(
        f"{what} is {len(key)} bytes; a CurveZMQ key is {Z85_KEY_BYTES} Z85 characters "
        f"or {RAW_KEY_BYTES} raw bytes"
    )


def _link_new(source: Path, target: Path) -> None:
    """Give ``source`` the name ``target``, failing rather than replacing a file a
    concurrent run created meanwhile (os.link refuses an existing name)."""
    try:
        os.link(source, target)
    except FileExistsError as exc:
        raise ConfigError(f"{target} exists; keys are never overwritten") from exc
    except OSError as exc:
        raise ConfigError(f"cannot write {target}: {exc.strerror or exc}") from exc
