"""The trust boundary's core promise, against claims it must not believe (issue 13): nothing fabricated
reaches a training batch, and every honest result is accepted.

One coordinator process (async push-pull, GGUFs published at q8_0 so llama.cpp's tolerance is the loosest
there is) and two honest `echo-swarm join` torch processes serve every test; each test id runs one attacker as
its own process (tests/adversarial/adversary.py) beside them, then checks the store: no result row of the
attacker's identities was ever ingested by a learner step, the attacker earned nothing, and the honest
clients lost nothing (no refusal for cause, nothing invalidated or dropped, credit and trust still growing).
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.integration.helpers import (
    Proc,
    db_rows,
    get_status,
    server_errors,
    start_client,
    start_coordinator,
    wait_until,
    write_config,
)

pytestmark = pytest.mark.slow

BENIGN = ("lease_expired", "not_lease_holder", "job_completed")  # bad luck, not evidence against a result
RATE_STEPS = 96  # learner steps timed in each phase of the idle-sybil measurement (~0.14 s a step: 6 steps were under a second, where one slow step decided the 10 %; 48 steps, ~7 s a phase, still measured one 12 % phase in a full run)


@dataclass
class Swarm:
    url: str
    run_dir: Path
    tmp: Path
    honest: list[Proc]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Swarm]:
    tmp = tmp_path_factory.mktemp("trust")
    run_dir = tmp / "run"
    cfg = write_config(
        tmp / "run.toml", run_dir, tiny_model_dir, top={"sync_mode": "async-push-pull", "max_staleness": 2},
        learner={"max_steps": 100_000}, jobs={"lease_timeout_s": 20.0, "long_poll_s": 1.0},
        snapshots={"gguf": "q8_0"}, trust={"quarantine_s": 3600.0})
    coord, url = start_coordinator(cfg, tmp / "coord.log")
    honest = [start_client(url, tmp / f"honest{k}", tmp / f"honest{k}.log", "--backend", "torch") for k in range(2)]
    try:
        # Both honest clients must have registered and had a result accepted before any attack: async push-pull
        # can reach version 2 on one client's results while the other is still loading its model.
        wait_until(lambda: (s := get_status(url)) and s["version"] >= 2 and len(db_rows(
            run_dir, "SELECT client_id FROM clients WHERE accepted > 0")) == 2, 240, "both honest clients to train")
        yield Swarm(url, run_dir, tmp, honest)
    finally:
        for p in (*honest, coord):
            p.stop()


def attack(swarm: Swarm, kind: str, seconds: float | None = None) -> dict[str, Any]:
    out = swarm.tmp / f"{kind}.json"
    extra = ["--seconds", str(seconds)] if seconds is not None else []
    proc = Proc([sys.executable, "-m", "tests.adversarial.adversary", kind, "--url", swarm.url, "--home",
                 str(swarm.tmp / f"adv-{kind}"), "--out", str(out), *extra], swarm.tmp / f"adv-{kind}.log")
    rc = proc.proc.wait(300)
    proc.stop()
    assert rc == 0 and out.exists(), f"adversary {kind} crashed (rc {rc}):\n{proc.output()[-3000:]}"
    report: dict[str, Any] = json.loads(out.read_text())
    assert report["error"] is None, report["error"]
    return report


def codes(report: dict[str, Any]) -> list[tuple[int, str | None]]:
    return [(a["status"], a["reason"]) for a in report["attempts"]]


def honest_ids(swarm: Swarm) -> set[str]:
    ids = {r[0] for r in db_rows(swarm.run_dir, "SELECT client_id FROM clients WHERE profile NOT LIKE '%adversary%'")}
    assert len(ids) == 2, ids
    return ids


def nothing_trained_or_earned(swarm: Swarm, report: dict[str, Any]) -> None:
    """No result of the attacker's identities was ever in a learner batch, none is waiting to be, and none of
    them holds credit or trust."""
    for cid in report["identities"]:
        trained = db_rows(swarm.run_dir, "SELECT job_id, ingested_step FROM results WHERE client_id=? AND "
                                         "ingested_step IS NOT NULL", (cid,))
        assert trained == [], (report["kind"], cid, trained)
        buffered = db_rows(swarm.run_dir, "SELECT job_id FROM results WHERE client_id=?", (cid,))
        assert buffered == [], (report["kind"], cid, buffered)
        assert db_rows(swarm.run_dir, "SELECT credit FROM clients WHERE client_id=? AND credit != 0", (cid,)) == []
        assert db_rows(swarm.run_dir, "SELECT valid_total FROM trust WHERE client_id=? AND valid_total > 0",
                       (cid,)) == []


def honest_lose_nothing(swarm: Swarm) -> None:
    for p in swarm.honest:
        assert p.proc.poll() is None, f"an honest client died:\n{p.output()[-3000:]}"
    for cid in honest_ids(swarm):
        reasons = [r for (r,) in db_rows(swarm.run_dir, "SELECT reason FROM rejections WHERE client_id=?", (cid,))]
        assert [r for r in reasons if r not in BENIGN] == [], reasons
        taken_back = db_rows(swarm.run_dir, "SELECT job_id, outcome FROM audit WHERE client_id=? AND (outcome LIKE "
                                            "'invalidated%' OR outcome LIKE 'dropped%')", (cid,))
        assert taken_back == [], taken_back
        (credit, accepted), = db_rows(swarm.run_dir, "SELECT credit, accepted FROM clients WHERE client_id=?", (cid,))
        assert credit > 0 and accepted > 0
        (valid, bad, quarantines), = db_rows(swarm.run_dir, "SELECT SUM(valid_total), SUM(consecutive_invalid), "
                                                            "SUM(quarantines) FROM trust WHERE client_id=?", (cid,))
        assert valid > 0 and bad == 0 and quarantines == 0


def judged(swarm: Swarm, cid: str) -> list[tuple[Any, ...]]:
    return db_rows(swarm.run_dir, "SELECT outcome, reason FROM audit WHERE client_id=? AND outcome != 'accepted'",
                   (cid,))


def test_unknown_device_claim_is_refused_and_writes_nothing(swarm: Swarm) -> None:
    report = attack(swarm, "unknown_device")
    assert codes(report) == [(422, "schema_invalid")] * 3, report["attempts"]
    assert all("not a backend class" in a["message"] and "torch on cpu, cuda, mps" in a["message"]
               for a in report["attempts"])
    for cid in report["identities"]:
        assert db_rows(swarm.run_dir, "SELECT client_id FROM clients WHERE client_id=?", (cid,)) == []
    honest_lose_nothing(swarm)


@pytest.mark.parametrize("kind", ["sybil_confirms", "accomplice_junk", "accomplice_sits"])
def test_a_cherry_pick_is_refused_on_arrival_whatever_an_accomplice_does(swarm: Swarm, kind: str) -> None:
    """A cherry-picked original (real policy tokens with their true logprobs, drawn with another seed) and an
    accomplice identity hunting for a job linked to it by seed or prompts, to confirm it, spoil it with junk from
    another class, or sit on it — the attacks on the spot-check era's replicas. The keyed sampler's per-token
    check refuses the original at once (choice_mismatch), before anything could be confirmed or held; there is no
    linked job for the accomplice to find."""
    report = attack(swarm, kind)
    original, accomplice = report["identities"]
    assert codes(report) == [(422, "choice_mismatch")], report["attempts"]
    assert report["notes"]["offered"] >= 1  # the accomplice was handed work (and released it)...
    assert report["notes"]["recognised"] == 0  # ...but never anything it could link to its partner's job
    assert judged(swarm, original) == [("rejected", "choice_mismatch")]
    (quarantine_streak,), = db_rows(swarm.run_dir, "SELECT consecutive_invalid FROM trust WHERE client_id=?",
                                    (original,))
    assert quarantine_streak == 1
    assert judged(swarm, accomplice) == []  # nothing of its was refused: it only released what it was offered
    nothing_trained_or_earned(swarm, report)
    honest_lose_nothing(swarm)


@pytest.mark.parametrize("kind", ["quarantine_backend_claim", "quarantine_reregister"])
def test_quarantine_holds_across_claimed_backends_and_re_registration(swarm: Swarm, kind: str) -> None:
    report = attack(swarm, kind)
    earned = [(422, "logprob_mismatch")] * 3
    if kind == "quarantine_backend_claim":
        assert codes(report) == earned + [(403, "quarantined")] * 3, report["attempts"]
    else:
        assert codes(report) == earned + [(422, "schema_invalid"), (422, "schema_invalid"), (200, None),
                                          (403, "quarantined")], report["attempts"]
        assert "pinned to backend class torch/cpu" in report["attempts"][3]["message"]
    (cid,) = report["identities"]
    assert db_rows(swarm.run_dir, "SELECT backend_class FROM clients WHERE client_id=?", (cid,)) == [("torch/cpu",)]
    (until,), = db_rows(swarm.run_dir, "SELECT MAX(quarantined_until) FROM trust WHERE client_id=?", (cid,))
    assert until > time.time() + 3000
    nothing_trained_or_earned(swarm, report)
    honest_lose_nothing(swarm)


def test_tolerance_is_the_pinned_class_not_the_result_claim(swarm: Swarm) -> None:
    """Under snapshots.gguf = q8_0 a llama.cpp result may be off by 4.0 nats on one token, a torch one by 1.0:
    a torch identity claiming llama in its result is refused for the claim, and judged at torch's tolerance."""
    report = attack(swarm, "tolerance_escape")
    assert codes(report) == [(422, "binding_mismatch"), (422, "logprob_mismatch")], report["attempts"]
    assert "registered as torch/cpu" in report["attempts"][0]["message"]
    nothing_trained_or_earned(swarm, report)
    honest_lose_nothing(swarm)


@pytest.mark.serial  # a rate comparison: `make test` runs it alone, after the parallel phase
def test_an_idle_sybil_does_not_slow_training(swarm: Swarm) -> None:
    """RATE_STEPS learner steps without the sybil (an identity that only sends signed requests), with it, and
    without it again: the middle phase's typical step — the median of its steps' durations, from the store's step
    times — takes at most 20 % longer than the slower of the two others', and the whole phase at most 25 % longer
    (a sybil that stalled steps now and then). On this 2-core box, where the learner, the verifier, the API and
    two clients already share the cores, the sybil's 4 signed requests a second cost the typical step 0–10 % in
    runs that all passed a 10 % bound by luck or not (totals with the sybil ÷ without: 0.90, 0.94, 0.98, 1.03,
    1.09, 1.11); what this test exists to catch — a request path that stalls the learner (an fsync shared with its
    commits, a lock, a scan per identity) — cost several times that. Whole steps, from one version change to
    another: counting steps in fixed windows read a one-step difference as 14 %."""

    def seconds_for_steps() -> tuple[float, float, float]:
        """Wall-clock start, length and median step duration of RATE_STEPS steps, from the next version change on."""
        def version() -> int:  # /healthz: cheap, and not under the status page's per-address read limit
            with urllib.request.urlopen(swarm.url + "/healthz", timeout=10) as resp:
                return int(json.loads(resp.read())["version"])

        start = version()
        first = wait_until(lambda: (v := version()) > start and v, 120, "a learner step", interval=0.1)
        t0, w0 = time.monotonic(), time.time()
        wait_until(lambda: version() >= first + RATE_STEPS, 60 * RATE_STEPS, f"{RATE_STEPS} learner steps",
                   interval=0.1)
        at = [float(a) for (a,) in db_rows(swarm.run_dir, "SELECT at FROM steps WHERE step > ? AND step <= ? "
                                                           "ORDER BY step", (first, first + RATE_STEPS))]
        return w0, time.monotonic() - t0, statistics.median(b - a for a, b in itertools.pairwise(at))

    _, before, before_step = seconds_for_steps()
    started = time.time()
    out, stop = swarm.tmp / "idle_sybil.json", swarm.tmp / "idle_sybil.stop"
    proc = Proc([sys.executable, "-m", "tests.adversarial.adversary", "idle_sybil", "--url", swarm.url, "--home",
                 str(swarm.tmp / "adv-idle_sybil"), "--out", str(out), "--seconds", "900", "--until", str(stop)],
                swarm.tmp / "adv-idle_sybil.log")
    try:
        wait_until(lambda: db_rows(swarm.run_dir, "SELECT client_id FROM clients WHERE profile LIKE "
                                                  "'%adversary-a%' AND registered_at >= ?", (started,)),
                   120, "the sybil to register and start sending requests")
        measured_from, during, during_step = seconds_for_steps()
        measured_to = time.time()
        stop.touch()
        assert proc.proc.wait(120) == 0, proc.output()[-3000:]
    finally:
        proc.stop()
    report = json.loads(out.read_text())
    _, after, after_step = seconds_for_steps()
    print(f"seconds for {RATE_STEPS} steps: before {before:.1f}, with the idle sybil {during:.1f}, after {after:.1f}; "
          f"median step {before_step:.3f} / {during_step:.3f} / {after_step:.3f} s")
    notes = report["notes"]
    assert report["error"] is None
    # the sybil was at work throughout the middle phase, at least a request a second (it sends 4)
    assert notes["first_at"] <= measured_from and notes["last_at"] >= measured_to, (notes, measured_from, measured_to)
    assert notes["requests"] >= notes["last_at"] - notes["first_at"], notes
    assert set(codes(report)) == {(200, None)}  # it was served: every request valid, it simply never worked
    assert during_step <= 1.2 * max(before_step, after_step), (before_step, during_step, after_step)
    assert during <= 1.25 * max(before, after), (before, during, after)
    nothing_trained_or_earned(swarm, report)
    honest_lose_nothing(swarm)


def test_no_attack_in_this_module_met_a_server_error(swarm: Swarm) -> None:
    """Last in the module (pytest runs a file's tests in order): across every attack above, the coordinator
    answered each bad input with its typed 4xx, never a 5xx (issue 24: /metrics counts every reply by status)."""
    assert server_errors(swarm.url) == 0, "a request got a 5xx: see coord.log for the traceback"
