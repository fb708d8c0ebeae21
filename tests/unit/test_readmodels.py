"""coordinator/store/readmodels.py against a real store (SQLite and PostgreSQL): the audit view merges results and refusals, or reads
a dedicated audit log where the coordinator keeps one; trust standings are attached where they exist."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.core.jobs import plan_job
from coordinator.store import readmodels
from coordinator.store.store import Store

T0 = 1000.0
ALICE = "a" * 32
PROFILE = {"name": "alice", "backend": "torch", "device": "cpu", "platform": "Linux x86_64", "cpu_count": 4,
           "memory_gb": 8.0, "software": "t"}


@pytest.fixture()
def store(store_target: str | Path) -> Iterator[Store]:
    s = Store(store_target)
    s.clients.register(ALICE, b"k" * 32, PROFILE, T0)
    plan = plan_job(0, 0, 100, 2)
    s.jobs.create(plan, 4, T0)
    s.jobs.lease(plan.job_id, "lease", ALICE, T0 + 60, 0, T0)
    s.results.accept(job_id=plan.job_id, lease_id="lease", client_id=ALICE, version=0, content_sha256="1" * 64,
                     payload=b"", rewards=[1.0, 0.0], n_tokens=10, credit=10.0, now=T0 + 5)
    s.results.record_rejection(ALICE, "other-job", "logprob_mismatch", "logprobs disagree", "2" * 64, T0 + 9)
    yield s
    s.close()


def test_audit_reads_the_log_written_with_each_outcome_newest_first(store: Store) -> None:
    entries = readmodels.audit(store)
    assert [(e["outcome"], e["reason"], e["content_sha256"][0]) for e in entries] == [
        ("rejected", "logprob_mismatch", "2"), ("accepted", "ok", "1")]
    assert entries[1]["job_id"] == "j0" and entries[1]["version"] == 0
    assert readmodels.audit(store, outcome="accepted", limit=5)[0]["outcome"] == "accepted"
    assert readmodels.audit(store, job_id="other-job")[0]["reason"] == "logprob_mismatch"
    assert readmodels.audit(store, client_id="b" * 32) == []


def test_refusal_outcomes_and_trust_standings_are_reported(store: Store) -> None:
    store.conn.execute("DELETE FROM audit")
    store.conn.execute("INSERT INTO audit(at, client_id, job_id, version, outcome, reason, content_sha256) "
                       "VALUES(?,?,?,?,?,?,?)", (T0 + 20, ALICE, "j-r", 0, "rejected", "choice_mismatch", "3" * 64))
    store.conn.execute("INSERT INTO trust(client_id, backend_class, valid_total, invalid_total, quarantined_until) "
                       "VALUES(?,?,?,?,?)", (ALICE, "torch-cpu", 7, 2, T0 + 100))
    (entry,) = readmodels.audit(store)
    assert (entry["outcome"], entry["reason"], entry["job_id"]) == ("rejected", "choice_mismatch", "j-r")
    assert readmodels.audit(store, outcome="accepted") == []
    (row,) = readmodels.clients(store, T0 + 50, 30.0)
    assert row["trust"]["valid"] == 7 and row["trust"]["invalid"] == 2 and row["trust"]["quarantined"] is True
    assert readmodels.clients(store, T0 + 500, 30.0)[0]["trust"]["quarantined"] is False


def test_client_views(store: Store) -> None:
    (row,) = readmodels.clients(store, T0 + 10, 30.0)
    assert (row["name"], row["backend"], row["platform"], row["state"], row["credit"]) == (
        "alice", "torch", "Linux x86_64", "active", 10.0)
    assert "public_key" not in row and "profile" not in row
    summary = readmodels.client_summary(readmodels.client_states(store, T0 + 10, 30.0))
    assert summary["by_state"]["active"] == 1 and summary["active_by_backend"] == {"torch": 1}
    assert readmodels.client_summary(readmodels.client_states(store, T0 + 1000, 30.0))["by_state"]["idle"] == 1
    store.clients.set_banned(ALICE, True)
    assert readmodels.top_clients(store, T0, 30.0) == []


def test_teams_add_up_their_members_and_leave_out_the_banned_and_the_teamless(store: Store) -> None:
    """readmodels.teams: grouped by the exact name, best credit first; a banned member counts for nobody, a volunteer
    without a team is on no team's row (and a profile from before the field has none)."""
    assert readmodels.teams(store) == []  # alice's profile names no team
    bob, eve, mal = "b" * 32, "e" * 32, "f" * 32
    for cid, team in ((bob, "red"), (eve, "blue"), (mal, "blue"), (ALICE, "blue")):
        store.clients.register(cid, cid[:1].encode() * 32, PROFILE | {"name": cid[:3], "team": team}, T0 + 1)
    store.conn.execute("UPDATE clients SET accepted = 3, credit = 30.0 WHERE client_id = ?", (bob,))
    store.conn.execute("UPDATE clients SET accepted = 2, credit = 12.5 WHERE client_id = ?", (eve,))
    store.conn.execute("UPDATE clients SET accepted = 9, credit = 90.0 WHERE client_id = ?", (mal,))
    store.clients.set_banned(mal, True)
    assert readmodels.teams(store) == [
        {"rank": 1, "team": "red", "members": 1, "accepted": 3, "credit": 30.0},
        {"rank": 2, "team": "blue", "members": 2, "accepted": 3, "credit": 22.5},  # eve and alice (1 result, 10.0)
    ]
    assert readmodels.teams(store, top=1)[0]["team"] == "red"
    assert {r["name"]: r["team"] for r in readmodels.top_clients(store, T0 + 10, 30.0)} == {
        "bbb": "red", "eee": "blue", "aaa": "blue"}


def test_the_operators_and_the_volunteers_views_show_reporting(store: Store) -> None:
    """What the keyed sampler cannot see, per client: leases not returned and the returned rewards against the
    other volunteers' at the same versions (coordinator.core.reporting) — in the admin listing and the
    volunteer page, both from the same figures."""
    bob = "b" * 32
    store.clients.register(bob, b"k" * 32, PROFILE | {"name": "bob"}, T0)
    for k in range(1, 6):  # bob: five results at version 0, all rewarded 0.0; alice's one scored 0.5
        plan = plan_job(0, k, 100, 2)
        store.jobs.create(plan, 4, T0)
        assert store.jobs.lease(plan.job_id, f"L{k}", bob, T0 + 60, 0, T0)
        assert store.results.accept(job_id=plan.job_id, lease_id=f"L{k}", client_id=bob, version=0,
                                    content_sha256="3" * 64, payload=b"", rewards=[0.0, 0.0], n_tokens=4, credit=4.0,
                                    now=T0 + 6)
    plan = plan_job(0, 9, 100, 2)
    store.jobs.create(plan, 4, T0)
    assert store.jobs.lease(plan.job_id, "L9", ALICE, T0 + 60, 0, T0) and store.jobs.release(plan.job_id, "L9", ALICE)
    rows = {r["client_id"]: r["reporting"] for r in readmodels.clients(store, T0 + 10, 30.0, reporting=True)}
    assert (rows[ALICE]["leased"], rows[ALICE]["unreturned"], rows[ALICE]["unreturned_share"]) == (2, 1, 0.5)
    assert rows[ALICE]["results_compared"] == 1 and rows[ALICE]["reward_excess"] == pytest.approx(0.5)
    assert rows[ALICE]["reward_z"] > 4  # one result against five alike: the variance floor keeps it finite
    assert rows[bob]["results_compared"] == 0  # only one other result at its version: too few to compare
    me = readmodels.volunteer(store, ALICE, T0 + 10, 30.0)
    assert me is not None and me["reporting"] == rows[ALICE]
    assert "reporting" not in readmodels.clients(store, T0 + 10, 30.0)[0]  # the public listings skip the query
    assert (rows[ALICE]["dropped_compared"], rows[ALICE]["dropped_z"]) == (0, 0.0)  # its drop: nobody returned it
    # bob returns the job alice dropped, at the version she held it: what she dropped is now seen
    assert store.jobs.lease(plan.job_id, "L9b", bob, T0 + 60, 0, T0)
    assert store.results.accept(job_id=plan.job_id, lease_id="L9b", client_id=bob, version=0, content_sha256="4" * 64,
                                payload=b"", rewards=[0.0, 0.0], n_tokens=4, credit=4.0, now=T0 + 7)
    rows = {r["client_id"]: r["reporting"] for r in readmodels.clients(store, T0 + 10, 30.0, reporting=True)}
    assert rows[ALICE]["dropped_compared"] == 1 and rows[ALICE]["dropped_excess"] == pytest.approx(0.5)
    assert rows[bob]["dropped_compared"] == 0
    assert readmodels.volunteer(store, ALICE, T0 + 10, 30.0)["reporting"] == rows[ALICE]  # type: ignore[index]


def test_aggregates_read_alike_on_both_engines(store: Store) -> None:
    """The grouped and summed views (throughput buckets, staleness, totals) give ints and floats, not Decimals,
    and the same numbers on SQLite and PostgreSQL."""
    store.versions.publish_initial("m" * 64, T0)
    store.steps.commit(step=1, trained_version=0, job_ids=["j0"], new_version=1, manifest_sha="n" * 64,
                       mean_reward=0.5, metrics={"step_s": 1.0}, now=T0 + 20)
    series = readmodels.throughput(store, T0, T0 + 60, bins=6)
    assert sum(b["results_per_min"] for b in series) > 0
    assert readmodels.trained_staleness(store) == {0: 1}
    totals = readmodels.result_totals(store)
    assert totals == {"accepted": 1, "tokens": 10, "too_stale": 0}
    assert all(type(v) is int for v in totals.values())
    assert readmodels.rejection_counts(store) == {"logprob_mismatch": 1}


def test_reward_means_are_each_rewards_series_by_step(store: Store) -> None:
    assert readmodels.reward_means(store) == {}  # no step yet
    for step, means in [(1, {"last_number": 0.25, "plug:f": 1.0}), (2, None), (3, {"last_number": 0.5, "plug:f": 0.0})]:
        metrics = {"step_s": 0.1} | ({"reward_means": means} if means else {})
        store.steps.commit(step=step, trained_version=step - 1, job_ids=[], new_version=step, manifest_sha="m" * 64,
                           mean_reward=0.5, metrics=metrics, now=T0 + step)
    assert readmodels.reward_means(store) == {"last_number": [[1, 0.25], [3, 0.5]], "plug:f": [[1, 1.0], [3, 0.0]]}


def test_volunteers_are_found_by_name_or_id_prefix_and_shown(store: Store) -> None:
    bob, eve = "b" * 32, "e" * 32
    store.clients.register(bob, b"b" * 32, PROFILE | {"name": "Bob_100%"}, T0 + 1)
    store.clients.register(eve, b"e" * 32, PROFILE | {"name": "eve"}, T0 + 2)
    store.conn.execute("UPDATE clients SET banned = 1 WHERE client_id = ?", (eve,))
    assert [v["client_id"] for v in readmodels.find_volunteers(store, "ALI")] == [ALICE]  # name, any case
    assert [v["client_id"] for v in readmodels.find_volunteers(store, "bbbbbb")] == [bob]  # id prefix
    assert [v["name"] for v in readmodels.find_volunteers(store, "_100%")] == ["Bob_100%"]  # LIKE's wildcards, literal
    assert [v["client_id"] for v in readmodels.find_volunteers(store, "%")] == [bob]  # not everyone
    assert readmodels.find_volunteers(store, "  ") == []
    assert readmodels.find_volunteers(store, "eve") == [] and readmodels.volunteer(store, eve, T0, 30.0) is None
    me = readmodels.volunteer(store, ALICE, T0 + 10, 30.0)
    assert me is not None and me["name"] == "alice" and me["rank"] == 1 and me["credit"] == 10.0
    assert me["results"] == [{"job_id": "j0", "version": 0, "received_at": T0 + 5, "tokens": 10, "mean_reward": 0.5}]
    assert me["versions"] == [{"version": 0, "results": 1, "tokens": 10}]
    assert me["refusals"] == {"logprob_mismatch": 1} and me["accepted"] == 1
    assert readmodels.volunteer(store, bob, T0 + 10, 30.0)["rank"] == 2  # type: ignore[index]
    assert readmodels.volunteer(store, "c" * 32, T0, 30.0) is None


def test_counters_add_up_across_writers_and_restarts(store_target: str | Path) -> None:
    first = Store(store_target)
    first.add_to_counter("counter:x", 5)
    second = Store(store_target)  # another API process on the same store
    second.add_to_counter("counter:x", 7)
    first.close()
    second.close()
    again = Store(store_target)  # a restart
    try:
        assert again.counter("counter:x") == 12 and again.counter("counter:none") == 0
    finally:
        again.close()
