"""When the client may start new work: pause, time windows and `--idle-only`, as pure functions of `now`.

The client asks :func:`work_gate` before every lease. It never interrupts a job it has already started
(a job takes seconds to a few minutes); it only declines to fetch the next one.

Idle (`--idle-only`): where the platform says how long ago the keyboard or mouse was last used
(swarm_client.presence: macOS's HID idle time, a Linux desktop's idle monitor), the machine is idle once nobody
has touched it for ``--idle-input-minutes``. Where it does not (a server, a service without a desktop session),
CPU load decides, as before: on Linux the machine counts as idle when, over the last sample (about a second, taken
between jobs, so while this client itself is not generating), at least ``min_idle`` (default 80 %) of all CPU
time was idle, measured from /proc/stat; elsewhere (no /proc/stat) the 1-minute load average per core must be
below ``1 - min_idle``.

On battery (``--pause-on-battery``, the default) and over the monthly data cap (``--max-gb-per-month``) no new
job starts either; each reason is a short state shown on the panel and the control page.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, time
from pathlib import Path

_WINDOW = re.compile(r"^\s*(\d{1,2}):(\d{2})\s*-\s*(\d{1,2}):(\d{2})\s*$")


@dataclass(frozen=True)
class Window:
    """A daily time window in local time; ``start > end`` wraps past midnight (22:00-07:00)."""

    start: time
    end: time

    def contains(self, t: time) -> bool:
        if self.start == self.end:
            return True  # "00:00-00:00": all day
        if self.start < self.end:
            return self.start <= t < self.end
        return t >= self.start or t < self.end

    def __str__(self) -> str:
        return f"{self.start:%H:%M}-{self.end:%H:%M}"


def parse_window(text: str) -> Window:
    """``"22:00-07:00"`` → Window. Raises ValueError with a message that shows the expected form."""
    m = _WINDOW.match(text)
    if not m:
        raise ValueError(f"time window {text!r} is not of the form HH:MM-HH:MM (e.g. 22:00-07:00)")
    h1, m1, h2, m2 = (int(g) for g in m.groups())
    if h1 > 23 or h2 > 23 or m1 > 59 or m2 > 59:
        raise ValueError(f"time window {text!r} has an hour above 23 or a minute above 59")
    return Window(time(h1, m1), time(h2, m2))


def in_windows(now: datetime, windows: list[Window]) -> bool:
    """True when no windows are set, or ``now`` (local wall-clock time) lies in one of them."""
    return not windows or any(w.contains(now.time()) for w in windows)


# ---- idle ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CpuTimes:
    idle: int  # idle + iowait jiffies
    total: int


def parse_proc_stat(text: str) -> CpuTimes | None:
    """The aggregate ``cpu`` line of /proc/stat → idle and total jiffies."""
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] == "cpu":
            values = [int(v) for v in parts[1:]]
            idle = values[3] + (values[4] if len(values) > 4 else 0)
            # guest times are already counted in user/nice: total is the first 8 fields
            return CpuTimes(idle=idle, total=sum(values[:8]))
    return None


def idle_fraction(before: CpuTimes, after: CpuTimes) -> float | None:
    """Share of CPU time idle between two samples; None if no time passed."""
    dt = after.total - before.total
    if dt <= 0:
        return None
    return max(0.0, min(1.0, (after.idle - before.idle) / dt))


def is_idle(fraction: float | None, load1: float | None, cpus: int, min_idle: float) -> bool:
    """The idle heuristic: /proc/stat idle share if known, else the load average per core."""
    if fraction is not None:
        return fraction >= min_idle
    if load1 is not None and cpus > 0:
        return load1 / cpus <= 1.0 - min_idle
    return True  # nothing to measure with: do not block work forever


def work_gate(now: datetime, *, paused: bool, windows: list[Window], idle_only: bool, idle: bool,
              snoozed_until: datetime | None = None, on_battery: bool = False,
              data_cap: str | None = None) -> str | None:
    """Why new work must not start now (a short state shown to the volunteer), or None to go ahead.
    ``data_cap``: why the monthly data cap blocks work (swarm_client.bandwidth), or None."""
    if paused:
        return "paused"
    if snoozed_until is not None and now < snoozed_until:
        return f"snoozed until {snoozed_until:%H:%M}"
    if on_battery:
        return "on battery"
    if data_cap is not None:
        return data_cap
    if not in_windows(now, windows):
        return "outside " + ", ".join(str(w) for w in windows)
    if idle_only and not idle:
        return "waiting for idle"
    return None


class IdleProbe:
    """Samples the machine for :func:`is_idle` (the only impure part: reads /proc/stat or the load average, and
    asks ``input_idle`` for the seconds since the last keyboard or mouse input, None where unknown)."""

    def __init__(self, min_idle: float, proc_stat: Path = Path("/proc/stat"), *,
                 input_idle: Callable[[], float | None] | None = None, min_input_idle_s: float = 300.0) -> None:
        self.min_idle = min_idle
        self.proc_stat = proc_stat
        self.input_idle = input_idle
        self.min_input_idle_s = min_input_idle_s
        self.source = "cpu"  # what decided last: "input" or "cpu"
        self._last: CpuTimes | None = self._read()

    def _read(self) -> CpuTimes | None:
        try:
            return parse_proc_stat(self.proc_stat.read_text())
        except (OSError, ValueError, IndexError):
            return None

    def idle(self) -> bool:
        """Idle since the previous call (the first call compares with construction time); by keyboard and mouse
        input where the platform tells it, else by CPU load."""
        seconds = self.input_idle() if self.input_idle is not None else None
        if seconds is not None:
            self.source = "input"
            self._last = self._read()
            return seconds >= self.min_input_idle_s
        self.source = "cpu"
        now = self._read()
        fraction = idle_fraction(self._last, now) if self._last and now else None
        self._last = now
        try:
            load1: float | None = os.getloadavg()[0]
        except (OSError, AttributeError):
            load1 = None
        return is_idle(fraction, load1, os.cpu_count() or 1, self.min_idle)

    def measure(self, seconds: float, wait: Callable[[float], object]) -> bool:
        """Sample over ``seconds`` from now (call between jobs, so this client's own work is not counted)."""
        self._last = self._read()
        wait(seconds)
        return self.idle()


#: How often a job in progress asks whether someone touched the keyboard or mouse (``--idle-only``), and how
#: recent an input must be to count as "touched since the last look": twice the interval, so none is missed.
INPUT_CHECK_S = 1.0
INPUT_RECENT_S = 2 * INPUT_CHECK_S


class InputWatch:
    """``--idle-only`` during a job: someone using the machine holds the job in progress (decoding stops within
    :data:`INPUT_RECENT_S`), and it goes on once nobody has touched keyboard or mouse for ``min_input_idle_s`` —
    the same test as for starting a job. Only where the platform reports input: where it does not (a server), a
    job runs to its end, since the CPU load a job causes itself says nothing about a user."""

    def __init__(self, input_idle: Callable[[], float | None], min_input_idle_s: float) -> None:
        self.input_idle = input_idle
        self.min_input_idle_s = min_input_idle_s

    def touched(self) -> bool:
        seconds = self.input_idle()
        return seconds is not None and seconds < INPUT_RECENT_S

    def left_alone(self) -> bool:
        seconds = self.input_idle()
        return seconds is None or seconds >= self.min_input_idle_s

