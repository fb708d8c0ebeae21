"""The listener's limits on a real coordinator (aiohttp on 127.0.0.1 behind coordinator.api.netguard, real
SQLite), driven over raw sockets as a hostile client would: bodies refused at the endpoint's cap while they
stream (chunked included), a hang-up mid-body is not an internal error, idle and slowloris connections are
capped and timed out, every response carries CSP and nosniff, and /v1/status is built once for quick readers
and rate-limited."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import select
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from coordinator.api.app import CONN_GUARD
from coordinator.api.netguard import ConnectionGuard
from coordinator.api.public_reads import PUBLIC_READS
from coordinator.api.status_page import WEB_DIR
from coordinator.config import load_config
from coordinator.launch.one_process import create_app
from coordinator.launch.serve import start_site
from coordinator.limits import SMALL_REQUEST_BYTES
from shared import wire
from shared.messages import ErrorBody
from tests.integration.helpers import db_rows, wait_until, write_config
from tests.integration.ops_helpers import scrape


@dataclass
class Served:
    url: str
    port: int
    app: web.Application
    run_dir: Path

    @property
    def guard(self) -> ConnectionGuard:
        return self.app[CONN_GUARD]


@contextlib.contextmanager
def guarded_coordinator(tmp_path: Path, model_dir: Path, **server: Any) -> Iterator[Served]:
    """A coordinator served exactly as `echo-swarm coordinator` serves it (coordinator.launch.serve.start_site), in a
    background thread; ``server`` overrides [server] keys."""
    run_dir = tmp_path / "run"
    cfg = load_config(write_config(tmp_path / "run.toml", run_dir, model_dir, learner={"max_steps": 50},
                                   server={"public_reads_per_address_rps": 0.0, **server},
                                   limits={"per_address_rps": 0.0}))
    app = create_app(cfg)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runner, site = asyncio.run_coroutine_threadsafe(start_site(app, cfg), loop).result(180)
    try:
        yield Served(f"http://127.0.0.1:{site.port}", site.port, app, run_dir)
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


def read_reply(sock: socket.socket, timeout: float = 20.0) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 reply with a Content-Length body, read off a raw socket."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a reply: {data!r}"
        data += chunk
    head, rest = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk
        rest += chunk
    return int(lines[0].split()[1]), headers, rest[:length]


def value(metrics: dict[Any, float], name: str, **labels: str) -> float:
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.mark.parametrize("path", ["/v1/register", "/v1/admin/status"])  # the app's own reader, and aiohttp's
def test_a_chunked_body_is_refused_at_the_endpoint_cap_while_it_streams(tmp_path: Path, tiny_model_dir: Path,
                                                                         path: str) -> None:
    with guarded_coordinator(tmp_path, tiny_model_dir) as served:
        before = served.guard.stats.bytes_received
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        # a small send buffer: what is in flight when the answer comes stays below what the server still
        # reads (and discards) after answering, so the answer is not lost to a reset
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 32 * 1024)
        sock.connect(("127.0.0.1", served.port))
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/msgpack\r\n"
                     f"Transfer-Encoding: chunked\r\n\r\n".encode())
        chunk = b"%x\r\n%s\r\n" % (8192, b"\xa5" * 8192)
        sent, total = 0, 16 * 1024 * 1024  # what an attacker would stream: 16 MiB against a 64 KiB cap
        sock.setblocking(False)
        while sent < total and not select.select([sock], [], [], 0)[0]:  # until the server answers
            try:
                sent += sock.send(chunk) and len(chunk)
            except BlockingIOError:
                select.select([sock], [sock], [], 1.0)
        sock.setblocking(True)
        status, headers, body = read_reply(sock)
        sock.close()
        assert status == 413 and wire.decode(body, ErrorBody).error == "body_too_large", (status, body)
        assert f"limit for {path}" in wire.decode(body, ErrorBody).message
        assert headers.get("connection", "").lower() == "close"
        # answered long before the whole body was sent, and the server read little more than the cap
        assert sent < total / 4, sent
        consumed = served.guard.stats.bytes_received - before
        assert SMALL_REQUEST_BYTES < consumed < SMALL_REQUEST_BYTES + 1024 * 1024, consumed
        assert db_rows(served.run_dir, "SELECT COUNT(*) FROM clients") == [(0,)]  # nothing written


def test_a_client_hanging_up_mid_body_is_counted_apart_not_as_an_internal_error(
        tmp_path: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    with guarded_coordinator(tmp_path, tiny_model_dir) as served:
        expected = {"/v1/results": 0, "/v1/register": 0}
        metrics: dict[Any, float] = {}
        for path in ("/v1/results", "/v1/register", "/v1/results"):
            sock = socket.create_connection(("127.0.0.1", served.port))
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/msgpack\r\n"
                         f"Content-Length: 2000\r\n\r\n".encode() + b"\x00" * 500)
            wait_until(lambda: any(c.phase == "body" for c in list(served.guard.open)), 30,
                       "the server to start reading the body")
            sock.close()  # gone mid-body
            expected[path] += 1

            def counted() -> dict[Any, float]:  # each hang-up answered before the next is sent: no reordering
                m = scrape(served.url)
                return m if all(value(m, "echo_swarm_http_requests_total", route=route, status="499") == n
                                for route, n in expected.items()) else {}

            metrics = wait_until(counted, 30, f"the hang-up on {path} to be counted as 499 ({expected})")
        assert not [k for k in metrics if k[0] == "echo_swarm_http_requests_total" and ("status", "500") in k[1]]
    # the coordinator's and aiohttp's own records (a test loop torn down earlier may log pending tasks)
    errors = [r for r in caplog.records if (r.levelno >= logging.ERROR or r.exc_info)
              and r.name.split(".")[0] in ("coordinator", "aiohttp")]
    assert not errors, [r.getMessage() for r in errors]
    assert sum("hung up" in r.getMessage() for r in caplog.records) == 3


def test_every_response_carries_csp_and_nosniff_and_the_page_needs_nothing_inline(tmp_path: Path,
                                                                                  tiny_model_dir: Path) -> None:
    with guarded_coordinator(tmp_path, tiny_model_dir) as served:
        for path, method in (("/", "GET"), ("/static/status.js", "GET"), ("/healthz", "GET"), ("/v1/status", "GET"),
                             ("/metrics", "GET"), ("/v1/nowhere", "GET"), ("/v1/register", "POST")):
            req = urllib.request.Request(served.url + path, method=method, data=b"\xc1" if method == "POST" else None)
            try:
                with urllib.request.urlopen(req, timeout=30) as resp:
                    headers = resp.headers
            except urllib.error.HTTPError as err:
                headers = err.headers
            assert headers["X-Content-Type-Options"] == "nosniff", path
            csp = headers["Content-Security-Policy"]
            assert "default-src 'none'" in csp and "script-src 'self'" in csp and "unsafe" not in csp, (path, csp)
            assert "frame-ancestors 'none'" in csp
    # the page works under that policy: no inline script or style, no markup built from strings
    html = (WEB_DIR / "index.html").read_text()
    assert all("src=" in tag for tag in re.findall(r"<script[^>]*>", html)) and not re.search(r"\sstyle=", html)
    js = (WEB_DIR / "status.js").read_text()
    assert "innerHTML" not in js and "style=" not in js and "eval(" not in js


def test_status_is_built_once_for_quick_readers_and_rate_limited_per_address(tmp_path: Path,
                                                                             tiny_model_dir: Path) -> None:
    with guarded_coordinator(tmp_path, tiny_model_dir, public_reads_per_address_rps=0.5,
                             public_reads_burst=3, public_cache_s=30.0) as served:
        builds = served.app[PUBLIC_READS].cache.builds
        replies = []
        for _ in range(2):
            with urllib.request.urlopen(served.url + "/v1/status", timeout=30) as resp:
                replies.append(json.loads(resp.read()))
        assert builds.get("status-full") == 1 and replies[0] == replies[1]
        with urllib.request.urlopen(served.url + "/metrics", timeout=30) as resp:
            assert 'echo_swarm_public_reply_builds_total{reply="status-full"} 1.0' in resp.read().decode()
        with pytest.raises(urllib.error.HTTPError) as refused:  # the fourth read within a second
            urllib.request.urlopen(served.url + "/v1/status", timeout=30)
        assert refused.value.code == 429
        assert wire.decode(refused.value.read(), ErrorBody).error == "rate_limited"
        assert builds.get("status-full") == 1  # nothing was built for the refused reader
        with urllib.request.urlopen(served.url + "/healthz", timeout=30) as resp:  # never limited
            assert resp.status == 200


def test_idle_and_slowloris_connections_are_capped_and_closed_while_others_are_served(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    with guarded_coordinator(tmp_path, tiny_model_dir, header_timeout_s=1.5, max_connections_per_address=16
                             ) as served:
        idle = [socket.create_connection(("127.0.0.1", served.port)) for _ in range(20)]
        loris = [socket.create_connection(("127.0.0.1", served.port)) for _ in range(20)]
        for s in loris:
            s.sendall(b"GET /v1/status HTTP/1.1\r\n")
        wait_until(lambda: served.guard.stats.accepted >= 40, 30, "the flood to be accepted")
        assert len(served.guard.open) <= 16 and served.guard.stats.evicted >= 24
        started = time.monotonic()
        while time.monotonic() - started < 2.5:  # the slowloris keeps trickling header bytes
            for s in loris:
                with contextlib.suppress(OSError):
                    s.send(b"X")
            with urllib.request.urlopen(served.url + "/healthz", timeout=10) as resp:  # room is made for others
                assert resp.status == 200
            threading.Event().wait(0.25)
        wait_until(lambda: served.guard.stats.expired["header"] >= 1 and not any(
            c.phase in ("fresh", "headers") for c in list(served.guard.open)), 10, "the flood to time out")
        assert served.guard.stats.peak <= 16
        for s in idle + loris:
            s.close()
        metrics = scrape(served.url)
        assert value(metrics, "echo_swarm_connections_evicted_total") >= 24
        assert value(metrics, "echo_swarm_connections_timed_out_total", phase="header") >= 1
        assert value(metrics, "echo_swarm_connections_limit") == served.guard.caps.total


def test_a_body_that_trickles_in_is_cut_off_at_the_body_timeout(tmp_path: Path, tiny_model_dir: Path) -> None:
    with guarded_coordinator(tmp_path, tiny_model_dir, body_timeout_s=1.5) as served:
        sock = socket.create_connection(("127.0.0.1", served.port))
        sock.sendall(b"POST /v1/register HTTP/1.1\r\nHost: x\r\nContent-Type: application/msgpack\r\n"
                     b"Content-Length: 4000\r\n\r\n")
        sock.settimeout(0.2)
        started, closed = time.monotonic(), False
        # one byte every 0.2 s: never done in time. Cut within 30 s, a quarter of the 120-s default, the configured
        # 1.5 s applied (how much sooner is the machine's load, not the server's rule)
        while not closed and time.monotonic() - started < 30:
            try:
                sock.send(b"\x00")
                closed = sock.recv(1) == b""
            except TimeoutError:
                continue
            except OSError:
                closed = True
        sock.close()
        assert closed, "the trickling body was not cut within 30 s"
        assert served.guard.stats.expired["body"] == 1  # cut for the body timeout, not for another reason
        assert db_rows(served.run_dir, "SELECT COUNT(*) FROM clients") == [(0,)]
