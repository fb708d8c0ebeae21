"""Every network call of a p2p fetch has a timeout (docs/protocol.md §6a): a holder that accepts a blob stream and
then says nothing, or stops sending mid-file, cannot hold a client past its deadline; the client reports the
fallback (and the caller continues over HTTP from the verified bytes, tests/integration/test_p2p_snapshots.py).
And a holder that refuses for good is not asked again, while the lookups back off."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import pytest

from shared import crypto, p2p
from shared.p2p import PeerNode, Uploads
from shared.records import manifest_file

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("hivemind")]  # missing, these fail (conftest)
STALL_S = 60.0  # how long a stalling holder keeps a stream open: far past the client's timeouts
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


class Stalling(PeerNode):
    """Accepts each stream, then never answers (``mode = "silent"``) or stops after the first piece ("stall")."""

    mode = "silent"

    async def _serve(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.mode == "stall":  # one piece from the start of the file, then nothing (also on a resume)
            from shared.messages import BlobReply, BlobRequest

            req = await p2p.read_frame(reader, BlobRequest)
            path = self.resolve(req.sha256)
            assert path is not None
            await p2p.write_frame(writer, BlobReply(status="ok", length=path.stat().st_size - req.offset))
            if req.offset == 0:
                writer.write(path.read_bytes()[:65536])
                await writer.drain()
        await asyncio.sleep(STALL_S)


async def _fetch_from(server: PeerNode, mf: Any, part: Path, deadline_s: float) -> tuple[Any, float]:
    """A fresh client fetches ``mf`` from ``server`` (its only peer, holding it): (its report, seconds taken)."""
    client = PeerNode("run", server.coordinator_key, lambda s: None, Uploads())
    try:
        await server.start(initial_peers=[], host_maddrs=LOOPBACK)
        await client.start(initial_peers=await server.visible_maddrs(), host_maddrs=LOOPBACK)
        await server.announce([mf.sha256])
        t0 = time.monotonic()
        report = await client.fetch(mf, part, deadline_s=deadline_s)
        return report, time.monotonic() - t0
    finally:
        await client.stop()
        await server.stop()


async def _scenario(tmp_path: Path, mode: str) -> None:
    blob = tmp_path / "blob"
    blob.write_bytes(os.urandom(4 * 65536))
    mf = manifest_file(blob, "model.safetensors", piece_size=65536)
    pub = crypto.public_bytes(crypto.generate_key())
    server = Stalling("run", pub, lambda s: blob if s == mf.sha256 else None, Uploads())
    server.mode = mode
    part = tmp_path / "part"
    report, took = await _fetch_from(server, mf, part, 1.0)
    assert report.fallback.startswith("no peer delivered the file within 1s"), report
    # the reply (silent) or the next byte (stall) timed out (2 s here); then the deadline (1 s) passed. The client let
    # go before the holder did: how much sooner depends on the machine's load, which a tighter bound would test
    assert took < STALL_S, took
    assert report.peer_bytes == (65536 if mode == "stall" else 0)  # the one piece that arrived counts
    assert (part.stat().st_size if part.exists() else 0) == report.peer_bytes  # verified bytes only


@pytest.mark.parametrize("mode", ["silent", "stall"])
def test_a_silent_or_stalling_holder_cannot_hold_the_client(tmp_path: Path, mode: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(p2p, "CALL_TIMEOUT_S", 2.0)
    monkeypatch.setattr(p2p, "IDLE_TIMEOUT_S", 2.0)
    asyncio.run(asyncio.wait_for(_scenario(tmp_path, mode), 120))


async def _refusing_scenario(tmp_path: Path) -> None:
    blob = tmp_path / "blob"
    blob.write_bytes(os.urandom(2 * 65536))
    mf = manifest_file(blob, "model.safetensors", piece_size=65536)
    pub = crypto.public_bytes(crypto.generate_key())
    server = PeerNode("run", pub, lambda s: blob if s == mf.sha256 else None, Uploads(per_blob=0))  # all "seeded"
    report, took = await _fetch_from(server, mf, tmp_path / "part", 3.0)
    assert report.fallback.startswith("no peer delivered the file within 3s"), report
    assert report.refused == 1, report  # "seeded" is final: asked once, not on every round
    # rounds back off (0.25-0.5 s, doubling): over 3 s a handful of lookups, not one every 0.3-1 s
    assert 2 <= report.lookups <= 6, (report.lookups, took)


@pytest.mark.serial  # counts lookup rounds in a 3-s deadline: `make test` runs it alone, after the parallel phase
def test_a_final_refusal_is_not_asked_again_and_lookups_back_off(tmp_path: Path) -> None:
    asyncio.run(asyncio.wait_for(_refusing_scenario(tmp_path), 120))
