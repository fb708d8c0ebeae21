"""The volunteer's say over when new work starts: `echo-swarm client pause / snooze / finish` (control.json), the
battery, the monthly data budget, the time windows and `--idle-only` — and, within a job, the hold while someone uses
the machine.

Read before every lease (:meth:`Gates.admit`) and while waiting (:meth:`Gates.wait_unless_held`), so that a pause is
noticed within one poll; the decision itself is the pure swarm_client.schedule.work_gate. With several runs in one
process the controls are read from the client's home for every run (``control_home``), and the budget and the
download cap are one meter and one throttle.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from swarm_client.bandwidth import MB, MonthlyMeter, Throttle
from swarm_client.control import Controls, read_controls, update_controls
from swarm_client.outcomes import EXIT_OK, Next
from swarm_client.presence import input_idle_s, on_battery
from swarm_client.reporting import IN_USE_STATE, Reporter
from swarm_client.schedule import IdleProbe, parse_window, work_gate
from swarm_client.settings import JoinConfig

GATE_POLL_S = 1.0  # how often a paused / waiting client re-reads its control file and the clock
BATTERY_POLL_S = 10.0  # how often the power supply is read (a pmset subprocess on macOS)


class Gates:
    """Whether new work may start now, and the waits that notice when that changes. ``stop``: the process's stop
    event (Ctrl-C ends every wait); ``throttle``: the download cap a control sets at run time; ``meter``: the
    month's data budget; ``reporter``: where a gate that holds the client is said and shown."""

    def __init__(self, cfg: JoinConfig, control_home: Path, stop: threading.Event, throttle: Throttle,
                 meter: MonthlyMeter, reporter: Reporter) -> None:
        self.cfg = cfg
        self.control_home = control_home
        self.stop = stop
        self.throttle = throttle
        self.meter = meter
        self.reporter = reporter
        self.windows = [parse_window(w) for w in cfg.windows]
        self.idle_probe = IdleProbe(cfg.idle_min_percent / 100, input_idle=input_idle_s,
                                    min_input_idle_s=cfg.idle_input_minutes * 60) if cfg.idle_only else None
        self.controls = Controls()  # the last read of control.json
        self._battery: tuple[float, bool] = (-1e9, False)  # (monotonic time read, on battery)
        self._gated: str | None = None  # the gate holding the client, as last said (None: none)

    def start(self) -> None:
        """Read the controls a previous run left: a finish meant for a client that has since stopped is dropped, a
        pause is said."""
        self.controls = read_controls(self.control_home)
        if self.controls.finish:
            update_controls(self.control_home, finish=False)
        if self.controls.paused:
            self.reporter.say("paused (by `echo-swarm client pause`): no work is fetched until `echo-swarm client "
                              "resume`")

    def joined(self) -> None:
        """A run joined (the first, or the operator's next): whatever gate holds the client is said again."""
        self._gated = None

    def apply(self) -> Controls:
        """Read control.json and apply what takes effect at once (the bandwidth cap, also mid-download)."""
        controls = self.controls = read_controls(self.control_home)
        rate = controls.max_mbps if controls.max_mbps is not None else self.cfg.max_mbps
        self.throttle.set_rate(None if rate is None else rate * MB)
        return controls

    def finishing(self) -> bool:
        """Whether `echo-swarm client finish` was asked (read now)."""
        return read_controls(self.control_home).finish

    def clear_finish(self) -> None:
        """A finish obeyed: the next start works normally."""
        if self.finishing():
            update_controls(self.control_home, finish=False)

    def held_back(self) -> bool:
        """Paused, snoozed or finishing: a job that arrives now is handed back at once."""
        c = read_controls(self.control_home)
        return c.paused or c.finish or c.snoozed(time.time())

    def on_battery(self) -> bool:
        """Whether this machine runs on battery, read at most every BATTERY_POLL_S (False unless asked to care)."""
        if not self.cfg.pause_on_battery:
            return False
        read_at, value = self._battery
        if time.monotonic() - read_at >= BATTERY_POLL_S:
            value = on_battery()
            self._battery = (time.monotonic(), value)
        return value

    async def gate(self) -> str | None:
        """Why no new work may start now (paused, snoozed, on battery, over the data cap, outside the time
        windows, machine busy), or None. Also applies a bandwidth cap set at run time."""
        controls = self.apply()
        now = time.time()
        snoozed = datetime.fromtimestamp(controls.snooze_until) if controls.snoozed(now) and controls.snooze_until \
            else None
        battery = await asyncio.to_thread(self.on_battery)
        blocked = controls.paused or snoozed is not None or battery
        idle = True
        if self.idle_probe is not None and not blocked:
            idle = await asyncio.to_thread(self.idle_probe.measure, GATE_POLL_S, self.stop.wait)
        return work_gate(datetime.fromtimestamp(now), paused=controls.paused, windows=self.windows,
                         idle_only=self.cfg.idle_only, idle=idle, snoozed_until=snoozed, on_battery=battery,
                         data_cap=self.meter.blocked())

    async def admit(self) -> Next | int:
        """The volunteer's own gates (a schedule, idle-only, battery, a pause) and `client finish`: LEASE when none
        holds the client, AGAIN after waiting a gate's poll interval, EXIT_OK when finishing."""
        gate = await self.gate()
        if self.controls.finish:
            self.reporter.say("finishing (`echo-swarm client finish`): no new job; the last result is submitted, "
                              "then the client exits")
            return EXIT_OK
        if gate != self._gated:
            self.reporter.say(f"not fetching new work: {gate}" if gate else "fetching work again")
            self._gated = gate
        if gate is not None:
            self.reporter.stats.gated_polls += 1
            self.reporter.set_state(gate)
            self.reporter.write_status()
            await asyncio.to_thread(self.stop.wait, GATE_POLL_S)
            return Next.AGAIN
        self.reporter.set_state("waiting")
        return Next.LEASE

    async def wait_unless_held(self, seconds: float) -> None:
        """Wait as the coordinator asked, but notice a pause, snooze or finish (or Ctrl-C) within one poll."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0 and not self.stop.is_set() and not self.held_back():
            await asyncio.to_thread(self.stop.wait, min(left, GATE_POLL_S))

    def holding_from(self, loop: asyncio.AbstractEventLoop) -> Callable[[bool], None]:
        """The pacer's ``on_hold`` (called on the generating thread): the state, said and shown on the loop."""
        def on_hold(holding: bool) -> None:
            def show() -> None:
                self.reporter.say(f"{IN_USE_STATE}: the job in hand waits until nobody has touched keyboard or mouse "
                                  f"for {self.cfg.idle_input_minutes:g} min" if holding else "nobody is using this "
                                  "machine again: the job goes on")
                self.reporter.set_state(IN_USE_STATE if holding else "generating")
            loop.call_soon_threadsafe(show)
        return on_hold
