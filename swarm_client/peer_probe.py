"""One volunteer's snapshot path, without a generation backend: fetch a version exactly as `join` does (signed
manifest, peers first with `--p2p`, HTTP fallback, whole-file check), print one JSON line with what it cost, then
optionally keep serving peers until interrupted. Used by the p2p tests and bench/egress.py to run many real
client processes on a small machine (a torch backend per process would not fit).

    python -m swarm_client.peer_probe URL --home DIR [--p2p] [--serve-s 60] [--corrupt-piece 2]

``--corrupt-piece N`` makes this a *bad* peer for tests: after fetching honestly, it serves a copy of each file
with piece N altered. ``--p2pd-missing`` / ``--no-hivemind`` reproduce the two start failures p2p must survive.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

from shared import wire
from shared.endpoints import SNAPSHOT
from shared.messages import Manifest, SignedManifest
from shared.records import open_manifest
from swarm_client.api import CoordinatorClient, RetryPolicy
from swarm_client.identity import load_identity
from swarm_client.peer_fetch import ClientPeer, PeerSettings
from swarm_client.snapshots import SnapshotCache


def _corrupt_copies(blobs: Path, piece: int, piece_size: int) -> dict[str, Path]:
    bad_dir = blobs.parent / "bad"
    bad_dir.mkdir(exist_ok=True)
    out = {}
    for blob in blobs.iterdir():
        if len(blob.name) == 64:
            data = bytearray(blob.read_bytes())
            pos = piece * piece_size
            if pos < len(data):
                data[pos] ^= 0xFF
            (bad_dir / blob.name).write_bytes(bytes(data))
            out[blob.name] = bad_dir / blob.name
    return out


def _cpu(peer: object) -> tuple[float, float]:
    """CPU seconds of (this process, its p2pd) (Linux /proc; the daemon's share is 0 elsewhere)."""
    daemon = 0.0
    child = getattr(getattr(getattr(peer, "node", None), "p2p", None), "_child", None)
    if child is not None:
        try:
            fields = Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()
            daemon = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except OSError:
            pass
    return time.process_time(), daemon


def _cpu_since(peer: object, start: tuple[float, float]) -> dict[str, float]:
    now = _cpu(peer)
    py, daemon = now[0] - start[0], now[1] - start[1]
    return {"cpu_s": round(py + daemon, 3), "cpu_python_s": round(py, 3), "cpu_p2pd_s": round(daemon, 3)}


async def main(args: argparse.Namespace) -> int:
    said: list[str] = []
    api = CoordinatorClient(args.url, load_identity(args.home), retry=RetryPolicy(attempts=3, base_s=0.2))
    peer = None
    t0 = time.monotonic()
    try:
        info = await api.info()
        cache = SnapshotCache(args.home / "cache", api, info.coordinator_public_key)
        if args.p2p:
            peer = ClientPeer(cache.blobs, PeerSettings(deadline_s=args.deadline_s, listen=["/ip4/127.0.0.1/tcp/0"],
                                                        uploads=args.uploads, uploads_per_blob=args.uploads_per_blob),
                              say=said.append)
            if await peer.start(api, info.run_id, info.coordinator_public_key):
                cache.peers = peer
                peer.prefer = set(args.prefer)
        started = time.monotonic() - t0
        if args.wait_go is not None:  # bench/egress.py: every client up before any fetch starts
            (args.home / "waiting").write_text("")
            while not args.wait_go.exists():
                await asyncio.sleep(0.1)
        cpu0 = _cpu(peer)
        version = info.current_version if args.version < 0 else args.version
        signed = wire.decode(await api.get_raw(SNAPSHOT.at(version=version)), SignedManifest)
        manifest, sha = open_manifest(signed, info.coordinator_public_key)
        t1 = time.monotonic()
        await cache.ensure(info.run_id, version, sha)
        ready = time.monotonic() - t1
        if args.corrupt_piece is not None and peer is not None and peer.node is not None:
            piece_size = next(f.piece_size for f in wire.decode(signed.manifest, Manifest).files if f.piece_size)
            bad = _corrupt_copies(cache.blobs, args.corrupt_piece, piece_size)
            peer.node.resolve = bad.get
        stats = peer.stats if peer is not None else None
        print(json.dumps({
            "event": "ready", "version": manifest.version, "start_s": round(started, 3), "ready_s": round(ready, 3),
            "http_bytes": cache.bytes_downloaded, "peer_bytes": stats.peer_bytes if stats else 0,
            "wasted_bytes": stats.wasted_bytes if stats else 0, "banned": stats.banned if stats else 0,
            "fallbacks": stats.fallbacks if stats else 0, "lookups": stats.lookups if stats else 0,
            "refused": stats.refused if stats else 0, "p2p": cache.peers is not None, "said": said,
            "peer_id": peer.node.peer_id if peer is not None and peer.node is not None else None,
            "corrupt": args.corrupt_piece} | _cpu_since(peer, cpu0)), flush=True)
        if args.serve_s > 0 and cache.peers is not None:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), args.serve_s)
            print(json.dumps({"event": "served", "served_bytes": cache.peers.served_bytes}
                             | _cpu_since(peer, cpu0)), flush=True)
        return 0
    finally:
        if peer is not None:
            await peer.stop()
        await api.close()


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m swarm_client.peer_probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("url")
    ap.add_argument("--home", type=Path, required=True)
    ap.add_argument("--version", type=int, default=-1, help="version to fetch (default: the current one)")
    ap.add_argument("--p2p", action="store_true")
    ap.add_argument("--serve-s", type=float, default=0.0, help="keep serving peers this long (or until SIGINT)")
    ap.add_argument("--deadline-s", type=float, default=20.0)
    ap.add_argument("--uploads", type=int, default=2)
    ap.add_argument("--uploads-per-blob", type=int, default=3)
    ap.add_argument("--corrupt-piece", type=int, default=None)
    ap.add_argument("--prefer", action="append", default=[], help="peer id to ask first (repeatable)")
    ap.add_argument("--p2pd-missing", action="store_true", help="point hivemind at a p2pd that does not exist")
    ap.add_argument("--no-hivemind", action="store_true", help="behave as if hivemind were not installed")
    ap.add_argument("--wait-go", type=Path, default=None, help="after start-up, write HOME/waiting and wait for this "
                    "file before fetching")
    return ap.parse_args(argv)


def run(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.no_hivemind:
        sys.modules["hivemind"] = None  # type: ignore[assignment]  # import hivemind now raises ImportError
    if args.p2pd_missing:
        import hivemind.p2p.p2p_daemon as daemon

        daemon.P2PD_FILENAME = "p2pd-not-installed"  # type: ignore[misc]
    return asyncio.run(main(args))


if __name__ == "__main__":
    raise SystemExit(run())
