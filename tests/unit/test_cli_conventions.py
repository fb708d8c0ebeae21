"""Command-line conventions (issue 25): --version, shell completion, `echo-swarm env`, errors on stderr, one table
of exit codes (README and --help generated from it), a group's options accepted after its subcommand, and `join`'s
help, config keys and docs/client.md from one source (JoinConfig)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from echo_swarm import reference
from echo_swarm.argv import hoist_group_options
from echo_swarm.cli import app
from shared.exit_codes import ExitCode, codes_table
from swarm_client.settings import FLAG_FIELDS, JoinConfig

REPO = Path(__file__).resolve().parents[2]


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "echo_swarm", *args], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env=os.environ | (env or {}))


def test_version() -> None:
    from importlib.metadata import version

    res = cli("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"echo-swarm {version('echo-swarm')}"


def test_shell_completion_is_on() -> None:
    # typer detects the calling shell otherwise (CI runs under sh, which it does not support); with detection off,
    # --show-completion takes the shell as its value (typer's own tests do the same)
    res = cli("--show-completion", "bash", env={"_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"})
    assert res.returncode == 0 and "_ECHO_SWARM_COMPLETE" in res.stdout
    assert "--install-completion" in cli("--help").stdout


def test_env_reports_versions_backends_devices_and_paths(tmp_path: Path) -> None:
    res = cli("env", "--json", "--home", str(tmp_path / "home"), env={"ECHO_SWARM_CONFIG": str(tmp_path / "c.toml")})
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["versions"]["echo-swarm"] and set(data["backends"]) >= {"llama", "torch"}
    assert data["paths"]["client home"] == str(tmp_path / "home")
    assert data["paths"]["snapshot cache"] == str(tmp_path / "home" / "cache")
    assert data["devices"]["cpu cores"] >= 1 and "torch build" in data
    assert "client home" in cli("env", "--home", str(tmp_path)).stdout  # the plain-text form


def test_the_readme_exit_code_table_is_the_codes() -> None:
    readme = (REPO / "README.md").read_text()
    assert reference.block("exit-codes") in readme, ("README.md's exit codes differ from shared/exit_codes.py: run "
                                                     "python -m echo_swarm.reference README.md docs/client.md")
    assert len({int(c) for c in ExitCode}) == len(ExitCode)  # each code means one thing
    assert "| 2 | bad usage" in codes_table()


def test_docs_client_md_lists_every_join_option_as_the_code_has_it() -> None:
    doc = (REPO / "docs" / "client.md").read_text()
    assert reference.block("join-options") in doc, ("docs/client.md's options table differs from JoinConfig: run "
                                                    "python -m echo_swarm.reference README.md docs/client.md")


def test_join_help_is_the_settings_descriptions() -> None:
    join = typer.main.get_command(app).commands["join"]  # type: ignore[attr-defined]
    fields = JoinConfig.model_fields
    checked = 0
    for param in join.params:
        field = FLAG_FIELDS.get(param.name, param.name)
        if field in fields:
            first = (fields[field].description or "").split(";")[0].split(" None")[0][:40]
            assert first in (param.help or ""), f"--{param.name}'s help is not JoinConfig.{field}'s description"
            checked += 1
    assert checked >= 35


@pytest.mark.parametrize(("flag", "field"), sorted(FLAG_FIELDS.items()))
def test_a_flags_name_is_also_a_config_key(tmp_path: Path, flag: str, field: str) -> None:
    from swarm_client.config import load_file

    value = '["22:00-07:00"]' if field == "windows" else "true" if field == "p2p_serve" else "3"
    path = tmp_path / "client.toml"
    path.write_text(f'{flag} = {value}\n')
    assert set(load_file(path, required=True)) == {field}


def test_a_groups_options_work_after_its_subcommand(tmp_path: Path) -> None:
    group = typer.main.get_command(app)
    assert hoist_group_options(group, ["admin", "status", "--run-dir", "X", "--json"]) == \
        ["admin", "--run-dir", "X", "status", "--json"]
    assert hoist_group_options(group, ["admin", "--run-dir", "X", "status"]) == ["admin", "--run-dir", "X", "status"]
    assert hoist_group_options(group, ["client", "status", "--home", "h"]) == ["client", "status", "--home", "h"]
    res = cli("admin", "status", "--run-dir", str(tmp_path))  # through main(): no "No such option"
    assert res.returncode == 1 and "endpoint.json" in res.stderr and res.stdout == ""


def test_errors_go_to_stderr_with_the_usage_code(tmp_path: Path) -> None:
    res = cli("join", "coordinator.example:8470", "--home", str(tmp_path),
              env={"ECHO_SWARM_CONFIG": str(tmp_path / "none.toml")})
    assert res.returncode == ExitCode.USAGE and res.stdout == ""
    assert res.stderr.count("\n") == 1 and "needs http:// or https://" in res.stderr
    assert not (tmp_path / "identity.key").exists()
    res = CliRunner().invoke(app, ["client", "snooze", "soon", "--home", str(tmp_path)])
    assert res.exit_code == ExitCode.USAGE and "30m" in res.output
