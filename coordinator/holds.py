"""Hold points: named places in a role where a fault test stops it mid-operation, deterministically, to kill it
or to let the rest of the system run ahead of it.

A test that wants a coordinator killed *while* a version is half written cannot get there by polling the disk and
hoping (the write may finish between the look and the kill, and every later assertion would still hold). With
``ECHO_SWARM_HOLD="NAME=PATH"`` in a role's environment, the role, on reaching hold point NAME, writes its pid to
PATH (atomically) and blocks until PATH is removed; the test waits for PATH, does what it came to do (SIGKILL, or
let clients work against the held state), and removes PATH to let the role go on. Several points:
``NAME=PATH,NAME=PATH``. Unset (always, outside tests), a hold point is one dictionary look-up.

The points (each reached once per run; the name carries the version):

- ``publish-vN`` (coordinator.publish.snapshots.SnapshotStore.publish): version N's files are written into its
  temporary folder ``snapshots/.tmp-vN-*``; nothing is fsynced, renamed or signed yet, and the database does not
  know the version.
- ``recompute-vN`` (coordinator.roles.verifier.VerifierWorker): a verifier has claimed a request to recompute a
  result of version N and not begun it — a verifier held busy, while the rest of the run goes on. Reached by every
  such request: each one held writes the marker again, and removing it lets every one held go on.
- ``evaluate-vN`` (coordinator.roles.verifier.VerifierWorker): verifier 0 has claimed the held-out evaluation of
  version N and not begun it — an evaluation slowed down while the learner goes on.
"""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

HOLD_ENV = "ECHO_SWARM_HOLD"
POLL_S = 0.01  # how often a held role looks whether its marker was removed


def hold_markers(spec: str | None = None) -> dict[str, Path]:
    """The hold points named in ``spec`` (default: ``$ECHO_SWARM_HOLD``) and each one's marker path."""
    raw = os.environ.get(HOLD_ENV, "") if spec is None else spec
    points: dict[str, Path] = {}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"{HOLD_ENV}: {item!r} is not NAME=PATH (e.g. publish-v4=/tmp/held)")
        points[name] = Path(path)
    return points


def hold(point: str) -> None:
    """Block here if ``point`` is named in ``$ECHO_SWARM_HOLD``: write this process's pid to the marker, then wait
    until someone removes it."""
    if HOLD_ENV not in os.environ:
        return
    marker = hold_markers().get(point)
    if marker is None:
        return
    # one temporary name per thread: two requests held at once in one role (its event loop's worker threads) each
    # write their own — with one name per process, the second rename found the first's file gone (FileNotFoundError,
    # which a verifier answers as "version gone")
    tmp = marker.with_name(f".{marker.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(f"{os.getpid()}\n")
    os.replace(tmp, marker)  # whoever waits on the marker reads a whole pid
    released = threading.Event()
    while marker.exists():
        released.wait(POLL_S)


async def hold_async(point: str) -> None:
    """:func:`hold` on an event loop: the wait runs on a thread, so the role's loop goes on meanwhile."""
    if HOLD_ENV in os.environ and point in hold_markers():
        await asyncio.to_thread(hold, point)
