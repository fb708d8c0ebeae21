"""Malicious and broken clients against a real coordinator, with honest volunteers working alongside.

One coordinator process (async push-pull, so several jobs are open at once), three honest `echo-swarm join`
processes (two torch, one llama.cpp: one check for every backend class), and one adversary process per kind
(tests/adversarial/adversary.py: its own Ed25519 identity, the production HTTP client and backend, one
corruption; the token-choice cheats also through llama.cpp identities, whose results the verifier recomputes with
llama.cpp on the job's own GGUF file). Each kind must be refused with its reason code; nothing an adversary sent may reach the training
data (result rows, learner batches); the honest clients must lose nothing (no refusals, no lost trust, still
earning credit) and the run must keep training.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from coordinator.config import LimitsConfig
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

Attempts = list[dict[str, Any]]
Report = dict[str, Any]
#: the run's per-address registration budget: the registration flood's 60 sign-ups from 127.0.0.1 meet it
REGISTRATION_BURST, REGISTRATIONS_PER_MIN = 40, 6.0


def _codes(attempts: Attempts) -> list[tuple[int, str | None]]:
    return [(a["status"], a["reason"]) for a in attempts]


def _all(status: int, reason: str, n: int) -> Callable[[Attempts], None]:
    def check(attempts: Attempts) -> None:
        assert _codes(attempts) == [(status, reason)] * n, attempts

    return check


def _exact(*codes: tuple[int, str | None]) -> Callable[[Attempts], None]:
    def check(attempts: Attempts) -> None:
        assert _codes(attempts) == list(codes), attempts

    return check


def _cheat(attempts: Attempts) -> None:
    """One cheating result, refused by the keyed check — unless its tokens are exactly the job's honest keyed sample
    (a near-deterministic policy: greedy and forced answers can coincide with it), which is honest work, accepted."""
    assert len(attempts) == 1, attempts
    want = (200, None) if attempts[0].get("same_as_honest") else (422, "choice_mismatch")
    assert _codes(attempts) == [want], attempts


def _llama_cheat(attempts: Attempts) -> None:
    """The same cheat through a llama.cpp identity: recomputed by llama.cpp on the job's GGUF, it is refused by the
    keyed check — or by the logprob check first, as its "true" logprobs are torch's, not the file's — unless its
    tokens are exactly the llama.cpp client's honest keyed sample."""
    assert len(attempts) == 1, attempts
    if attempts[0].get("same_as_honest"):
        assert _codes(attempts) == [(200, None)], attempts
    elif attempts[0].get("within_tolerance"):  # a torch sample whose every difference from the file's keyed choice
        # lies within 0.1 logit (docs/security.md §4): the keyed check passes it; the logprob check may not
        assert _codes(attempts) in ([(200, None)], [(422, "logprob_mismatch")]), attempts
    else:
        assert _codes(attempts) in ([(422, "choice_mismatch")], [(422, "logprob_mismatch")]), attempts


def _junk(attempts: Attempts) -> None:
    # junk tokens are far less likely than sampling makes them: the sampling test alone refuses them too, so which
    # of the two checks answers depends only on their order in the intake (through a llama.cpp identity their torch
    # logprobs may already differ from the GGUF's beyond the logprob check's tolerance)
    assert _codes(attempts) in ([(422, "choice_mismatch")], [(422, "sampling_mismatch")],
                                [(422, "logprob_mismatch")]), attempts


def _late(attempts: Attempts) -> None:
    # past its deadline the job is reissued; depending on how far the new holder got, the late result meets an
    # expired lease, someone else's lease or a completed job — refused every time
    (a,) = attempts
    assert (a["status"], a["reason"]) in {(410, "lease_expired"), (403, "not_lease_holder"), (409, "job_completed")}, a


def _thief(attempts: Attempts) -> None:
    # a result sent for another client's lease: not_lease_holder — or job_completed where the job was done first (the
    # holder is a fresh identity, so a measured honest client may hold a replica of its job and return it sooner)
    assert _codes(attempts) in ([(403, "not_lease_holder")], [(409, "job_completed")]), attempts


def _oversized(attempts: Attempts) -> None:
    first, second = attempts
    assert (first["status"], first["reason"]) == (413, "body_too_large"), first
    assert "limit" in first["message"]
    # the server answers 413 from Content-Length without reading the body; the client may see it or a reset
    assert (second["status"], second["reason"]) in {(413, "body_too_large"), (0, None)}, second


def _registration_flood(report: Report) -> None:
    attempts = report["attempts"]
    codes = _codes(attempts)
    ok = sum(1 for c in codes if c == (200, None))
    assert set(codes) <= {(200, None), (429, "rate_limited")}, codes
    # the address's burst, plus what refilled while the flood lasted (a loaded machine makes it last longer)
    allowed = REGISTRATION_BURST + REGISTRATIONS_PER_MIN / 60 * report["notes"]["flood_s"] + 1
    assert 1 <= ok <= allowed and (429, "rate_limited") in codes, (allowed, codes)
    assert "slow down" in next(a["message"] for a in attempts if a["status"] == 429)


def _request_flood(report: Report) -> None:
    # 300 requests at once: beyond the per-identity burst (the run's default limits, plus the refill while the
    # flood lasts: 0.3 s on a quiet machine, 0.6 s seen with two suites at once) they are refused with
    # rate_limited, and connections beyond server.max_connections_per_address are refused before any request is
    # read (status 0)
    codes = _codes(report["attempts"])
    assert set(codes) <= {(200, None), (429, "rate_limited"), (0, None)}, codes
    limits = LimitsConfig()
    allowed = limits.per_identity_burst + limits.per_identity_rps * report["notes"]["flood_s"] + 1
    assert codes.count((200, None)) <= allowed and (429, "rate_limited") in codes, (allowed, codes)


def _hoarder(attempts: Attempts) -> None:
    assert set(_codes(attempts)) == {(200, None)}, attempts
    assert sum(1 for a in attempts if a["what"].startswith("lease ")) == 10, attempts
    got = sum(1 for a in attempts if a.get("got_job"))
    assert 1 <= got <= 2, attempts  # limits.max_leases_per_client = 2: the rest of the queue stays available


def _admin(attempts: Attempts) -> None:
    assert len(attempts) == 10
    for a in attempts:  # refused without an operator key, before anything is read or changed
        if "signed with a volunteer's key" in a["what"]:
            assert (a["status"], a["reason"]) == (401, "not_admin"), a
        else:  # not even a signed envelope: refused as such
            assert (a["status"], a["reason"]) in {(401, "not_admin"), (422, "schema_invalid")}, a


def _sybil(attempts: Attempts) -> None:
    assert _codes(attempts) == [(422, "logprob_mismatch")] * 3 + [(403, "quarantined")], attempts
    assert "in a row" in attempts[-1]["message"]


def _of_attempts(check: Callable[[Attempts], None]) -> Callable[[Report], None]:
    def of_report(report: Report) -> None:
        check(report["attempts"])

    return of_report


ATTEMPT_CHECKS: dict[str, Callable[[Attempts], None]] = {
    "forged_signature": _all(401, "bad_signature", 2),
    "replayed_result": _exact((200, None), (409, "replayed_nonce")),
    "other_clients_lease": _thief,
    "late_result": _late,
    "wrong_version": _all(409, "wrong_version", 1),
    "inflated_reward": _all(422, "schema_invalid", 1),
    "fabricated_logprobs": _all(422, "logprob_mismatch", 1),
    "other_model": _all(422, "logprob_mismatch", 1),
    "truncated_output": _all(422, "finish_reason_inconsistent", 1),
    "padded_output": _all(422, "token_out_of_range", 1),
    "oversized_body": _oversized,
    "malformed_msgpack": _all(400, "malformed", 4),
    "unauthenticated_admin": _admin,
    "sybil_rotation": _sybil,
    "lease_hoarder": _hoarder,
    # real policy tokens (or chosen ones) with their true logprobs: the logprob check passes, and the keyed sampler's
    # per-token check refuses them at once — the attacks the spot-checks used to catch afterwards, if at all
    "own_seed": _cheat,
    "forced_correct": _cheat,
    "best_of_16": _cheat,
    "topk_steer": _cheat,
    "greedy": _cheat,
    "junk": _junk,
    # the same through llama.cpp identities (issue 36: recomputed by llama.cpp on the job's own GGUF at 0.1 logit),
    # and a torch client's sample sent as a llama.cpp one (class shopping)
    "llama_greedy": _llama_cheat,
    "llama_forced_correct": _llama_cheat,
    "llama_best_of_16": _llama_cheat,
    "llama_topk_steer": _llama_cheat,
    "llama_junk": _junk,
    "llama_torch_sample": _llama_cheat,
}
#: Each kind's check of its report (what each attempt got back, and the adversary's notes)
EXPECTED: dict[str, Callable[[Report], None]] = {
    **{kind: _of_attempts(check) for kind, check in ATTEMPT_CHECKS.items()},
    "request_flood": _request_flood,
    "registration_flood": _registration_flood,  # last: it spends the address's registration budget
}


def _honest_refusals(run_dir: Path, client_id: str, logs: dict[int, str]) -> str:
    """What an honest client had refused, in enough detail to tell why from a CI log alone: the client's backend,
    each refusal's version and message (its logprob or margin figures), and the lines of the clients' own logs
    that name the refused job (which version each loaded, what it fetched)."""
    (profile,), = db_rows(run_dir, "SELECT profile FROM clients WHERE client_id=?", (client_id,))
    rows = db_rows(run_dir, "SELECT job_id, version, reason, detail FROM audit WHERE client_id=? AND "
                            "outcome='rejected'", (client_id,))
    out = [f"honest client {client_id[:8]} ({json.loads(profile)['backend']}) was refused:"]
    for job_id, version, reason, detail in rows:
        out.append(f"  {job_id} at version {version}: {reason}: {detail}")
        for k, text in logs.items():
            out.extend(f"    honest{k}.log: {line}" for line in text.splitlines()
                       if job_id and re.search(rf"\b{re.escape(job_id)}\b", line))
    return "\n".join(out)


def _run_adversary(kind: str, url: str, tmp: Path) -> Report:
    out = tmp / f"{kind}.json"
    proc = Proc([sys.executable, "-m", "tests.adversarial.adversary", kind, "--url", url, "--home",
                 str(tmp / f"adv-{kind}"), "--out", str(out)], tmp / f"adv-{kind}.log")
    rc = proc.proc.wait(300)
    proc.stop()
    assert rc == 0 and out.exists(), f"adversary {kind} crashed (rc {rc}):\n{proc.output()[-3000:]}"
    report: dict[str, Any] = json.loads(out.read_text())
    return report


# its own hang guard, with room for a loaded machine: 195 s in CI, but `make test-twice` on a busy 2-core machine had
# run 20 of its 23 attackers (~100 s each, four at a time) when the suite's 600-s timeout stopped it, in both copies
@pytest.mark.timeout(1800)
def test_adversaries_are_refused_and_honest_clients_lose_nothing(tmp_path: Path, tiny_model_dir: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = write_config(
        tmp_path / "run.toml", run_dir, tiny_model_dir, top={"sync_mode": "async-push-pull", "max_staleness": 2},
        learner={"max_steps": 5000}, jobs={"lease_timeout_s": 20.0, "long_poll_s": 1.0},
        limits={"registration_burst": REGISTRATION_BURST, "registrations_per_address_per_min": REGISTRATIONS_PER_MIN},
        trust={"quarantine_s": 3600.0})
    coord, url = start_coordinator(cfg, tmp_path / "coord.log")
    honest = [start_client(url, tmp_path / f"honest{k}", tmp_path / f"honest{k}.log", "--backend", backend)
              for k, backend in enumerate(("torch", "torch", "llama"))]
    reports: dict[str, dict[str, Any]] = {}
    try:
        wait_until(lambda: (s := get_status(url)) and s["version"] >= 1, 240, "honest clients to train a version")
        # three kinds run alone afterwards. The two floods: every process here shares 127.0.0.1, and a flood of
        # connections from one address is refused by the per-address connection cap, whoever else is on that
        # address. The hoarder: a new identity gets its first job only while no other identity of unknown pace holds
        # a lease (docs/protocol.md §4), and among the other attackers it drew lots for that turn with every new
        # one (CI at 4bd8ead: no job in two minutes); alone, it waits at most for the last attacker's lease to end
        alone = ("lease_hoarder", "request_flood", "registration_flood")
        kinds = [k for k in EXPECTED if k not in alone]
        with ThreadPoolExecutor(max_workers=4) as pool:
            for report in pool.map(lambda k: _run_adversary(k, url, tmp_path), kinds):
                reports[report["kind"]] = report
        for kind in alone:
            reports[kind] = _run_adversary(kind, url, tmp_path)
        version_after_attacks = (get_status(url) or {})["version"]
        wait_until(lambda: (s := get_status(url)) and s["version"] >= version_after_attacks + 2, 240,
                   "training to go on after the attacks")
        for p in honest:
            assert p.proc.poll() is None, f"an honest client died:\n{p.output()[-3000:]}"
        # no attack found an unexpected error: every bad input got its typed 4xx (issue 24)
        assert server_errors(url) == 0, "a request got a 5xx: see coord.log for the traceback"
    finally:
        for p in (*honest, coord):
            p.stop()

    failures = []
    for kind, check in EXPECTED.items():
        report = reports[kind]
        try:
            assert report["error"] is None, report["error"]
            check(report)
        except AssertionError as exc:
            failures.append(f"{kind}: {exc}")
    assert not failures, "\n".join(failures)

    # no effect on training data: no adversary result row, no adversary sample in any learner batch
    honest_ids = {r[0] for r in db_rows(run_dir, "SELECT client_id FROM clients WHERE profile NOT LIKE '%adversary%' "
                                                 "AND profile NOT LIKE '%sybil%'")}
    assert len(honest_ids) == 3
    replayer = reports["replayed_result"]["identities"][0]
    # a "cheat" whose tokens were exactly the honest keyed sample is honest work: its one result may stand
    coincided = {cid for r in reports.values() if any(a.get("same_as_honest") for a in r["attempts"])
                 for cid in r["identities"]}
    print(f"cheats identical to the honest keyed sample (accepted as honest work): "
          f"{sorted(k for k, r in reports.items() if any(a.get('same_as_honest') for a in r['attempts']))}")
    for kind, report in reports.items():
        for cid in report["identities"]:
            # an accepted result is the job's trained one, or the second of a replicated job (credited, not trained:
            # an honest replica holder may have returned the same keyed sample first)
            rows = db_rows(run_dir, "SELECT job_id FROM results WHERE client_id=? UNION ALL "
                                    "SELECT job_id FROM replica_results WHERE client_id=?", (cid, cid))
            assert len(rows) == (1 if cid == replayer or cid in coincided else 0), (kind, rows)
    trained = {r[0] for r in db_rows(run_dir, "SELECT client_id FROM results WHERE ingested_step IS NOT NULL")}
    assert trained <= honest_ids | {replayer} | coincided
    for (step, n) in db_rows(run_dir, "SELECT ingested_step, COUNT(*) FROM results WHERE ingested_step IS NOT NULL "
                                      "GROUP BY ingested_step"):
        assert n == 2, (step, n)  # every learner batch complete: B = 2 jobs

    # every refusal is in the audit log with its reason and the content hash of what was sent
    audited = db_rows(run_dir, "SELECT reason FROM audit WHERE outcome='rejected'")
    for reason in ("bad_signature",):
        assert (reason,) not in audited  # unauthenticated requests never reach the log: nothing is written
    answered = {a["reason"] for r in reports.values() for a in r["attempts"]}
    for reason in ("logprob_mismatch", "choice_mismatch", "wrong_version", "finish_reason_inconsistent",
                   "token_out_of_range", "schema_invalid", "malformed"):
        assert reason in answered and (reason,) in audited, reason
    (thief,) = reports["other_clients_lease"]["attempts"]  # not_lease_holder or job_completed (_thief)
    assert (thief["reason"],) in audited, (thief, audited)

    # honest clients lose nothing: no refusal for cause, trust intact, credit earned
    logs = {k: p.output() for k, p in enumerate(honest)}
    for cid in honest_ids:
        reasons = db_rows(run_dir, "SELECT reason FROM rejections WHERE client_id=?", (cid,))
        assert not [r for (r,) in reasons if r not in ("lease_expired", "not_lease_holder", "job_completed")], (
            _honest_refusals(run_dir, cid, logs))
        (credit, accepted), = db_rows(run_dir, "SELECT credit, accepted FROM clients WHERE client_id=?", (cid,))
        assert credit > 0 and accepted > 0
        for (cv, ci, q) in db_rows(run_dir, "SELECT consecutive_valid, consecutive_invalid, quarantines FROM trust "
                                            "WHERE client_id=?", (cid,)):
            assert ci == 0 and q == 0 and cv > 0
        invalidated = db_rows(run_dir, "SELECT job_id FROM audit WHERE client_id=? AND outcome LIKE 'invalidated%'",
                              (cid,))
        assert not invalidated

    # each token-choice cheat was refused on arrival: never accepted, never held, never trained, no credit
    for kind in ("own_seed", "forced_correct", "best_of_16", "topk_steer", "greedy", "junk", "llama_greedy",
                 "llama_forced_correct", "llama_best_of_16", "llama_topk_steer", "llama_junk", "llama_torch_sample"):
        (cheat,) = reports[kind]["identities"]
        if cheat in coincided:  # honest work after all (its tokens were the keyed sample): accepted, credited
            continue
        outcomes = db_rows(run_dir, "SELECT outcome, reason FROM audit WHERE client_id=?", (cheat,))
        assert outcomes == [("rejected", reports[kind]["attempts"][0]["reason"])], (kind, outcomes)
        assert db_rows(run_dir, "SELECT credit FROM clients WHERE client_id=?", (cheat,)) == [(0.0,)], kind

    # sybils gain nothing: the quarantine stands, and the rotated key starts untrusted with no credit
    old, new = reports["sybil_rotation"]["identities"]
    (until,), = db_rows(run_dir, "SELECT MAX(quarantined_until) FROM trust WHERE client_id=?", (old,))
    assert until > time.time() + 3000
    assert db_rows(run_dir, "SELECT consecutive_valid FROM trust WHERE client_id=? AND consecutive_valid > 0",
                   (new,)) == []
    assert db_rows(run_dir, "SELECT credit FROM clients WHERE client_id=?", (new,)) == [(0.0,)]
    # unauthenticated admin calls changed nothing
    assert db_rows(run_dir, "SELECT COUNT(*) FROM clients WHERE banned=1") == [(0,)]
