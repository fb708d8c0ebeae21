"""`echo-swarm coordinator`'s body: the run config from the TOML file and the flags, then the role(s) started.

A module of its own so that it carries the coordinator's imports: echo_swarm.cli imports it only when the command
runs, because coordinator.launch.main loads the whole coordinator (aiohttp, the store, prometheus_client; over
half a second), which `echo-swarm --help`, `join` and a client-only install never need.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from coordinator.config import ConfigError, load_config
from coordinator.launch.main import run
from coordinator.tasks.factory import check_task
from shared.exit_codes import ExitCode


def serve(config: Path | None, overrides: dict[str, Any], role: str, index: int) -> int:
    """The exit code of serving ``role`` (or every role) of the run; a bad config or role is one line on stderr
    and ExitCode.USAGE, before anything starts."""
    try:
        cfg = load_config(config, overrides)
        check_task(cfg.task)  # what the task's library says of its settings, before anything starts
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        return ExitCode.USAGE
    if role not in ("all", "api", "learner", "verifier", "p2p"):
        typer.echo(f"error: --role {role!r} is not a role; use all, api, learner, verifier or p2p", err=True)
        return ExitCode.USAGE
    return run(cfg, role, index)
