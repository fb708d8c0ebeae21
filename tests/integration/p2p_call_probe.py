"""A volunteer that sends the signed calls over libp2p, in a process of its own (hivemind imports torch and runs
p2pd), for tests/integration/test_p2p_calls.py: it joins the coordinator's DHT as `join --p2p --p2p-jobs` does,
then registers, leases and releases through the production CoordinatorClient (with ``--jobs``, over libp2p first),
replays one envelope, and sends one oversized body; it prints one JSON line with what each call answered.

    python -m tests.integration.p2p_call_probe URL --home DIR [--p2p] [--jobs] [--no-hivemind] [--unreachable]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any


async def main(args: argparse.Namespace) -> int:
    from shared import wire
    from shared.crypto import sign_request
    from shared.errors import ProtocolError
    from shared.messages import (
        ClientProfile,
        ErrorBody,
        LeaseRequest,
        LeaseResponse,
        RegisterRequest,
        RegisterResponse,
        ReleaseRequest,
        ReleaseResponse,
    )
    from swarm_client.api import CoordinatorClient, RetryPolicy, refusal_code
    from swarm_client.identity import load_identity
    from swarm_client.peer_calls import PeerCalls
    from swarm_client.peer_fetch import ClientPeer, PeerSettings

    said: list[str] = []
    identity = load_identity(args.home)
    api = CoordinatorClient(args.url, identity, retry=RetryPolicy(attempts=3, base_s=0.2), timeout_s=30)
    peer = None
    out: dict[str, Any] = {"event": "done", "client_id": identity.client_id}
    try:
        info = await api.info()
        t0 = time.monotonic()
        if args.p2p:
            peer = ClientPeer(args.home / "blobs", PeerSettings(listen=["/ip4/127.0.0.1/tcp/0"], serve=False,
                                                                coordinator=args.coordinator_maddr),
                              say=said.append)
            (args.home / "blobs").mkdir(parents=True, exist_ok=True)
            await peer.start(api, info.run_id, info.coordinator_public_key)
            out["peer_id"] = peer.node.peer_id if peer.node is not None else None
        if args.unreachable and peer is not None and peer.node is not None:  # a coordinator peer nobody runs
            import os

            from hivemind.p2p import PeerID

            # an identity multihash of a random Ed25519 public key: a well-formed peer id no daemon answers to
            peer.coordinator_peer = PeerID(b"\x00\x24\x08\x01\x12\x20" + os.urandom(32)).to_base58()
        calls = None
        if args.jobs and peer is not None:
            api.calls = calls = PeerCalls(peer, api.timeout_s, said.append)
        profile = ClientProfile(name="probe", backend="torch", device="cpu", platform="Linux x86_64", cpu_count=2,
                                memory_gb=4.0, software="probe")
        reg = await api.post("/v1/register", RegisterRequest(public_key=identity.public_key, profile=profile),
                             RegisterResponse)
        out["registered"] = reg.new
        lease = await api.post("/v1/lease", LeaseRequest(backend="torch", held_version=-1), LeaseResponse)
        if lease.job is not None:
            from shared.messages import Job

            job = wire.decode(lease.job.job, Job)
            out["job_id"], out["lease_id"] = job.job_id, job.lease_id
            rel = await api.post("/v1/release", ReleaseRequest(job_id=job.job_id, lease_id=job.lease_id),
                                 ReleaseResponse)
            out["released"] = rel.released
        if args.bench and "job_id" in out:  # N more releases of the released job (answered released=false)
            times = []
            for _ in range(args.bench):
                t1 = time.perf_counter()
                await api.post("/v1/release", ReleaseRequest(job_id=out["job_id"], lease_id=out["lease_id"]),
                               ReleaseResponse)
                times.append((time.perf_counter() - t1) * 1000)
            times.sort()
            out["bench_ms"] = {"p50": round(times[len(times) // 2], 2), "p90": round(times[int(len(times) * 0.9)], 2)}
        if calls is not None:
            out["calls"], out["fallbacks"] = calls.sent, calls.fallbacks
        out["took_s"] = round(time.monotonic() - t0, 2)
        if args.jobs and peer is not None and peer.node is not None and not args.unreachable:
            from shared.p2p_calls import call

            node, coord = peer.node, peer.coordinator_peer
            # a release of the job released above (answered released=false, nothing changes), sent twice
            again_body = ReleaseRequest(job_id=out.get("job_id", "j0"), lease_id=out.get("lease_id", "l0"))
            envelope = wire.encode(sign_request(identity.key, "/v1/release", wire.encode(again_body),
                                                timestamp=time.time()))
            first = await call(node.p2p, coord, "/v1/release", envelope, 30)
            again = await call(node.p2p, coord, "/v1/release", envelope, 30)
            async with api.session.post(args.url + "/v1/release", data=envelope) as resp:
                http = (resp.status, await resp.read())
            out["replay"] = {"first": [first[0], wire.decode(first[1], ReleaseResponse).released],
                             "p2p": [again[0], wire.decode(again[1], ErrorBody).error],
                             "http": [http[0], wire.decode(http[1], ErrorBody).error]}
            big = b"\x00" * (64 * 1024 + 1)
            status, body = await call(node.p2p, coord, "/v1/register", big, 30)
            out["oversize"] = [status, wire.decode(body, ErrorBody).error]
            status, body = await call(node.p2p, coord, "/v1/results", b"\x00" * (4 << 20), 30)  # refused unread
            out["oversize_results"] = [status, wire.decode(body, ErrorBody).error]
            status, body = await call(node.p2p, coord, "/v1/info", b"", 30)
            out["unknown_path"] = [status, wire.decode(body, ErrorBody).error]
    except ProtocolError as exc:
        out["refused"] = refusal_code(exc)
    finally:
        out["said"] = said
        print(json.dumps(out), flush=True)
        if peer is not None:
            await peer.stop()
        await api.close()
    return 0


def run() -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.integration.p2p_call_probe")
    ap.add_argument("url")
    ap.add_argument("--home", type=Path, required=True)
    ap.add_argument("--p2p", action="store_true")
    ap.add_argument("--jobs", action="store_true")
    ap.add_argument("--no-hivemind", action="store_true", help="behave as if hivemind were not installed")
    ap.add_argument("--coordinator-maddr", action="append", default=[], help="the coordinator peer's multiaddr "
                    "(as join --p2p-coordinator; default: GET /v1/p2p)")
    ap.add_argument("--bench", type=int, default=0, help="then time this many signed calls (releases)")
    ap.add_argument("--unreachable", action="store_true", help="send the calls to a peer id nobody runs")
    args = ap.parse_args(sys.argv[1:])
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.no_hivemind:
        sys.modules["hivemind"] = None  # type: ignore[assignment]  # import hivemind now raises ImportError
    return asyncio.run(main(args))


if __name__ == "__main__":
    raise SystemExit(run())
