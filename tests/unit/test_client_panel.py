"""The volunteer's display: the rich panel shows every figure; without a terminal, one plain line per job."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from swarm_client.bandwidth import MonthlyMeter
from swarm_client.panel import Display
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
