"""The volunteer's bandwidth caps: a rate (MB/s) on snapshot downloads, and a data budget per calendar month
counted across restarts.

Snapshots are what a client moves in bulk (a policy version is the model's size, every version); leases and
results are kilobytes. So the rate cap throttles the snapshot download loop (swarm_client.snapshots): it reads
the next chunk only when the token bucket allows, and TCP's flow control then slows the sender to the same rate,
so the link itself carries no more than the cap (the first ~``BURST_S`` seconds excepted). Every byte to and from
the coordinator — downloads, requests and replies — counts toward the monthly budget, kept in ``data_usage.json``
in the client home and written at most every ``FLUSH_S`` seconds and when the client stops. Over the budget the
client starts no new job (a download in progress is finished) until the month turns.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

BURST_S = 0.25  # the bucket holds this many seconds' worth of bytes: a short burst, not a long catch-up
FLUSH_S = 5.0
USAGE_FILE = "data_usage.json"
MB = 1e6
GB = 1e9


class Throttle:
    """A token bucket of ``rate`` bytes/s (None: no limit) with an injected clock. :meth:`delay` accounts bytes and
    says how long to wait before the next read so that, over any stretch, bytes ≤ rate × time + the burst."""

    def __init__(self, rate: float | None, clock: Callable[[], float] = time.monotonic, burst_s: float = BURST_S) -> None:
        self.rate = rate
        self.clock = clock
        self.burst_s = burst_s
        self._free_at = clock()  # when the bucket is full again (virtual scheduling)

    def set_rate(self, rate: float | None) -> None:
        if rate != self.rate:
            self.rate = rate
            self._free_at = self.clock()

    def delay(self, nbytes: int) -> float:
        if not self.rate or self.rate <= 0:
            return 0.0
        now = self.clock()
        self._free_at = max(self._free_at, now - self.burst_s) + nbytes / self.rate
        return max(0.0, self._free_at - now)

    async def take(self, nbytes: int) -> None:
        wait = self.delay(nbytes)
        if wait > 0:
            await asyncio.sleep(wait)


def month_of(t: float) -> str:
    return datetime.fromtimestamp(t).strftime("%Y-%m")


def next_month(month: str) -> str:
    year, mon = (int(x) for x in month.split("-"))
    return f"{year + mon // 12}-{mon % 12 + 1:02d}-01"


class MonthlyMeter:
    """Bytes moved this calendar month (local time), persisted in ``path`` across restarts, against ``cap``."""

    def __init__(self, path: Path, cap_bytes: int | None, clock: Callable[[], float] = time.time,
                 flush_s: float = FLUSH_S) -> None:
        self.path = path
        self.cap_bytes = cap_bytes
        self.clock = clock
        self.flush_s = flush_s
        self.month = month_of(clock())
        self.bytes = 0
        self._flushed_at = clock()
        self._dirty = False
        try:
            data = json.loads(path.read_text())
            if data.get("month") == self.month and isinstance(data.get("bytes"), int) and data["bytes"] >= 0:
                self.bytes = data["bytes"]
        except (OSError, ValueError, AttributeError):
            pass

    def _roll(self) -> None:
        month = month_of(self.clock())
        if month != self.month:
            self.month, self.bytes, self._dirty = month, 0, True

    def add(self, nbytes: int) -> None:
        self._roll()
        self.bytes += nbytes
        self._dirty = True
        if self.clock() - self._flushed_at >= self.flush_s:
            self.flush()

    def flush(self) -> None:
        if not self._dirty:
            return
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"month": self.month, "bytes": self.bytes}))
            os.replace(tmp, self.path)
        except OSError:
            return  # a full disk: counted in memory, written on the next try
        self._dirty = False
        self._flushed_at = self.clock()

    def used(self) -> int:
        self._roll()
        return self.bytes

    def blocked(self) -> str | None:
        """Why no new work may start (the cap is reached), or None."""
        if self.cap_bytes is None or self.used() < self.cap_bytes:
            return None
        return f"monthly data cap reached ({self.bytes / GB:.2f} of {self.cap_bytes / GB:g} GB); resumes " \
               f"{next_month(self.month)}"

    def describe(self) -> str:
        """For the panel: ``1.23 GB this month (cap 50 GB)``."""
        used = self.used()
        text = f"{used / GB:.2f} GB this month"
        return text + (f" (cap {self.cap_bytes / GB:g} GB)" if self.cap_bytes is not None else "")
