"""The coordinator's notices, as the volunteer sees them: fetched from ``GET /v1/notices`` when the client joins and
every few minutes after, checked against the key this client pinned and the run it joined (a forged or replayed
board is dropped), shown once each — a line above the panel, the panel's "notice" row, `client status`, the
control page — and as a desktop notification where the platform has one (``notify-send`` on PATH; never
required). Which notices were seen is remembered per run in the client home, so a restart does not notify again.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shared import wire
from shared.endpoints import NOTICES
from shared.errors import EchoSwarmError, SignatureError
from shared.messages import Notice, SignedNotices
from shared.records import open_notices
from swarm_client.api import CoordinatorClient

logger = logging.getLogger(__name__)

POLL_S = 300.0  # how often a joined client asks for notices
SEEN_FILE = "notices-seen.json"  # {run_id: the highest notice id shown}


def below(version: str, minimum: str) -> bool:
    """Whether release ``version`` is older than ``minimum`` (both dotted numbers; a source checkout, which has no
    release number, is never older)."""
    try:
        have = tuple(int(p) for p in version.split(".")[:4])
    except ValueError:
        return False
    want = tuple(int(p) for p in minimum.split("."))
    return have < want


def describe(notice: Notice, software: str) -> str:
    """The line a volunteer reads."""
    if notice.kind == "update":
        needed = notice.min_client_version or ""
        verdict = (f"this client is {software}: please update (pip install -U echo-swarm)" if below(software, needed)
                   else f"this client ({software}) is recent enough")
        return f"notice from the coordinator: {notice.text} (needs echo-swarm {needed} or newer; {verdict})"
    return f"notice from the coordinator{' about runs' if notice.kind == 'run' else ''}: {notice.text}"


def desktop_notify(text: str) -> bool:
    """A desktop notification through ``notify-send`` when it is on PATH and a desktop session is there; False
    otherwise (nothing is required: the panel, the page and `client status` show the notice anyway)."""
    exe = shutil.which("notify-send")
    if exe is None or not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")
                           or os.environ.get("DBUS_SESSION_BUS_ADDRESS")):
        return False
    try:  # the text is an argument, never parsed by a shell; the notification daemon shows it as plain text
        subprocess.Popen([exe, "--app-name=echo-swarm", "echo-swarm", text], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    except OSError:
        return False
    return True


class NoticeWatch:
    """Fetches and shows the run's notices. ``shown``: the notices in force as the client last saw them, newest
    last, as plain dicts with the line shown for each (for status.json and the control page)."""

    def __init__(self, home: Path, software: str, say: Callable[[str], None],
                 notify: Callable[[str], bool] = desktop_notify) -> None:
        self.home = home
        self.software = software
        self.say = say
        self.notify = notify
        self.shown: list[dict[str, Any]] = []
        self._last = -1e9

    async def poll(self, api: CoordinatorClient, coordinator_key: bytes, run_id: str, *, now: bool = False) -> bool:
        """Ask for the board when one is due (``now``: at once); show the notices not seen yet. True when what is
        in force changed. A coordinator without notices (an older release), a refused or unreadable board: logged,
        never a reason to stop working."""
        if not now and time.monotonic() - self._last < POLL_S:
            return False
        self._last = time.monotonic()
        try:
            raw = await api.get_raw(NOTICES.path)
            board = open_notices(wire.decode(raw, SignedNotices), coordinator_key, run_id)
        except (EchoSwarmError, SignatureError, ValueError, OSError) as exc:
            logger.info("no notices from the coordinator: %s", exc)
            return False
        seen = self._seen().get(run_id, 0)
        for notice in board.notices:
            if notice.notice_id > seen:
                line = describe(notice, self.software)
                self.say(line)
                self.notify(line)
        if board.notices:
            self._remember(run_id, max(seen, board.notices[-1].notice_id))
        shown = [n.model_dump() | {"line": describe(n, self.software)} for n in board.notices]
        changed = shown != self.shown
        self.shown = shown
        return changed

    def _seen(self) -> dict[str, int]:
        try:
            data = json.loads((self.home / SEEN_FILE).read_text())
        except (OSError, ValueError):
            return {}
        return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, int)} \
            if isinstance(data, dict) else {}

    def _remember(self, run_id: str, notice_id: int) -> None:
        seen = self._seen() | {run_id: notice_id}
        path = self.home / SEEN_FILE
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(seen))
            os.replace(tmp, path)
        except OSError as exc:  # a full disk: notices may be shown again after a restart, nothing worse
            logger.warning("could not write %s: %s", path, exc)
