"""A few-second self-benchmark: tokens/s of the loaded backend on a tiny, fixed workload.

Reported at registration (``benchmark_tokens_per_s``) so the coordinator can later size or order work by
speed. It runs the backend's own `generate` on a local, unsigned job (4 samples × up to 32 new tokens of an
8-token prompt), after a 2-token warm-up, and stops at ``budget_s`` whatever it has. Informational only: a
volunteer can report anything, so the coordinator must never trust it for security or credit.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from shared import PROTOCOL_VERSION
from shared.messages import Job, JobPrompt, SamplingParams

logger = logging.getLogger(__name__)
NEVER = 2**31 - 1  # a stop token id no vocabulary has: every sample runs to max_tokens


def bench_job(max_tokens: int, group_size: int = 4) -> Job:
    now = time.time()
    return Job(protocol=PROTOCOL_VERSION, run_id="benchmark", job_id="benchmark", lease_id="benchmark",
               client_id="0" * 32, version=0, manifest_sha256="0" * 64,
               prompts=[JobPrompt(prompt_id=0, token_ids=list(range(1, 9)), text="")], prompt_hash="0" * 64,
               group_size=group_size, sampling=SamplingParams(temperature=1.0, max_tokens=max_tokens,
                                                              stop_token_ids=[NEVER]),
               seed=1234, issued_at=now, deadline=now + 60, max_result_bytes=1 << 20)


def run_benchmark(backend: Any, budget_s: float = 3.0) -> float | None:
    """Tokens/s of ``backend`` (already loaded); None if it could not run."""
    try:
        backend.generate(bench_job(2), lambda: False)  # warm-up: first-call allocations, kernels
        deadline = time.monotonic() + budget_s
        t0 = time.monotonic()
        samples = backend.generate(bench_job(32), lambda: time.monotonic() > deadline)
        elapsed = time.monotonic() - t0
    except Exception as exc:  # noqa: BLE001 — a benchmark failure must never stop the client joining
        logger.warning("self-benchmark failed: %s", exc)
        return None
    tokens = sum(len(s.token_ids) for s in samples)
    return tokens / elapsed if elapsed > 0 and tokens else None
