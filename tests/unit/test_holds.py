"""Hold points (coordinator.holds): a role held at a named point writes its pid and waits until released."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from coordinator.holds import HOLD_ENV, hold, hold_markers


def test_a_named_point_holds_until_its_marker_is_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "held"
    monkeypatch.setenv(HOLD_ENV, f"publish-v9=/nowhere/else, publish-v4={marker}")
    done = threading.Event()
    worker = threading.Thread(target=lambda: (hold("publish-v4"), done.set()), daemon=True)
    worker.start()
    appeared = threading.Event()
    for _ in range(1000):  # the marker appears (a condition), 10 s at most
        if marker.exists():
            appeared.set()
            break
        appeared.wait(0.01)
    assert appeared.is_set() and int(marker.read_text()) == os.getpid()
    assert not done.wait(0.2)  # still held while the marker is there
    marker.unlink()
    worker.join(10)
    assert done.is_set()


def test_other_points_and_no_setting_pass_straight_through(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(HOLD_ENV, raising=False)
    hold("publish-v4")
    monkeypatch.setenv(HOLD_ENV, f"publish-v5={tmp_path / 'held'}")
    hold("publish-v4")
    assert not (tmp_path / "held").exists()


def test_a_malformed_setting_says_the_form() -> None:
    assert hold_markers("") == {}
    with pytest.raises(ValueError, match="NAME=PATH"):
        hold_markers("publish-v4")


def test_requests_held_at_once_in_one_process_each_hold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A verifier holds every recompute it claims, several at once on its worker threads: each must write the marker
    and wait, none fail (with one temporary file name per process, a second writer's rename found the first's file
    gone, and the verifier answered that request "version gone")."""
    marker = tmp_path / "held"
    monkeypatch.setenv(HOLD_ENV, f"recompute-v0={marker}")
    tick = threading.Event()  # never set: a sleep that is a wait

    def held(start: threading.Barrier, errors: list[BaseException]) -> None:
        start.wait()
        try:
            hold("recompute-v0")
        except BaseException as exc:  # noqa: BLE001 — the test reports whatever a writer raised
            errors.append(exc)

    for _ in range(20):
        start, errors = threading.Barrier(8), list[BaseException]()
        workers = [threading.Thread(target=held, args=(start, errors), daemon=True) for _ in range(8)]
        for w in workers:
            w.start()
        for _ in range(1000):  # the marker appears (a condition), 10 s at most
            if marker.exists():
                break
            tick.wait(0.01)
        assert marker.exists()
        for _ in range(1000):  # release every one held, also a late writer that wrote the marker again
            marker.unlink(missing_ok=True)
            if not any(w.is_alive() for w in workers):
                break
            tick.wait(0.01)
        assert not any(w.is_alive() for w in workers)
        assert errors == [], errors
