"""The model repository: its layout as ``ipuserve model example --repository`` writes it,
the config.toml fields, and broken entries reported with their reason."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from ipuserve.face.cli import main
from ipuserve.runtime.popef import examples
from ipuserve.worker.repository import ModelConfig, Repository, read_config
from tests.repository import SMALL_MLP, write_version


def test_model_example_writes_numbered_versions(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    assert "repo/mlp/1/mlp.popef" in write_version(repo, "mlp", "--seed", "1", *SMALL_MLP)
    assert "repo/mlp/2/mlp.popef" in write_version(repo, "mlp", "--seed", "2", *SMALL_MLP)
    write_version(repo, "simple", "--version", "7")
    entries = Repository(repo).scan()
    assert [(e.name, e.version, e.problem) for e in entries] == [
        ("mlp", "1", ""),
        ("mlp", "2", ""),
        ("simple", "7", ""),
    ]
    scanned = Repository(repo)
    scanned.scan()
    assert scanned.latest("mlp") == "2" and scanned.latest("nope") is None
    assert entries[0].files == (repo / "mlp" / "1" / "mlp.popef",)


def test_model_example_refuses_out_with_repository_or_version_without(tmp_path: Path) -> None:
    runner = CliRunner()
    both = runner.invoke(
        main,
        ["model", "example", "simple", str(tmp_path / "x.popef"), "--repository", str(tmp_path)],
    )
    assert both.exit_code == 2 and "no OUT" in both.output
    alone = runner.invoke(
        main, ["model", "example", "simple", str(tmp_path / "x.popef"), "--version", "2"]
    )
    assert alone.exit_code == 2 and "--version needs --repository" in alone.output
    bad = runner.invoke(
        main, ["model", "example", "simple", "--repository", str(tmp_path), "--hidden-size", "4"]
    )
    assert bad.exit_code == 2 and not (tmp_path / "simple").exists()  # no empty version left


def test_config_fields_and_defaults(tmp_path: Path) -> None:
    assert read_config(tmp_path / "none.toml") == (ModelConfig(), "")
    assert ModelConfig().replicas == 1 and ModelConfig().workers == 1
    assert ModelConfig().batch_policy == "adaptive" and ModelConfig().pinned is None
    path = tmp_path / "config.toml"
    path.write_text(
        "replicas = 2\nbatching_dim = 0\nbatch_policy = 'fixed'\nbatch_timeout_ms = 2.5\n"
        "credit = 100\ndefault_version = 1\nworkers = 3\n"
    )
    config, problem = read_config(path)
    assert problem == ""
    assert (config.replicas, config.batching_dim, config.batch_policy) == (2, 0, "fixed")
    assert (config.batch_timeout_ms, config.credit, config.workers) == (2.5, 100, 3)
    assert config.pinned == "1"
    path.write_text("default_version = '3'\n")
    assert read_config(path)[0].pinned == "3"


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("replicas = 0\n", "replicas"),
        ("replica = 2\n", "unknown field `replica`"),
        ("batch_policy = 'lazy'\n", "batch_policy"),
        ("replicas = [\n", "config.toml"),
        ("default_version = '0'\n", "default_version"),
    ],
)
def test_a_bad_config_breaks_every_version_of_its_model_only(
    tmp_path: Path, text: str, said: str
) -> None:
    for name in ("good", "bad"):
        examples.simple(seed=1).write(tmp_path / name / "1" / f"{name}.popef")
        examples.simple(seed=2).write(tmp_path / name / "2" / f"{name}.popef")
    (tmp_path / "bad" / "config.toml").write_text(text)
    entries = {e.key: e for e in Repository(tmp_path).scan()}
    assert entries[("good", "1")].problem == entries[("good", "2")].problem == ""
    for version in ("1", "2"):
        problem = entries[("bad", version)].problem
        assert said in problem and "bad/config.toml" in problem, problem
        assert str(tmp_path) not in problem
        assert entries[("bad", version)].wire().problem == problem


def test_broken_versions_say_why_and_the_others_stand(tmp_path: Path) -> None:
    examples.simple().write(tmp_path / "m" / "1" / "m.popef")
    (tmp_path / "m" / "2").mkdir()  # empty
    (tmp_path / "m" / "3").mkdir()
    (tmp_path / "m" / "3" / "m.popef").write_bytes(b"not a zip")
    (tmp_path / "m" / "latest").mkdir()  # no version: skipped
    (tmp_path / "m" / "config.toml").write_text("batch_policy = 'fixed'\n")  # needs a window
    (tmp_path / "n" / "1").mkdir(parents=True)
    examples.branches().write(tmp_path / "n" / "1" / "n.popef")  # conditional: refused
    (tmp_path / ".hidden" / "1").mkdir(parents=True)
    entries = {e.key: e.problem for e in Repository(tmp_path).scan()}
    assert set(entries) == {("m", "1"), ("m", "2"), ("m", "3"), ("n", "1")}
    assert all(
        "batch_timeout_ms" in entries[("m", v)] or "no .popef" in entries[("m", v)] for v in "123"
    )
    (tmp_path / "m" / "config.toml").unlink()
    repo = Repository(tmp_path)
    entries = {e.key: e.problem for e in repo.scan()}
    assert entries[("m", "1")] == ""
    assert entries[("m", "2")] == "no .popef file in m/2"  # no path of this machine
    assert "m/3/m.popef" in entries[("m", "3")]
    assert not any(str(tmp_path) in problem for problem in entries.values())
    assert "conditional" in entries[("n", "1")] or "branch" in entries[("n", "1")]
    examples.simple().write(tmp_path / "m" / "2" / "m.popef")  # fixed: seen by the next scan
    assert repo.scan() and repo.get("m", "2") is not None and repo.get("m", "2").problem == ""


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--model", "m.popef", "--repository", "r"], "either --model"),
        ([], "either --model"),
        (["--model", "m.popef", "--load", "mlp"], "--load needs --repository"),
        (["--repository", "r", "--replicas", "2"], "--replicas set(s) one model's serving"),
        (["--repository", "r", "--load", "mlp:0"], "must be a positive integer"),
        (["--repository", "r", "--load", "mlp:v2"], "must be a positive integer"),
    ],
)
def test_worker_refuses_what_a_repository_worker_cannot_take(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], said: str
) -> None:
    (tmp_path / "m.popef").write_bytes(b"")
    (tmp_path / "r").mkdir()
    monkeypatch.chdir(tmp_path)
    done = CliRunner().invoke(main, ["worker", "--broker", "tcp://127.0.0.1:1", *args])
    assert done.exit_code == 2 and said in done.output, done.output
