"""Talking to a running client: `echo-swarm client pause|resume|status`.

Two small JSON files in the client home, each replaced atomically (write + rename), so neither side ever reads
half a file and nothing breaks if the client is not running or crashes:
- ``control.json``, written by the commands: ``{"paused": true, "since": <unix time>}``. The running client
  reads it before every lease (at least once a second while it waits), so a pause takes effect within one
  poll. A pause persists across restarts until `resume`.
- ``status.json``, written by the running client: its pid, state, counters and credit.

Paused means: no new job is fetched. A job already being generated is finished and submitted (a job takes
seconds to a few minutes, and abandoning it would waste the work); a job that arrives on a lease request
already in flight when the pause lands is released at once, so the coordinator reissues it to someone else.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

CONTROL = "control.json"
STATUS = "status.json"


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def set_paused(home: Path, paused: bool, now: float | None = None) -> None:
    _write_json(Path(home) / CONTROL, {"paused": paused, "since": time.time() if now is None else now})


def is_paused(home: Path) -> bool:
    data = _read_json(Path(home) / CONTROL)
    return bool(data and data.get("paused") is True)


def write_status(home: Path, status: dict[str, Any]) -> None:
    _write_json(Path(home) / STATUS, status)


def read_status(home: Path) -> dict[str, Any] | None:
    return _read_json(Path(home) / STATUS)


def pid_alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def describe(home: Path) -> dict[str, Any]:
    """What `echo-swarm client status` shows: the running client's last status and the pause flag."""
    status = read_status(home) or {}
    running = status.get("state") not in (None, "stopped") and pid_alive(status.get("pid"))
    return {"home": str(home), "running": running, "paused": is_paused(home), **status}
