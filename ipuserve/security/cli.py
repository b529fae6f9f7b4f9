"""``ipuserve keys``: make and inspect CurveZMQ key pairs (mounted by ipuserve.face.cli).

    ipuserve keys generate broker --dir keys/       # keys/broker.key, keys/broker.key_secret
    ipuserve keys show keys/broker.key              # prints the public key

``show`` prints the public key alone on stdout, so ``$(ipuserve keys show F)`` is the
key; its fingerprint (the name the broker's log gives it) goes to stderr.

:func:`curve_client_options` gives a command that reaches the broker (worker, infer,
models, bench) its ``--curve-secret-key`` and ``--broker-public-key``, and
:func:`keys_from_options` turns them into :class:`ClientKeys` (or None: plaintext).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import click

from ipuserve.clikit import fail, option
from ipuserve.errors import ConfigError
from ipuserve.security.keys import fingerprint, generate_keypair, load_public_key
from ipuserve.security.sockets import OPTION_NAMES, ClientKeys, client_keys

F = TypeVar("F", bound=Callable[..., object])


@click.group("keys")
def keys_group() -> None:
    """Generate and show CurveZMQ keys (docs/security.md)."""


@keys_group.command("generate")
@click.argument("name")
@option(
    "--dir",
    "directory",
    envvar="IPUSERVE_KEYS_DIR",
    default=".",
    type=click.Path(file_okay=False, path_type=Path),
    help="Folder to write NAME.key (public) and NAME.key_secret (secret, mode 0600) in; "
    "created if missing.",
)
def generate(name: str, directory: Path) -> None:
    """Write a new key pair NAME.key / NAME.key_secret; never overwrites one."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        files = generate_keypair(name, directory)
    except OSError as exc:
        fail(f"cannot create {directory}: {exc.strerror or exc}")
        return
    except ConfigError as exc:
        fail(str(exc))
        return
    public = load_public_key(files.public)
    click.echo(f"public key  {files.public}  (give it to the broker's allow-list, or to peers)")
    click.echo(f"secret key  {files.secret}  (mode 0600; keep it on this machine only)")
    click.echo(f"fingerprint {fingerprint(public)}")


@keys_group.command("show")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
def show(file: Path) -> None:
    """Print the public key of FILE (a .key or .key_secret file)."""
    try:
        public = load_public_key(file)
    except ConfigError as exc:
        fail(str(exc))
        return
    click.echo(public.decode())
    click.echo(f"fingerprint {fingerprint(public)}", err=True)


def curve_client_options(command: F, envvar_prefix: str | None = None) -> F:
    """``--curve-secret-key FILE --broker-public-key FILE`` (each with its variable):
    what a peer of a broker with keys needs; neither means plaintext. ``envvar_prefix``
    (e.g. ``IPUSERVE_MODELS``): the variables a group's commands share, instead of
    each command's own."""
    key_file = click.Path(dir_okay=False, path_type=Path)
    shared = envvar_prefix is not None
    command = option(
        "--broker-public-key",
        type=key_file,
        default=None,
        envvar=f"{envvar_prefix}_BROKER_PUBLIC_KEY" if shared else None,
        help="The broker's public key file (broker.key), which the broker must prove it "
        "holds; with --curve-secret-key.",
    )(command)
    return option(
        "--curve-secret-key",
        type=key_file,
        default=None,
        envvar=f"{envvar_prefix}_CURVE_SECRET_KEY" if shared else None,
        help="This peer's secret key file (NAME.key_secret, from `ipuserve keys generate`): "
        "talk CURVE to a broker with keys (docs/security.md); with --broker-public-key "
        "[default: plaintext].",
    )(command)


def keys_from_options(secret_key: Path | None, broker_public_key: Path | None) -> ClientKeys | None:
    """The keys :func:`curve_client_options` named, loaded now: one without the other
    is a usage error, a file that cannot be read a one-line error."""
    if (secret_key is None) != (broker_public_key is None):
        given, needed = OPTION_NAMES if secret_key is not None else OPTION_NAMES[::-1]
        raise click.UsageError(f"{given} needs {needed} too (CURVE takes both)")
    try:
        return client_keys(secret_key, broker_public_key)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None


commands: list[click.Command] = [keys_group]
