"""The protocol's signed calls over libp2p (docs/protocol.md §6b): a client that joined the swarm's DHT can send
``/v1/register``, ``/v1/lease``, ``/v1/release`` and ``/v1/results`` to the coordinator's libp2p peer instead of
its HTTP address. The bytes are the HTTP ones: the same SignedRequest envelope goes out, the same status and reply
body (msgpack) come back, because the coordinator's peer relays each call to its own API (coordinator.roles.p2p_relay),
so both transports share one code path and one set of checks.

Requests and replies travel in a stream, never in hivemind's unary replies (a reply over 4 MiB hangs the caller,
../shared/notes/p2p.md), as a head frame (the blob protocol's framing: 4-byte big-endian length ≤ 4096, then
msgpack) followed by exactly the bytes the head announces. Every read and write has a timeout.
Importing hivemind imports torch: this module imports it only inside :func:`call`.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from typing import Any, TypeVar

from pydantic import BaseModel

from shared import wire
from shared.messages import MAX_CALL_BYTES, CallReply, CallRequest

CALL_PROTOCOL = "/echo-swarm/call/1"
MAX_HEAD = 4096  # a head frame (CallRequest / CallReply), as the blob protocol's frames
CHUNK = 64 * 1024
IDLE_S = 10.0  # longest wait for the next bytes of a head or body being sent or received

M = TypeVar("M", bound=BaseModel)


async def write_head(writer: asyncio.StreamWriter, message: BaseModel, idle_s: float = IDLE_S) -> None:
    data = wire.encode(message)
    writer.write(struct.pack(">I", len(data)) + data)
    await asyncio.wait_for(writer.drain(), idle_s)


async def read_head(reader: asyncio.StreamReader, model: type[M], wait_s: float = IDLE_S) -> M:
    """One head frame; ``wait_s`` bounds the wait for its first byte (a reply head comes after the API's answer)."""
    head = await asyncio.wait_for(reader.readexactly(4), wait_s)
    (n,) = struct.unpack(">I", head)
    if n > MAX_HEAD:
        raise ValueError(f"head frame of {n} bytes; the limit is {MAX_HEAD}")
    return wire.decode(await asyncio.wait_for(reader.readexactly(n), IDLE_S), model)


async def write_body(writer: asyncio.StreamWriter, data: bytes, idle_s: float = IDLE_S) -> None:
    for i in range(0, len(data), CHUNK):
        writer.write(data[i:i + CHUNK])
        await asyncio.wait_for(writer.drain(), idle_s)


async def read_body(reader: asyncio.StreamReader, length: int, idle_s: float = IDLE_S) -> bytes:
    """Exactly ``length`` bytes (the caller bounded it), each chunk within ``idle_s``."""
    out = bytearray()
    while len(out) < length:
        chunk = await asyncio.wait_for(reader.read(min(CHUNK, length - len(out))), idle_s)
        if not chunk:
            raise asyncio.IncompleteReadError(bytes(out), length)
        out += chunk
    return bytes(out)


async def _send(writer: asyncio.StreamWriter, head: CallRequest, body: bytes) -> None:
    await write_head(writer, head)
    await write_body(writer, body)


async def call(p2p: Any, peer_id: str, path: str, body: bytes, timeout_s: float) -> tuple[int, bytes]:
    """Send one signed call to ``peer_id`` over ``p2p`` (a started hivemind P2P) and return the API's HTTP status
    and reply bytes. Raises on any transport failure (TimeoutError, ConnectionError, hivemind's P2P errors,
    ValueError for a bad frame): the caller falls back to HTTP. ``timeout_s`` bounds the whole call."""
    from hivemind.p2p import PeerID

    if len(body) > MAX_CALL_BYTES:
        raise ValueError(f"a call body of {len(body)} bytes; the limit is {MAX_CALL_BYTES}")

    async def go() -> tuple[int, bytes]:
        _, reader, writer = await asyncio.wait_for(
            p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), CALL_PROTOCOL), IDLE_S)
        # the reply is read while the body is sent: a refusal from the head alone (too large, unknown path, busy)
        # comes before the body is read, and then the rest of the body cannot be written any more
        sending = asyncio.ensure_future(_send(writer, CallRequest(path=path, length=len(body)), body))
        try:
            reply = await read_head(reader, CallReply, wait_s=timeout_s)
            return reply.status, await read_body(reader, reply.length)
        except Exception:
            if sending.done() and not sending.cancelled() and sending.exception() is not None:
                raise sending.exception() from None  # type: ignore[misc]  # the cause: the send failed first
            raise
        finally:
            sending.cancel()
            with contextlib.suppress(BaseException):
                await sending
            writer.close()

    return await asyncio.wait_for(go(), timeout_s)
