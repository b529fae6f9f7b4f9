"""``ipuserve model``: write the example models and inspect model files.

``ipuserve model example mlp mlp.popef --weights-file mlp-weights.popef`` writes a
model; ``ipuserve model inspect mlp.popef mlp-weights.popef`` prints what the spec's
``popef_dump`` would (``--json`` for machines). A file that cannot be read gives a
one-line error and exit code 1, never a traceback.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from ipuserve.clikit import option
from ipuserve.errors import ModelFileError
from ipuserve.limits import is_version
from ipuserve.runtime.popef import dump, examples
from ipuserve.runtime.popef.container import write_model
from ipuserve.runtime.popef.reader import load_model
from ipuserve.runtime.popef.types import DataType, Model


@click.group("model")
def model() -> None:
    """Write example models and inspect model files (the spec's popef_dump)."""


@model.command("example")
@click.argument("name", metavar="NAME", type=click.Choice(list(examples.EXAMPLES)))
@click.argument("out", required=False, type=click.Path(dir_okay=False, path_type=Path))
@option(
    "--repository",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Write into this model repository instead of OUT: REPO/NAME/VERSION/NAME.popef "
    "(docs/repository_layout.md).",
)
@option(
    "--version",
    "version",
    type=click.IntRange(min=1),
    default=None,
    show_default="one more than the largest version in the repository, else 1",
    help="With --repository: the version to write.",
)
@option(
    "--weights-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    show_default="none: tensor data goes into OUT",
    help="Write the tensor data (weights) to this second file.",
)
@option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=None,
    show_default="simple, noop, branches: 1; mlp: 16",
    help="Compiled batch size.",
)
@option("--seed", type=int, default=0, help="Seed of the weights (simple, mlp, branches).")
@option(
    "--batch-dim",
    type=click.IntRange(0, 1),
    default=0,
    help="Dimension of the batch in the I/O tensors (simple, noop).",
)
@option(
    "--dtype",
    type=click.Choice([t.value for t in DataType]),
    default="float32",
    help="Element type (mlp: float16 or float32; noop: any).",
)
@option(
    "--input-size", type=click.IntRange(min=1), default=784, help="mlp: features per input sample."
)
@option(
    "--hidden-size",
    type=click.IntRange(min=1),
    default=1024,
    help="mlp: width of each hidden layer.",
)
@option("--layers", type=click.IntRange(min=0), default=2, help="mlp: number of hidden layers.")
@option("--outputs", type=click.IntRange(min=1), default=10, help="mlp: number of logits.")
@option(
    "--elements",
    type=click.IntRange(min=1),
    default=1024,
    help="noop: elements per sample (1048576 float32 = 4 MiB).",
)
def example(
    name: str,
    out: Path | None,
    repository: Path | None,
    version: int | None,
    weights_file: Path | None,
    **chosen: Any,
) -> None:
    """Write example model NAME to OUT, or as a new version in a model repository.

    Its weights go into OUT too, or to --weights-file if given; --repository writes
    REPO/NAME/VERSION/NAME.popef instead.

    Options an example does not take are refused when given explicitly.
    """
    out = _destination(name, out, repository, version, weights_file)
    opts = _options_for(name, chosen)
    try:
        built = examples.build(name, **opts)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    if repository is not None:  # only now: a failed build leaves no empty version behind
        out.parent.mkdir(parents=True, exist_ok=True)
    paths = write_model(built, out, weights_file)
    click.echo(_written(built, paths))


@model.command("inspect")
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path))
@option("--json", "as_json", is_flag=True, default=False, help="Print JSON instead of text.")
def inspect(files: tuple[Path, ...], as_json: bool) -> None:
    """Describe the model held by FILES (several files may make one model)."""
    try:
        loaded = load_model(files)
    except ModelFileError as e:
        raise click.ClickException(str(e)) from None
    description = dump.describe(loaded)
    click.echo(json.dumps(description, indent=2) if as_json else dump.render(description))


def _destination(
    name: str, out: Path | None, repository: Path | None, version: int | None, weights: Any
) -> Path:
    """OUT, or the version's file in the repository: REPO/NAME/VERSION/NAME.popef (the
    layout ipuserve.worker.repository reads; the runtime does not import the worker)."""
    if repository is None:
        if out is None:
            raise click.UsageError("give OUT (a file to write) or --repository")
        if version is not None:
            raise click.UsageError("--version needs --repository")
        return out
    if out is not None or weights is not None:
        raise click.UsageError("--repository writes one file per version: no OUT or --weights-file")
    if version is None:
        found = [int(p.name) for p in (repository / name).glob("*") if is_version(p.name)]
        version = max(found, default=0) + 1
    return repository / name / str(version) / f"{name}.popef"


def _options_for(name: str, chosen: dict[str, Any]) -> dict[str, Any]:
    """The options to pass to example ``name``: defaults of options it does not take are
    dropped; values given on the command line or in the environment must apply."""
    accepted = examples.options(name)
    context = click.get_current_context()
    given = {
        key
        for key in chosen
        if context.get_parameter_source(key) is not click.core.ParameterSource.DEFAULT
    }
    stray = [key for key in chosen if key in given and key not in accepted]
    if stray:
        raise click.UsageError(
            f"{_flags(stray)} does not apply to the {name!r} example (it takes {_flags(accepted)})"
        )
    return {key: value for key, value in chosen.items() if key in accepted and value is not None}


def _flags(keys: list[str]) -> str:
    return ", ".join("--" + key.replace("_", "-") for key in keys)


def _written(built: Model, paths: list[Path]) -> str:
    meta = built.metadata
    contents = (
        ["metadata, executable, tensor data"]
        if len(paths) == 1
        else ["metadata, executable", "tensor data"]
    )
    count = len(built.tensorData)
    tensors = f" ({count} tensor{'s' * (count != 1)})" if count else ""
    lines = [
        f"wrote example model {meta.modelName()!r} (batch size {meta.batchSize()}, "
        f"executable sha256 {built.executable.hash()[:16]}...):"
    ]
    lines += [
        f"  {path}: {what}{tensors if 'tensor' in what else ''}"
        for path, what in zip(paths, contents, strict=True)
    ]
    return "\n".join(lines)
