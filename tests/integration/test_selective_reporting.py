"""The result intake consults the selective-reporting rule (coordinator.core.reporting) after each accepted result
(issue 37: deleting that call left the suite green). A real coordinator on loopback, raw protocol clients, the
production torch backend for the honest results, and a reward plug-in that makes the attack certain: a sum's
parity decides its reward, so a client that reads the prompt knows the reward before it generates.

The selective identity B leases many jobs, returns only those that will score 1 and releases the rest; an honest
identity A then takes the released ones (reissued first) and returns them, scoring 0. B's next accepted result is
the evidence: most of its leases ended without a result, and what it returned scores above the others' at the same
version — the intake lowers its trust there, with an audit line saying why. A, which returned everything, is not
flagged; nor is B while nobody else's results at its version gave an expectation to compare with."""

from __future__ import annotations

import re
from pathlib import Path

from coordinator.tasks.text import TextCodec
from echo_swarm.demo_tasks import DEMO_DATA
from shared import wire
from shared.endpoints import RELEASE, RESULTS
from shared.messages import Job, ReleaseRequest, ReleaseResponse, SubmitResponse
from tests.integration.conftest import LiveCoordinator, running_coordinator
from tests.integration.helpers import RawClient, db_rows
from tests.integration.ops_helpers import honest_result, lease, register

# 1 for an even sum, 0 for an odd one, whatever was generated: what each job will score is in its prompt
PLUGIN = '''
def parity(prompts, completions, answer, **columns):
    return [1.0 if int(a.rsplit("####", 1)[1]) % 2 == 0 else 0.0 for a in answer]
'''
LEASES = 24  # B's leases: at least 3 odd and 2 even sums among them but for a chance of 2e-5


def _even(codec: TextCodec, job: Job) -> bool:
    a, b = re.search(r"(\d+)\+(\d+)", codec.decode(list(job.prompts[0].token_ids))).groups()  # type: ignore[union-attr]
    return (int(a) + int(b)) % 2 == 0


def _accepted(live: LiveCoordinator, client: RawClient, job: Job) -> SubmitResponse:
    status, raw = client.post(RESULTS.path, honest_result(live, job))
    assert status == 200, RawClient.error(raw)
    reply = wire.decode(raw, SubmitResponse)
    assert reply.accepted
    return reply


def _flags(live: LiveCoordinator, client: RawClient) -> list[tuple[str, str]]:
    return db_rows(live.run_dir, "SELECT reason, detail FROM audit WHERE outcome='flagged' AND client_id=?",
                   (client.client_id,))  # type: ignore[return-value]


def test_the_intake_flags_a_client_that_returns_only_what_scores_well(tmp_path: Path, tiny_model_dir: Path) -> None:
    plugin = tmp_path / "parity_reward.py"
    plugin.write_text(PLUGIN)
    task = {"type": "dataset", "train_path": str(DEMO_DATA / "sums.jsonl"), "prompt_column": "question",
            "prompt_template": "Q: {prompt}= A:", "heldout_size": 64, "rewards": [{"function": f"{plugin}:parity"}]}
    with running_coordinator(tmp_path, tiny_model_dir, jobs={"prompts_per_job": 1, "speed_aware": False},
                             learner={"prompts_per_step": 32},  # 32 jobs at version 0: nothing trains meanwhile
                             trust={"reporting_min_leases": 4, "reporting_min_results": 2},
                             limits={"max_leases_per_client": LEASES}, sections={"task": task}) as live:
        codec = TextCodec.from_folder(tiny_model_dir)
        key = live.coordinator.public_key
        selective, honest = register(live, "selective"), register(live, "honest")
        held = [lease(selective, key) for _ in range(LEASES)]
        keep = [j for j in held if _even(codec, j)]
        drop = [j for j in held if not _even(codec, j)]
        assert len(keep) >= 2 and len(drop) >= 3, (len(keep), len(drop))
        for job in drop:  # abandoned, having seen what they would score
            status, raw = selective.post(RELEASE.path, ReleaseRequest(job_id=job.job_id, lease_id=job.lease_id))
            assert status == 200 and wire.decode(raw, ReleaseResponse).released
        assert _accepted(live, selective, keep[0]).mean_reward == 1.0
        assert _flags(live, selective) == []  # nobody else's results at version 0 yet: no expectation to compare

        # the honest identity takes the released jobs (the oldest leasable first) and returns all it takes
        for _ in range(3):
            job = lease(honest, key)
            assert job.job_id in {j.job_id for j in drop}
            assert _accepted(live, honest, job).mean_reward == 0.0

        _accepted(live, selective, keep[1])  # the evidence is complete with this one
        flags = _flags(live, selective)
        assert len(flags) == 1, flags
        reason, detail = flags[0]
        assert reason == "selective_reporting"
        assert f"{len(drop)} of {LEASES} leases" in detail and "2 results returned score +1.000 above" in detail, detail
        (streak,), = db_rows(live.run_dir, "SELECT consecutive_valid FROM trust WHERE client_id=?",
                             (selective.client_id,))
        assert streak == 0  # its valid streak reset (core.trust.on_flag)
        assert _flags(live, honest) == []
