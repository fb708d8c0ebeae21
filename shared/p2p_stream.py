"""Moving a snapshot file over one libp2p blob stream (docs/protocol.md §6a) at about the cost of the stream itself.

Measured (docs/benchmarks.md, bench/egress.py) the Python side cost several times the two p2pd daemons: a task
wake-up and a ``wait_for`` per 32-256 KiB read, each read copied into the StreamReader's buffer, out of it, and
again into the piece, and the sender reading the file into Python to write it to the daemon's socket. Here:

- the sender hands the file to the kernel (``loop.sendfile``: ``sendfile(2)`` into the daemon's unix socket; no
  byte enters Python);
- the receiver takes over the stream's transport with a :class:`PieceReceiver` (an ``asyncio.BufferedProtocol``):
  the socket is read straight into one piece-sized buffer (``recv_into``), and the fetching task wakes once per
  piece, not once per read. It hashes that buffer for the piece and for the whole file and writes it from there.
"""

from __future__ import annotations

import asyncio
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

MAX_FRAME = 4096  # a request or reply frame (msgpack), after its 4-byte length
SEND_SLICE = 1 << 20  # the sender's idle timeout applies to each slice: a slice must move within it


class StreamCut(ConnectionError):
    """The blob stream ended, broke or sat idle before the bytes asked for arrived (resume from the last piece)."""


class PieceReceiver(asyncio.BufferedProtocol):
    """The receiving end of a blob stream, installed on its transport before the request is sent (nothing can
    arrive before it). :meth:`fill` reads exactly ``n`` bytes into the one buffer and returns a view of them;
    reading is paused in between, so the sender is held back by the stream's flow control, never by memory here.
    The view is valid until the next :meth:`fill`."""

    def __init__(self, transport: Any) -> None:
        self.transport = transport
        self.buf = bytearray(MAX_FRAME + 4)  # grows to a piece on the first piece (not for a refusal)
        self.view = memoryview(self.buf)
        self.want = self.filled = 0
        self.received = 0  # bytes in all, for the idle check
        self.waiter: asyncio.Future[None] | None = None
        self.ended: BaseException | None = None
        transport.pause_reading()
        transport.set_protocol(self)

    # -- asyncio.BufferedProtocol ---------------------------------------------------------------------------
    def get_buffer(self, sizehint: int) -> memoryview:
        return self.view[self.filled:self.want]

    def buffer_updated(self, nbytes: int) -> None:
        self.filled += nbytes
        self.received += nbytes
        if self.filled >= self.want:
            self.transport.pause_reading()
            self._wake(None)

    def eof_received(self) -> bool:
        self._end(StreamCut(f"the peer closed the stream {self.want - self.filled} bytes short"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(StreamCut(f"the stream broke ({type(exc).__name__ if exc else 'closed'})"))

    def _end(self, exc: BaseException) -> None:
        if self.ended is None:
            self.ended = exc
        self._wake(exc)

    def _wake(self, exc: BaseException | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            if exc is None:
                self.waiter.set_result(None)
            else:
                self.waiter.set_exception(exc)

    # -- the fetching task's side ----------------------------------------------------------------------------
    async def fill(self, n: int, idle_timeout_s: float) -> memoryview:
        """The next ``n`` bytes of the stream; :class:`StreamCut` if it ends first or no byte arrives for
        ``idle_timeout_s`` (a slow link that keeps moving is never cut)."""
        if n > len(self.buf):
            self.buf = bytearray(n)
            self.view = memoryview(self.buf)
        if self.ended is not None:
            raise self.ended
        self.want, self.filled = n, 0
        self.waiter = asyncio.get_running_loop().create_future()
        if n:
            self.transport.resume_reading()
        else:
            self.waiter.set_result(None)
        seen = -1
        try:
            while not self.waiter.done():
                if self.received == seen:
                    raise StreamCut(f"no byte for {idle_timeout_s:.0f}s")
                seen = self.received
                await asyncio.wait((self.waiter,), timeout=idle_timeout_s)
        finally:
            if not self.waiter.done():  # cut or cancelled: nothing may set (and leave unread) its outcome later
                self.waiter.cancel()
                self.transport.pause_reading()
        self.waiter.result()
        return self.view[:n]

    async def frame(self, idle_timeout_s: float) -> bytes:
        """One frame of the blob protocol: a 4-byte big-endian length (≤ MAX_FRAME), then that many bytes."""
        (n,) = struct.unpack(">I", await self.fill(4, idle_timeout_s))
        if n > MAX_FRAME:
            raise ValueError(f"frame of {n} bytes; the limit is {MAX_FRAME}")
        return bytes(await self.fill(n, idle_timeout_s))


async def send_file(transport: Any, path: Path, offset: int, idle_timeout_s: float,
                    on_sent: Callable[[int], None]) -> None:
    """Send ``path`` from ``offset`` to its end over ``transport`` by ``sendfile(2)`` (asyncio falls back to
    reads and writes where the transport cannot), a slice at a time so that a stalled reader is cut after
    ``idle_timeout_s``; ``on_sent`` sees the bytes of each slice sent."""
    loop = asyncio.get_running_loop()
    with open(path, "rb") as fh:
        left = os.fstat(fh.fileno()).st_size - offset
        while left > 0:
            sent = await asyncio.wait_for(loop.sendfile(transport, fh, offset, min(SEND_SLICE, left)), idle_timeout_s)
            if sent <= 0:
                raise StreamCut("sendfile sent nothing")
            offset, left = offset + sent, left - sent
            on_sent(sent)
