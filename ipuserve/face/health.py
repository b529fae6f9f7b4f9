"""``ipuserve health URL``: a health check for containers, which have no curl.

GETs the URL -- a broker's or worker's ``/ready`` or ``/healthz`` (:mod:`ipuserve.probes`),
the gateway's ``/v2/health/ready`` -- and exits 0 on a 2xx answer, 1 on anything
else (another status, a refused connection, no answer in time, a TLS failure), with
one line saying which: what Compose, Swarm and Kubernetes exec probes read.
"""

from __future__ import annotations

import http.client
import ssl
import sys
import urllib.error
import urllib.request
from pathlib import Path

import click

from ipuserve.clikit import TimeoutSeconds, option

#: The most of a body the line shows (a probe's reason is one short line).
SHOWN_BYTES = 200


@click.command()
@click.argument("url")
@option("--timeout-s", default=5.0, type=TimeoutSeconds(), help="Give up after this long.")
@option(
    "--ca",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="For https: trust the certificates in this PEM file (a self-signed server's).",
)
@option(
    "--insecure-tls",
    is_flag=True,
    default=False,
    help="For https: do not verify the server's certificate (a test setup's alone).",
)
def health(url: str, timeout_s: float, ca: Path | None, insecure_tls: bool) -> None:
    """GET URL: exit 0 on a 2xx answer, 1 otherwise (a container's health check)."""
    if not url.startswith(("http://", "https://")):
        raise click.BadParameter(f"{url!r} is not an http:// or https:// URL", param_hint="URL")
    if ca is not None and insecure_tls:
        raise click.UsageError("--ca and --insecure-tls exclude each other")
    ok, line = check(url, timeout_s, _tls(ca, insecure_tls))
    click.echo(line, err=not ok)
    sys.exit(0 if ok else 1)


def check(url: str, timeout_s: float, context: ssl.SSLContext | None = None) -> tuple[bool, str]:
    """``(2xx answered, one line saying what came back)``."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s, context=context) as response:
            return _answer(200 <= response.status < 300, response)
    except urllib.error.HTTPError as exc:  # a status urllib calls an error (4xx, 5xx)
        with exc:
            return _answer(False, exc)
    except urllib.error.URLError as exc:  # refused, unknown host, TLS
        return False, f"{url}: cannot reach it: {_reason(exc.reason)}"
    except (TimeoutError, OSError, http.client.HTTPException) as exc:
        return False, f"{url}: no answer in {timeout_s:g} s ({_reason(exc)})"


def _answer(
    ok: bool, response: http.client.HTTPResponse | urllib.error.HTTPError
) -> tuple[bool, str]:
    body = response.read(SHOWN_BYTES).decode(errors="replace")
    status = f"{response.status} {response.reason}" if response.reason else str(response.status)
    text = " ".join(body.split())
    return ok, f"{status}: {text}" if text else status


def _reason(reason: object) -> str:
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror
    return str(reason) or type(reason).__name__


def _tls(ca: Path | None, insecure: bool) -> ssl.SSLContext | None:
    if insecure:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context
    return ssl.create_default_context(cafile=str(ca)) if ca is not None else None


commands: list[click.Command] = [health]
