"""The duty cycle a job is generated at (`--max-cpu-percent`), and the hold while someone uses the machine
(`--idle-only`).

Its own module because two collaborators read it: the generation (swarm_client/generation.py) hands it to the
backend as the per-step callback, and the status (swarm_client/reporting.py) reads its step count as the job's
progress for the panel and the control page.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from swarm_client.schedule import INPUT_CHECK_S, InputWatch


class Pacer:
    """Throttles decoding to a duty cycle: after each step that took t seconds, idle t·(100/p − 1). Counts the
    steps of the job in hand (its progress, for the panel and the control page). With ``watch`` (``--idle-only``)
    it also holds the job while someone uses the machine (swarm_client.schedule.InputWatch), telling
    ``on_hold(True)`` then ``on_hold(False)`` (called on the generating thread)."""

    def __init__(self, percent: float, stop: threading.Event, watch: InputWatch | None = None,
                 on_hold: Callable[[bool], None] | None = None) -> None:
        self.factor = 100.0 / percent - 1.0
        self.stop = stop
        self.watch = watch
        self.on_hold = on_hold
        self.last = time.monotonic()
        self.looked = self.last
        self.steps = 0

    def reset(self) -> None:
        self.last = self.looked = time.monotonic()
        self.steps = 0

    def __call__(self) -> bool:
        self.steps += 1
        now = time.monotonic()
        until = now + (now - self.last) * self.factor if self.factor > 0 else now
        while True:  # the duty cycle's rest, in slices short enough to notice someone using the machine
            if self.watch is not None and time.monotonic() - self.looked >= INPUT_CHECK_S:
                self._hold_while_in_use(self.watch)
            left = until - time.monotonic()
            if left <= 0 or self.stop.wait(min(left, INPUT_CHECK_S)):
                break
        self.last = time.monotonic()
        return self.stop.is_set()

    def _hold_while_in_use(self, watch: InputWatch) -> None:
        self.looked = time.monotonic()
        if not watch.touched():
            return
        if self.on_hold is not None:
            self.on_hold(True)
        while not self.stop.wait(INPUT_CHECK_S) and not watch.left_alone():
            pass
        self.looked = time.monotonic()
        if self.on_hold is not None:
            self.on_hold(False)
