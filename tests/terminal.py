"""Run a command on a real pseudo-terminal of a given size and read back the bytes a person would see: rich
decides its width, colours and redraws from the terminal it finds, so a pipe or COLUMNS would test something else.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import termios
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rich.cells import cell_len

# rich's own styling: SGR colours, hiding the cursor and the Live panel's cursor moves and line erases
_STYLE = re.compile(rb"\x1b\[[0-9;]*m")


@dataclass
class Screen:
    """What a command wrote to its terminal, and how it ended."""

    returncode: int
    raw: bytes

    def text(self) -> str:
        """The output without colour codes, lines joined with \\n (the terminal's \\r\\n undone)."""
        return _STYLE.sub(b"", self.raw).decode().replace("\r\n", "\n")

    def lines(self) -> list[str]:
        return self.text().split("\n")

    def widest(self) -> int:
        return max(cell_len(line) for line in self.lines())


def terminal_env(**extra: str) -> dict[str, str]:
    """This process's environment without what would override the terminal's own size or colours."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "NO_COLOR", "FORCE_COLOR", "TERM")}
    return env | {"TERM": "xterm-256color", "PYTHONUNBUFFERED": "1"} | extra


def run_on_terminal(argv: Sequence[str], *, columns: int = 80, rows: int = 24, env: dict[str, str] | None = None,
                    timeout_s: float = 120.0, until: Callable[[bytes], bool] | None = None,
                    then: Callable[[subprocess.Popen[bytes]], None] | None = None) -> Screen:
    """Run ``argv`` with a ``columns`` x ``rows`` pseudo-terminal as stdin, stdout and stderr; return what it wrote
    once it exits. ``until``/``then``: when the output so far satisfies ``until``, call ``then`` with the process
    once (e.g. to send it a signal). A process still running after ``timeout_s`` is killed and the test fails."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    proc = subprocess.Popen(list(argv), stdin=slave, stdout=slave, stderr=slave, env=env or terminal_env(),
                            start_new_session=True)
    os.close(slave)
    out = bytearray()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{argv} still running after {timeout_s:.0f} s; it wrote:\n{out.decode(errors='replace')}")
            ready, _, _ = select.select([master], [], [], min(left, 1.0))
            if not ready:
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every copy of the terminal's other end is closed (the process exited)
                break
            if not chunk:
                break
            out += chunk
            if until is not None and then is not None and until(bytes(out)):
                then(proc)
                until = None
        return Screen(proc.wait(timeout=max(1.0, deadline - time.monotonic())), bytes(out))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
