"""The exit codes of every `echo-swarm` command, in one table: the commands return them, their --help and the
README's table are generated from it (a test keeps the README in step), and a service manager can act on them
(the systemd unit `echo-swarm client install-service` writes does not restart a client on a code that a restart
cannot fix).

2 is click's own code for a usage error (an unknown flag), so every refusal of bad settings uses it too, and no
other failure does.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    FAILED = 1
    USAGE = 2
    REFUSED = 3
    RESOURCES = 4
    UNREACHABLE = 5
    NOT_A_COORDINATOR = 6
    PORT_IN_USE = 10
    MODEL_INVALID = 11
    RUN_DIR_UNWRITABLE = 12
    NO_DISK_SPACE = 13


#: What each code means, as --help and README.md say it.
MEANING: dict[ExitCode, str] = {
    ExitCode.OK: "done (join: stopped by Ctrl-C, `client finish`, --max-jobs or a finished run with "
                 "--exit-when-finished)",
    ExitCode.FAILED: "an unexpected failure (the coordinator: the run stopped; see the log), or the coordinator "
                     "refused an `admin` command or could not be reached",
    ExitCode.USAGE: "bad usage: an unknown flag, an invalid setting or config file",
    ExitCode.REFUSED: "join: refused by the coordinator (e.g. banned, or its key changed); retrying cannot help",
    ExitCode.RESOURCES: "join: this machine lacks the memory or disk for the run's model",
    ExitCode.UNREACHABLE: "join: the coordinator could not be reached (nothing listening, or gave up retrying)",
    ExitCode.NOT_A_COORDINATOR: "join: the URL answers, but not as an echo-swarm coordinator",
    ExitCode.PORT_IN_USE: "coordinator: its port is in use",
    ExitCode.MODEL_INVALID: "coordinator: the model folder is missing or incomplete",
    ExitCode.RUN_DIR_UNWRITABLE: "coordinator: the run directory cannot be written",
    ExitCode.NO_DISK_SPACE: "coordinator: not enough free disk for one policy version",
}

#: Codes a restart of the client cannot fix: the service unit does not restart on them.
NO_RESTART = (ExitCode.USAGE, ExitCode.REFUSED, ExitCode.RESOURCES, ExitCode.NOT_A_COORDINATOR)


def codes_text(codes: tuple[ExitCode, ...] | None = None) -> str:
    """``0 done …, 2 bad usage …`` — one sentence for --help."""
    return "; ".join(f"{int(c)} {MEANING[c]}" for c in (codes or tuple(ExitCode)))


def codes_table() -> str:
    """The Markdown table README.md carries (tests/unit/test_cli_conventions.py keeps it in step)."""
    rows = ["| code | meaning |", "|---|---|"]
    rows += [f"| {int(c)} | {MEANING[c]} |" for c in ExitCode]
    return "\n".join(rows)
