"""``ipuserve keys``: make and inspect CurveZMQ key pairs (mounted by ipuserve.face.cli).

    ipuserve keys generate broker --dir keys/       # keys/broker.key, keys/broker.key_secret
    ipuserve keys show keys/broker.key              # prints the public key

``show`` prints the public key alone on stdout, so ``$(ipuserve keys show F)`` is the
key; its fingerprint (the name the broker's log gives it) goes to stderr.
"""

from __future__ import annotations

from pathlib import Path

import click

from ipuserve.clikit import fail, option
from ipuserve.errors import ConfigError
from ipuserve.security.keys import fingerprint, generate_keypair, load_public_key


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


commands: list[click.Command] = [keys_group]
