"""Wake the run's other role processes on this host the moment one of them changed the store.

Why: the roles hand work to each other through the store (a new version, a recompute request and its answer, an
accepted result), and a process that only polls notices each hand-over up to a poll interval late. Sequential
pull crosses four such hand-overs per step (version → API → client … result → verifier → API → learner), all on
the critical path. A ring here is a one-byte datagram to every role's UNIX socket in the run's private folder:
the receiver only learns "look at the store now". Nothing is carried, so nothing can be lost, forged or replayed:
a stray or missed datagram costs one store query or one poll interval, and polling stays as the fallback (roles
on other hosts of a PostgreSQL store, a socket path too long, a full receive buffer).

One socket per process, named ``<role>.<pid>.sock``; a sender lists the folder at most every ``LIST_EVERY_S`` and
removes a socket file nobody is bound to any more (a process killed with -9 leaves its file behind).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

from coordinator.store.tmpfs import run_folder

logger = logging.getLogger(__name__)

LIST_EVERY_S = 1.0  # how stale a sender's list of the other processes' sockets may be
SUFFIX = ".sock"
MAX_PATH = 100  # sun_path holds 108 bytes on Linux, 104 on macOS


def folder_for(run_dir: Path) -> Path | None:
    """The run's doorbell folder: in its private tmpfs folder (coordinator.store.tmpfs), else ``run_dir/roles``."""

    base = run_folder(Path(run_dir)) or Path(run_dir) / "roles"
    folder = base / "bells"
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError:
        return None
    return folder


class Doorbell:
    """This process's socket in ``folder``: :meth:`send` wakes every other one, ``on_ring`` runs when woken."""

    def __init__(self, folder: Path, name: str, on_ring: Callable[[], None]) -> None:
        self.folder = folder
        self.path = folder / f"{name}.{os.getpid()}{SUFFIX}"
        self._on_ring = on_ring
        self._sock: socket.socket | None = None
        self._peers: list[str] = []
        self._listed_at = -LIST_EVERY_S
        self.sent = self.received = 0

    def open(self) -> bool:
        """Bind and listen on the running loop; False (and polling only) where a socket cannot be had here."""
        if len(os.fsencode(self.path)) > MAX_PATH or not hasattr(socket, "AF_UNIX"):
            logger.info("no doorbell (socket path %s too long or no UNIX sockets): roles poll the store", self.path)
            return False
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.setblocking(False)
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()  # a file of an earlier process with this pid
            sock.bind(str(self.path))
            os.chmod(self.path, 0o600)
            asyncio.get_running_loop().add_reader(sock.fileno(), self._drain)
        except OSError as exc:
            sock.close()
            logger.info("no doorbell at %s (%s): roles poll the store", self.path, exc)
            return False
        self._sock = sock
        return True

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is None:
            return
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(sock.fileno())
        sock.close()
        with contextlib.suppress(OSError):
            self.path.unlink()

    def send(self) -> None:
        """Wake every other process of the run on this host (never blocks; a failure only means a poll)."""
        if self._sock is None:
            return
        now = time.monotonic()
        if now - self._listed_at >= LIST_EVERY_S:
            self._list(now)
        for peer in self._peers:
            try:
                self._sock.sendto(b"\x01", peer)
                self.sent += 1
            except BlockingIOError:
                pass  # its queue is full of rings it has not read yet: it is waking anyway
            except (ConnectionRefusedError, FileNotFoundError) as exc:
                self._listed_at = -LIST_EVERY_S  # look again next time
                if isinstance(exc, ConnectionRefusedError):
                    with contextlib.suppress(OSError):
                        os.unlink(peer)  # nobody is bound to it: the process is gone
            except OSError as exc:
                if exc.errno not in (errno.ENOBUFS, errno.EAGAIN):
                    logger.debug("doorbell to %s: %s", peer, exc)

    def _list(self, now: float) -> None:
        self._listed_at = now
        try:
            names = os.listdir(self.folder)
        except OSError:
            names = []
        own = self.path.name
        self._peers = [str(self.folder / n) for n in names if n.endswith(SUFFIX) and n != own]

    def _drain(self) -> None:
        assert self._sock is not None
        rung = False
        while True:
            try:
                self._sock.recv(64)
            except OSError:  # BlockingIOError: every ring read
                break
            rung = True
            self.received += 1
        if rung:
            self._on_ring()
