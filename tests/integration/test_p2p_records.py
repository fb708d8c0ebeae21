"""The DHT records of p2p snapshots (docs/protocol.md §6a) against an attacker on the same DHT: forged, replayed and
re-dated latest-version records and a hijacked holder entry are refused by the honest nodes' validators (which
remember the records they accepted, never the ones they refused). And when a client announces small files.

Three real libp2p peers (each its own p2pd process) on loopback: C (the coordinator's key signs), R (a reader) and
P, an attacker whose DHT node runs no validator and stores whatever it likes.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from shared import crypto, records, wire
from shared.messages import HolderEntry
from shared.p2p import PeerNode, Uploads
from swarm_client.peer_fetch import P2P_MIN_BYTES, ClientPeer, PeerSettings

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("hivemind")]  # missing, these fail (conftest)

RUN = "run-p2p"
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


async def _attacker(maddrs: list[str]):  # type: ignore[no-untyped-def]
    from hivemind.dht.node import DHTNode
    from hivemind.p2p import P2P

    p2p = await P2P.create(initial_peers=maddrs, host_maddrs=LOOPBACK, nat_port_map=False, auto_nat=False,
                           use_relay=False, use_ipfs=False)
    node = await DHTNode.create(p2p=p2p, initial_peers=maddrs, record_validator=None, wait_timeout=3)
    return p2p, node


async def _scenario(tmp_path: Path) -> None:
    from hivemind.utils.timed_storage import get_dht_time

    key, forger = crypto.generate_key(), crypto.generate_key()
    pub = crypto.public_bytes(key)
    c = PeerNode(RUN, pub, lambda s: None, Uploads())
    r = PeerNode(RUN, pub, lambda s: None, Uploads())
    p2p_p = node_p = None
    try:
        await c.start(initial_peers=[], host_maddrs=LOOPBACK)
        maddrs = await c.visible_maddrs()
        await r.start(initial_peers=maddrs, host_maddrs=LOOPBACK)
        p2p_p, node_p = await _attacker(maddrs)
        now = get_dht_time()

        def latest(version: int, signer=key, created: float = now, ttl: float = 300):  # type: ignore[no-untyped-def]
            return records.sign_latest(signer, run_id=RUN, version=version, manifest_sha256=f"{version:064x}",
                                       created_at=created, expires_at=created + ttl)

        v1, v2 = latest(1, created=now - 10), latest(2)
        await c.publish_latest(v1)
        await c.publish_latest(v2)
        assert (await r.get_latest()).version == 2  # type: ignore[union-attr]
        refused = c.validator.refused + r.validator.refused
        k = records.latest_key(RUN)

        # forged: v999 signed by another key, with a later expiration than the genuine record
        forged = latest(999, signer=forger, created=now + 5)
        await node_p.store(k, wire.encode(forged), forged.expires_at)
        # re-dated: the genuine v1 record, stored with a later expiration than the one it signed
        await node_p.store(k, wire.encode(v1), v2.expires_at + 30)
        # replayed: the genuine v1 record as signed (its older expiration loses to v2's)
        await node_p.store(k, wire.encode(v1), v1.expires_at)
        for node in (r, c):
            got = await node.get_latest()
            assert got is not None and got.version == 2 and got.signature == v2.signature
        assert c.validator.refused + r.validator.refused >= refused + 2  # forged and re-dated, on both honest nodes

        # holder entries: R announces a file; P overwrites R's owner subkey with its own peer id (unsigned)
        sha = "ab" * 32
        await r.announce([sha])
        assert set(await c.holders(sha)) == {r.peer_id}
        bogus = wire.encode(HolderEntry(peer_id=p2p_p.peer_id.to_base58(), served_bytes=10**12))
        await node_p.store(records.blob_key(RUN, sha), bogus, get_dht_time() + 100, subkey=r._rsa_subkey)
        # ... and stores a plain (unowned) entry and a value that is no HolderEntry
        await node_p.store(records.blob_key(RUN, sha), bogus, get_dht_time() + 100, subkey="anyone")
        for node in (c, r):
            holders = await node.holders(sha)
            assert holders == {r.peer_id: 0}, holders
    finally:
        for closer in ([node_p.shutdown] if node_p else []) + ([p2p_p.shutdown] if p2p_p else []):
            await asyncio.wait_for(closer(), 10)
        await r.stop()
        await c.stop()


def test_forged_replayed_redated_and_hijacked_records_are_refused(tmp_path: Path) -> None:
    asyncio.run(asyncio.wait_for(_scenario(tmp_path), 180))


async def _small_files_scenario(tmp_path: Path) -> None:
    pub = crypto.public_bytes(crypto.generate_key())
    c = PeerNode(RUN, pub, lambda s: None, Uploads())
    client: ClientPeer | None = None
    try:
        await c.start(initial_peers=[], host_maddrs=LOOPBACK)
        blobs = tmp_path / "blobs"
        blobs.mkdir()
        client = ClientPeer(blobs, PeerSettings(listen=LOOPBACK, coordinator=await c.visible_maddrs()))
        assert await client.start(None, RUN, pub)  # type: ignore[arg-type]  # its coordinator is given: no HTTP
        assert client.node is not None
        await asyncio.sleep(0)  # the periodic announcement's first round: nothing held yet, then 60 s of sleep
        small, small2, big = "01" * 32, "02" * 32, "03" * 32
        for name, size in ((small, 100), (small2, 100), (big, P2P_MIN_BYTES)):
            (blobs / name).write_bytes(b"x" * size)
        me = client.node.peer_id
        await client.announce([small])  # a small file alone: no DHT store yet
        assert await c.holders(small) == {}
        await client.announce([big])  # the next large file takes it along
        assert set(await c.holders(big)) == {me} and set(await c.holders(small)) == {me}
        await client.announce([small2])
        assert await c.holders(small2) == {}
        await client.announce_pending()  # the version is complete
        assert set(await c.holders(small2)) == {me}
    finally:
        if client is not None:
            await client.stop()
        await c.stop()


def test_small_files_are_announced_together_with_the_next_large_one(tmp_path: Path) -> None:
    """Files under P2P_MIN_BYTES come over HTTP (swarm_client/peer_fetch.py), but older clients still look them up:
    a client announces them with its next announcement of a large file, or when its version is complete, not one
    DHT store each."""
    asyncio.run(asyncio.wait_for(_small_files_scenario(tmp_path), 120))
