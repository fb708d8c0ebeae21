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


def test_the_readme_families_table_is_the_exporters() -> None:
    readme = (REPO / "README.md").read_text()
    assert reference.block("model-families") in readme, ("README.md's model families differ from coordinator/publish/"
                                                         "gguf_export.py: run python -m echo_swarm.reference README.md")
    assert "| `Qwen3ForCausalLM` | Qwen3 | llama.cpp's converters |" in reference.model_families_markdown()


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


def _options(help_text: str) -> dict[str, str]:
    """The rows of rich's options panel: each option's first name → the rest of its row, continuation lines
    joined, as one line of words."""
    rows: dict[str, str] = {}
    current = ""
    for line in help_text.splitlines():
        words = line.strip("│ ").split()
        if line.startswith("│ --"):
            current = words[0]
            rows[current] = " ".join(words[1:])
        elif current and line.startswith("│") and words:
            rows[current] += " " + " ".join(words)
    return rows


def test_coordinator_help_shows_the_run_configs_defaults_and_flags_as_flags() -> None:
    """`coordinator --help` on a terminal: each flag that sets a run-config key shows that key's built-in default
    (the flags themselves default to unset, so that the config file's keys stand), and a flag shows no `<bool>`
    value, since it takes none. The same for every command's --help."""
    from coordinator.config import load_config
    from echo_swarm.cli import COORDINATOR_KEYS
    from tests.terminal import run_on_terminal

    screen = run_on_terminal([sys.executable, "-m", "echo_swarm", "coordinator", "--help"], columns=200)
    assert screen.returncode == 0, screen.text()
    rows = _options(screen.text())
    built_in = load_config(None)
    expected = {"--port": "8470", "--host": "127.0.0.1", "--sync-mode": "sequential-pull", "--p2p": "--no-p2p",
                "--role": "all", "--index": "0"}
    for name, key in COORDINATOR_KEYS.items():
        value: object = built_in
        for part in key.split("."):
            value = getattr(value, part)
        flag = "--" + name.replace("_", "-")
        if value is None:  # unset: the help says what happens then
            assert "[default:" not in rows[flag], rows[flag]
        else:
            shown = expected.get(flag, "--no-p2p" if value is False else str(value))
            assert rows[flag].endswith(f"[default: {shown}]"), (flag, rows[flag])
    assert set(expected) <= set(rows)
    assert rows["--p2p"].startswith("--no-p2p Run a libp2p peer") and rows["--help"] == "Show this message and exit."
    for command in ([], ["join"], ["client", "status"], ["admin"], ["admin", "clients"], ["demo"]):
        shown = run_on_terminal([sys.executable, "-m", "echo_swarm", *command, "--help"], columns=200)
        assert shown.returncode == 0 and "Usage:" in shown.text() and "<bool>" not in shown.text(), command
        if command == ["join"]:  # its defaults come from JoinConfig, and were swallowed as rich markup too
            assert _options(shown.text())["--retries"].endswith(f"[default: {JoinConfig.model_fields['retries'].default}]")
