"""When the client may start work: time windows, the idle heuristic and the combined gate (pure, take `now`)."""

from __future__ import annotations

from datetime import datetime

import pytest

from swarm_client.schedule import (
    CpuTimes,
    IdleProbe,
    idle_fraction,
    in_windows,
    is_idle,
    parse_proc_stat,
    parse_window,
    work_gate,
)


def at(hh: int, mm: int) -> datetime:
    return datetime(2026, 11, 29, hh, mm)


def test_window_within_a_day() -> None:
    w = parse_window("09:30-17:00")
    assert [in_windows(at(h, m), [w]) for h, m in [(9, 29), (9, 30), (16, 59), (17, 0)]] == [False, True, True, False]


def test_window_wrapping_past_midnight() -> None:
    w = parse_window("22:00-07:00")
    assert [w.contains(at(h, m).time()) for h, m in [(21, 59), (22, 0), (0, 0), (6, 59), (7, 0), (12, 0)]] == \
        [False, True, True, True, False, False]
    assert str(w) == "22:00-07:00"


def test_several_windows_and_none_means_always() -> None:
    ws = [parse_window("01:00-02:00"), parse_window("13:00-14:00")]
    assert in_windows(at(13, 30), ws) and in_windows(at(1, 0), ws) and not in_windows(at(3, 0), ws)
    assert in_windows(at(3, 0), [])
    assert in_windows(at(3, 0), [parse_window("00:00-00:00")])  # equal ends: all day


@pytest.mark.parametrize("text", ["22-07", "22:00", "25:00-07:00", "22:60-07:00", "ab:cd-ef:gh", ""])
def test_bad_windows_say_the_expected_form(text: str) -> None:
    with pytest.raises(ValueError, match="HH:MM|hour above 23"):
        parse_window(text)


PROC_STAT = """cpu  100 0 50 800 50 0 0 0 0 0
cpu0 50 0 25 400 25 0 0 0 0 0
intr 1 2 3
"""


def test_proc_stat_and_idle_fraction() -> None:
    before = parse_proc_stat(PROC_STAT)
    assert before == CpuTimes(idle=850, total=1000)
    after = CpuTimes(idle=before.idle + 90, total=before.total + 100)
    assert idle_fraction(before, after) == pytest.approx(0.9)
    assert idle_fraction(before, before) is None
    assert parse_proc_stat("intr 1 2") is None


def test_idle_heuristic_prefers_proc_stat_then_load_average() -> None:
    assert is_idle(0.85, load1=8.0, cpus=2, min_idle=0.8)  # /proc/stat wins over a high load average
    assert not is_idle(0.5, load1=0.0, cpus=2, min_idle=0.8)
    assert is_idle(None, load1=0.3, cpus=2, min_idle=0.8)  # 0.15 per core ≤ 0.2
    assert not is_idle(None, load1=1.0, cpus=2, min_idle=0.8)
    assert is_idle(None, None, cpus=2, min_idle=0.8)  # nothing to measure: never block forever


def test_gate_order_pause_then_window_then_idle() -> None:
    night = [parse_window("22:00-07:00")]
    assert work_gate(at(23, 0), paused=True, windows=night, idle_only=True, idle=True) == "paused"
    assert work_gate(at(12, 0), paused=False, windows=night, idle_only=True, idle=True) == "outside 22:00-07:00"
    assert work_gate(at(23, 0), paused=False, windows=night, idle_only=True, idle=False) == "waiting for idle"
    assert work_gate(at(23, 0), paused=False, windows=night, idle_only=False, idle=False) is None
    assert work_gate(at(23, 0), paused=False, windows=night, idle_only=True, idle=True) is None


def test_idle_probe_reads_a_proc_stat_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 0 900 0 0 0 0\n")
    probe = IdleProbe(min_idle=0.8, proc_stat=stat)

    def busy(_: float) -> None:  # during the sample, 90 of 100 new jiffies were busy
        stat.write_text("cpu  190 0 0 910 0 0 0 0\n")

    assert probe.measure(0.0, busy) is False

    def quiet(_: float) -> None:
        stat.write_text("cpu  195 0 0 1005 0 0 0 0\n")

    assert probe.measure(0.0, quiet) is True
