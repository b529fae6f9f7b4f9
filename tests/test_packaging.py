"""pyproject.toml's package list against the source tree: setuptools installs only the
packages listed, so a package missing from ``packages`` (with its ``package-dir`` entry
present) works in an editable install and is silently absent from ``pip install .``."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _setuptools() -> dict[str, object]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        table: dict[str, object] = tomllib.load(f)["tool"]["setuptools"]
    return table


def _folder(package: str, package_dir: dict[str, str]) -> Path:
    """Where setuptools looks for ``package``: its own package-dir entry, or its
    parent's folder plus its last name, or the dotted path from the root."""
    if package in package_dir:
        return ROOT / package_dir[package]
    parent, _, last = package.rpartition(".")
    return _folder(parent, package_dir) / last if parent else ROOT / package


def test_every_listed_package_is_a_folder_with_an_init() -> None:
    table = _setuptools()
    package_dir: dict[str, str] = table["package-dir"]  # type: ignore[assignment]
    for package in table["packages"]:  # type: ignore[attr-defined]
        assert (_folder(package, package_dir) / "__init__.py").is_file(), package


def test_every_package_under_a_listed_one_is_listed() -> None:
    table = _setuptools()
    packages: list[str] = table["packages"]  # type: ignore[assignment]
    package_dir: dict[str, str] = table["package-dir"]  # type: ignore[assignment]
    assert set(package_dir) <= set(packages), "a package-dir entry that is not installed"
    for package in packages:
        folder = _folder(package, package_dir)
        for init in folder.glob("*/__init__.py"):
            sub = f"{package}.{init.parent.name}"
            assert sub in packages, f"{sub} ({init.parent}) is not in [tool.setuptools] packages"


def _required_python() -> str:
    """pyproject.toml's requires-python as "3.11" (it is a plain lower bound)."""
    with (ROOT / "pyproject.toml").open("rb") as f:
        spec: str = tomllib.load(f)["project"]["requires-python"]
    assert spec.startswith(">="), spec
    return spec.removeprefix(">=")


def test_setup_py_refuses_an_older_python_with_pyprojects_bound() -> None:
    """setup.py runs before pip fetches any dependency (pip < 25.1 checks
    requires-python only after downloading them all): its bound is pyproject's, and a
    Python below it stops there, saying which it needs."""
    required = _required_python()
    major, minor = (int(part) for part in required.split("."))
    setup_py = (ROOT / "setup.py").read_text()
    assert f"REQUIRED = ({major}, {minor})" in setup_py
    older = f"import runpy, sys; sys.version_info = ({major}, {minor - 1}, 0); "
    done = subprocess.run(
        [sys.executable, "-c", older + "runpy.run_path('setup.py', run_name='__main__')"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert f"ipuserve needs Python {required} or newer" in done.stderr


def test_the_readme_names_the_python_version_next_to_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Two commands", 1)[1].split("```sh", 1)[0]
    assert f"Python {_required_python()} or newer" in section


def _dockerignore() -> list[tuple[re.Pattern[str], bool]]:
    """.dockerignore's patterns in order, each with whether it excludes (not ``!``).

    Docker's rules, as its pattern matcher applies them: a pattern is a cleaned path
    (no trailing ``/``), ``*`` and ``?`` stop at ``/``, ``**`` crosses folders, and a
    pattern that matches a path or any folder above it decides for the path; the last
    such pattern wins."""
    patterns = []
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        excludes = not line.startswith("!")
        text = line.removeprefix("!").strip("/")
        regex = ""
        i = 0
        while i < len(text):
            if text.startswith("**/", i):
                regex, i = regex + "(?:.*/)?", i + 3
            elif text.startswith("**", i):
                regex, i = regex + ".*", i + 2
            elif text[i] == "*":
                regex, i = regex + "[^/]*", i + 1
            elif text[i] == "?":
                regex, i = regex + "[^/]", i + 1
            elif text[i] == "[":
                end = text.index("]", i)
                regex, i = regex + text[i : end + 1], end + 1
            else:
                regex, i = regex + re.escape(text[i]), i + 1
        patterns.append((re.compile(regex), excludes))
    return patterns


def _in_build_context(path: str, patterns: list[tuple[re.Pattern[str], bool]]) -> bool:
    parts = path.split("/")
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for pattern, excludes in patterns:
        if any(pattern.fullmatch(candidate) for candidate in candidates):
            excluded = excludes
    return not excluded


def test_the_dockerignore_reader_sees_what_it_keeps_out() -> None:
    """Without this, a reader that excluded nothing would pass the check below."""
    patterns = _dockerignore()
    assert not _in_build_context("tests/test_packaging.py", patterns)
    assert not _in_build_context(".venv/bin/python", patterns)
    assert not _in_build_context("client/__pycache__/core.cpython-311.pyc", patterns)
    assert _in_build_context("client/core.py", patterns)


def test_the_image_build_context_holds_every_listed_package() -> None:
    """The Dockerfile's fallback ``pip install /src`` installs from the build context,
    which .dockerignore reduces to an allow-list: a package folder missing there is
    missing from the image (``gateway/`` once was), and so are the build's own files."""
    patterns = _dockerignore()
    table = _setuptools()
    package_dir: dict[str, str] = table["package-dir"]  # type: ignore[assignment]
    needed = ["pyproject.toml", "setup.py", "README.md"]
    for package in table["packages"]:  # type: ignore[attr-defined]
        folder = _folder(package, package_dir)
        needed += [
            str(path.relative_to(ROOT))
            for path in folder.iterdir()
            if path.is_file() and path.suffix != ".pyc"
        ]
    left_out = [path for path in needed if not _in_build_context(path, patterns)]
    assert not left_out, f".dockerignore keeps these build inputs out of the image: {left_out}"
