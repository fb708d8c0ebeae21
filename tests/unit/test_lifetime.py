"""swarm_client/lifetime.py: a volunteer's credit and results per run, kept across restarts and new runs, never
counted twice, and never a reason to stop (a damaged file is set aside)."""

from __future__ import annotations

import json
from pathlib import Path

from swarm_client import lifetime
from swarm_client.lifetime import Lifetime

A, B, ME = "run-a", "run-b", "c" * 32


class Clock:
    def __init__(self) -> None:
        self.t = 1_700_000_000.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def test_a_restart_reads_the_coordinators_totals_again_and_adds_nothing(tmp_path: Path) -> None:
    clock = Clock()
    life = Lifetime(tmp_path, clock)
    life.joined("http://a", A, ME)  # a new identity: the coordinator lists nothing for it yet
    life.result("http://a", A, ME, accepted=True, total_credit=40.0)
    life.result("http://a", A, ME, accepted=True, total_credit=75.0)
    life.result("http://a", A, ME, accepted=False)
    again = Lifetime(tmp_path, clock)  # a restart: the same run, the coordinator's figures read at registration
    again.joined("http://a", A, ME, accepted=2, rejected=1, credit=75.0)
    assert again.totals() | {"since": None} == {"runs": 1, "accepted": 2, "rejected": 1, "credit": 75.0, "since": None}
    # a result whose reply was lost: the coordinator's count is higher than the client's tally, and wins
    again.joined("http://a", A, ME, accepted=3, rejected=1, credit=110.0)
    assert (again.totals()["accepted"], again.totals()["credit"]) == (3, 110.0)


def test_a_new_run_is_added_beside_the_old_one_and_the_plot_follows_the_total(tmp_path: Path) -> None:
    clock = Clock()
    life = Lifetime(tmp_path, clock)
    life.result("http://a:1", A, ME, accepted=True, total_credit=50.0)
    life.joined("http://a:2", B, ME)  # the operator's next run (the same coordinator on another port)
    life.result("http://a:2", B, ME, accepted=True, total_credit=20.0)
    reread = Lifetime(tmp_path, clock)
    assert reread.totals()["runs"] == 2 and reread.totals()["credit"] == 70.0
    assert [(r["run_id"], r["url"], r["credit"]) for r in reread.recent()] == [(B, "http://a:2", 20.0),
                                                                                 (A, "http://a:1", 50.0)]
    assert [c for _, c in reread.points] == [50.0, 70.0]  # joining B changed nothing: no point for it
    assert reread.totals()["since"] == reread.runs[f"{A}/{ME}"].first_at


def test_the_series_is_thinned_and_old_runs_retired_without_losing_the_total(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(lifetime, "MAX_POINTS", 16)
    monkeypatch.setattr(lifetime, "MAX_RUNS", 3)
    life = Lifetime(tmp_path, Clock())
    for k in range(100):
        life.result("http://a", f"run-{k // 10}", ME, accepted=True, total_credit=float(k % 10 + 1))
    assert len(life.points) <= 16 and life.points[-1][1] == 100.0  # the newest point is always kept
    assert [t for t, _ in life.points] == sorted(t for t, _ in life.points)
    assert len(life.runs) == 3 and life.totals() | {"since": None} == {
        "runs": 10, "accepted": 100, "rejected": 0, "credit": 100.0, "since": None}
    assert Lifetime(tmp_path).totals()["credit"] == 100.0  # the retired runs' share is in the file too


def test_a_damaged_file_is_set_aside_and_a_reader_changes_nothing(tmp_path: Path) -> None:
    (tmp_path / lifetime.FILE).write_text('{"runs": {"x": {"url": 1')
    assert Lifetime(tmp_path, readonly=True).totals()["runs"] == 0  # `client status`: reads, moves nothing
    assert (tmp_path / lifetime.FILE).exists() and not (tmp_path / (lifetime.FILE + ".damaged")).exists()
    life = Lifetime(tmp_path)
    assert (tmp_path / (lifetime.FILE + ".damaged")).read_text().startswith('{"runs"')
    life.result("http://a", A, ME, accepted=True, total_credit=5.0)
    assert json.loads((tmp_path / lifetime.FILE).read_text())["runs"][f"{A}/{ME}"]["credit"] == 5.0


def test_a_home_that_cannot_be_written_is_no_reason_to_stop(tmp_path: Path) -> None:
    blocked = tmp_path / "file-not-folder"
    blocked.write_text("")
    life = Lifetime(blocked / "home")  # its parent is a file: every save fails
    life.result("http://a", A, ME, accepted=True, total_credit=5.0)
    assert life.totals()["credit"] == 5.0
