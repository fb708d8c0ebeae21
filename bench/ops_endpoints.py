"""Cost of the operator/contributor endpoints on a large run: GET /v1/status (what every open status page
polls every 2 s), GET /metrics (one Prometheus scrape) and POST /v1/admin/clients, on a real coordinator
(tiny model) whose database is filled with synthetic clients, jobs and results.

    python bench/ops_endpoints.py                     # 2,000 clients, 20,000 results, 200 steps
    python bench/ops_endpoints.py --clients 10000 --results 100000

Prints the median and max latency of each endpoint over --repeats calls, and the reply sizes. The status page
polls ``?view=page``, which is computed at most once a second (the "cached" row) however many pages are open.

    python bench/ops_endpoints.py --pollers 8          # /healthz under 8 connections polling status + metrics

``--pollers N`` measures instead what N connections polling ``GET /v1/status`` and ``GET /metrics`` in a loop
(from another process) do to ``GET /healthz`` latency, side by side: with the public-read cache and per-address
rate limit off (``server.public_cache_s = 0``, ``server.public_reads_per_address_rps = 0``: every poll builds
its reply, as before issue 13) and with the defaults; plus /healthz with nobody polling. Prints a markdown table.
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

from coordinator.api.admin_keys import ADMIN_KEY_FILE  # noqa: E402
from coordinator.api.public_reads import PUBLIC_READS  # noqa: E402
from coordinator.api.service import Coordinator  # noqa: E402
from coordinator.config import load_config  # noqa: E402
from coordinator.launch.one_process import create_app  # noqa: E402
from coordinator.launch.serve import start_site  # noqa: E402
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
                                 "learner.max_steps": 1_000_000, "server.public_reads_per_address_rps": 0.0})
        coord = Coordinator(cfg)
        app = create_app(cfg, coord)
        runner = web.AppRunner(app, access_log=None)
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
                    if not name.startswith("  same"):
                        app[PUBLIC_READS].cache.clear()  # measure the computation, not the cache
                    data = None
                    if method == "POST":
                        data = wire.encode(crypto.sign_request(key, path, wire.encode(AdminList(limit=10_000)),
                                                               timestamp=time.time()))
                    dt, size = await timed(session, method, url + path, data)
                    times.append(dt)
                print(f"  {name:24s} median {statistics.median(times) * 1000:8.1f} ms   max {max(times) * 1000:8.1f} ms"
                      f"   reply {size / 1024:8.1f} KiB")
        await runner.cleanup()


async def poll_child(url: str, pollers: int, seconds: float) -> None:
    """Runs in its own process: ``pollers`` connections read status and metrics in a loop while a separate
    connection times GET /healthz every 50 ms. Prints one JSON line."""
    healthz: list[float] = []
    codes: dict[int, int] = {}
    end = time.monotonic() + seconds

    async def poller() -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
            while time.monotonic() < end:
                for path in ("/v1/status", "/metrics"):
                    async with session.get(url + path) as resp:
                        await resp.read()
                        codes[resp.status] = codes.get(resp.status, 0) + 1

    async def prober() -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
            while time.monotonic() < end:
                dt, _ = await timed(session, "GET", url + "/healthz")
                healthz.append(dt)
                await asyncio.sleep(0.05)

    await asyncio.gather(prober(), *(poller() for _ in range(pollers)))
    print(json.dumps({"healthz": healthz, "codes": codes}))


async def under_polling(args: argparse.Namespace) -> None:
    """/healthz latency while ``--pollers`` connections poll status and metrics: before vs after issue 13."""
    rows = []
    for label, pollers, server in (("nobody polling", 0, {}),
                                   (f"{args.pollers} pollers, cache and limit off", args.pollers,
                                    {"server.public_cache_s": 0.0, "server.public_reads_per_address_rps": 0.0}),
                                   (f"{args.pollers} pollers, defaults", args.pollers, {})):
        with tempfile.TemporaryDirectory() as tmp:
            cfg = load_config(None, {"run_dir": str(Path(tmp) / "run"), "server.port": 0, "learner.eval_size": 16,
                                     "learner.max_steps": 1_000_000, **server})
            coord = Coordinator(cfg)
            app = create_app(cfg, coord)
            runner, site = await start_site(app, cfg)
            fill(coord, args.clients, args.results, args.steps, random.Random(0))
            child = await asyncio.create_subprocess_exec(
                sys.executable, __file__, "--poll-child", f"http://127.0.0.1:{site.port}", "--pollers", str(pollers),
                "--seconds", str(args.seconds), stdout=asyncio.subprocess.PIPE)
            out, _ = await child.communicate()
            await runner.cleanup()
        got = json.loads(out.decode().strip().splitlines()[-1])
        lat = sorted(got["healthz"])
        builds = sum(app[PUBLIC_READS].cache.builds.values())
        rows.append(f"| {label} | {statistics.median(lat) * 1000:.1f} | {lat[int(0.95 * (len(lat) - 1))] * 1000:.1f} | "
                    f"{got['codes'].get('200', 0)} | {got['codes'].get('429', 0)} | {builds} |")
    print(f"{args.clients} clients, {args.results} results, {args.steps} steps; {args.seconds:.0f} s each\n")
    print("| status/metrics polling | /healthz median ms | /healthz p95 ms | polls answered 200 | polls 429 | "
          "replies built |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=2000)
    p.add_argument("--results", type=int, default=20000)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--pollers", type=int, default=0, help="measure /healthz under this many status/metrics pollers")
    p.add_argument("--seconds", type=float, default=15.0, help="with --pollers: how long each configuration runs")
    p.add_argument("--poll-child", metavar="URL", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.poll_child:
        asyncio.run(poll_child(a.poll_child, a.pollers, a.seconds))
    elif a.pollers:
        asyncio.run(under_polling(a))
    else:
        asyncio.run(main(a))
