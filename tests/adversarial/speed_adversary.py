"""Issue 37's claimed-speed attacker, as its own process:

    python -m tests.adversarial.speed_adversary --url URL --home DIR --out report.json --until STOPFILE \
        [--pause PAUSEFILE] [--at-once N]

A fresh identity per job: each registers declaring a self-benchmark of 10⁷ tokens/s (the protocol's ceiling), asks
for work until it holds one lease, and is never heard of again — it neither returns nor releases the job. ``N``
identities do so at once (each replaced by the next as soon as it holds its lease), until STOPFILE exists; while
PAUSEFILE exists no identity asks, and once none has a request in flight it writes PAUSEFILE.idle (removed when it
resumes). It loads no model and computes nothing.

The report lists every lease taken (job id, identity, wall-clock time), every refusal met, and the CPU seconds the
process used.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp

from shared.errors import ProtocolError
from shared.messages import LeaseRequest, LeaseResponse, RegisterRequest, RegisterResponse
from shared.records import open_job
from swarm_client.api import CoordinatorClient, RetryPolicy
from swarm_client.hardware import profile
from swarm_client.identity import load_identity

CLAIMED_TOKENS_PER_S = 1e7
NO_RETRY = RetryPolicy(attempts=1)


async def attack(url: str, home: Path, until: Path, at_once: int, pause: Path | None = None) -> dict[str, Any]:
    leases: list[dict[str, Any]] = []
    refusals: list[str] = []
    born = 0
    busy = 0  # workers with an identity at work
    idle = None if pause is None else pause.with_name(pause.name + ".idle")

    def paused() -> bool:
        return pause is not None and pause.exists()

    async def one_identity() -> None:
        nonlocal born
        born += 1
        ident = load_identity(home / f"sybil{born}")
        api = CoordinatorClient(url, ident, retry=NO_RETRY)
        try:
            info = await api.info()
            claimed = profile("torch", "cpu", f"fast-{born}").model_copy(
                update={"benchmark_tokens_per_s": CLAIMED_TOKENS_PER_S})
            await api.post("/v1/register", RegisterRequest(public_key=ident.public_key, profile=claimed),
                           RegisterResponse)
            while not until.exists() and not paused():
                resp = await api.post("/v1/lease", LeaseRequest(backend="torch", held_version=-1), LeaseResponse)
                if resp.job is not None:
                    job = open_job(resp.job, info.coordinator_public_key)
                    leases.append({"job_id": job.job_id, "client_id": ident.client_id, "version": job.version,
                                   "at": round(time.time(), 3)})
                    return  # …and vanishes with it
                if resp.finished:
                    return
                await asyncio.sleep(min(resp.retry_after_s, 0.5))
        finally:
            await api.close()

    async def worker() -> None:
        nonlocal busy
        while not until.exists():
            if paused():
                if busy == 0 and idle is not None:
                    idle.touch()
                await asyncio.sleep(0.1)
                continue
            if idle is not None:
                idle.unlink(missing_ok=True)
            busy += 1
            try:
                await one_identity()
            except (ProtocolError, aiohttp.ClientError, TimeoutError) as exc:
                refusals.append(f"{type(exc).__name__}: {exc}"[:200])
                await asyncio.sleep(0.5)
            finally:
                busy -= 1

    await asyncio.gather(*(worker() for _ in range(at_once)))
    return {"leases": leases, "identities": born, "refusals": refusals, "cpu_s": round(time.process_time(), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True)
    parser.add_argument("--home", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--until", type=Path, required=True, help="stop once this file exists")
    parser.add_argument("--pause", type=Path, help="no identity asks while this file exists")
    parser.add_argument("--at-once", type=int, default=4, help="identities asking for work at once")
    args = parser.parse_args()
    report = asyncio.run(attack(args.url, args.home, args.until, args.at_once, args.pause))
    args.out.write_text(json.dumps(report, indent=2))
    print(f"speed adversary: {len(report['leases'])} leases, {report['identities']} identities, "
          f"{len(report['refusals'])} refusals")


if __name__ == "__main__":
    main()
