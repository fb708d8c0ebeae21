"""The byte path of a p2p blob stream without libp2p (shared/p2p_stream.py, shared/hashing.py): the receiver reads
exactly what it is asked for into its buffer whatever sizes the bytes arrive in, and says when the stream ends or
idles short of it; the sender's sendfile delivers the file from an offset; the running whole-file digest equals a
second pass over the file whatever happened to the file in between (appends, a cut-back, a rewrite)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import struct
from pathlib import Path

import pytest

from shared.hashing import FileDigest
from shared.p2p_stream import MAX_FRAME, PieceReceiver, StreamCut, send_file


async def _pair() -> tuple[asyncio.Transport, socket.socket]:
    """A transport over one end of a unix socket pair (as a p2pd stream arrives) and the raw other end."""
    ours, theirs = socket.socketpair()
    theirs.setblocking(False)
    loop = asyncio.get_running_loop()
    transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, ours)
    return transport, theirs  # type: ignore[return-value]


def test_the_receiver_fills_exact_pieces_from_reads_of_any_size() -> None:
    data = os.urandom(3 * 65536 + 123)

    async def scenario() -> None:
        transport, peer = await _pair()
        receiver = PieceReceiver(transport)
        loop = asyncio.get_running_loop()
        reply = b"\x81\xa6status\xa2ok"

        async def sender() -> None:
            stream = struct.pack(">I", len(reply)) + reply + data
            for i in range(0, len(stream), 7001):  # odd write sizes straddle the frame and every piece boundary
                await loop.sock_sendall(peer, stream[i:i + 7001])
            peer.close()

        task = asyncio.create_task(sender())
        assert await receiver.frame(5.0) == reply
        got = b""
        for start in range(0, len(data), 65536):
            piece = await receiver.fill(min(65536, len(data) - start), 5.0)
            got += bytes(piece)
        assert got == data
        with pytest.raises(StreamCut):  # the sender closed: nothing more arrives
            await receiver.fill(1, 5.0)
        await task
        transport.close()

    asyncio.run(scenario())


def test_a_stream_that_ends_or_idles_short_of_a_piece_is_cut() -> None:
    async def scenario() -> None:
        transport, peer = await _pair()
        receiver = PieceReceiver(transport)
        await asyncio.get_running_loop().sock_sendall(peer, b"x" * 1000)
        with pytest.raises(StreamCut, match="no byte for"):  # 1000 of 4096 bytes, then silence
            await receiver.fill(4096, 0.3)
        peer.close()
        transport.close()

        transport, peer = await _pair()
        receiver = PieceReceiver(transport)
        await asyncio.get_running_loop().sock_sendall(peer, b"x" * 1000)
        peer.close()
        with pytest.raises(StreamCut):  # 1000 of 4096 bytes, then the end of the stream
            await receiver.fill(4096, 5.0)
        transport.close()

    asyncio.run(scenario())


def test_an_oversized_frame_is_refused() -> None:
    async def scenario() -> None:
        transport, peer = await _pair()
        receiver = PieceReceiver(transport)
        await asyncio.get_running_loop().sock_sendall(peer, struct.pack(">I", MAX_FRAME + 1))
        with pytest.raises(ValueError, match="frame of"):
            await receiver.frame(5.0)
        peer.close()
        transport.close()

    asyncio.run(scenario())


def test_send_file_delivers_the_file_from_an_offset(tmp_path: Path) -> None:
    blob = tmp_path / "blob"
    data = os.urandom(2 * (1 << 20) + 4567)  # more than one sendfile slice
    blob.write_bytes(data)

    async def scenario() -> None:
        transport, peer = await _pair()
        loop = asyncio.get_running_loop()
        sent: list[int] = []

        async def reader() -> bytes:
            out = bytearray()
            while len(out) < len(data) - 1000:
                out += await loop.sock_recv(peer, 1 << 16)
            return bytes(out)

        task = asyncio.create_task(reader())
        await send_file(transport, blob, 1000, 5.0, sent.append)
        assert await task == data[1000:] and sum(sent) == len(data) - 1000
        transport.close()
        peer.close()

    asyncio.run(scenario())


def test_the_running_digest_equals_a_second_pass_whatever_happened_to_the_file(tmp_path: Path) -> None:
    path = tmp_path / "x.partial"
    a, b = os.urandom(100_000), os.urandom(50_000)
    digest = FileDigest()
    digest.catch_up(path)  # no file yet
    assert digest.size == 0
    path.write_bytes(a)
    digest.catch_up(path)  # bytes written by someone else (a previous run): read once
    assert digest.size == len(a) and digest.hexdigest() == hashlib.sha256(a).hexdigest()
    with open(path, "ab") as fh:  # appended and fed as written: nothing read again
        fh.write(b)
    digest.update(b)
    digest.catch_up(path)
    assert digest.hexdigest() == hashlib.sha256(a + b).hexdigest()
    path.write_bytes(b)  # cut back and rewritten: it starts over
    digest.catch_up(path)
    assert digest.size == len(b) and digest.hexdigest() == hashlib.sha256(b).hexdigest()
