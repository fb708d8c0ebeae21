"""Connection floods against a real coordinator process while two honest `echo-swarm join` processes work
(issue 13: 200 slowloris connections were held open, and idle connections up to the file limit made the
coordinator exit).

The coordinator runs with a file limit of FD_LIMIT (set in its own process before it starts), so its
derived connection cap is small and the test is fast. Two flooder processes (tests/faults/flooder.py) attack
until the test has seen what it waits for (no fixed window: on a busy machine the flood simply lasts longer):
200 slowloris connections from 127.0.0.1 — the honest clients' own address — and idle
connections from 127.0.0.2, more of them than the coordinator has file descriptors, both reopening whatever the
server closes. The coordinator must stay up, never hold more descriptors than its limit allows, accept honest
results during the flood, and serve normally after it.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.integration.helpers import Proc, db_rows, start_client, stop_all, wait_until, write_config
from tests.integration.ops_helpers import scrape

pytestmark = pytest.mark.slow

FD_LIMIT = 1024
FLOOD_MAX_S = 600.0  # a bound on the flooders should the test die; the test stops them (STOP file) long before


def start_limited_coordinator(config: Path, log: Path) -> tuple[Proc, str]:
    """`echo-swarm coordinator` in a process whose file limit (soft and hard) is FD_LIMIT."""
    boot = ("import resource, runpy, sys; "
            f"resource.setrlimit(resource.RLIMIT_NOFILE, ({FD_LIMIT}, {FD_LIMIT})); "
            f"sys.argv = ['echo_swarm', 'coordinator', '--config', {str(config)!r}]; "
            "runpy.run_module('echo_swarm', run_name='__main__')")
    proc = Proc([sys.executable, "-c", boot], log, ready="listening on ")
    proc.ready.wait(180)
    out = proc.output()
    assert "listening on " in out, f"coordinator did not start:\n{out[-3000:]}"
    return proc, out.split("listening on ")[1].split()[0]


def flooder(url: str, kind: str, conns: int, source: str, tmp: Path) -> Proc:
    return Proc([sys.executable, "-m", "tests.faults.flooder", url, "--kind", kind, "--conns", str(conns),
                 "--until", str(tmp / "STOP"), "--seconds", str(FLOOD_MAX_S), "--source", source,
                 "--out", str(tmp / f"{kind}.json")], tmp / f"flood-{kind}.log")


def flood_report(tmp: Path, kind: str) -> dict[str, int]:
    """The flooder's latest report (rewritten atomically every second), {} before its first."""
    path = tmp / f"{kind}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def flood_has_bitten(tmp: Path) -> bool:
    """Both floods at full strength and the server cutting them off: 200 slowloris connections held at once,
    more idle connections opened than the coordinator has descriptors, and both kinds closed by the server."""
    loris, idle = flood_report(tmp, "slowloris"), flood_report(tmp, "idle")
    return (loris.get("most_open", 0) >= 200 and idle.get("opened", 0) > FD_LIMIT
            and loris.get("closed_by_server", 0) > 0 and idle.get("closed_by_server", 0) > 0)


def accepted(run_dir: Path, honest: set[str]) -> int:
    return sum(n for cid, n in db_rows(run_dir, "SELECT client_id, COUNT(*) FROM results GROUP BY client_id")
               if cid in honest)


def healthz_ms(url: str) -> float:
    t0 = time.perf_counter()
    with urllib.request.urlopen(url + "/healthz", timeout=10) as resp:
        assert resp.status == 200
    return (time.perf_counter() - t0) * 1000


def test_slowloris_and_fd_exhaustion_floods_leave_the_coordinator_serving(tmp_path: Path,
                                                                            tiny_model_dir: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = write_config(tmp_path / "run.toml", run_dir, tiny_model_dir, learner={"max_steps": 100_000},
                       server={"header_timeout_s": 3.0})
    coord, url = start_limited_coordinator(cfg, tmp_path / "coord.log")
    procs: list[Proc] = []
    peak_fds = [0]
    sampling = threading.Event()

    def sample_fds() -> None:  # the coordinator's open descriptors, from /proc, every 100 ms
        while not sampling.wait(0.1):
            try:
                peak_fds[0] = max(peak_fds[0], len(os.listdir(f"/proc/{coord.pid}/fd")))
            except OSError:
                return

    sampler = threading.Thread(target=sample_fds, daemon=True)
    try:
        procs = [start_client(url, tmp_path / f"honest{k}", tmp_path / f"honest{k}.log", "--backend", "torch")
                 for k in range(2)]
        def registered() -> set[str]:
            ids = {str(r[0]) for r in db_rows(run_dir, "SELECT client_id FROM clients")}
            return ids if len(ids) == 2 else set()

        honest = wait_until(registered, 240, "the honest clients to register")
        wait_until(lambda: accepted(run_dir, honest) >= 2, 300, "the honest clients' first results")
        before_ms = sorted(healthz_ms(url) for _ in range(10))[5]
        sampler.start()

        floods = [flooder(url, "slowloris", 200, "127.0.0.1", tmp_path),
                  flooder(url, "idle", FD_LIMIT + 100, "127.0.0.2", tmp_path)]
        procs += floods
        at_start = accepted(run_dir, honest)
        wait_until(lambda: accepted(run_dir, honest) >= at_start + 2 and flood_has_bitten(tmp_path), 300,
                   "honest results accepted while both floods are at full strength")
        assert all(f.proc.poll() is None for f in floods), "a flooder ended before the test stopped it"
        assert coord.proc.poll() is None
        (tmp_path / "STOP").touch()
        for f in floods:
            assert f.proc.wait(60) == 0, f.output()[-2000:]
        loris, idle = flood_report(tmp_path, "slowloris"), flood_report(tmp_path, "idle")
        assert loris["done"] and idle["done"], (loris, idle)
        assert loris["most_open"] >= 200 and idle["opened"] > FD_LIMIT, (loris, idle)
        assert loris["closed_by_server"] > 0 and idle["closed_by_server"] > 0, (loris, idle)

        # after the flood: up, answering at its usual speed, still accepting honest work
        assert coord.proc.poll() is None
        after_ms = sorted(healthz_ms(url) for _ in range(10))[5]
        at_end = accepted(run_dir, honest)
        wait_until(lambda: accepted(run_dir, honest) >= at_end + 2, 120, "honest results after the flood")
        metrics = scrape(url)
        for p in procs[:2]:
            assert p.proc.poll() is None, f"an honest client died:\n{p.output()[-3000:]}"
    finally:
        sampling.set()
        stop_all(*reversed(procs), coord)

    def value(name: str, **labels: str) -> float:
        return metrics.get((name, tuple(sorted(labels.items()))), 0.0)

    cap = value("echo_swarm_connections_limit")
    assert 0 < cap <= (FD_LIMIT - 256 - 512) / 2  # derived from the file limit, with room for everything else
    assert value("echo_swarm_connections_peak") <= cap
    # the flood's connections were cut off: evicted for newcomers (honest ones included) or timed out
    assert value("echo_swarm_connections_evicted_total") + value("echo_swarm_connections_timed_out_total",
                                                                 phase="header") >= loris["closed_by_server"]
    assert not [k for k in metrics if k[0] == "echo_swarm_http_requests_total" and ("status", "500") in k[1]]
    assert peak_fds[0] < FD_LIMIT, peak_fds
    assert "Too many open files" not in coord.output()
    assert after_ms < max(50.0, 5 * before_ms), (before_ms, after_ms)
    print(f"healthz median before/after the flood: {before_ms:.1f}/{after_ms:.1f} ms; coordinator fds at most "
          f"{peak_fds[0]} of {FD_LIMIT}; flood: {loris}, {idle}; evicted "
          f"{value('echo_swarm_connections_evicted_total'):.0f}, refused "
          f"{value('echo_swarm_connections_refused_total', cap='per_address'):.0f}+"
          f"{value('echo_swarm_connections_refused_total', cap='total'):.0f}")
