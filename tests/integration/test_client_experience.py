"""The volunteer client against a real coordinator: pause/resume through the CLI, the memory and disk
pre-checks that refuse a model before downloading it, config file vs flag precedence, and the hardware and
self-benchmark figures stored at registration."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from shared.hashing import sha256_file
from swarm_client.control import read_status
from tests.integration.conftest import LiveCoordinator
from tests.integration.helpers import REPO, db_rows, start_client, wait_until

pytestmark = pytest.mark.slow


def _cli(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "echo_swarm", *args], capture_output=True, text=True, cwd=REPO,
                         timeout=120, check=True)
    return out.stdout


def _leases(live: LiveCoordinator) -> int:
    """Leases the coordinator has handed out (every job's issue count; one client in these tests)."""
    return int(db_rows(live.run_dir, "SELECT COALESCE(SUM(issue_count), 0) FROM jobs")[0][0])


def _clients(live: LiveCoordinator) -> list[dict[str, Any]]:
    """The coordinator's clients table, read through a connection of our own (the server thread owns its)."""
    rows = db_rows(live.run_dir, "SELECT client_id, profile, accepted, benchmark_tokens_per_s FROM clients")
    return [{"client_id": r[0], "profile": json.loads(r[1]), "accepted": r[2], "benchmark_tokens_per_s": r[3]}
            for r in rows]


def _status(home: Path) -> dict[str, Any]:
    return read_status(home) or {}


def test_pause_stops_new_leases_within_one_poll_and_resume_restarts_them(
        tmp_path: Path, live_coordinator: LiveCoordinator) -> None:
    home = tmp_path / "client"
    client = start_client(live_coordinator.url, home, tmp_path / "client.log", "--no-panel")
    try:
        wait_until(lambda: _status(home).get("accepted", 0) >= 1, 240, "the client's first accepted result")
        assert "paused" in _cli("client", "pause", "--home", str(home))
        before_pause = _leases(live_coordinator)  # the pause file is written before the command returns
        wait_until(lambda: _status(home).get("state") == "paused", 120, "the client to report 'paused'")
        at_pause = _leases(live_coordinator)
        # the job being generated is finished; at most one lease already in flight arrives (and is released)
        assert at_pause - before_pause <= 1
        polls = _status(home)["gated_polls"]
        wait_until(lambda: _status(home)["gated_polls"] >= polls + 3, 60, "three polls while paused")
        assert _leases(live_coordinator) == at_pause, "a paused client leased a job"
        shown = json.loads(_cli("client", "status", "--home", str(home), "--json"))
        assert shown["running"] and shown["paused"] and shown["state"] == "paused"
        # said once: the state already says it (it printed "paused (paused)")
        assert _cli("client", "status", "--home", str(home)).splitlines()[0] == f"client {shown['client_id']}: paused"

        assert "resumed" in _cli("client", "resume", "--home", str(home))
        wait_until(lambda: _leases(live_coordinator) > at_pause, 60, "a new lease after resume")
        accepted = _status(home)["accepted"]
        wait_until(lambda: _status(home)["accepted"] > accepted, 240, "an accepted result after resume")
    finally:
        assert client.stop() == 0, client.output()[-3000:]
    out = client.output()
    assert "self-benchmark:" in out and "this machine:" in out
    # hardware and the self-benchmark are stored with the client, the benchmark in its own column
    (row,) = [c for c in _clients(live_coordinator) if c["client_id"] == _status(home)["client_id"]]
    assert row["benchmark_tokens_per_s"] is not None and row["benchmark_tokens_per_s"] > 0
    assert row["profile"]["benchmark_tokens_per_s"] == row["benchmark_tokens_per_s"]
    assert row["profile"]["disk_free_gb"] > 0 and row["profile"]["cpu_count"] >= 1


def _blobs(home: Path) -> list[Path]:
    blobs = home / "cache" / "blobs"
    return list(blobs.iterdir()) if blobs.exists() else []


def test_memory_and_disk_prechecks_refuse_before_download_and_flags_override_the_config_file(
        tmp_path: Path, live_coordinator: LiveCoordinator) -> None:
    config = tmp_path / "client.toml"
    config.write_text(f'url = "{live_coordinator.url}"\nmax-memory-gb = 0.001\nname = "from-file"\n')
    env = {"ECHO_SWARM_CONFIG": str(config)}
    home = tmp_path / "client"
    # torch: the disk-full trap below is the safetensors file, which a llama.cpp client never fetches
    argv = [sys.executable, "-m", "echo_swarm", "join", "--home", str(home), "--threads", "1", "--backend", "torch"]

    too_small = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=180, env=_env(env))
    assert too_small.returncode == 4, too_small.stdout + too_small.stderr
    assert "model too big for this machine" in too_small.stderr and "--max-memory-gb" in too_small.stderr
    assert _blobs(home) == [], "bytes were downloaded before the memory check"
    assert len(_clients(live_coordinator)) == 0, "a refused client registered"

    no_disk = subprocess.run(argv + ["--max-memory-gb", "64", "--min-free-disk-gb", "1000000"], capture_output=True,
                             text=True, cwd=REPO, timeout=180, env=_env(env))
    assert no_disk.returncode == 4, no_disk.stdout + no_disk.stderr
    assert "not enough free disk" in no_disk.stderr and "--min-free-disk-gb" in no_disk.stderr
    assert _blobs(home) == []

    # the disk fills up during a download (the weights' partial file is /dev/full): stop and say what to do
    weights = live_coordinator.run_dir / "snapshots" / "v000000" / "model.safetensors"
    full_home = tmp_path / "full"
    (full_home / "cache" / "blobs").mkdir(parents=True)
    (full_home / "cache" / "blobs" / f"{sha256_file(weights)}.partial").symlink_to("/dev/full")
    disk_full = subprocess.run(argv[:5] + [str(full_home)] + argv[6:] + ["--max-memory-gb", "64"],
                               capture_output=True, text=True, cwd=REPO, timeout=180, env=_env(env))
    assert disk_full.returncode == 4, disk_full.stdout + disk_full.stderr
    assert "disk full while writing" in disk_full.stderr and "free some disk space" in disk_full.stderr

    # the flag overrides the file's too-small ceiling; the file's url and name still apply
    ok = subprocess.run(argv + ["--max-memory-gb", "64", "--max-jobs", "1"], capture_output=True, text=True,
                        cwd=REPO, timeout=300, env=_env(env))
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
    (row,) = _clients(live_coordinator)
    assert row["profile"]["name"] == "from-file" and row["accepted"] == 1

    # a restart shows the credit earned before; --max-jobs counts this session's results only
    again = subprocess.run(argv + ["--max-memory-gb", "64", "--max-jobs", "1", "--no-benchmark"],
                           capture_output=True, text=True, cwd=REPO, timeout=300, env=_env(env))
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "accepted 2 rejected 0" in again.stdout and "stopped: 1 results accepted" in again.stdout
    (row,) = _clients(live_coordinator)
    assert row["accepted"] == 2

    # banned by the operator: the client stops at once and says why, instead of retrying
    conn = sqlite3.connect(live_coordinator.run_dir / "coordinator.sqlite", timeout=10)
    with conn:
        conn.execute("UPDATE clients SET banned=1 WHERE client_id=?", (row["client_id"],))
    conn.close()
    banned = subprocess.run(argv + ["--max-memory-gb", "64", "--no-benchmark"], capture_output=True, text=True,
                            cwd=REPO, timeout=180, env=_env(env))
    assert banned.returncode == 3, banned.stdout + banned.stderr
    assert "has banned this client" in banned.stderr and "contact the coordinator's operator" in banned.stderr


def _env(extra: dict[str, str]) -> dict[str, str]:
    import os

    return os.environ | {"PYTHONUNBUFFERED": "1"} | extra


def test_outside_its_time_window_the_client_leases_nothing(tmp_path: Path,
                                                           live_coordinator: LiveCoordinator) -> None:
    from datetime import datetime, timedelta

    now = datetime.now()
    window = f"{now + timedelta(hours=2):%H:%M}-{now + timedelta(hours=3):%H:%M}"
    home = tmp_path / "client"
    client = start_client(live_coordinator.url, home, tmp_path / "client.log", "--no-benchmark", "--window", window)
    try:
        wait_until(lambda: _status(home).get("gated_polls", 0) >= 3, 120, "three polls outside the window")
        assert _status(home)["state"] == f"outside {window}"
        assert _leases(live_coordinator) == 0
    finally:
        assert client.stop() == 0, client.output()[-3000:]
    assert f"not fetching new work: outside {window}" in client.output()


def test_a_banned_client_leaves_its_reason_on_the_terminal(tmp_path: Path, live_coordinator: LiveCoordinator) -> None:
    """A client banned while it runs exits 3. Its red lines were written below rich's live panel and wiped by the
    next redraw: the screen showed only `state stopped` and the reason survived in client.log alone. Here the
    client runs on a real pseudo-terminal, and its bytes are played on a VT100 screen (pyte): what a volunteer
    sees at the end has the reason, in red, above the final panel."""
    import pyte

    from coordinator.api.admin_keys import ADMIN_KEY_FILE
    from echo_swarm.admin_client import AdminClient
    from tests.terminal import run_on_terminal

    live = live_coordinator
    home = tmp_path / "client"
    columns, rows = 100, 80  # tall enough that nothing scrolls off the top
    argv = [sys.executable, "-m", "echo_swarm", "join", live.url, "--home", str(home), "--threads", "1",
            "--backend", "torch", "--no-benchmark", "--no-control-page"]

    def ban(_: object) -> None:
        AdminClient.open(live.url, key_path=live.run_dir / ADMIN_KEY_FILE).ban(_status(home)["client_id"],
                                                                               "sent garbage")

    screen_bytes = run_on_terminal(argv, columns=columns, rows=rows, timeout_s=300,
                                   until=lambda _: bool(_status(home).get("client_id")), then=ban)
    client_id = _status(home)["client_id"]
    screen = pyte.Screen(columns, rows)
    pyte.ByteStream(screen).feed(screen_bytes.raw)
    shown = [line.rstrip() for line in screen.display]
    assert screen_bytes.returncode == 3, "\n".join(shown)
    words = " ".join(" ".join(shown).split())
    reason = f"error: the coordinator has banned this client ({client_id}):"
    assert reason in words and "retrying will not help" in words, "\n".join(shown)
    row = next(i for i, line in enumerate(shown) if line.startswith("error: the coordinator has banned"))
    assert all(screen.buffer[row][x].fg == "red" for x in range(len("error:"))), "the reason is not in red"
    panel = [i for i, line in enumerate(shown) if "state" in line and "stopped" in line]
    assert panel and panel[-1] > row, "\n".join(shown)  # the final panel is below the reason, not over it
