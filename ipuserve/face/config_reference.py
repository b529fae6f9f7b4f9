"""The configuration reference: every command's options and environment variables.

Generated from the click commands themselves, so it cannot drift from the code.
``python -m ipuserve.face.config_reference`` prints the Markdown that README.md
embeds between its ``<!-- config-reference -->`` markers; a test checks that the
README holds exactly this text.
"""

from __future__ import annotations

import click

from ipuserve.logs import LOG_LEVEL_ENV

#: Variables read outside click (by the simulator when a DeviceManager is made).
RUNTIME_ENV = [
    (
        "IPUSERVE_SIM_IPUS",
        "4",
        "Simulated IPUs on this host: `COUNT` or `COUNT:VERSION` "
        "(2 = Mk2/Bow, 21 = C600, 1 = Mk1).",
    ),
    (
        "IPUSERVE_SIM_TIME_SCALE",
        "1",
        "Multiplier on the model's simulated steps, not the launch (a 10 us host sync): it "
        "slows the model, not the host; 0 = no simulated time (runs take only as long as "
        "the numpy work).",
    ),
    (
        "IPUSERVE_SIM_LOCK_DIR",
        "`$TMPDIR/ipuserve-sim-$UID`",
        "Lock files, one per IPU; processes sharing the directory share the IPUs.",
    ),
    (
        "IPUSERVE_SIM_BLAS_THREADS",
        "1",
        "BLAS threads per process (each simulated IPU computes on its own thread).",
    ),
    (LOG_LEVEL_ENV, "WARNING", "Log level of every process (also `ipuserve --log-level`)."),
]


def render(group: click.Group) -> str:
    lines = ["| variable | default | meaning |", "|---|---|---|"]
    lines += [f"| `{name}` | {default} | {text} |" for name, default, text in RUNTIME_ENV]
    for path, command in _commands(group, ["ipuserve"]):
        rows = [
            _row(path, param)
            for param in command.params
            if isinstance(param, click.Option) and not param.hidden
        ]
        if not rows:
            continue
        lines += [
            "",
            f"`{' '.join(path)}` — {_first_line(command)}",
            "",
            "| option | environment variable | default | meaning |",
            "|---|---|---|---|",
        ]
        lines += rows
    return "\n".join(lines) + "\n"


def _commands(group: click.Group, path: list[str]) -> list[tuple[list[str], click.Command]]:
    found: list[tuple[list[str], click.Command]] = []
    for name in sorted(group.commands):
        command = group.commands[name]
        if isinstance(command, click.Group):
            if command.params:  # a group that does something itself (``models``)
                found.append(([*path, name], command))
            found += _commands(command, [*path, name])
        else:
            found.append(([*path, name], command))
    return found


def _row(path: list[str], option: click.Option) -> str:
    flags = " / ".join(f"`{o}`" for o in [*option.opts, *option.secondary_opts])
    env = option.envvar or "IPUSERVE_" + "_".join([*path[1:], option.name or ""]).upper().replace(
        "-", "_"
    )
    unset = option.default is None or option.default == () or _is_sentinel(option.default)
    if option.is_flag and (unset or not option.default):
        default = "off"
    elif unset:
        default = ""
    else:
        default = f"`{option.default}`"
    help_text = (option.help or "").replace("|", "\\|").replace("\n", " ")
    return f"| {flags} | `{env}` | {default} | {help_text} |"


def _is_sentinel(value: object) -> bool:
    """click 8.2+ marks "no default" with a sentinel object rather than None."""
    return type(value).__name__ == "Sentinel"


def _first_line(command: click.Command) -> str:
    return (command.help or "").strip().splitlines()[0] if command.help else ""


START_MARKER = "<!-- config-reference:start -->\n"
END_MARKER = "<!-- config-reference:end -->"


def splice(readme: str, reference: str) -> str:
    """README text with the reference between its markers replaced by ``reference``."""
    start = readme.index(START_MARKER) + len(START_MARKER)
    end = readme.index(END_MARKER, start)
    return readme[:start] + reference + readme[end:]


def main(argv: list[str] | None = None) -> None:
    """Print the reference, or with ``--write README.md`` splice it into that file."""
    import sys

    from ipuserve.face.cli import main as root

    args = sys.argv[1:] if argv is None else argv
    reference = render(root)
    if args[:1] == ["--write"] and len(args) == 2:
        path = args[1]
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(splice(text, reference))
        return
    print(reference, end="")


if __name__ == "__main__":
    main()
