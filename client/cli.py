"""Click commands owned by ipuserve.client (mounted by ipuserve.face.cli): infer, models.

Every option has an ``IPUSERVE_<COMMAND>_<OPTION>`` environment variable (the
root group's auto prefix), shown in ``--help``. Errors the fabric reports become
one-line ``Error: [CODE] message`` exits instead of tracebacks.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
import numpy as np

from ipuserve import protocol as wire
from ipuserve.client.cli_support import client_address, client_for, typed_errors
from ipuserve.client.client import Client
from ipuserve.client.fleet import FleetModel, merge_models
from ipuserve.client.repository_cli import repository_commands
from ipuserve.clikit import (
    Endpoint,
    ModelName,
    TimeoutSeconds,
    check_writable,
    option,
    writing,
)
from ipuserve.errors import ConfigError, IpuserveError, TensorError
from ipuserve.npy_io import parse_input_spec, read_inputs
from ipuserve.security.cli import curve_client_options, keys_from_options

__all__ = ["client_address", "client_for", "commands", "infer", "models", "typed_errors"]

F = TypeVar("F", bound=Callable[..., object])

BROKER_HELP = (
    "The broker's frontend endpoint, e.g. tcp://HOST:5555; repeat it for several brokers "
    "(in the variable: space-separated). Requests spread over the brokers that answer."
)
MODELS_BROKER_HELP = (
    "The broker's frontend endpoint, e.g. tcp://HOST:5555; repeat it for several brokers "
    "(in the variable: space-separated): their models are shown as one fleet."
)


def describe(array: np.ndarray[Any, Any]) -> str:
    """One line about an output: dtype, shape and a few statistics."""
    head = f"{array.dtype}{list(array.shape)}"
    if array.size == 0 or array.dtype.kind not in "biuf":
        return head
    values = array.astype(np.float64)
    return (
        f"{head} min {values.min():.6g} max {values.max():.6g} "
        f"mean {values.mean():.6g} first {values.reshape(-1)[:4].tolist()}"
    )


def parse_npy_inputs(
    _ctx: Any, _param: Any, values: tuple[str, ...]
) -> dict[str, np.ndarray[Any, Any]]:
    """NAME=FILE.npy option values -> arrays (click callback for --input).

    Read as ``ipuserve tools real-data`` reads them (:mod:`ipuserve.npy_io`):
    plain ``.npy`` arrays only, never unpickling; an ``.npz``, a text file, a missing
    file or a name given twice is a one-line usage error naming the file.
    """
    if not values:
        return {}
    try:
        read = read_inputs(parse_input_spec(value) for value in values)
    except (ConfigError, TensorError) as exc:
        raise click.BadParameter(str(exc)) from None
    return {name: item.array for name, item in read.items()}


def _timeout_option(default_s: float, help_text: str) -> Callable[[F], F]:
    """``--timeout-s``, which both commands take, with its default and help."""
    return option("--timeout-s", type=TimeoutSeconds(), default=default_s, help=help_text)


@click.command()
@option("--broker", required=True, multiple=True, type=Endpoint(), help=BROKER_HELP)
@option(
    "--model", required=True, type=ModelName(), help="Model name, as `ipuserve models` lists it."
)
@option(
    "--input",
    "inputs",
    multiple=True,
    required=True,
    callback=parse_npy_inputs,
    help="NAME=FILE.npy, once per input tensor (in the variable: space-separated).",
)
@option(
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Save the outputs to this file, as given, in numpy's .npz format.",
)
@option(
    "--version",
    help="A version of the model (a whole number >= 1). Default: the model's default "
    "version (docs/repository.md).",
)
@_timeout_option(30.0, "Give up (DEADLINE_EXCEEDED) after this long.")
@curve_client_options
def infer(
    broker: tuple[str, ...],
    model: str,
    inputs: dict[str, Any],
    output: Path | None,
    version: str | None,
    timeout_s: float,
    curve_secret_key: Path | None,
    broker_public_key: Path | None,
) -> None:
    """Send one request with tensors from .npy files and print the outputs (and save them
    with --output), and which model version answered."""
    if output is not None:
        check_writable(output)
    keys = keys_from_options(curve_secret_key, broker_public_key)
    with typed_errors(), client_for(broker, timeout_s, keys) as client:
        future = client.infer_async(model, inputs, version=version)
        outputs = future.result(timeout_s + 5)
    for name, array in outputs.items():
        click.echo(f"{name}: {describe(array)}")
    if future.timing is not None:
        answered = "" if outputs.version is None else f" (version {outputs.version})"
        click.echo(f"took {future.timing.total_us / 1e3:.3f} ms{answered}", err=True)
    if output is not None:
        save_npz(output, outputs)
        click.echo(f"saved {', '.join(outputs)} to {output}", err=True)


def save_npz(path: Path, arrays: dict[str, np.ndarray[Any, Any]]) -> None:
    """``arrays`` as an .npz at exactly ``path`` (np.savez given a name would add ``.npz``);
    a path that cannot be written is a one-line error."""
    with writing(path, "wb") as file:
        np.savez(file, **arrays)  # type: ignore[arg-type]


@click.group(invoke_without_command=True)
@option("--broker", multiple=True, type=Endpoint(), help=MODELS_BROKER_HELP + " Required.")
@option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@_timeout_option(10.0, "Give up after this long.")
@curve_client_options
@click.pass_context
def models(
    ctx: click.Context,
    broker: tuple[str, ...],
    as_json: bool,
    timeout_s: float,
    curve_secret_key: Path | None,
    broker_public_key: Path | None,
) -> None:
    """List the broker's models: batch, queued requests, and each worker's credit, jobs
    and requests; or load, unload and list the model repository's versions (``models
    load|unload|index --help``).

    Credit and jobs count jobs (a group of requests is one job); queued and requests
    count the clients' requests. With several brokers, the fleet as one: each model
    once, each worker once with the brokers it is registered with (its numbers added
    up over them); a broker that does not answer is named on stderr and left out.
    """
    if ctx.invoked_subcommand is not None:
        return  # its own options say where and how
    if not broker:
        raise click.UsageError("Missing option '--broker'.")
    keys = keys_from_options(curve_secret_key, broker_public_key)
    with typed_errors(), client_for(broker, timeout_s, keys) as client:
        if isinstance(client.address, str):
            found = client.models()
        else:
            fleet = _fleet(client)
    if not isinstance(client.address, str):
        click.echo(json.dumps(fleet_json(fleet), indent=2) if as_json else fleet_table(fleet))
    elif as_json:
        click.echo(json.dumps(models_json(found), indent=2))
    else:
        click.echo(models_table(found))


def _fleet(client: Client) -> list[FleetModel]:
    """Every broker's models merged; those that did not answer named on stderr."""
    answers = client.models_by_broker()
    for endpoint, answer in answers.items():
        if isinstance(answer, IpuserveError):
            click.echo(f"warning: {endpoint}: [{answer.code}] {answer}", err=True)
    found = {e: a for e, a in answers.items() if not isinstance(a, IpuserveError)}
    if not found:
        raise next(a for a in answers.values() if isinstance(a, IpuserveError))
    return merge_models(found)


def models_json(found: list[wire.ModelInfo]) -> list[dict[str, Any]]:
    """The MODELS_REPLY as JSON, with each worker's job count also under ``jobs``, the
    table's name for it (``in_flight`` is the wire's, kept for scripts that read it)."""
    listed = [info.to_json() for info in found]
    for info in listed:
        for load in info["workers"]:
            load["jobs"] = load["in_flight"]
    return listed


_ROW = "{:20} {:>7} {:>5} {:>6}  {:28} {:>6} {:>5} {:>8}"


def models_table(found: list[wire.ModelInfo]) -> str:
    """One row per (model version, worker), then the model's inputs. ``jobs`` is what the credit
    bounds; ``requests`` what those jobs hold (more when clients send groups)."""
    header = _ROW.format(
        "model", "version", "batch", "queued", "worker", "credit", "jobs", "requests"
    )
    lines = [header, "-" * len(header)]
    for info in found:
        spec = info.spec
        first = (spec.name, spec.version, spec.batch_size, info.queued)
        for i, w in enumerate(info.workers or (wire.WorkerLoad("-", 0, 0, 0),)):
            lines.append(
                _ROW.format(
                    *(first if i == 0 else ("", "", "", "")),
                    w.worker_id,
                    w.credit,
                    w.in_flight,
                    w.requests,
                )
            )
        tensors = ", ".join(map(str, info.spec.inputs))
        dim = info.spec.batching_dim
        batching = "no dynamic batching" if dim is None else f"batched along dimension {dim}"
        lines.append(f"{'':28} inputs {tensors}; {batching}")
    if not found:
        lines.append("(no models: no worker has registered yet)")
    return "\n".join(lines)


def fleet_json(fleet: list[FleetModel]) -> list[dict[str, Any]]:
    """:func:`models_json` for several brokers: each worker with its ``brokers``."""
    listed = [model.to_json() for model in fleet]
    for info in listed:
        for load in info["workers"]:
            load["jobs"] = load["in_flight"]
    return listed


def fleet_table(fleet: list[FleetModel]) -> str:
    """:func:`models_table` over several brokers: the brokers each worker is registered
    with on the line below it."""
    lines = models_table([model.info() for model in fleet]).splitlines()
    out = lines[:2]
    rows = iter(lines[2:])
    for model in fleet:
        for worker in model.workers or (None,):
            out.append(next(rows))
            if worker is not None:
                out.append(f"{'':28} {'':5} {'':6}  brokers {' '.join(worker.brokers)}")
        out.append(next(rows))  # the inputs line
    out.extend(rows)
    return "\n".join(out)


for _command in repository_commands:
    models.add_command(_command)

commands: list[click.Command] = [infer, models]
