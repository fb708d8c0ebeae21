"""`echo-swarm client install-service` / `uninstall-service`: run `echo-swarm join` at login and restart it when
it fails, as a systemd user unit (Linux) or a launchd agent (macOS) — how BOINC and Folding@home clients run for
months.

The unit runs this very interpreter (``sys.executable -m echo_swarm join``, so the venv the command was installed
into) with the plain-log output (``--no-panel``) and the volunteer's own settings (their config file, or the URL
and flags given to install-service). It is restarted after a failure, a minute later, except for the exit codes a
restart cannot fix (shared.exit_codes.NO_RESTART: a refusal, a bad setting, a machine too small); a client that
exits 0 (`echo-swarm client finish`) stays stopped until the next login or `systemctl --user start`. It runs at
low CPU and I/O priority, so the volunteer's own programs come first.

Rendering is pure (tested by rendering and validating with ``systemd-analyze verify`` / plistlib); installing
writes the file and, where the service manager is reachable, enables and starts it.
"""

from __future__ import annotations

import os
import plistlib
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from shared.errors import EchoSwarmError
from shared.exit_codes import NO_RESTART

UNIT_NAME = "echo-swarm.service"
AGENT_LABEL = "org.echo-swarm.client"
RESTART_S = 60


def systemd_quote(arg: str) -> str:
    """One ExecStart word: systemd splits on whitespace and expands ``%`` specifiers and ``$`` variables, so
    words with spaces or quotes are double-quoted with C escapes, ``%`` is doubled and ``$`` is doubled."""
    arg = arg.replace("%", "%%").replace("$", "$$")
    if arg and not any(c in arg for c in " \t\n\"'\\;"):
        return arg
    escaped = arg.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t")
    return f'"{escaped}"'


@dataclass(frozen=True)
class ServiceSpec:
    """What the service runs: the full argv of `join`, its working folder and where its output goes."""

    argv: list[str]
    workdir: Path
    log_dir: Path


def join_argv(url: str | None, config: Path | None, home: Path | None, extra: list[str]) -> list[str]:
    """``python -m echo_swarm join [URL] --no-panel [--config C] [--home H] [extra…]`` with this interpreter."""
    argv = [sys.executable, "-m", "echo_swarm", "join"]
    if url:
        argv.append(url)
    argv.append("--no-panel")
    if config is not None:
        argv += ["--config", str(config.absolute())]
    if home is not None:
        argv += ["--home", str(home.absolute())]
    return argv + extra


def render_systemd(spec: ServiceSpec) -> str:
    no_restart = " ".join(str(int(c)) for c in NO_RESTART)
    return "\n".join([
        "# Written by `echo-swarm client install-service`; remove with `echo-swarm client uninstall-service`.",
        "[Unit]",
        "Description=echo-swarm volunteer client (generates rollouts for an RL training run)",
        "StartLimitIntervalSec=0",
        "",
        "[Service]",
        "Type=simple",
        f"ExecStart={' '.join(systemd_quote(a) for a in spec.argv)}",
        f"WorkingDirectory={str(spec.workdir).replace('%', '%%')}",
        "Environment=PYTHONUNBUFFERED=1",
        "Restart=on-failure",
        f"RestartSec={RESTART_S}",
        f"RestartPreventExitStatus={no_restart}",
        "# SIGTERM: the client finishes the decoding step, hands its lease back and exits",
        "KillSignal=SIGTERM",
        "TimeoutStopSec=90",
        "Nice=19",
        "IOSchedulingClass=idle",
        "",
        "[Install]",
        "WantedBy=default.target",
        "",
    ])


def render_launchd(spec: ServiceSpec) -> bytes:
    agent = {
        "Label": AGENT_LABEL,
        "ProgramArguments": spec.argv,
        "WorkingDirectory": str(spec.workdir),
        "EnvironmentVariables": {"PYTHONUNBUFFERED": "1"},
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},  # restarted after a failure, not after `client finish`
        "ThrottleInterval": RESTART_S,
        "ProcessType": "Background",
        "Nice": 19,
        "LowPriorityIO": True,
        "StandardOutPath": str(spec.log_dir / "service.out.log"),
        "StandardErrorPath": str(spec.log_dir / "service.err.log"),
    }
    return plistlib.dumps(agent)


def unit_path(platform: str | None = None) -> Path:
    """Where the unit (Linux) or agent (macOS) goes, for this user."""
    platform = platform or sys.platform
    home = Path.home()
    if platform == "darwin":
        return home / "Library" / "LaunchAgents" / f"{AGENT_LABEL}.plist"
    config = Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config")
    return config / "systemd" / "user" / UNIT_NAME


def render(spec: ServiceSpec, platform: str | None = None) -> bytes:
    platform = platform or sys.platform
    return render_launchd(spec) if platform == "darwin" else render_systemd(spec).encode()


class ServiceNotStarted(EchoSwarmError):
    """The unit (or agent) was written but the service manager did not enable and start it: the message says why
    and the command that does it by hand; ``done`` lists what was done (the file written)."""

    def __init__(self, message: str, done: list[str]) -> None:
        super().__init__(message)
        self.done = done


def _run(argv: list[str]) -> tuple[bool, str]:
    """Run a service manager command; (succeeded, its message on one line)."""
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, str(exc)
    return res.returncode == 0, "; ".join(line.strip() for line in (res.stderr or res.stdout).splitlines()
                                          if line.strip())


def install(spec: ServiceSpec, *, start: bool = True, platform: str | None = None) -> list[str]:
    """Write the unit or agent (atomically) and, with ``start``, enable and start it. Returns what was done, one
    line each; ServiceNotStarted when the unit is written but not running (no systemd, no user session)."""
    platform = platform or sys.platform
    path = unit_path(platform)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(render(spec, platform))
    os.replace(tmp, path)
    done = [f"wrote {path}"]
    if not start:
        return done
    if platform == "darwin":
        uid = os.getuid()
        _run(["launchctl", "bootout", f"gui/{uid}/{AGENT_LABEL}"])  # an older copy, if loaded
        ok, err = _run(["launchctl", "bootstrap", f"gui/{uid}", str(path)])
        if not ok:
            raise ServiceNotStarted(f"launchctl could not load {path} ({err}); load it with: launchctl bootstrap "
                                    f"gui/{uid} {path}", done)
        return done + ["started it with launchctl; it starts again at every login"]
    if shutil.which("systemctl") is None:
        raise ServiceNotStarted("systemctl is not available (this machine does not run systemd): start `echo-swarm "
                                "join` another way, or install with --no-start to only write the unit", done)
    ok, err = _run(["systemctl", "--user", "daemon-reload"])
    if ok:
        ok, err = _run(["systemctl", "--user", "enable", "--now", UNIT_NAME])
    if not ok:
        raise ServiceNotStarted(f"systemd did not enable {UNIT_NAME} ({err}); in a login session (not su or sudo), "
                                f"run: systemctl --user daemon-reload && systemctl --user enable --now {UNIT_NAME}",
                                done)
    return done + [f"enabled and started {UNIT_NAME} (logs: journalctl --user -u {UNIT_NAME}); to keep it running "
                   f"while you are logged out: loginctl enable-linger {os.environ.get('USER', '$USER')}"]


def uninstall(platform: str | None = None) -> list[str]:
    """Stop and remove the unit or agent. Returns what was done, one line each."""
    platform = platform or sys.platform
    path = unit_path(platform)
    done = []
    if platform == "darwin":
        _run(["launchctl", "bootout", f"gui/{os.getuid()}/{AGENT_LABEL}"])
    elif shutil.which("systemctl") is not None:
        ok, _ = _run(["systemctl", "--user", "disable", "--now", UNIT_NAME])
        if ok:
            done.append(f"stopped and disabled {UNIT_NAME}")
    if path.exists():
        path.unlink()
        done.append(f"removed {path}")
        if platform != "darwin" and shutil.which("systemctl") is not None:
            _run(["systemctl", "--user", "daemon-reload"])
    else:
        done.append(f"no service was installed ({path} does not exist)")
    return done
