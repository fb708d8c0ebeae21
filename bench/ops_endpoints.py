"""Cost of the operator/contributor endpoints on a large run: GET /v1/status (what every open status page
polls every 2 s), GET /metrics (one Prometheus scrape) and POST /v1/admin/clients, on a real coordinator
(tiny model) whose database is filled with synthetic clients, jobs and results.

    python bench/ops_endpoints.py                     # 2,000 clients, 20,000 results, 200 steps
    python bench/ops_endpoints.py --clients 10000 --results 100000

Prints the median and max latency of each endpoint over --repeats calls, and the reply sizes. The status page
polls ``?view=page``, which is computed at most once a second (the "cached" row) however many pages are open.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp  # noqa: E402
from aiohttp import web  # noqa: E402

from coordinator import status_page  # noqa: E402
from coordinator.admin_keys import ADMIN_KEY_FILE  # noqa: E402
from coordinator.app import create_app  # noqa: E402
from coordinator.config import load_config  # noqa: E402
from coordinator.service import Coordinator  # noqa: E402
from shared import crypto, wire  # noqa: E402
from shared.admin import AdminList  # noqa: E402


def fill(coord: Coordinator, n_clients: int, n_results: int, n_steps: int, rng: random.Random) -> None:
    """Synthetic rows written straight into the run's database (fsync off: this is setup, not the subject)."""
    conn = coord.store.conn
    conn.execute("PRAGMA synchronous=OFF")
    now = coord.clock()
    ids = [f"{k:032x}" for k in range(1, n_clients + 1)]
    platforms = ["Linux x86_64", "Darwin arm64", "Windows AMD64"]
    conn.execute("BEGIN")
    for k, cid in enumerate(ids):
        profile = {"name": f"vol-{k}", "backend": rng.choice(["torch", "llama"]), "device": "cpu",
                   "platform": rng.choice(platforms), "cpu_count": 8, "memory_gb": 16.0, "software": "bench"}
        conn.execute("INSERT INTO clients(client_id, public_key, profile, registered_at, last_seen, accepted, credit) "
                     "VALUES(?,?,?,?,?,?,?)", (cid, b"\0" * 32, json.dumps(profile), now - 3600,
                                               now - rng.uniform(0, 3600), 10, rng.uniform(0, 1e5)))
    for j in range(n_results):
        job_id = f"bench-{j}"
        conn.execute("INSERT INTO jobs(job_id, seq, version, prompt_ids, seed, group_size, created_at, state, "
                     "issue_count) VALUES(?,?,?,?,?,?,?, 'done', 1)", (job_id, 10_000_000 + j, 0, "[1,2]", j, 4, now))
        conn.execute("INSERT INTO results(job_id, client_id, lease_id, version, received_at, content_sha256, payload, "
                     "rewards, mean_reward, n_tokens, ingested_step) VALUES(?,?,?,?,?,?,?,?,?,?,?)",
                     (job_id, rng.choice(ids), "l", 0, now - rng.uniform(0, 3600), "0" * 64, b"", "[0.5]", 0.5,
                      64, 1 + j % max(1, n_steps)))
    for s in range(1, n_steps + 1):
        conn.execute("INSERT INTO steps(step, trained_version, mean_reward, metrics, at) VALUES(?,?,?,?,?)",
                     (10_000 + s, s - 1, rng.random(), json.dumps({"step_s": rng.uniform(0.1, 2)}), now))
    conn.execute("COMMIT")
    conn.execute("PRAGMA synchronous=FULL")


async def timed(session: aiohttp.ClientSession, method: str, url: str, data: bytes | None = None
                ) -> tuple[float, int]:
    t0 = time.perf_counter()
    async with session.request(method, url, data=data) as resp:
        body = await resp.read()
        assert resp.status == 200, (url, resp.status, body[:200])
    return time.perf_counter() - t0, len(body)


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        cfg = load_config(None, {"run_dir": str(run_dir), "server.port": 0, "learner.eval_size": 16,
                                 "learner.max_steps": 1_000_000})
        coord = Coordinator(cfg)
        runner = web.AppRunner(create_app(cfg, coord), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        url = f"http://127.0.0.1:{port}"
        fill(coord, args.clients, args.results, args.steps, random.Random(0))
        key = crypto.load_private_key(run_dir / ADMIN_KEY_FILE)
        print(f"{args.clients} clients, {args.results} results, {args.steps} steps; {args.repeats} calls each")
        async with aiohttp.ClientSession() as session:
            for name, method, path in (("GET /v1/status", "GET", "/v1/status"),
                                       ("GET /v1/status?view=page", "GET", "/v1/status?view=page"),
                                       ("  same, cached", "GET", "/v1/status?view=page"),
                                       ("GET /metrics", "GET", "/metrics"),
                                       ("POST /v1/admin/clients", "POST", "/v1/admin/clients")):
                times, size = [], 0
                for _ in range(args.repeats):
                    if name.startswith("GET /v1/status?"):
                        status_page._page_cache.clear()  # measure the computation, not the cache
                    data = None
                    if method == "POST":
                        data = wire.encode(crypto.sign_request(key, path, wire.encode(AdminList(limit=10_000)),
                                                               timestamp=time.time()))
                    dt, size = await timed(session, method, url + path, data)
                    times.append(dt)
                print(f"  {name:24s} median {statistics.median(times) * 1000:8.1f} ms   max {max(times) * 1000:8.1f} ms"
                      f"   reply {size / 1024:8.1f} KiB")
        await runner.cleanup()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=2000)
    p.add_argument("--results", type=int, default=20000)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=10)
    asyncio.run(main(p.parse_args()))
