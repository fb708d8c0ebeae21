"""The token-choice cheats through llama.cpp identities at every quantised precision a run offers (issue 36).

tests/adversarial/test_adversaries.py makes each cheat through a llama.cpp identity on the run's default GGUF (f16).
A volunteer who runs a quantised file is judged on that file: the verifier replays its evaluations with llama.cpp
on the GGUF its lease names, at the same 0.1 logit. Here a run publishes every version in f16, q8_0, q6_K, q5_K_M
and q4_K_M (`snapshots.gguf_also`, llama.cpp's own quantiser); one adversary process per quantised precision leases
at that precision and makes the six cheats one after the other, each with an identity of its own — greedy
decoding, forced-correct answers, best-of-16 by reward, top-4 steering towards the answer and junk, each refused
(the keyed check, or the logprob or sampling check first: its "true" logprobs are torch's, not the file's) unless
its tokens are exactly the honest keyed sample of that very file, which is honest work; and a torch client's honest
sample sent as the quantised one (class shopping), refused unless where it differs it lies within the class's 0.1
logit (the tolerance's freedom: on the tiny model q8_0's logits lie within ~0.1 of torch's, so a torch sample's
few differing choices usually do). Two honest llama.cpp volunteers at q4_K_M and q6_K
work beside them and lose nothing.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.adversarial.test_adversaries import Attempts, _codes, _junk, _llama_cheat
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



def _shopped(attempts: Attempts) -> None:
    """A torch client's honest sample sent as this precision's: refused where a token it chose differently from the
    file's keyed choice lies beyond the class's 0.1 logit; accepted where every such token lies within it — the
    tolerance's own freedom (docs/security.md §4: the headroom kept for hardware the replay cannot make equal), which
    a torch sample at a near-tie spends as any llama.cpp identity could. bench/choice_calibration.py measures how
    often each happens ("torch sample as this class")."""
    assert len(attempts) == 1, attempts
    assert _codes(attempts) in ([(200, None)], [(422, "choice_mismatch")], [(422, "logprob_mismatch")]), attempts


PRECISIONS = ("q8_0", "q6_K", "q5_K_M", "q4_K_M")
CHEATS = {"llama_greedy": _llama_cheat, "llama_forced_correct": _llama_cheat, "llama_best_of_16": _llama_cheat,
          "llama_topk_steer": _llama_cheat, "llama_junk": _junk, "llama_torch_sample": _shopped}
HONEST = ("q4_K_M", "q6_K")


def _attack(precision: str, url: str, tmp: Path) -> list[dict[str, Any]]:
    out = tmp / f"adv-{precision}.json"
    proc = Proc([sys.executable, "-m", "tests.adversarial.adversary", *CHEATS, "--precision", precision,
                 "--url", url, "--home", str(tmp / f"adv-{precision}"), "--out", str(out)],
                tmp / f"adv-{precision}.log")
    rc = proc.proc.wait(900)
    proc.stop()
    assert rc == 0 and out.exists(), f"adversary at {precision} crashed (rc {rc}):\n{proc.output()[-3000:]}"
    reports: list[dict[str, Any]] = json.loads(out.read_text())
    return reports


@pytest.mark.timeout(1800)
def test_every_cheat_through_a_quantised_identity_is_refused_on_its_own_file(tmp_path: Path,
                                                                             tiny_model_dir: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = write_config(
        tmp_path / "run.toml", run_dir, tiny_model_dir, top={"sync_mode": "async-push-pull", "max_staleness": 2},
        learner={"max_steps": 5000}, jobs={"lease_timeout_s": 60.0, "long_poll_s": 1.0},
        snapshots={"gguf_also": list(PRECISIONS)},
        limits={"registration_burst": 60, "registrations_per_address_per_min": 60.0})
    coord, url = start_coordinator(cfg, tmp_path / "coord.log")
    honest = [start_client(url, tmp_path / f"honest-{p}", tmp_path / f"honest-{p}.log", "--backend", "llama",
                           "--precision", p) for p in HONEST]
    try:
        wait_until(lambda: (s := get_status(url)) and s["version"] >= 1, 300, "the honest clients to train a version")
        with ThreadPoolExecutor(max_workers=2) as pool:
            reports = dict(zip(PRECISIONS, pool.map(lambda p: _attack(p, url, tmp_path), PRECISIONS), strict=True))
        after = (get_status(url) or {})["version"]
        wait_until(lambda: (s := get_status(url)) and s["version"] >= after + 1, 300, "training to go on")
        for p in honest:
            assert p.proc.poll() is None, f"an honest client died:\n{p.output()[-3000:]}"
        assert server_errors(url) == 0, "a request got a 5xx: see coord.log for the traceback"
    finally:
        for p in (*honest, coord):
            p.stop()

    failures = []
    coincided: set[str] = set()
    for precision, runs in reports.items():
        assert [r["kind"] for r in runs] == list(CHEATS), runs
        for report in runs:
            kind = f"{report['kind']} at {precision}"
            try:
                assert report["error"] is None, report["error"]
                CHEATS[report["kind"]](report["attempts"])
                # the lease named the precision asked for, so the verdict came from that file's replay
                (cheat,) = report["identities"]
                assert set(report["notes"]["leased_precisions"]) == {precision}, report["notes"]
            except AssertionError as exc:
                failures.append(f"{kind}: {exc}")
                continue
            if report["attempts"][0].get("same_as_honest") or report["attempts"][0]["status"] == 200:
                coincided.add(cheat)  # honest work of that file, or a torch sample within the class's tolerance
                continue
            assert db_rows(run_dir, "SELECT job_id FROM results WHERE client_id=?", (cheat,)) == [], kind
            assert db_rows(run_dir, "SELECT credit FROM clients WHERE client_id=?", (cheat,)) == [(0.0,)], kind
    assert not failures, "\n".join(failures)
    shopped = [(p, r["attempts"][0]) for p, runs in reports.items() for r in runs if r["kind"] == "llama_torch_sample"]
    print("torch samples sent as a quantised file's: " + ", ".join(
        f"{p} {'identical' if a['same_as_honest'] else 'accepted within 0.1' if a['status'] == 200 else 'refused'}"
        for p, a in shopped))

    # the honest quantised volunteers lose nothing, and only they (and coinciding "cheats") are trained
    honest_ids = {cid for (cid,) in db_rows(run_dir, "SELECT client_id FROM clients WHERE profile NOT LIKE "
                                                     "'%adversary%'")}
    assert len(honest_ids) == len(HONEST)
    for cid in honest_ids:
        reasons = [r for (r,) in db_rows(run_dir, "SELECT reason FROM rejections WHERE client_id=?", (cid,))]
        assert not [r for r in reasons if r not in ("lease_expired", "not_lease_holder", "job_completed")], reasons
        (accepted,), = db_rows(run_dir, "SELECT accepted FROM clients WHERE client_id=?", (cid,))
        assert accepted > 0
    trained = {cid for (cid,) in db_rows(run_dir, "SELECT client_id FROM results WHERE ingested_step IS NOT NULL")}
    assert trained <= honest_ids | coincided
