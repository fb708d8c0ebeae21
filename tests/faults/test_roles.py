"""Every result a client was told was accepted survives kill -9 of any role, on SQLite and on PostgreSQL (issues 12
and 37), counted from the clients' side.

The run is real: `echo-swarm coordinator` in its process layout (the API, the learner, a verifier and the libp2p peer,
each a process of the supervisor) on either store, and two volunteers running the production join loop — one over
HTTP, one sending its signed calls, results included, over libp2p through the p2p role (`join --p2p --p2p-jobs`) —
each keeping a journal of the results it was told were accepted (tests/faults/acking_client.py). While they submit,
each role is killed with SIGKILL in turn, at a moment it holds work (hold points, coordinator.holds): the learner
with a step trained and its version half written, the verifier holding a claimed recompute, the p2p role once it has relayed results, the API while both clients talk to it. After each kill
the supervisor restarts the role, and the run goes on: both clients get more results accepted.

What must hold: every result a client was told was accepted (its job, its lease, its client) is in the store — as the
job's result, or, where the job was replicated (issue 37) and the other holder's came first, as a credited second
result (``replica_results``: never trained) —, and the job's result is trained once, in the step after the version it was generated with, or still waits for that step, or — where more
results of its version came back than that step takes — is set aside as too stale (credited, never trained); every
step trained its whole batch; the API process never loads torch.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coordinator.holds import HOLD_ENV
from coordinator.store.db import Db
from shared.endpoints import RESULTS
from swarm_client.identity import load_identity
from tests.faults.acking_client import journal, read_acks, start_acking_client
from tests.integration.helpers import (
    Proc,
    get_status,
    process_alive,
    start_coordinator,
    stop_all,
    wait_until,
    write_config,
)

pytestmark = pytest.mark.slow

#: A guard against a hang, never a pace: each wait below ends on its condition, this long at most.
HANG_S = 300.0
#: Seconds between two reads of the status page: it answers 10 a second per address (limits.public_reads_per_
#: address_rps), and a read over that is a 429 the waits would read as "not yet"
STATUS_POLL_S = 0.25
#: What each step trains in write_config's run: 4 prompts a step, 2 a job.
BATCH = 2
#: The versions at which the learner (publishing) and the verifier (recomputing) are held and killed.
LEARNER_HELD, VERIFIER_HELD = 2, 4


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest) -> Iterator[str | None]:
    """The run's store: its SQLite file in the run directory (None: the default), or a PostgreSQL schema."""
    yield None if request.param == "sqlite" else str(request.getfixturevalue("pg_url"))


def _roles(url: str) -> dict[str, Any]:
    status = get_status(url)
    return status["roles"] if status else {}


def _pid(url: str, role: str) -> int:
    return int(_roles(url).get(role, {}).get("pid") or 0)


def _live_pid(url: str, role: str) -> int:
    """The role's process as it reported it (a status page that did not answer in time is asked again)."""
    return int(wait_until(lambda: _pid(url, role), HANG_S, f"the {role} role's pid", STATUS_POLL_S))


def _version(url: str) -> int:
    """The newest published version (a status page that did not answer in time is asked again)."""
    status = wait_until(lambda: get_status(url), HANG_S, "the status page", STATUS_POLL_S)
    assert status is not None
    return int(status["version"])


def _restarted(url: str, role: str, old: int) -> int:
    """The role's new process, once it has reported (0 until then)."""
    pid = _pid(url, role)
    return pid if pid and pid != old and process_alive(pid) else 0


def _maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


class Swarm:
    """The clients of the run, the hold points its roles stop at (coordinator.holds), and what the test reads."""

    def __init__(self, url: str, homes: list[Path], clients: list[Proc], holds: dict[str, Path]) -> None:
        self.url, self.homes, self.clients, self.holds = url, homes, clients, holds
        self.used: set[str] = set()  # the points a role was killed at

    def acked(self) -> list[int]:
        return [len(read_acks(journal(home))) for home in self.homes]

    def running(self) -> bool:
        for c in self.clients:
            assert c.proc.poll() is None, f"a client exited:\n{c.output()[-3000:]}"
        return True

    def let_go(self) -> bool:
        """Release every role held at a point already used: a restarted role reaches its predecessor's point again
        (it redoes that work), and is let go on."""
        for point in self.used:
            self.holds[point].unlink(missing_ok=True)
        return True

    def goes_on(self, what: str, *, each: bool = True) -> None:
        """Every client gets another result accepted (from now), and every client is still running. ``each=False``:
        some client does — where the run may reach the verifier's hold (every later result waits there) within a
        few steps, the issuer's choice of who gets those few jobs (a measured client first: the p2p client, slower
        to ask through its relay, got none in two runs of three) is no fault's to show."""
        before = self.acked()
        wait_until(lambda: self.running() and self.let_go() and (all if each else any)(
            n > b for n, b in zip(self.acked(), before, strict=True)), HANG_S,
                   f"{'each client' if each else 'a client'} to get a result accepted after {what}")

    def kill_held(self, role: str, point: str) -> int:
        """SIGKILL the role's process where it holds at ``point`` (its pid in the marker), and wait for the
        supervisor's new one to report."""
        marker = self.holds[point]
        text = wait_until(lambda: self.running() and marker.exists() and marker.read_text().strip(), HANG_S,
                          f"the {role} to reach {point}")
        pid = int(text)
        assert pid == _live_pid(self.url, role), (pid, _roles(self.url))
        self.used.add(point)
        return self.kill(role, pid)

    def kill(self, role: str, pid: int) -> int:
        os.kill(pid, signal.SIGKILL)
        return int(wait_until(lambda: _restarted(self.url, role, pid), HANG_S, f"a new {role} process",
                              STATUS_POLL_S))


def test_every_acknowledged_result_survives_kill_9_of_each_role(tmp_path: Path, tiny_model_dir: Path,
                                                                 store_url: str | None, hivemind: Any) -> None:
    run_dir = tmp_path / "run"
    cfg = write_config(tmp_path / "run.toml", run_dir, tiny_model_dir, top={"layout": "processes"},
                       # a run longer than the test: the test stops it once every role has been killed
                       learner={"max_steps": 10_000, "checkpoint_every_steps": 3},
                       verification={"claim_s": 20.0}, p2p={"enabled": True, "seed_peers": 1},
                       snapshots={"gguf": "off"}, store={"url": store_url} if store_url else {})
    # where the learner and the verifier hold work when they are killed: the learner has trained step 2 and is
    # writing version 2 (nothing of the step recorded yet); the verifier has claimed a recompute of a version-4
    # result, whose client waits for the verdict
    holds = {point: tmp_path / point for point in (f"publish-v{LEARNER_HELD}", f"recompute-v{VERIFIER_HELD}")}
    coord, url = start_coordinator(cfg, tmp_path / "coord.log",
                                   env={HOLD_ENV: ",".join(f"{point}={path}" for point, path in holds.items())})
    homes = [tmp_path / "http", tmp_path / "p2p"]
    clients = [start_acking_client(url, homes[0]), start_acking_client(url, homes[1], "--p2p")]
    swarm = Swarm(url, homes, clients, holds)
    t0 = time.monotonic()
    try:
        wait_until(lambda: (r := _roles(url)) and all(r.get(n, {}).get("pid") for n in
                                                      ("api", "learner", "verifier-0", "p2p")), HANG_S,
                   "every role to report its pid", STATUS_POLL_S)
        api_pid = _live_pid(url, "api")
        assert api_pid != coord.pid  # the supervisor is not the API: roles are processes of their own

        # 1. the learner, mid-step: step 2 trained, version 2 half written
        assert "libtorch" in _maps(_live_pid(url, "learner"))  # (the check below can fail: the learner's maps show it)
        swarm.kill_held("learner", f"publish-v{LEARNER_HELD}")
        assert "libtorch" not in _maps(api_pid)  # while the learner trained, the API had no torch loaded
        swarm.goes_on("the learner's restart", each=False)  # the verifier holds at version 4: 2 steps away
        wait_until(lambda: _version(url) > LEARNER_HELD, HANG_S, "the restarted learner to publish its version",
                   STATUS_POLL_S)

        # 2. the verifier, holding a claimed recompute (a client waits for its verdict)
        swarm.kill_held("verifier-0", f"recompute-v{VERIFIER_HELD}")
        swarm.goes_on("the verifier's restart")

        # 3. the p2p role, once it has relayed the p2p client's results (it relays its calls from then on)
        wait_until(lambda: ((_roles(url).get("p2p", {}).get("calls") or {}).get("relayed") or {}).get(
            RESULTS.path, 0) > 0, HANG_S, "the p2p role to relay results", STATUS_POLL_S)
        swarm.kill("p2p", _live_pid(url, "p2p"))
        swarm.goes_on("the p2p role's restart")

        # 4. the API, while both clients talk to it
        new_api = swarm.kill("api", _live_pid(url, "api"))
        assert "libtorch" not in _maps(new_api)
        swarm.goes_on("the API's restart")
        print(f"4 roles killed and restarted in {time.monotonic() - t0:.0f}s; acknowledged {swarm.acked()}")
    finally:
        swarm.used.update(holds)
        swarm.let_go()
        stop_all(*clients, coord)
    db = Db(store_url or run_dir / "coordinator.sqlite")
    try:
        _every_acknowledged_result_is_kept(db, homes)
    finally:
        db.close()
    log = (tmp_path / "coord.log").read_text()
    for role in ("learner", "verifier-0", "p2p", "api"):
        assert re.search(rf"{role} \(pid \d+\) exited with -9; restarting it", log), role
    assert "resumed at version" in log


def _every_acknowledged_result_is_kept(db: Db, homes: list[Path]) -> None:
    results = {r["job_id"]: r for r in db.execute(
        "SELECT job_id, lease_id, client_id, version, ingested_step, stale_at FROM results").fetchall()}
    # a replicated job's second result, acknowledged as accepted and credited, never trained (docs/protocol.md §5)
    credited = {(r["job_id"], r["client_id"]): r for r in db.execute(
        "SELECT job_id, client_id, lease_id, version FROM replica_results").fetchall()}
    (newest,) = db.execute("SELECT MAX(version) FROM versions").fetchone()
    for home in homes:
        client_id = load_identity(home).client_id
        acks = read_acks(journal(home))
        assert len({a["job"] for a in acks}) == len(acks)  # one acknowledgement a job
        lost = [a for a in acks if a["job"] not in results]
        assert not lost, f"{home.name}: {len(lost)} of {len(acks)} acknowledged results are not in the store: {lost}"
        for a in acks:
            second = credited.get((a["job"], client_id))
            if second is not None and results[a["job"]]["lease_id"] != a["lease"]:
                assert (second["lease_id"], second["version"]) == (a["lease"], a["version"]), (dict(second), a)
                continue
            row = results[a["job"]]
            assert (row["lease_id"], row["client_id"], row["version"]) == (a["lease"], client_id, a["version"]), a
            # sequential pull: a result of version v is trained by the step that makes v + 1, or waits for it; or,
            # where more results of v came back than that step takes (issuance gives a fresh job in place of a lease
            # whose result is slow: held in verification, or sent while the p2p relay was down), the learner sets
            # it aside as too stale at a later version: credited, never trained (coordinator.store.results)
            if row["stale_at"] is not None:
                assert row["ingested_step"] is None and row["stale_at"] > a["version"], dict(row)
                continue
            assert row["ingested_step"] == a["version"] + 1 or (row["ingested_step"] is None
                                                                and a["version"] == newest), (dict(row), newest)
    # nothing trained twice or short: every step trained its own whole batch
    per_step = [tuple(r) for r in db.execute("SELECT ingested_step, COUNT(*) FROM results WHERE ingested_step IS "
                                             "NOT NULL GROUP BY ingested_step ORDER BY 1").fetchall()]
    assert per_step == [(step, BATCH) for step in range(1, newest + 1)], per_step
