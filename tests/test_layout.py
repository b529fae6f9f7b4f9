"""Dependencies point one way (DESIGN.md §1), read from the source's import statements.

``runtime`` <- ``worker``; the common ground (``ipuserve/`` outside ``ipuserve/face/``)
<- every component; ``client`` <- ``bench`` and ``gateway``; and only the face (CLI root,
demo, config reference) imports components side by side. Every ``import`` and ``from ... import``
counts, also those inside functions, which is where a lazy import would hide one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COMPONENTS = ("runtime", "worker", "broker", "client", "bench", "gateway")
#: the packages above the common ground: the components and the face that mounts them
UPPER = (*COMPONENTS, "face")

#: what each part of the source may import, of UPPER (its own package aside)
ALLOWED: dict[str, frozenset[str]] = {
    "common": frozenset(),
    "runtime": frozenset(),
    "worker": frozenset({"runtime"}),
    "broker": frozenset(),
    "client": frozenset(),
    "bench": frozenset({"client"}),
    "gateway": frozenset({"client"}),
    "face": frozenset(COMPONENTS),
    # `python -m ipuserve`: the entry point, nothing but the face's CLI
    "main": frozenset({"face"}),
}


def part_of(path: Path) -> str:
    """Which part of the layout a source file belongs to."""
    top = path.relative_to(ROOT).parts[0]
    if top in COMPONENTS:
        return top
    relative = path.relative_to(ROOT / "ipuserve")
    if relative.parts[0] == "face":
        return "face"
    return "main" if relative == Path("__main__.py") else "common"


def imported(path: Path) -> set[str]:
    """The UPPER packages ``path`` imports (``ipuserve.X`` for X in UPPER)."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import; the layout check reads absolute"
            module = node.module or ""
            names += [module, *(f"{module}.{alias.name}" for alias in node.names)]
    found = set()
    for name in names:
        parts = name.split(".")
        if len(parts) > 1 and parts[0] == "ipuserve" and parts[1] in UPPER:
            found.add(parts[1])
    return found


def sources() -> list[Path]:
    folders = [ROOT / "ipuserve", *(ROOT / name for name in COMPONENTS)]
    return sorted(path for folder in folders for path in folder.rglob("*.py"))


def test_the_parser_sees_the_imports_it_checks() -> None:
    """Without this, a parser that found nothing would pass every check below."""
    assert imported(ROOT / "ipuserve" / "face" / "cli.py") == {*COMPONENTS, "face"}
    assert "runtime" in imported(ROOT / "worker" / "runner_backend.py")
    assert "client" in imported(ROOT / "bench" / "cli.py")
    assert {part_of(path) for path in sources()} == set(ALLOWED)


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_each_module_imports_only_what_its_part_may(path: Path) -> None:
    part = part_of(path)
    forbidden = imported(path) - ALLOWED[part] - {part}
    named = ", ".join(f"ipuserve.{name}" for name in sorted(forbidden))
    assert not forbidden, (
        f"{path.relative_to(ROOT)} ({part}) imports {named}; DESIGN.md §1: dependencies "
        "point one way"
    )


def runtime_modules_imported(path: Path) -> set[str]:
    """The ``ipuserve.runtime`` submodules ``path`` imports by name (``ipuserve.runtime.X``
    in an ``import`` or a ``from ... import``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            found.add(node.module or "")
    return {name for name in found if name.startswith("ipuserve.runtime.")}


def test_the_submodule_check_sees_a_submodule_import(tmp_path: Path) -> None:
    """Without this, a parser that found nothing would pass the check below."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from ipuserve.runtime import ModelRunner\n"
        "from ipuserve.runtime.popef.reader import load_model\n"
        "def lazy() -> None:\n    import ipuserve.runtime.simulator.config\n",
        encoding="utf-8",
    )
    assert runtime_modules_imported(probe) == {
        "ipuserve.runtime.popef.reader",
        "ipuserve.runtime.simulator.config",
    }


@pytest.mark.parametrize(
    "path", sorted((ROOT / "worker").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT))
)
def test_the_worker_uses_only_what_the_runtime_exports(path: Path) -> None:
    """The worker is a client of the runtime's public API (``ipuserve.runtime`` and what
    its ``__init__`` exports, ``popef`` among them), so the runtime may rearrange its
    modules without breaking the worker; what the worker needs, the runtime exports."""
    reached = runtime_modules_imported(path)
    assert not reached, (
        f"{path.relative_to(ROOT)} imports {', '.join(sorted(reached))}; import from "
        "ipuserve.runtime (export the name in runtime/__init__.py if it is missing)"
    )


#: the components a request passes through, whose classes must not share a name
REQUEST_PATH = ("client", "broker", "worker")


def classes_defined(paths: list[Path]) -> dict[str, list[str]]:
    """Each class name defined in ``paths`` (at any depth), with where."""
    found: dict[str, list[str]] = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.ClassDef):
                where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                found.setdefault(node.name, []).append(str(where))
    return found


def name_clashes(paths: list[Path], taken: set[str]) -> dict[str, list[str]]:
    """Class names defined twice in ``paths``, or that are one of ``taken``."""
    return {
        name: where
        for name, where in classes_defined(paths).items()
        if len(where) > 1 or name in taken
    }


def wire_and_runtime_names() -> set[str]:
    """The names a reader of the request path already knows: the wire's public names
    (``wire.Job``, ``wire.Result``, ``wire.Replies``, ...) and the runtime's exports
    (the spec's ``Request``, ``Session``, ...)."""
    import ipuserve.protocol as wire
    import ipuserve.runtime as runtime

    return {name for name in dir(wire) if not name.startswith("_")} | set(runtime.__all__)


def test_the_clash_check_sees_a_clash(tmp_path: Path) -> None:
    """Without this, a reader that found no class would pass the check below."""
    (tmp_path / "a.py").write_text("class Job:\n    pass\nclass Link:\n    pass\n")
    (tmp_path / "b.py").write_text("def f() -> None:\n    class Link:\n        pass\n")
    paths = sorted(tmp_path.glob("*.py"))
    found = name_clashes(paths, {"Job"})
    assert set(found) == {"Job", "Link"}
    assert {"Job", "Result", "Replies", "Request", "Session"} <= wire_and_runtime_names()


def test_one_name_per_thing_on_the_request_path() -> None:
    """A class of the client, the broker or the worker has a name no other class of
    theirs has, and none of the wire's or the runtime's: a reader who meets ``Job``
    knows which one it is (issue 21: the worker's ``WorkItem`` and ``WorkResult``,
    the worker's ``Connection``, the client's ``ReplyRouter`` and ``TurnBatch``)."""
    paths = sorted(path for part in REQUEST_PATH for path in (ROOT / part).rglob("*.py"))
    clashes = name_clashes(paths, wire_and_runtime_names())
    assert not clashes, f"one name, two things on the request path: {clashes}"
