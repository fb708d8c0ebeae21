"""The volunteer client against real processes (issue 25).

- Start-up failures are one line on stderr, each with its own exit code, and write nothing: a coordinator whose
  port is taken or whose model folder is missing, a join to a web server that is not a coordinator, to a URL
  without a scheme, or to a port where nothing listens.
- The download rate cap holds on a real throttled transfer from a coordinator: never more than 10 % above the
  cap, and the throttle itself holds the transfer back no longer than the cap requires.
- The one long test: a client keeps working through a coordinator outage of two minutes and has results accepted
  after it (the snapshot egress counter survives the restart); when the run finishes it says so and leases
  nothing; and when the operator starts the next run at the same URL it joins that one by itself.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from coordinator.run.notices import NOTICES_KEY
from shared.exit_codes import ExitCode
from swarm_client.api import CoordinatorClient, RetryPolicy
from swarm_client.bandwidth import MonthlyMeter, Throttle
from swarm_client.control import read_status
from swarm_client.reporting import FINISHED_STATE, UNREACHABLE_STATE
from swarm_client.snapshots import SnapshotCache
from tests.integration.conftest import LiveCoordinator
from tests.integration.helpers import REPO, Proc, db_rows, start_client, wait_until, write_config

pytestmark = pytest.mark.slow
OUTAGE_S = 120.0  # the "a coordinator restart of at least 2 minutes"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run([sys.executable, "-m", "echo_swarm", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=timeout, env=os.environ | {"PYTHONUNBUFFERED": "1"} | (env or {}))


def _one_line(res: subprocess.CompletedProcess[str]) -> str:
    assert res.stdout == "", f"stdout should be empty:\n{res.stdout}"
    lines = res.stderr.splitlines()
    assert len(lines) == 1, f"expected one line on stderr:\n{res.stderr}"
    return lines[0]


# ---- fail fast ------------------------------------------------------------------------------------------------
def test_a_coordinator_that_cannot_start_says_why_in_one_line_and_writes_nothing(tmp_path: Path,
                                                                                 tiny_model_dir: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        run_dir = tmp_path / "run"
        config = write_config(tmp_path / "run.toml", run_dir, tiny_model_dir, port=port)
        res = _cli("coordinator", "--config", str(config))
        assert res.returncode == ExitCode.PORT_IN_USE
        line = _one_line(res)
        assert f"port {port}" in line and "--port" in line and not run_dir.exists()

    missing = _cli("coordinator", "--config", str(config), "--model", str(tmp_path / "no-model"))
    assert missing.returncode == ExitCode.MODEL_INVALID
    assert "does not exist" in _one_line(missing) and not run_dir.exists()

    (tmp_path / "a-file").write_text("")
    unwritable = _cli("coordinator", "--config", str(config), "--port", "0", "--run-dir", str(tmp_path / "a-file" / "run"))
    assert unwritable.returncode == ExitCode.RUN_DIR_UNWRITABLE and "--run-dir" in _one_line(unwritable)


class _Html(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 — the stdlib's name
        body = b"<!DOCTYPE HTML><html><body><h1>Not Found</h1></body></html>"
        self.send_response(404)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_join_tells_a_wrong_url_apart_in_one_line_and_writes_nothing(tmp_path: Path) -> None:
    env = {"ECHO_SWARM_CONFIG": str(tmp_path / "no-client.toml")}
    home = tmp_path / "home"
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Html)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        web_url = f"http://127.0.0.1:{server.server_address[1]}"
        res = _cli("join", web_url, "--home", str(home), env=env)
    finally:
        server.shutdown()
        thread.join(10)
    assert res.returncode == ExitCode.NOT_A_COORDINATOR
    line = _one_line(res)
    assert "not as an echo-swarm coordinator" in line and "HTTP 404" in line and "internal_error" not in line

    res = _cli("join", "127.0.0.1:8470", "--home", str(home), env=env)
    assert res.returncode == ExitCode.USAGE and "needs http:// or https://" in _one_line(res)

    t0 = time.monotonic()
    res = _cli("join", f"http://127.0.0.1:{_free_port()}", "--home", str(home), "--retries", "3", env=env)
    assert res.returncode == ExitCode.UNREACHABLE and time.monotonic() - t0 < 60
    lines = res.stderr.splitlines()
    assert len(lines) == 3 and res.stdout == ""  # one line per retry, then the error
    assert all("connection refused" in x for x in lines) and lines[-1].startswith("error: cannot reach")
    # nothing of the client's state was written (no identity, no status): only the log, which records the failure
    written = sorted(str(f.relative_to(home)) for f in home.rglob("*") if f.is_file())
    assert written == ["logs/client.log"], written
    assert "not as an echo-swarm coordinator" in (home / "logs" / "client.log").read_text()


# ---- the bandwidth cap -------------------------------------------------------------------------------------------
class _CountedThrottle(Throttle):
    """The real token bucket, adding up the waits it asks for (what the cap costs, apart from the machine's own
    time to receive, hash and write the bytes)."""

    def __init__(self, rate: float) -> None:
        super().__init__(rate)
        self.waited_s = 0.0

    def delay(self, nbytes: int) -> float:
        wait = super().delay(nbytes)
        self.waited_s += wait
        return wait


def test_the_download_rate_cap_holds_within_ten_percent(live_coordinator: LiveCoordinator, tmp_path: Path) -> None:
    """Two conditions a slow machine cannot break (it only makes a download slower, and the bucket's waits shorter):
    the transfer is never more than 10 % faster than the cap, and the waits the throttle asks for add up to no more
    than 10 % over what the cap requires (size / cap). A throttle that let bytes through too fast fails the first;
    one that held them back too long (a wrong unit, a bucket that never refills) fails the second. (A lower bound on
    the rate itself would fail on a loaded machine for the machine's sake, not the throttle's.)"""
    weights = live_coordinator.run_dir / "snapshots" / "v000000" / "model.safetensors"
    size = weights.stat().st_size
    from shared.hashing import sha256_file

    sha = sha256_file(weights)
    cap = 0.5e6  # bytes/s: the 4 MB file takes about 8 s
    meter = MonthlyMeter(tmp_path / "data_usage.json", None)
    throttle = _CountedThrottle(cap)

    async def fetch() -> float:
        client = CoordinatorClient(live_coordinator.url, None, retry=RetryPolicy(attempts=2, base_s=0.01))
        try:
            cache = SnapshotCache(tmp_path / "cache", client, live_coordinator.coordinator.public_key,
                                  throttle=throttle, count=meter.add)
            t0 = time.monotonic()
            await cache.fetcher.fetch(sha, size, "model.safetensors")
            return time.monotonic() - t0
        finally:
            await client.close()

    elapsed = asyncio.run(fetch())
    rate, needed = size / elapsed, size / cap
    print(f"\n{size} bytes in {elapsed:.2f} s: {rate / 1e6:.3f} MB/s against a cap of {cap / 1e6:.3f} MB/s; "
          f"the throttle waited {throttle.waited_s:.2f} s of the {needed:.2f} s the cap requires")
    assert rate <= 1.10 * cap, f"{rate / 1e6:.3f} MB/s is more than 10 % above the {cap / 1e6} MB/s cap"
    assert throttle.waited_s <= 1.10 * needed, f"the throttle waited {throttle.waited_s:.2f} s for a {needed:.2f}-s cap"
    assert meter.used() == size  # every byte counted toward the monthly budget
    assert sha256_file(tmp_path / "cache" / "blobs" / sha) == sha


# ---- the long one: an outage, a finished run, the next run -----------------------------------------------------------
def _coordinator(config: Path, log: Path, *extra: str) -> Proc:
    proc = Proc([sys.executable, "-m", "echo_swarm", "coordinator", "--config", str(config), *extra], log,
                ready="listening on ")
    proc.ready.wait(240)
    assert "listening on " in proc.output(), f"coordinator did not start:\n{proc.output()[-3000:]}"
    return proc


def _get(url: str) -> dict[str, object]:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


def _leases(run_dir: Path) -> int:
    return int(db_rows(run_dir, "SELECT COALESCE(SUM(issue_count), 0) FROM jobs")[0][0])


@pytest.mark.timeout(1500)
def test_a_client_outlasts_a_two_minute_outage_waits_out_a_finished_run_and_joins_the_next(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    run_a, run_b = tmp_path / "run-a", tmp_path / "run-b"
    config_a = write_config(tmp_path / "a.toml", run_a, tiny_model_dir, port=port, top={"layout": "one-process"},
                            learner={"max_steps": 1000})
    config_b = write_config(tmp_path / "b.toml", run_b, tiny_model_dir, port=port, top={"layout": "one-process"},
                            learner={"max_steps": 2})
    home = tmp_path / "client"
    procs: list[Proc] = []
    client: Proc | None = None
    try:
        coord = _coordinator(config_a, tmp_path / "coord-a1.log")
        procs.append(coord)
        client = start_client(url, home, tmp_path / "client.log", "--no-benchmark", "--no-panel", "--backend",
                              "llama", "--log-level", "debug", "--name", "long-runner")

        def status() -> dict[str, object]:
            return read_status(home) or {}

        wait_until(lambda: int(status().get("accepted", 0)) >= 2, 300, "two accepted results before the outage")
        first = _get(url + "/v1/status")
        run_a_id, egress_before = first["run_id"], first["snapshot_egress"]["http_bytes"]  # type: ignore[index]
        assert egress_before > 0

        # -- a two-minute outage: the test holds the coordinator down, the client waits it out --------------------
        assert coord.stop() == 0
        down_at = time.monotonic()
        wait_until(lambda: status().get("state") == UNREACHABLE_STATE, 120, "the client to notice the outage")
        accepted = int(status()["accepted"])
        wait_until(lambda: time.monotonic() - down_at >= OUTAGE_S and client.proc.poll() is None, OUTAGE_S + 30,
                   "the outage to last two minutes with the client still running")
        coord = _coordinator(config_a, tmp_path / "coord-a2.log")
        procs.append(coord)
        # read at once, before the client (backing off up to a minute) downloads anything from the new process: a
        # counter kept in the process would read about 0 here
        egress_restarted = _get(url + "/v1/status")["snapshot_egress"]["http_bytes"]  # type: ignore[index]
        assert egress_restarted >= egress_before, "the snapshots-out counter fell back on the restart"
        wait_until(lambda: int(status().get("accepted", 0)) > accepted, 300, "a result accepted after the outage")
        out = client.output()
        assert out.count("lost the coordinator") == 1 and out.count("answers again") == 1, out[-4000:]
        assert "retry 2/" not in out  # no line per attempt once joined
        egress_after = _get(url + "/v1/status")["snapshot_egress"]["http_bytes"]  # type: ignore[index]
        assert egress_after >= egress_restarted

        # -- the run finishes: announced, and no job is leased -------------------------------------------------------
        version = int(_get(url + "/healthz")["version"])  # type: ignore[arg-type]
        assert coord.stop() == 0
        coord = _coordinator(config_a, tmp_path / "coord-a3.log", "--max-steps", str(version + 1))
        procs.append(coord)
        wait_until(lambda: status().get("state") == FINISHED_STATE, 300, "the client to announce the finished run")
        assert FINISHED_STATE in _cli("client", "status", "--home", str(home)).stdout
        leases = _leases(run_a)
        log = home / "logs" / "client.log"
        polls = log.read_text().count("still finished")
        wait_until(lambda: log.read_text().count("still finished") > polls, 120, "the client to look again")
        assert _leases(run_a) == leases, "a client whose run has finished leased a job"
        assert "the run has finished" in client.output()
        # the learner told every volunteer in a signed notice, once (coordinator.run.notices.announce_finished)
        board = json.loads(db_rows(run_a, "SELECT value FROM meta WHERE key = ?", (NOTICES_KEY,))[0][0])
        assert [n["kind"] for n in board["notices"]] == ["run"]
        assert "this run has finished: it trained " in board["notices"][0]["text"]

        # -- the operator starts the next run at the same URL, with the same key: the client follows ------------
        assert coord.stop() == 0
        run_b.mkdir()
        shutil.copy2(run_a / "coordinator.key", run_b / "coordinator.key")
        coord = _coordinator(config_b, tmp_path / "coord-b.log")
        procs.append(coord)
        wait_until(lambda: db_rows(run_b, "SELECT COUNT(*) FROM results")[0][0] >= 1, 300,
                   "a result accepted in the next run")
        assert "has started at" in client.output()
        assert status().get("run_id") == _get(url + "/v1/status")["run_id"] != run_a_id
        assert client.proc.poll() is None
    finally:
        if client is not None:
            assert client.stop() == 0, client.output()[-3000:]
        for p in reversed(procs):
            p.stop()
