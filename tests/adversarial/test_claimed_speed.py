"""The claimed-speed attack as real processes (issue 37's must-show): a swarm where a fresh identity per job declares
10⁷ tokens/s keeps its honest clients' results per minute within 20 % of the same run without it.

Each fresh identity of the attacker (tests/adversarial/speed_adversary.py, 4 at once) declares the protocol's ceiling
of 10⁷ tokens/s at registration, takes one job's lease and vanishes. Before replicas, such a lease held one of the
version's B slots until it was overdue (≥ 5 s, lengthened by the stalls themselves), and an honest client fell from
85.5 to 6.9 results a minute (docs/benchmarks.md). Now a measured client refused a slot is given a replica of the
unproven holder's job (coordinator.core.scheduling.choose_replica) and returns it: the vanished holder delays nothing.

One coordinator (sequential pull, B = 2 jobs per version, the tiny model) and two honest ``echo-swarm join``
clients; once both are measured, five phases: without the attacker, with it, without, with, without. Each phase is
the time the honest clients take for the next ``PER_PHASE`` accepted results (results counted, no wall-clock
window). A phase with the attacker starts once it holds leases and it asks throughout; after it, the attacker pauses
and every job it took is done before the next phase starts. The rate without it is its three phases' together, the
rate with it its two phases': a run whose versions grow slower or faster as it trains, or a machine whose load
drifts, moves both sides alike. The attacker loads no model and computes nothing. The per-address sign-up budget is
turned off (``limits.registrations_per_address_per_min = 0``, ``new_identities_per_min = 0``): everyone here
registers from 127.0.0.1, and the budget would otherwise ration the attacker to one identity every 2 s — the test
shows that replicas, not the budget, keep the honest rate.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tests.integration import helpers
from tests.integration.helpers import db_rows, wait_until

pytestmark = pytest.mark.slow

PER_PHASE = 50  # accepted honest results timed in each phase: 25 versions of B = 2
AT_ONCE = 4  # attacker identities asking for work at once


def _results(run_dir: Path) -> int:
    return int(db_rows(run_dir, "SELECT COUNT(*) FROM results")[0][0])


def _timed(run_dir: Path, n: int, what: str) -> tuple[float, int]:
    """Seconds until ``n`` more results are accepted, counted from the next one's arrival (so that a phase starts
    at a result, not at whatever moment the previous phase ended): (seconds, results at its start)."""
    start = _results(run_dir)
    first = wait_until(lambda: (r := _results(run_dir)) > start and r, 600, f"a result to start {what}")
    t0 = time.monotonic()
    wait_until(lambda: _results(run_dir) >= first + n, 900, f"{n} results of {what}")
    return time.monotonic() - t0, first


@pytest.mark.serial  # a rate comparison: `make test` runs it alone, after the parallel phase (0.79 against the bound
# 0.8 once, in the parallel phase beside benches at load 11; alone 1.03, two copies at once 1.00 and 1.02)
@pytest.mark.timeout(1500)
def test_fresh_identities_claiming_speed_leave_the_honest_rate(tmp_path: Path, tiny_model_dir: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = helpers.write_config(tmp_path / "run.toml", run_dir, tiny_model_dir, top={"sync_mode": "sequential-pull"},
                       learner={"max_steps": 100_000},
                       jobs={"lease_timeout_s": 120.0, "long_poll_s": 2.0},
                       limits={"registrations_per_address_per_min": 0, "new_identities_per_min": 0})
    coord, url = helpers.start_coordinator(cfg, tmp_path / "coord.log")
    honest = [helpers.start_client(url, tmp_path / f"honest{i}", tmp_path / f"honest{i}.log") for i in range(2)]
    stop, pause = tmp_path / "stop", tmp_path / "pause"
    pause.touch()  # the attacker starts paused: its start-up is in no phase
    attacker = helpers.Proc([sys.executable, "-m", "tests.adversarial.speed_adversary", "--url", url, "--home",
                     str(tmp_path / "adv"), "--out", str(tmp_path / "adv.json"), "--until", str(stop), "--pause",
                     str(pause), "--at-once", str(AT_ONCE)], tmp_path / "adv.log")
    without: list[float] = []
    with_attacker: list[float] = []
    during = 0
    try:
        # both honest clients measured: each has results accepted (its pace is its results', not its claim)
        wait_until(lambda: len(db_rows(run_dir, "SELECT DISTINCT client_id FROM results")) == 2 and
                   _results(run_dir) >= 6, 600, "both honest clients to have results accepted")
        honest_ids = {r[0] for r in db_rows(run_dir, "SELECT DISTINCT client_id FROM results")}
        marks = ",".join("?" * len(honest_ids))

        def sybil_leases() -> int:
            return int(db_rows(run_dir, f"SELECT COUNT(*) FROM jobs WHERE lease_client IS NOT NULL AND lease_client "
                                        f"NOT IN ({marks})", tuple(honest_ids))[0][0])

        for phase in range(5):
            if phase % 2 == 0:
                without.append(_timed(run_dir, PER_PHASE, f"phase {phase} (no attacker)")[0])
                continue
            wanted = sybil_leases() + AT_ONCE
            pause.unlink()
            wait_until(lambda: sybil_leases() >= wanted, 300, "the attacker to hold leases")  # noqa: B023
            at_start = sybil_leases()
            with_attacker.append(_timed(run_dir, PER_PHASE, f"phase {phase} (with the attacker)")[0])
            during += sybil_leases() - at_start
            pause.touch()
            wait_until(lambda: pause.with_name("pause.idle").exists(), 120, "the attacker to pause")
            wait_until(lambda: not db_rows(run_dir, f"SELECT job_id FROM jobs WHERE state='leased' AND lease_client "
                                                    f"NOT IN ({marks})", tuple(honest_ids)), 300,
                       "every job the attacker took to be done (its replicas returned)")
        stop.touch()
        rc = attacker.proc.wait(120)
        assert rc == 0, f"the attacker crashed (rc {rc}):\n{attacker.output()[-3000:]}"
        for p in honest:
            assert p.proc.poll() is None, f"an honest client died:\n{p.output()[-3000:]}"
        assert helpers.server_errors(url) == 0, "a request got a 5xx: see coord.log for the traceback"
    finally:
        stop.touch()
        for p in [attacker, *honest, coord]:
            p.stop()

    report = json.loads((tmp_path / "adv.json").read_text())
    per_min_without = len(without) * PER_PHASE / sum(without) * 60
    per_min_with = len(with_attacker) * PER_PHASE / sum(with_attacker) * 60
    replicas = db_rows(run_dir, "SELECT client_id FROM replica_leases")
    credited = db_rows(run_dir, "SELECT COUNT(*) FROM replica_results")[0][0]
    print(f"honest results per minute: {per_min_without:.1f} without the attacker (phases of {PER_PHASE}: "
          f"{', '.join(f'{t:.1f}' for t in without)} s), {per_min_with:.1f} with it "
          f"({', '.join(f'{t:.1f}' for t in with_attacker)} s); ratio {per_min_with / per_min_without:.2f}; attacker: "
          f"{len(report['leases'])} leases by {report['identities']} identities ({during} during its phases), "
          f"{len(report['refusals'])} refusals, {report['cpu_s']} CPU s; replicas given: {len(replicas)}, credited "
          f"second results: {credited}")
    # the attack was at work: its fresh identities took leases throughout the measured phase
    assert during >= PER_PHASE // 2, (during, report)
    # nothing it took was trained or credited: it returned nothing
    assert set(r[0] for r in db_rows(run_dir, "SELECT client_id FROM results")) <= honest_ids
    # its jobs were returned by the honest clients' replicas
    assert replicas and {r[0] for r in replicas} <= honest_ids
    # and the honest swarm kept its pace: within 20 % of the same run without the attacker
    assert per_min_with >= 0.8 * per_min_without, (per_min_with, per_min_without)
    # no honest result was refused
    refused = db_rows(run_dir, f"SELECT client_id, reason FROM rejections WHERE client_id IN ({marks})",
                      tuple(honest_ids))
    assert refused == [], refused
