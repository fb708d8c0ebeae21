"""Attackers on the coordinator's budgets and sign-up (issue 24), each run as its own process:

    python -m tests.adversarial.address_adversary KIND --url URL --home DIR --out report.json [--source IP]

- ``header_fuzz``: from one source address, requests aiohttp's parser refuses (a repeated Content-Type, a method it
  does not know), then seeded random headers (non-ASCII, undecodable, a forged relay header), methods and paths on
  every endpoint, as fast as it can; then one well-formed request. Every reply's status is reported.
- ``peer_ids``: several libp2p peers (one peer id each) on one host, each registering fresh identities over the
  coordinator's libp2p call relay (docs/protocol.md §6b).
- ``signup_flood``: fresh identities registering from many source addresses in 127.0.0.0/8 at once.

Requests are written byte for byte on sockets bound to the source address: an HTTP library would refuse or
re-encode exactly the bytes under test, and loopback's 127.0.0.0/8 gives every attacker its own address.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgpack

from shared import crypto, wire
from shared.messages import P2PInfo, RegisterRequest
from swarm_client.hardware import profile
from swarm_client.identity import load_identity

RELAY_HEADERS = (b"X-Echo-Swarm-Relay", b"X-Echo-Swarm-Peer", b"X-Echo-Swarm-Peer-Address")
ENDPOINTS = [(b"GET", b"/v1/info"), (b"POST", b"/v1/register"), (b"POST", b"/v1/lease"), (b"POST", b"/v1/release"),
             (b"POST", b"/v1/results"), (b"GET", b"/v1/snapshots/latest"), (b"GET", b"/v1/blobs/" + b"0" * 64),
             (b"GET", b"/v1/p2p"), (b"GET", b"/v1/status"), (b"GET", b"/healthz"), (b"GET", b"/metrics"),
             (b"GET", b"/"), (b"GET", b"/volunteer"), (b"GET", b"/v1/volunteers"),
             (b"GET", b"/v1/volunteers/" + b"a" * 32), (b"POST", b"/v1/admin/status"), (b"GET", b"/static/app.js")]


async def raw(url: str, source: str, method: bytes, path: bytes, headers: list[tuple[bytes, bytes]],
              body: bytes = b"") -> tuple[int, str | None]:
    """One request on a fresh connection from ``source``: (status, reason code of an ErrorBody or None)."""
    parts = urlsplit(url)
    reader, writer = await asyncio.wait_for(asyncio.open_connection(
        parts.hostname, parts.port, local_addr=(source, 0)), 30)
    try:
        head = [method + b" " + path + b" HTTP/1.1", b"Host: " + (parts.hostname or "").encode(),
                b"Connection: close", b"Content-Length: " + str(len(body)).encode()]
        head += [n + b": " + v for n, v in headers]
        writer.write(b"\r\n".join(head) + b"\r\n\r\n" + body)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 60)
    finally:
        writer.close()
    if not data:
        return 0, None
    status = int(data.split(b"\r\n", 1)[0].split()[1])
    reply = data.partition(b"\r\n\r\n")[2]
    try:
        err = msgpack.unpackb(reply, raw=False)
    except Exception:
        return status, None
    return status, err.get("error") if isinstance(err, dict) else None


# ---- header fuzzing ------------------------------------------------------------------------------------
def fuzzed(rng: random.Random) -> tuple[bytes, bytes, list[tuple[bytes, bytes]], bool]:
    """(method, path, headers, whether a header is not ASCII) for one request the app itself answers."""
    method, path = rng.choice(ENDPOINTS)
    if rng.random() < 0.3:
        method = rng.choice([b"PUT", b"DELETE", b"PATCH", b"OPTIONS", b"POST", b"GET"])
    if rng.random() < 0.3:
        path = path.rsplit(b"/", 1)[0] + b"/" + "".join(f"%{rng.randrange(256):02X}" for _ in range(6)).encode()
    if rng.random() < 0.2:
        path += b"?q=%FF%FE&view=%C3%28"
    names = [b"User-Agent", b"Accept", b"Authorization", b"X-Forwarded-For", b"Cookie", b"Range", *RELAY_HEADERS]
    headers, bad = [], False
    for name in rng.sample(names, rng.randrange(1, 4)):
        kind = rng.randrange(4)
        if kind == 0:
            value = bytes(rng.randrange(0x80, 0x100) for _ in range(rng.randrange(1, 20)))  # undecodable
        elif kind == 1:
            value = rng.choice(["é", "ключ", "🙂", "\u202e"]).encode()  # valid UTF-8, not ASCII
        elif kind == 2:
            value = bytes(rng.randrange(0x20, 0x7F) for _ in range(rng.randrange(0, 64)))  # printable ASCII
        else:
            value = b"0" * 64 if name == RELAY_HEADERS[0] else b"12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo"
        bad = bad or not value.isascii()
        headers.append((name, value))
    return method, path, headers, bad


async def header_fuzz(url: str, source: str, home: Path, report: dict[str, Any]) -> None:
    rng = random.Random(24)
    parser_refused = [(b"POST", b"/v1/lease", [(b"Content-Type", b"a"), (b"Content-Type", b"b")]),
                      (b"GET\x01", b"/v1/info", []), (b"GET", b"/v1/info", [(b"Bad Name", b"x")])]
    attempts: list[dict[str, Any]] = []
    t0 = time.monotonic()
    for n in range(report["parser_refused"]):
        method, path, headers = parser_refused[n % len(parser_refused)]
        status, reason = await raw(url, source, method, path, headers)
        attempts.append({"phase": "parser", "status": status, "reason": reason})
    sem = asyncio.Semaphore(8)

    async def one(n: int) -> None:
        method, path, headers, bad = fuzzed(random.Random(rng.random()))
        async with sem:
            status, reason = await raw(url, source, method, path, headers)
        attempts.append({"phase": "fuzz", "status": status, "reason": reason, "bad_header": bad,
                         "what": f"{method!r} {path[:60]!r} {[h[0] for h in headers]}"})

    await asyncio.gather(*(one(n) for n in range(report["fuzzed"])))
    report["elapsed_s"] = time.monotonic() - t0
    status, reason = await raw(url, source, b"GET", b"/v1/info", [])  # well-formed, right after: over budget
    attempts.append({"phase": "after", "status": status, "reason": reason})
    report["attempts"] = attempts


# ---- many peer ids from one host -------------------------------------------------------------------------
def registration(home: Path, name: str) -> tuple[str, bytes]:
    ident = load_identity(home / name)
    body = wire.encode(RegisterRequest(public_key=ident.public_key, profile=profile("torch", "cpu", "adversary")))
    return ident.client_id, wire.encode(crypto.sign_request(ident.key, "/v1/register", body, timestamp=time.time()))


async def peer_ids(url: str, source: str, home: Path, report: dict[str, Any]) -> None:
    import aiohttp
    from hivemind.p2p import P2P

    from shared.p2p_calls import call

    async with aiohttp.ClientSession() as http, http.get(url + "/v1/p2p") as resp:
        info = wire.decode(await resp.read(), P2PInfo)
    assert info.enabled and info.peer_id, info
    attempts: list[dict[str, Any]] = []
    peers = []
    t0 = time.monotonic()
    try:
        for p in range(report["peers"]):
            node = await P2P.create(initial_peers=list(info.maddrs), host_maddrs=[f"/ip4/{source}/tcp/0"])
            peers.append(node)
            for k in range(report["per_peer"]):
                cid, data = registration(home, f"p{p}-{k}")
                report["identities"].append(cid)
                status, reply = await call(node, info.peer_id, "/v1/register", data, 60.0)
                err = msgpack.unpackb(reply, raw=False) if status != 200 else {}
                attempts.append({"peer": node.peer_id.to_base58(), "status": status, "reason": err.get("error"),
                                 "message": err.get("message", ""), "client_id": cid})
    finally:
        for node in peers:
            await node.shutdown()
    report["attempts"] = attempts
    report["elapsed_s"] = time.monotonic() - t0  # the registration budget refills meanwhile


# ---- sign-up flood from many addresses -------------------------------------------------------------------
async def signup_flood(url: str, source: str, home: Path, report: dict[str, Any]) -> None:
    base = [int(x) for x in source.split(".")]
    sources = [f"127.{base[1]}.{base[2]}.{base[3] + k}" for k in range(report["addresses"])]
    jobs = [(s, f"{s}-{k}") for s in sources for k in range(report["per_address"])]
    sem = asyncio.Semaphore(16)
    attempts: list[dict[str, Any]] = []

    async def one(src: str, name: str) -> None:
        cid, data = registration(home, name)
        report["identities"].append(cid)
        async with sem:
            status, reason = await raw(url, src, b"POST", b"/v1/register", [(b"Content-Type", b"application/msgpack")],
                                       data)
        attempts.append({"source": src, "status": status, "reason": reason, "client_id": cid})

    t0 = time.monotonic()
    await asyncio.gather(*(one(s, n) for s, n in jobs))
    report["elapsed_s"] = time.monotonic() - t0
    report["attempts"] = attempts


KINDS = {"header_fuzz": header_fuzz, "peer_ids": peer_ids, "signup_flood": signup_flood}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=sorted(KINDS))
    parser.add_argument("--url", required=True)
    parser.add_argument("--home", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--source", default="127.0.0.1", help="source address (the first one, for signup_flood)")
    parser.add_argument("--count", type=json.loads, default={}, help="sizes, e.g. '{\"fuzzed\": 300}'")
    args = parser.parse_args()
    report: dict[str, Any] = {"kind": args.kind, "identities": [], "attempts": [], "error": None,
                              "parser_refused": 30, "fuzzed": 300, "peers": 3, "per_peer": 3, "addresses": 60,
                              "per_address": 4} | args.count
    args.home.mkdir(parents=True, exist_ok=True)
    try:
        asyncio.run(KINDS[args.kind](args.url.rstrip("/"), args.source, args.home, report))
    except (OSError, TimeoutError, AssertionError, ValueError) as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
    args.out.write_text(json.dumps(report, indent=2))
    print(f"adversary {args.kind}: {len(report['attempts'])} attempts, error={report['error']}")


if __name__ == "__main__":
    main()
