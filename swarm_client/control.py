"""Talking to a running client: `echo-swarm client pause|resume|snooze|finish|status` and the local control page.

Two small JSON files in the client home, each replaced atomically (write + rename), so neither side ever reads
half a file and nothing breaks if the client is not running or crashes:
- ``control.json``, written by the commands and the control page (:class:`Controls`): a pause, a snooze until
  some time, "finish the current job, then exit", a bandwidth cap set at run time. The running client reads it
  before every lease (at least once a second while it waits), so each takes effect within one poll. A pause
  persists across restarts until `resume`; a finish is cleared by the client that obeyed it.
- ``status.json``, written by the running client: its pid, state, counters and credit.
- ``lifetime.json``, written by the running client (swarm_client/lifetime.py): credit and results per run, kept
  across runs and restarts; read here for `client status`.

Paused (or snoozed) means: no new job is fetched. A job already being generated is finished and submitted (a job
takes seconds to a few minutes, and abandoning it would waste the work); a job that arrives on a lease request
already in flight when the pause lands is released at once, so the coordinator reissues it to someone else.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from swarm_client.lifetime import Lifetime

CONTROL = "control.json"
STATUS = "status.json"

_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*([smhd])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_SNOOZE_S = 7 * 86400


@dataclass(frozen=True)
class Controls:
    """What the volunteer asked of the running client (control.json)."""

    paused: bool = False
    since: float = 0.0  # when the pause (or resume) was set
    snooze_until: float | None = None  # unix time: no new work before it
    finish: bool = False  # finish the job in hand, submit it, then exit
    max_mbps: float | None = None  # download cap set at run time (the control page), MB/s; None: the config's

    def snoozed(self, now: float) -> bool:
        return self.snooze_until is not None and now < self.snooze_until

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> Controls:
        """Tolerant of an older or hand-edited file: unknown keys and wrongly typed values are ignored."""
        if not data:
            return cls()
        out: dict[str, Any] = {}
        for f in fields(cls):
            value = data.get(f.name)
            if f.name in ("paused", "finish") and isinstance(value, bool):
                out[f.name] = value
            elif f.name in ("since", "snooze_until", "max_mbps") and isinstance(value, int | float) \
                    and not isinstance(value, bool) and value >= 0:
                out[f.name] = float(value)
        return cls(**out)


def parse_duration(text: str) -> float:
    """``"30m"``, ``"2h"``, ``"1h30m"``, ``"90s"``, ``"45"`` (minutes) → seconds. ValueError says the form."""
    text = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        seconds = float(text) * 60
    else:
        parts = _DURATION.findall(text)
        if not parts or _DURATION.sub("", text).strip():
            raise ValueError(f"{text!r} is not a duration: write e.g. 30m, 2h, 1h30m or 90s")
        seconds = sum(float(n) * _UNIT_S[u] for n, u in parts)
    if not 0 < seconds <= MAX_SNOOZE_S:
        raise ValueError(f"{text!r}: a snooze lasts more than 0 and at most 7 days")
    return seconds


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


def read_controls(home: Path) -> Controls:
    return Controls.from_json(_read_json(Path(home) / CONTROL))


def update_controls(home: Path, **changes: Any) -> Controls:
    """Read, change, write back atomically. Writers are a person's commands and clicks: seconds apart."""
    new = replace(read_controls(home), **changes)
    _write_json(Path(home) / CONTROL, asdict(new))
    return new


def set_paused(home: Path, paused: bool, now: float | None = None) -> None:
    """Pause, or resume (which also ends a snooze)."""
    t = time.time() if now is None else now
    update_controls(home, paused=paused, since=t, **({} if paused else {"snooze_until": None}))


def snooze(home: Path, seconds: float, now: float | None = None) -> float:
    """No new work for ``seconds`` from now; returns the unix time the snooze ends."""
    until = (time.time() if now is None else now) + seconds
    update_controls(home, snooze_until=until)
    return until


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


def controls_view(home: Path, now: float | None = None) -> dict[str, Any]:
    """The controls in force: paused, snoozed until (None when not snoozed now), finishing, the run-time cap."""
    controls = read_controls(home)
    t = time.time() if now is None else now
    return {"paused": controls.paused, "snoozed_until": controls.snooze_until if controls.snoozed(t) else None,
            "finishing": controls.finish, "max_mbps": controls.max_mbps}


def describe(home: Path, now: float | None = None) -> dict[str, Any]:
    """What `echo-swarm client status` shows: the running client's last status, the controls, and its lifetime
    statistics (swarm_client/lifetime.py: the totals and the five runs it worked for last)."""
    status = read_status(home) or {}
    running = status.get("state") not in (None, "stopped") and pid_alive(status.get("pid"))
    life = Lifetime(home, readonly=True)
    return {"home": str(home), "running": running, **controls_view(home, now), **status,
            "lifetime": {"total": life.totals(), "runs": life.recent(5)}}
