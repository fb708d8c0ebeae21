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
