"""The volunteer's display: the rich panel shows every figure; without a terminal, one plain line per job."""

from __future__ import annotations

import io
import os
import pty
import select
import signal
import threading
import time
import tty
from collections.abc import Callable
from pathlib import Path
from typing import IO

import pytest
from rich.console import Console

from swarm_client.bandwidth import MonthlyMeter
from swarm_client.panel import Display, whole_writes
from swarm_client.reporting import FINISHED_STATE, UNREACHABLE_STATE, ClientStats


def stats() -> ClientStats:
    return ClientStats(client_id="0123456789abcdef" * 2, version=7, accepted=12, rejected=3, credit=1234.5,
                       last_job="j42", tokens_per_s=987.6, state="generating")


def test_panel_shows_version_job_speed_counts_and_credit() -> None:
    display = Display(stats(), live=False, url="http://coord:8470", hardware="2 CPU cores, no GPU")
    out = io.StringIO()
    Console(file=out, width=100, color_system=None).print(display)
    text = out.getvalue()
    for expected in ("echo-swarm", "generating", "http://coord:8470", "j42", "987.6", "12", "3", "1,234.5",
                     "2 CPU cores", "client pause"):
        assert expected in text, (expected, text)


def test_plain_lines_without_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    s = stats()
    display = Display(s, live=False)
    display.start()
    display.update()  # a state change alone: no line
    display.update(line=True)
    display.update(line=True)  # unchanged: not repeated
    s.accepted += 1
    display.update(line=True)
    display.say("an event")
    display.stop()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and "accepted 12" in lines[0] and "accepted 13" in lines[1] and lines[2] == "an event"
    assert "credit 1,234" in lines[0] and "988 tok/s" in lines[0]



@pytest.mark.parametrize("state", [FINISHED_STATE, UNREACHABLE_STATE, "snoozed until 14:30", "on battery"])
def test_panel_names_a_held_state_and_shows_the_data_used_and_the_caps(state: str, tmp_path: Path) -> None:
    """What a volunteer left alone sees: a finished run, an outage or a hold spelled out on the panel (not a bare
    `waiting`), and the data used this month against the budget, with the rate cap (issue 25)."""
    meter = MonthlyMeter(tmp_path / "data_usage.json", 10**9)
    meter.add(250 * 10**6)
    s = stats()
    s.state, s.bandwidth = state, meter.describe() + " · limit 2.5 MB/s"
    out = io.StringIO()
    Console(file=out, width=140, color_system=None).print(Display(s, live=False, url="http://coord:8470"))
    text = out.getvalue()
    row = next(line for line in text.splitlines() if " data " in line)
    assert state in text and "0.25 GB this month (cap 1 GB) · limit 2.5 MB/s" in row, text


def _runs() -> list[dict[str, object]]:
    return [{"url": "http://a.example:8470", "share": 3.0, "work_fraction": 0.74, "state": "generating",
             "accepted": 31, "rejected": 1, "credit": 5120.0},
            {"url": "http://b.example:8470", "share": 1.0, "work_fraction": 0.26, "state": "coordinator paused",
             "accepted": 11, "rejected": 0, "credit": 1800.5}]


def test_one_panel_lists_every_run_of_a_client_with_several_coordinators() -> None:
    """`join A --attach B=1` on a terminal: URL's panel has a row per run — coordinator, share, work so far, state,
    accepted / rejected, credit (issue 34; the terminal used to show tagged lines only)."""
    display = Display(stats(), live=False, url="http://a.example:8470")
    display.runs = _runs
    out = io.StringIO()
    Console(file=out, width=120, color_system=None).print(display)
    rows = out.getvalue().splitlines()
    head = next(line for line in rows if "coordinator" in line and "share" in line)
    assert "work so far" in head and "accepted / rejected" in head and "credit" in head, rows
    a = next(line for line in rows if "http://a.example:8470" in line and " 3 " in line)
    b = next(line for line in rows if "http://b.example:8470" in line)
    assert "74 %" in a and "generating" in a and "31 / 1" in a and "5,120.0" in a, a
    assert " 1 " in b and "26 %" in b and "coordinator paused" in b and "11 / 0" in b and "1,800.5" in b, b
    single = io.StringIO()
    Console(file=single, width=120, color_system=None).print(Display(stats(), live=False))
    assert "work so far" not in single.getvalue()  # one run: no table


def test_an_attached_runs_lines_go_through_the_panel(monkeypatch: pytest.MonkeyPatch) -> None:
    """An attached run draws no panel of its own: where URL's display is a live panel, the attached run's lines and
    redraws go through it — printed beside the panel they would be erased by the next redraw, and a plain status line
    after it stops would be a second, untagged way of saying what the panel said; where there is no terminal, it
    prints its own plain lines."""
    screen, beside = io.StringIO(), io.StringIO()
    monkeypatch.setattr("sys.stdout", screen)  # the panel's console writes here
    main, attached = Display(stats(), live=True), Display(stats(), live=False)
    attached.relay(main)
    main.start()
    monkeypatch.setattr("sys.stdout", beside)  # what the attached run would print by itself lands here
    attached.say("[http://b.example:8470] result j7 accepted")
    attached.update(line=True)  # a job finished: the panel redraws, no status line of its own
    main.stop()
    attached.say("[http://b.example:8470] stopped")  # winding down after the panel stopped: still through it
    attached.update(line=True)
    assert beside.getvalue() == "", beside.getvalue()  # nothing printed beside the panel, before or after it stopped
    shown = screen.getvalue()
    assert "result j7 accepted" in shown and "[http://b.example:8470] stopped" in shown, shown
    assert "[echo-swarm 01234567]" not in shown, shown

    plain, alone = Display(stats(), live=False), Display(stats(), live=False)  # no terminal: plain lines each
    alone.relay(plain)
    alone.say("[http://b.example:8470] result j8 accepted")
    alone.update(line=True)
    monkeypatch.undo()
    assert "result j8 accepted" in beside.getvalue() and "[echo-swarm 01234567]" in beside.getvalue()


def _interrupted_write(make: Callable[[int], IO[str]]) -> tuple[int, int]:
    """Write a long text to a pseudo-terminal nobody reads yet through ``make(slave)``, interrupt the write with a
    signal once the writer is blocked in write(2) with part of it sent (as Ctrl-C does to a client whose terminal
    is slow), then read everything: (bytes that arrived, bytes written)."""
    master, slave = pty.openpty()
    tty.setraw(slave)  # no \\n → \\r\\n: the byte counts compare as they are
    text = ("x" * 99 + "\n") * 2000 + "END"
    writer = threading.get_native_id()
    previous = signal.signal(signal.SIGUSR1, lambda *_: None)

    def interrupt() -> None:
        syscall = Path(f"/proc/self/task/{writer}/syscall")
        # blocked in write(2) (x86-64: 1, arm64: 64) once the terminal's buffer is full
        while not (select.select([master], [], [], 0)[0] and syscall.read_text().split()[0] in ("1", "64")):
            time.sleep(0.01)
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGUSR1)

    got = bytearray()

    def drain() -> None:
        interrupted.join()
        while not got.endswith(b"END") and select.select([master], [], [], 5)[0]:
            got.extend(os.read(master, 65536))

    interrupted, reader = threading.Thread(target=interrupt), threading.Thread(target=drain)
    interrupted.start()
    reader.start()
    try:
        stream = make(slave)
        stream.write(text)
        stream.flush()
        reader.join(60)
    finally:
        signal.signal(signal.SIGUSR1, previous)
        os.close(slave)
        os.close(master)
    return len(got), len(text)


def test_a_signal_during_a_redraw_loses_no_byte_of_it_on_an_unbuffered_stdout() -> None:
    """PYTHONUNBUFFERED=1 makes stdout write through a raw file: a Ctrl-C that interrupts a panel redraw on a slow
    terminal drops the rest of it, and the next redraw erased the notice lines above the panel (seen in
    tests/integration/test_notices.py under load). The panel's console writes through whole_writes."""
    def unbuffered(fd: int) -> IO[str]:
        return io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), write_through=True)  # what python -u makes

    arrived, written = _interrupted_write(unbuffered)
    assert arrived < written  # the mechanism: the raw stream drops what the interrupted write(2) did not send
    arrived, written = _interrupted_write(lambda fd: whole_writes(unbuffered(fd)))
    assert arrived == written
