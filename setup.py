"""Refuse an old Python at once, before pip fetches any dependency.

pip before 25.1 checks a local project's ``Requires-Python`` only after it has
collected, and downloaded, every dependency (it yielded that check last: pypa/pip
#13270), so ``pip install .`` on Python 3.10 fetched numpy, grpcio and the rest
(27 MB) and only then said "requires a different Python". setuptools runs this file
when pip first asks what the build needs, before pip resolves anything, so the
refusal comes there. Everything else about the build is in pyproject.toml.
"""

import sys

from setuptools import setup

#: pyproject.toml's requires-python (tests/test_packaging.py keeps the two equal)
REQUIRED = (3, 11)

if sys.version_info < REQUIRED:
    sys.exit(
        f"ipuserve needs Python {REQUIRED[0]}.{REQUIRED[1]} or newer; this is "
        f"{sys.version.split()[0]} ({sys.executable}). Make the venv with a newer one, "
        f"e.g. python{REQUIRED[0]}.{REQUIRED[1]} -m venv .venv"
    )

setup()
