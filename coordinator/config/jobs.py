"""The ``[sampling]`` and ``[jobs]`` sections: what a leased job asks of a client and how the API hands jobs out."""

from __future__ import annotations

from pydantic import Field

from coordinator.config.base import StrictModel


class SamplingConfig(StrictModel):
    """How clients sample: the full softmax at a temperature (no truncation, so logprobs are exact)."""

    temperature: float = Field(1.0, gt=0, le=4)
    max_tokens: int = Field(8, ge=1, le=4096, description="New tokens per completion, at most.")


class JobsConfig(StrictModel):
    prompts_per_job: int = Field(8, ge=1, le=256, description="Prompts (GRPO groups) per leased job.")
    lease_timeout_s: float = Field(120.0, gt=0, description="Seconds a client has to return a leased job before it is reissued.")
    retry_after_s: float = Field(0.5, gt=0, le=60, description="Seconds an idle client is told to wait before asking again.")
    long_poll_s: float = Field(10.0, ge=0, le=25, description="Seconds a lease request waits for a job before "
                               "answering 'none yet' (must stay below the clients' 30 s request timeout).")
    speed_aware: bool = Field(True, description="Give free queue slots to the clients expected to return soonest, "
                              "and in async-push-pull only jobs a client can return while they are within "
                              "max_staleness, no earlier than the learner needs them (core.pacing). Off: first "
                              "come, first served, filling the queue to max_staleness.")
    max_held_lag: int = Field(2, ge=0, le=64, description="async-push-pull: a client keeps generating with the "
                              "version it already holds only while that version is at most this many versions "
                              "behind the current one (and its result will be within max_staleness); otherwise its "
                              "lease names the current version, which it fetches (a patch) first. Keeps a fast "
                              "client's rollouts fresh whatever max_staleness is; max_staleness then bounds how old "
                              "a slow client's result may be (issue 32). 64: hold as long as max_staleness allows.")
    secret_plans: bool = Field(True, description="Key every job's prompts and sampling seed with a secret of this "
                               "run (kept in its database): the seed is the job's secret sampling key (shared.sampler), "
                               "so a client cannot compute another job's sampling noise, nor its own before it holds "
                               "the lease. Off: plans follow from learner.seed alone, so two runs with one seed draw "
                               "the same jobs (the demo and the benchmarks that compare sync modes run by run).")
