"""The keyed-choice check and the sampling test at the trust boundary: a result decoded greedily — with its true
behaviour logprobs, so it passes the logprob check — is refused with ``choice_mismatch`` (422: its tokens are not
the job's keyed sampler's), and, with that check switched off, by the sampling test (``sampling_mismatch``); nothing
is written to results either way, and an honest result of the same job shape is accepted. A real coordinator on loopback, a raw protocol client, jobs shaped like
the default run's (8 prompts × 8 samples)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from shared import wire
from shared.messages import Completion, Job, ResultSubmission, SubmitResponse
from shared.policy import completion_logprobs, generate, load_model
from tests.integration.conftest import LiveCoordinator, running_coordinator
from tests.integration.helpers import RawClient, db_rows
from tests.integration.ops_helpers import honest_result, lease, register

JOBS: dict[str, Any] = {"prompts_per_job": 8}  # × group_size 8: the default run's job shape
LEARNER: dict[str, Any] = {"group_size": 8, "prompts_per_step": 16}


def greedy_result(live: LiveCoordinator, job: Job) -> ResultSubmission:
    """What a lazy client returns: argmax decoding of the job's snapshot, reporting each token's true logprob
    under the job's temperature (so only the sampling test can tell)."""
    import torch

    model = load_model(live.run_dir / "snapshots" / f"v{job.version:06d}").eval()
    prompts = [list(p.token_ids) for p in job.prompts]
    stops = list(job.sampling.stop_token_ids)
    with torch.no_grad():
        samples = generate(model, prompts, group_size=job.group_size, temperature=job.sampling.temperature,
                           max_tokens=job.sampling.max_tokens, stop_ids=stops, seed=None, pad_id=stops[0])
        comps = [s.token_ids for s in samples]
        lp, _ = completion_logprobs(model, [p for p in prompts for _ in range(job.group_size)], comps,
                                    temperature=job.sampling.temperature, pad_id=stops[0])
    completions = [Completion(token_ids=c, logprobs=[min(0.0, x) for x in row[: len(c)]],
                              finish_reason=s.finish_reason)  # type: ignore[arg-type]
                   for c, row, s in zip(comps, lp.tolist(), samples, strict=True)]
    return ResultSubmission(job_id=job.job_id, lease_id=job.lease_id, version=job.version,
                            prompt_hash=job.prompt_hash, seed=job.seed, group_size=job.group_size, backend="torch",
                            generation_s=0.1, completions=completions)


@pytest.mark.parametrize("choice_check", [True, False], ids=["keyed-choice", "sampling-test-alone"])
def test_a_greedy_result_is_refused_and_an_honest_one_accepted(tmp_path: Path, tiny_model_dir: Path,
                                                               choice_check: bool) -> None:
    reason = "choice_mismatch" if choice_check else "sampling_mismatch"
    with running_coordinator(tmp_path, tiny_model_dir, jobs=JOBS,
                             learner=LEARNER, sections={"verification": {"choice_check": choice_check}}) as live:
        lazy, honest = register(live, "lazy"), register(live, "honest")
        job = lease(lazy, live.coordinator.public_key)
        assert len(job.prompts) * job.group_size == 64
        status, raw = lazy.post("/v1/results", greedy_result(live, job))
        err = RawClient.error(raw)
        assert (status, err.error) == (422, reason), f"{status} {err}"
        if choice_check:
            assert "not the job's keyed sampler's choice" in err.message and "§5b" in err.message
        else:
            assert "more predictable than sampling" in err.message and "greedy" in err.message
        assert db_rows(live.run_dir, "SELECT COUNT(*) FROM results") == [(0,)]
        assert db_rows(live.run_dir, "SELECT reason FROM rejections WHERE job_id=?", (job.job_id,)) == [(reason,)]

        other = lease(honest, live.coordinator.public_key)
        status, raw = honest.post("/v1/results", honest_result(live, other))
        assert status == 200, RawClient.error(raw)
        assert wire.decode(raw, SubmitResponse).accepted
        assert db_rows(live.run_dir, "SELECT job_id FROM results") == [(other.job_id,)]
