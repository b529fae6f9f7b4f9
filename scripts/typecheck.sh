#!/usr/bin/env bash
# mypy cannot follow setuptools' package-dir mapping (runtime/ -> ipuserve.runtime, ...),
# so check a shadow tree of symlinks laid out as the installed package is.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
shadow="$root/build/typecheck"
rm -rf "$shadow"
mkdir -p "$shadow/ipuserve"
for entry in "$root"/ipuserve/*; do
    ln -s "$entry" "$shadow/ipuserve/$(basename "$entry")"
done
for component in runtime worker broker client bench gateway; do
    ln -s "$root/$component" "$shadow/ipuserve/$component"
done
cd "$shadow"
exec mypy --config-file "$root/pyproject.toml" -p ipuserve "$@"
