"""``ipuserve tools``: the Model Runtime's tools (spec chapter 7) on the simulated IPUs.

::

    ipuserve tools queues-benchmark --batch 16 --request-size 4 --duration-s 5
    ipuserve tools callbacks-benchmark --elements 1048576 --zero-copy --json
    ipuserve tools real-data --popef mlp.popef --input input=x.npy --output-dir out/

The measuring lives in :mod:`ipuserve.runtime.tools`; this module only turns
options into configurations and reports into text. Any ipuserve error becomes a
one-line ``Error: ...`` and exit code 1, never a traceback. Long runs draw a
progress line on stderr when it is a terminal.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from ipuserve.clikit import option
from ipuserve.errors import ConfigError, IpuserveError
from ipuserve.npy_io import parse_input_spec, read_inputs
from ipuserve.progress import ProgressLine
from ipuserve.runtime.popef.types import DataType
from ipuserve.runtime.tools.callbacks_bench import CallbacksBenchConfig, run_callbacks_benchmark
from ipuserve.runtime.tools.queues_bench import run_queues_benchmark
from ipuserve.runtime.tools.queues_config import MODES, QueuesBenchConfig
from ipuserve.runtime.tools.real_data import RealDataConfig, run_real_data
from ipuserve.runtime.tools.report import callbacks_table, queues_table, real_data_table
from ipuserve.runtime.tools.stats import Budget

DTYPES = click.Choice([t.value for t in DataType])
POPEF = click.Path(dir_okay=False, path_type=str)


@click.group("tools")
def tools() -> None:
    """Benchmarks of the queues and callbacks, and runs on real data (spec chapter 7)."""


def _output_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """--json, and --progress/--no-progress (default: a progress line on a terminal only)."""
    func = option(
        "--progress/--no-progress",
        "show_progress",
        default=None,
        show_default="on when stderr is a terminal",
        help="Draw a progress line on stderr.",
    )(func)
    return option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")(func)


@tools.command("queues-benchmark")
@option(
    "--mode",
    type=click.Choice(MODES),
    default="queues",
    help="queues: an InputQueue/OutputQueue pair with packing; ring: a bare SpscRingBuffer.",
)
@option("--shape", default="1024", help="Shape of one sample, e.g. 3,224,224.")
@option("--dtype", type=DTYPES, default="float32", help="Element type.")
@option(
    "--batch",
    type=click.IntRange(min=1),
    default=16,
    help="Compiled batch: samples per device run.",
)
@option("--request-size", type=click.IntRange(min=1), default=1, help="Samples per enqueued item.")
@option(
    "--ring-size",
    type=click.IntRange(min=1),
    default=None,
    show_default="2 x --batch, as a QueueManager",
    help="Slots per ring buffer.",
)
@option("--items", type=click.IntRange(min=1), default=None, help="Measure this many items.")
@option(
    "--duration-s",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    show_default="2 unless --items is given",
    help="Measure for this long.",
)
@option("--warmup", type=click.IntRange(min=0), default=100, help="Unmeasured items first.")
@_output_options
def queues_benchmark(
    shape: str,
    items: int | None,
    duration_s: float | None,
    warmup: int,
    as_json: bool,
    show_progress: bool | None,
    **geometry: Any,
) -> None:
    """Measure how fast tensors move through the ring buffers and queues.

    A producer thread enqueues items by reference; a thread standing in for the
    device packs them into batches and splits the batches back. Reports items/s,
    samples/s, GB/s (payload per direction) and per-item latency.
    """
    with _errors():
        config = QueuesBenchConfig(
            sample_shape=_parse_shape(shape),
            budget=Budget(warmup=warmup, count=items, duration_s=_duration(items, duration_s)),
            **geometry,
        )
        with _progress(show_progress) as progress:
            report = run_queues_benchmark(config, progress)
    _emit(report, queues_table, as_json)


@tools.command("callbacks-benchmark")
@option(
    "--popef",
    multiple=True,
    type=POPEF,
    help="Model file (repeat for several); default: a generated noop model.",
)
@option(
    "--elements",
    type=click.IntRange(min=1),
    default=1024,
    help="noop: elements per sample (1048576 float32 = 4 MiB).",
)
@option("--batch-size", type=click.IntRange(min=1), default=1, help="noop: compiled batch.")
@option("--dtype", type=DTYPES, default="float32", help="noop: element type.")
@option("--ipu-model", is_flag=True, help="Run on an IPU Model (no IPU, no simulated time).")
@option(
    "--zero-copy",
    is_flag=True,
    help="Input callbacks return their own array instead of filling the device's.",
)
@option("--runs", type=click.IntRange(min=1), default=1000, help="Measured runs.")
@option(
    "--duration-s",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    show_default="none: --runs decides",
    help="Stop measuring after this long.",
)
@option("--warmup", type=click.IntRange(min=0), default=10, help="Unmeasured runs first.")
@_output_options
def callbacks_benchmark(
    popef: tuple[str, ...],
    runs: int,
    duration_s: float | None,
    warmup: int,
    as_json: bool,
    show_progress: bool | None,
    **rest: Any,
) -> None:
    """Measure how fast a Session's anchor callbacks move data.

    Binds the model to a device, connects a timed callback to every input and
    output anchor and runs the main programs. Honours IPUSERVE_SIM_TIME_SCALE.
    """
    _refuse_noop_options(popef, ("elements", "batch_size", "dtype"))
    with _errors():
        config = CallbacksBenchConfig(
            popef=popef, budget=Budget(warmup=warmup, count=runs, duration_s=duration_s), **rest
        )
        with _progress(show_progress) as progress:
            report = run_callbacks_benchmark(config, progress)
    _emit(report, callbacks_table, as_json)


@tools.command("real-data")
@option(
    "--popef",
    multiple=True,
    required=True,
    type=POPEF,
    help="Model file (repeat for several files making one model).",
)
@option(
    "--input",
    "input_specs",
    multiple=True,
    metavar="NAME=FILE.npy",
    envvar="IPUSERVE_TOOLS_REAL_DATA_INPUT",
    help="An input tensor and the .npy file holding it (repeat per input).",
)
@option(
    "--output-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("."),
    show_default="the current directory",
    help="Where each output goes, as NAME.npy.",
)
@option("--replicas", type=click.IntRange(min=1), default=1, help="Model replicas.")
@option(
    "--batching-dim",
    type=click.IntRange(min=0),
    default=None,
    show_default="none: batches must be multiples of the compiled batch",
    help="Accept any batch size along this dimension (dynamic batching).",
)
@option("--runs", type=click.IntRange(min=1), default=1, help="How many times to run.")
@option("--ipu-model", is_flag=True, help="Run on IPU Models instead of attached IPUs.")
@_output_options
def real_data(
    input_specs: tuple[str, ...], as_json: bool, show_progress: bool | None, **opts: Any
) -> None:
    """Run a model on inputs read from .npy files and write its outputs as .npy files."""
    specs = [_input_spec(spec) for spec in input_specs]
    with _errors():
        inputs = read_inputs(specs)
        with _progress(show_progress) as progress:
            report = run_real_data(RealDataConfig(**opts), inputs, progress)
    _emit(report, real_data_table, as_json)


# -- helpers -------------------------------------------------------------------------


#: The runtime's advice is for library users; on the command line it is an option.
CLI_HINTS = {"set ModelRunnerConfig.batching_dim": "pass --batching-dim"}


@contextmanager
def _errors() -> Iterator[None]:
    """ipuserve errors (and unwritable outputs) as one-line click errors."""
    try:
        yield
    except IpuserveError as error:
        message = _one_line(str(error))
        for library, cli in CLI_HINTS.items():
            message = message.replace(library, cli)
        raise click.ClickException(message) from None
    except OSError as error:
        where = f"{error.filename}: " if error.filename else ""
        raise click.ClickException(f"{where}{error.strerror or error}") from None


@contextmanager
def _progress(show: bool | None) -> Iterator[ProgressLine]:
    line = ProgressLine(enabled=show)
    try:
        yield line
    finally:
        line.finish()


def _emit(report: dict[str, Any], table: Callable[[dict[str, Any]], str], as_json: bool) -> None:
    """Print the report; after Ctrl-C, exit 130 (as every ipuserve command does) so a
    script cannot take the partial report for a complete one."""
    click.echo(json.dumps(report, indent=2) if as_json else table(report))
    if report.get("interrupted"):
        click.echo("Error: interrupted (Ctrl-C): the report covers what completed", err=True)
        raise SystemExit(128 + signal.SIGINT)  # as a shell reports it, like every command


def _parse_shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in text.replace("x", ",").split(",") if d.strip())
    except ValueError:
        raise click.BadParameter(
            f"{text!r} is not a list of integers like 3,224,224", param_hint="--shape"
        ) from None
    if not dims:
        raise click.BadParameter("give at least one dimension", param_hint="--shape")
    return dims


def _duration(items: int | None, duration_s: float | None) -> float | None:
    """Without --items the run is timed: 2 s unless --duration-s says otherwise."""
    return 2.0 if items is None and duration_s is None else duration_s


def _input_spec(spec: str) -> tuple[str, Path]:
    try:
        return parse_input_spec(spec)
    except ConfigError as error:
        raise click.BadParameter(str(error), param_hint="--input") from None


def _refuse_noop_options(popef: tuple[str, ...], names: tuple[str, ...]) -> None:
    """--elements, --batch-size and --dtype describe the generated model only."""
    context = click.get_current_context()
    given = [
        n
        for n in names
        if context.get_parameter_source(n) is not click.core.ParameterSource.DEFAULT
    ]
    if popef and given:
        flags = ", ".join("--" + n.replace("_", "-") for n in given)
        raise click.UsageError(f"{flags} describe the generated noop model, not --popef files")


def _one_line(text: str) -> str:
    return " ".join(text.split())
