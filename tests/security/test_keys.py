"""Key files: what ``generate`` writes, what ``load_*`` accepts and refuses, and the
``ipuserve keys`` commands."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import zmq
import zmq.auth
from click.testing import CliRunner
from zmq.utils import z85

from ipuserve.errors import ConfigError
from ipuserve.face.cli import main
from ipuserve.security import (
    AllowLists,
    Role,
    fingerprint,
    generate_keypair,
    load_public_key,
    load_secret_key,
)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_generate_writes_a_public_file_and_a_private_secret_file(tmp_path: Path) -> None:
    files = generate_keypair("node-1", tmp_path)
    assert (files.public, files.secret) == (tmp_path / "node-1.key", tmp_path / "node-1.key_secret")
    assert mode(files.secret) == 0o600
    assert mode(files.public) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["node-1.key", "node-1.key_secret"]
    public, secret = zmq.auth.load_certificate(files.secret)
    assert secret is not None and zmq.curve_public(secret) == public
    assert zmq.auth.load_certificate(files.public) == (public, None)


def test_generate_never_overwrites(tmp_path: Path) -> None:
    first = generate_keypair("a", tmp_path)
    before = first.secret.read_bytes()
    with pytest.raises(ConfigError, match="never overwritten"):
        generate_keypair("a", tmp_path)
    assert first.secret.read_bytes() == before


@pytest.mark.parametrize("name", ["", ".hidden", "a/b", "x y", "../up"])
def test_generate_refuses_names_that_are_not_plain_file_names(tmp_path: Path, name: str) -> None:
    with pytest.raises(ConfigError, match="key name"):
        generate_keypair(name, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_secret_key_loads_from_its_file_or_from_bytes(tmp_path: Path) -> None:
    files = generate_keypair("k", tmp_path)
    pair = load_secret_key(files.secret)
    assert load_secret_key(pair.secret) == pair
    assert load_secret_key(z85.decode(pair.secret)) == pair
    assert load_public_key(files.public) == pair.public == load_public_key(files.secret)
    assert "secret" not in repr(pair).replace("secret=<hidden>", "")
    assert pair.secret.decode() not in repr(pair)


def test_a_secret_key_others_can_read_is_loaded_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    files = generate_keypair("k", tmp_path)
    load_secret_key(files.secret)
    assert "others on this host can read it" not in caplog.text
    files.secret.chmod(0o644)
    assert load_secret_key(files.secret).public == load_public_key(files.public)
    assert "others on this host can read it" in caplog.text


def test_fingerprint_is_short_and_the_same_for_either_form(tmp_path: Path) -> None:
    public = load_public_key(generate_keypair("k", tmp_path).public)
    assert fingerprint(public) == fingerprint(z85.decode(public)) == fingerprint(public.decode())
    assert len(fingerprint(public)) == 12
    other = load_public_key(generate_keypair("j", tmp_path).public)
    assert fingerprint(other) != fingerprint(public)


def test_bad_keys_are_config_errors_naming_the_file(tmp_path: Path) -> None:
    files = generate_keypair("k", tmp_path)
    with pytest.raises(ConfigError, match=r"holds no secret key"):
        load_secret_key(files.public)
    with pytest.raises(ConfigError, match=r"does not exist"):
        load_secret_key(tmp_path / "missing.key_secret")
    (tmp_path / "empty.key").write_text("# nothing\n")
    with pytest.raises(ConfigError, match=r"empty\.key"):
        load_public_key(tmp_path / "empty.key")
    (tmp_path / "short.key").write_text('curve\n    public-key = "abc"\n')
    with pytest.raises(ConfigError, match=r"3 bytes"):
        load_public_key(tmp_path / "short.key")
    with pytest.raises(ConfigError, match="not a valid Z85 key"):
        load_public_key(b" " * 40)


def test_a_secret_file_whose_halves_disagree_is_refused(tmp_path: Path) -> None:
    one = load_secret_key(generate_keypair("one", tmp_path).secret)
    two = load_secret_key(generate_keypair("two", tmp_path).secret)
    mixed = tmp_path / "mixed.key_secret"
    mixed.write_text(
        f'curve\n    public-key = "{one.public.decode()}"\n'
        f'    secret-key = "{two.secret.decode()}"\n'
    )
    with pytest.raises(ConfigError, match="does not belong"):
        load_secret_key(mixed)


def test_allow_lists_read_only_public_key_files(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clients, workers = tmp_path / "clients", tmp_path / "workers"
    clients.mkdir()
    workers.mkdir()
    generate_keypair("c", clients)  # the secret beside it: ignored, with a warning
    (clients / "README").write_text("client keys go here\n")
    lists = AllowLists.load({Role.CLIENT: clients, Role.WORKER: workers})
    assert lists.counts() == {"client": 1, "worker": 0}
    assert "c.key_secret is a secret key" in caplog.text
    assert "holds no .key file" in caplog.text


def test_allow_lists_name_a_missing_directory_or_a_bad_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"client key directory .* does not exist"):
        AllowLists.load({Role.CLIENT: tmp_path / "nowhere"})
    (tmp_path / "bad.key").write_text("not a certificate\n")
    with pytest.raises(ConfigError, match=r"bad\.key"):
        AllowLists.load({Role.CLIENT: tmp_path})


# -- the CLI ------------------------------------------------------------------------


def test_cli_generate_then_show(tmp_path: Path) -> None:
    runner = CliRunner()
    made = runner.invoke(main, ["keys", "generate", "broker", "--dir", str(tmp_path / "k")])
    assert made.exit_code == 0, made.output
    secret, public = tmp_path / "k/broker.key_secret", tmp_path / "k/broker.key"
    assert mode(secret) == 0o600
    expected, _ = zmq.auth.load_certificate(public)

    for file in (public, secret):
        shown = runner.invoke(main, ["keys", "show", str(file)])
        assert shown.exit_code == 0, shown.output
        assert shown.stdout.splitlines()[0] == expected.decode()
    assert fingerprint(expected) in made.output


def test_cli_generate_reads_its_directory_from_the_environment(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        main, ["keys", "generate", "w1"], env={"IPUSERVE_KEYS_DIR": str(tmp_path)}
    )
    assert result.exit_code == 0, result.output
    assert (tmp_path / "w1.key").is_file()


def test_cli_errors_are_one_line(tmp_path: Path) -> None:
    runner = CliRunner()
    assert runner.invoke(main, ["keys", "generate", "x", "--dir", str(tmp_path)]).exit_code == 0
    again = runner.invoke(main, ["keys", "generate", "x", "--dir", str(tmp_path)])
    assert again.exit_code == 1
    assert "never overwritten" in again.output and "Traceback" not in again.output
    missing = runner.invoke(main, ["keys", "show", str(tmp_path / "nope.key")])
    assert missing.exit_code == 1 and "does not exist" in missing.output
