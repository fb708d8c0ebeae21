"""Volunteer controls (issue 25): snooze and finish in the control file, the bandwidth token bucket and the
monthly data budget (counted across restarts), pause on battery (a Linux sysfs tree, macOS pmset) and idle by
keyboard/mouse input (macOS ioreg, xprintidle; real subprocesses of stand-in commands), falling back to CPU."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from datetime import datetime, time, timedelta
from pathlib import Path
from typing import Any

import pytest

from swarm_client import presence
from swarm_client.bandwidth import MonthlyMeter, Throttle, next_month
from swarm_client.control import (
    Controls,
    describe,
    parse_duration,
    read_controls,
    set_paused,
    snooze,
    update_controls,
    write_status,
)
from swarm_client.schedule import IdleProbe, parse_window, work_gate


# ---- the control file ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "seconds"), [("30m", 1800), ("2h", 7200), ("1h30m", 5400), ("90s", 90),
                                               ("45", 2700), ("1d", 86400), (" 2H ", 7200)])
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "soon", "30x", "8d", "0m", "-5m", "1h soon"])
def test_bad_durations_say_the_form(text: str) -> None:
    with pytest.raises(ValueError, match="30m|7 days"):
        parse_duration(text)


def test_controls_round_trip_and_resume_ends_a_snooze(tmp_path: Path) -> None:
    set_paused(tmp_path, True, now=100.0)
    until = snooze(tmp_path, 60, now=1000.0)
    c = read_controls(tmp_path)
    assert c.paused and c.since == 100.0 and c.snooze_until == until == 1060.0
    assert c.snoozed(1059.0) and not c.snoozed(1060.0)
    set_paused(tmp_path, False)
    c = read_controls(tmp_path)
    assert not c.paused and c.snooze_until is None
    update_controls(tmp_path, finish=True, max_mbps=2.5)
    assert describe(tmp_path)["finishing"] and read_controls(tmp_path).max_mbps == 2.5


def test_an_old_or_hand_edited_control_file_is_read_leniently(tmp_path: Path) -> None:
    (tmp_path / "control.json").write_text(json.dumps({"paused": True, "since": "yesterday", "finish": 1,
                                                       "max_mbps": -3, "future_key": [1]}))
    assert read_controls(tmp_path) == Controls(paused=True)
    (tmp_path / "control.json").write_text("{not json")
    assert read_controls(tmp_path) == Controls()


def test_the_gate_names_each_reason_in_order() -> None:
    now = datetime(2025, 6, 1, 12, 0)
    kw = dict(windows=[], idle_only=False, idle=True)
    assert work_gate(now, paused=True, on_battery=True, **kw) == "paused"
    assert work_gate(now, paused=False, snoozed_until=datetime(2025, 6, 1, 12, 30), on_battery=True,
                     **kw) == "snoozed until 12:30"
    assert work_gate(now, paused=False, snoozed_until=datetime(2025, 6, 1, 11, 0), on_battery=True,
                     **kw) == "on battery"
    assert work_gate(now, paused=False, data_cap="monthly data cap reached", **kw) == "monthly data cap reached"
    assert work_gate(now, paused=False, windows=[parse_window("13:00-14:00")], idle_only=False,
                     idle=True) == "outside 13:00-14:00"
    assert work_gate(now, paused=False, **kw) is None


# ---- bandwidth ------------------------------------------------------------------------------------------------
class Clock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_the_token_bucket_allows_rate_times_time_plus_a_short_burst() -> None:
    clock = Clock()
    bucket = Throttle(1e6, clock, burst_s=0.25)
    moved = 0
    for _ in range(200):  # 64 KiB reads as fast as the bucket lets them through
        clock.t += bucket.delay(65536)
        moved += 65536
    assert moved / clock.t == pytest.approx(1e6, rel=0.02)
    assert bucket.delay(1) > 0  # no credit piles up while busy
    clock.t += 100  # idle for long: only the burst is saved up, not 100 s worth
    assert bucket.delay(250_000) == 0 and bucket.delay(100_000) == pytest.approx(0.1)
    assert Throttle(None, clock).delay(10**9) == 0


def test_the_monthly_budget_survives_a_restart_and_turns_with_the_month(tmp_path: Path) -> None:
    path = tmp_path / "data_usage.json"
    june = datetime(2025, 6, 10, 12).timestamp()
    clock = Clock(june)
    meter = MonthlyMeter(path, 2 * 10**9, clock, flush_s=5)
    meter.add(10**9)
    assert meter.blocked() is None
    meter.flush()
    again = MonthlyMeter(path, 2 * 10**9, clock)  # a restart
    assert again.used() == 10**9
    again.add(10**9)
    assert again.blocked() == "monthly data cap reached (2.00 of 2 GB); resumes 2025-07-01"
    clock.t = datetime(2025, 7, 1, 0, 1).timestamp()
    assert again.used() == 0 and again.blocked() is None
    assert next_month("2025-12") == "2026-01-01"


# ---- battery ------------------------------------------------------------------------------------------------
def _supply(root: Path, name: str, **files: str) -> None:
    folder = root / name
    folder.mkdir(parents=True)
    for key, value in files.items():
        (folder / key).write_text(value + "\n")


def test_linux_battery_from_sysfs(tmp_path: Path) -> None:
    laptop = tmp_path / "laptop"
    _supply(laptop, "AC", type="Mains", online="0")
    _supply(laptop, "BAT0", type="Battery", status="Discharging")
    assert presence.linux_on_battery(laptop) is True
    (laptop / "AC" / "online").write_text("1\n")  # plugged in
    assert presence.linux_on_battery(laptop) is False
    mouse = tmp_path / "desktop"
    _supply(mouse, "hid-mouse-battery", type="Battery", scope="Device", status="Discharging")
    assert presence.linux_on_battery(mouse) is False  # a wireless mouse's battery is not the machine's
    assert presence.linux_on_battery(tmp_path / "none") is None
    assert presence.on_battery(laptop) is False


def fake_command(folder: Path, name: str, output: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(f"#!/bin/sh\ncat <<'EOF'\n{output}\nEOF\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_macos_battery_from_pmset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_command(tmp_path, "pmset", "Now drawing from 'Battery Power'\n -InternalBattery-0 (id=1)\t83%; discharging")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert presence.macos_on_battery() is True
    fake_command(tmp_path, "pmset", "Now drawing from 'AC Power'")
    assert presence.macos_on_battery() is False


# ---- idle by input ----------------------------------------------------------------------------------------------
def test_input_idle_time_from_xprintidle_and_ioreg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("DBUS_SESSION_BUS_ADDRESS", raising=False)
    monkeypatch.delenv("DISPLAY", raising=False)
    assert presence.input_idle_s() is None  # no desktop session: unknown (CPU load decides)
    monkeypatch.setenv("DISPLAY", ":0")
    fake_command(tmp_path, "xprintidle", "42500")
    assert presence.input_idle_s() == 42.5
    assert presence.parse_ioreg_idle('    |   "HIDIdleTime" = 310123456789\n') == pytest.approx(310.123456789)
    assert presence.parse_mutter_idle("(uint64 1500,)") == 1.5


def test_idle_probe_prefers_input_over_cpu(tmp_path: Path) -> None:
    stat_file = tmp_path / "stat"
    stat_file.write_text("cpu 100 0 100 0 0 0 0 0 0 0\n")  # all busy
    seconds: list[float | None] = [10.0]
    probe = IdleProbe(0.8, stat_file, input_idle=lambda: seconds[0], min_input_idle_s=300)
    assert not probe.idle() and probe.source == "input"  # touched 10 s ago
    seconds[0] = 600.0
    assert probe.idle() and probe.source == "input"  # nobody for 10 minutes, however busy the CPU
    seconds[0] = None  # the platform stopped answering: CPU load decides
    stat_file.write_text("cpu 200 0 200 0 0 0 0 0 0 0\n")
    assert not probe.idle() and probe.source == "cpu"


@pytest.mark.parametrize(("state", "running", "controls", "first_line"), [
    # a running client that obeyed the pause says so in its state: said once (it printed "paused (paused)")
    ("paused", True, {"paused": True}, "paused"),
    # a pause set while a job runs: the job is finished first
    ("generating", True, {"paused": True}, "generating (paused: no new job after this one)"),
    ("stopped", False, {"paused": True}, "not running (paused)"),
    ("snoozed until 23:59", True, {"snooze_until": "23:59"}, "snoozed until 23:59"),
    ("generating", True, {"snooze_until": "23:59"}, "generating (snoozed until 23:59)"),
    ("paused", True, {"paused": True, "snooze_until": "23:59"}, "paused (snoozed until 23:59)"),
    ("generating", True, {"finish": True}, "generating (finishing)"),
])
def test_client_status_says_each_control_once(tmp_path: Path, state: str, running: bool, controls: dict[str, Any],
                                              first_line: str) -> None:
    """`echo-swarm client status` as a volunteer reads it (its stdout, from the real command)."""
    if "snooze_until" in controls:  # the next 23:59 to come
        at = datetime.combine(datetime.now().date(), time(23, 59))
        controls = controls | {"snooze_until": (at if at > datetime.now() else at + timedelta(days=1)).timestamp()}
    update_controls(tmp_path, **controls)
    write_status(tmp_path, {"client_id": "c0ffee" * 5 + "00", "state": state, "pid": os.getpid() if running else 0,
                            "url": "http://127.0.0.1:8470", "run_id": "r1", "version": 3, "last_job": "j29",
                            "tokens_per_s": 12.5, "accepted": 4, "rejected": 0, "credit": 40.0})
    res = subprocess.run([sys.executable, "-m", "echo_swarm", "client", "status", "--home", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert res.stdout.splitlines()[0] == f"client {'c0ffee' * 5}00: {first_line}", res.stdout



def test_a_job_in_hand_is_held_at_recent_input_and_goes_on_after_the_idle_minutes() -> None:
    from swarm_client.schedule import INPUT_RECENT_S, InputWatch

    seconds: list[float | None] = [0.5]
    watch = InputWatch(lambda: seconds[0], min_input_idle_s=180.0)
    assert watch.touched() and not watch.left_alone()
    seconds[0] = INPUT_RECENT_S + 0.1  # no input since the last look: not held, but not yet left alone either
    assert not watch.touched() and not watch.left_alone()
    seconds[0] = 180.0
    assert watch.left_alone()
    seconds[0] = None  # the platform stopped answering: never held on a guess, never kept holding
    assert not watch.touched() and watch.left_alone()
