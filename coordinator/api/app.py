"""HTTP surface of the coordinator (aiohttp), and the API role's composition: handlers parse, call the role's
phases (coordinator.api.service.Coordinator builds them: sign-in, leasing, intake, the run's reads), and encode; every
domain error becomes an HTTP status plus a msgpack ``{error, message}`` body in one middleware.

Availability (issue 13): the outer middleware tells the connection guard (coordinator.api.netguard) what each
connection is doing, and every POST body is capped at its endpoint's limit *while it streams*; a client that hangs
up mid-request is answered 499 (counted, never logged as an internal error); every response carries nosniff
and a strict Content-Security-Policy; ``/v1/status`` is shared and rate-limited (coordinator.api.public_reads).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from aiohttp import web

from coordinator.api import admin, metrics, netguard, status_page
from coordinator.api.egress import EGRESS_COUNTER, EGRESS_FLUSH_S, stored_report
from coordinator.api.ops_actions import Operations
from coordinator.api.public_reads import PUBLIC_READS, PublicReads
from coordinator.api.service import Coordinator
from coordinator.api.status_page import select_status
from coordinator.config import CoordinatorConfig
from coordinator.core.connections import Phase, address_key
from coordinator.core.ratelimit import BurstLog
from coordinator.limits import MAX_REQUEST_BYTES, SIGNED_POSTS
from coordinator.run.names import P2P
from coordinator.run.relay import TOKEN_HEADER, relayed_address
from shared import wire
from shared.endpoints import (
    BLOB,
    HEALTHZ,
    INFO,
    LEASE,
    NOTICES,
    P2P_INFO,
    READS,
    REGISTER,
    RELEASE,
    RESULTS,
    SNAPSHOT,
    STATUS,
    Read,
)
from shared.errors import ProtocolError, Reason
from shared.messages import ErrorBody, P2PInfo

logger = logging.getLogger(__name__)

COORDINATOR = web.AppKey("coordinator", Coordinator)
#: Set when a role this process runs beside the API has failed: the process stops (coordinator.launch.serve).
FATAL = web.AppKey("fatal", asyncio.Event)
CONN_GUARD = web.AppKey("conn_guard", netguard.ConnectionGuard)
#: Internal errors are logged (with their traceback) at most once a minute per kind and route; the rest counted.
INTERNAL_ERRORS = web.AppKey("internal_errors", BurstLog)
INTERNAL_ERROR_LOG_S = 60.0
MSGPACK = "application/msgpack"
#: The status page loads only its own script, stylesheet and JSON; nothing inline, no frames, no forms.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
SECURITY_HEADERS = {"X-Content-Type-Options": "nosniff", "Content-Security-Policy": CSP,
                    "Referrer-Policy": "no-referrer"}
#: nginx's code for "client closed the request": counted under its own status, not as a server error.
CLIENT_CLOSED = 499
BODY_CHUNK = 64 * 1024
#: Body bytes still read (and discarded) after a request was answered without reading all of its body, so the
#: client sees the answer instead of a reset; beyond it the connection is closed.
DRAIN_AFTER_REFUSAL = 256 * 1024
_SHA = re.compile(r"[0-9a-f]{64}")
_VERSION = re.compile(r"[0-9]{1,9}", re.ASCII)


def _packed(data: bytes, status: int = 200) -> web.Response:
    return web.Response(body=data, status=status, content_type=MSGPACK)


def error_response(reason: Reason, message: str, status: int | None = None) -> web.Response:
    """The msgpack ``ErrorBody`` reply of a refusal. A message that quotes the request (a path segment, a header)
    may hold lone surrogates (undecodable bytes); they are escaped, since a msgpack str must be UTF-8."""
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    err = ProtocolError(reason, message)
    return _packed(wire.encode(ErrorBody(error=reason.value, message=message[:2048])), status or err.http_status)


class ClientGone(Exception):
    """The client closed its connection before its request was read: nothing to answer, nothing wrong here."""


@web.middleware
async def connection_middleware(request: web.Request,
                                handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """Outermost: marks the connection busy for the guard (netguard.ReplyWritten marks it idle once the
    reply is out), caps any POST body at its endpoint's limit (aiohttp's own ``read()`` then stops there
    too), and bounds what is still read of a body the answer did not need."""
    netguard.mark(request, Phase.HANDLING)
    if request.method == "POST":
        request = request.clone(client_max_size=request.app[COORDINATOR].body_cap(request.path))
    try:
        return await handler(request)
    finally:
        if not request.content.is_eof():  # answered before its body was read: discard a little, then close
            netguard.limit_drain(request, DRAIN_AFTER_REFUSAL)


@web.middleware
async def durability_middleware(request: web.Request,
                                handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """No reply leaves before what its request committed is power-safe (an accepted result above all): the
    store's commits are not fsynced under SQLite's write lock, so a lease never waits for a disk flush
    (coordinator.store.db, durability); the flush happens here, after the commit, off the event loop. Only a
    request during which something was committed waits for it (a role's commit in the meantime may be counted)."""
    coord = request.app[COORDINATOR]
    store = getattr(coord, "store", None)  # absent before the start
    before = 0 if store is None else store.commits  # the durability watermark (Coordinator.flush)
    response = await handler(request)
    await coord.flush(since=before)
    return response


@web.middleware
async def errors_middleware(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                            ) -> web.StreamResponse:
    """Every request is charged to its address's budget before anything else (coordinator.api.guard; issue 24):
    whatever follows — a refusal, a handler that raises, an unexpected fault — it has been counted, so no kind of
    failure is a free request. Then the input's own faults become typed 4xx replies (a header that is not ASCII:
    ``bad_header``, naming it); only the coordinator's own faults are 500s, logged once per burst with a count."""
    try:
        charge(request)
        return await handler(request)
    except ProtocolError as exc:
        response = error_response(exc.reason, exc.message)
        if exc.reason is Reason.BODY_TOO_LARGE:
            response.force_close()
        return response
    except ClientGone:
        logger.info("client %s hung up during %s %s", request.remote, request.method, printable(request.path))
        return web.Response(status=CLIENT_CLOSED)
    except web.HTTPRequestEntityTooLarge:  # a handler's own request.read() passed the cap set above
        response = error_response(Reason.BODY_TOO_LARGE, f"request body exceeds {request.client_max_size} bytes, "
                                                          f"the limit for {printable(request.path)}")
        response.force_close()
        return response
    except web.HTTPNotFound:  # the router found no route (e.g. a name with characters a route never matches)
        if request.path.startswith(BLOB.prefix):
            return error_response(Reason.NO_SUCH_BLOB, f"no file named {printable(request.path[len(BLOB.prefix):][:64])!r} is being "
                                                       f"served")
        if request.path.startswith(SNAPSHOT.prefix):
            return error_response(Reason.NO_SUCH_VERSION, f"{printable(request.path[len(SNAPSHOT.prefix):][:26])!r} is not a published "
                                                          f"version")
        return error_response(Reason.NOT_FOUND, f"there is no endpoint {printable(request.path)}; see "
                                                f"docs/protocol.md")
    except web.HTTPMethodNotAllowed as exc:
        return error_response(Reason.METHOD_NOT_ALLOWED, f"{printable(request.method)} is not allowed on "
                                                         f"{printable(request.path)}; use "
                                                         f"{', '.join(sorted(exc.allowed_methods))}")
    except web.HTTPException:
        raise
    except Exception as exc:
        key = f"{type(exc).__name__} {request.method[:16]} {_route(request)}"
        held_back = request.app[INTERNAL_ERRORS].allow(key, time.monotonic())
        if held_back is not None:  # the first of a burst (with the count of the last one's), the rest counted
            more = f" ({held_back} more like it since the last report)" if held_back else ""
            logger.exception("internal error handling %s %s%s", printable(request.method), printable(request.path),
                             more)
        return error_response(Reason.INTERNAL, "the coordinator hit an internal error; it has been logged")


ADDRESS = web.RequestKey("client_address", str)  # set by charge() for every request it lets through


def printable(text: str, limit: int = 200) -> str:
    """``text`` cut to ``limit`` characters with anything but printable ASCII escaped: request paths, methods and
    header names go into replies (msgpack str must be UTF-8) and log lines, and aiohttp hands over undecodable
    bytes as lone surrogates that neither can encode."""
    cut = text[:limit]
    return cut if cut.isascii() and cut.isprintable() else ascii(cut)[1:-1]


def _route(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


def _charge_unparsed(coord: Coordinator, address: str) -> None:
    """A request aiohttp's parser refused never reaches errors_middleware: the connection guard charges it here
    (netguard.ReplyWritten), so it too counts against its address's budget."""
    coord.guard.per_address.check(address, coord.clock())  # nothing to refuse: the parser answered already


def check_headers(request: web.BaseRequest) -> None:
    """Refuse (400 ``bad_header``, naming it) a header whose name or value is not printable ASCII. HTTP header
    values are bytes; aiohttp decodes them as UTF-8 with surrogate escapes, so anything else would reach code that
    compares, encodes or logs them as text."""
    for name, value in request.headers.items():
        if not (name.isascii() and value.isascii() and name.isprintable() and (not value or value.isprintable())):
            raise ProtocolError(Reason.BAD_HEADER, f"header {printable(name, 64)!r} is not printable ASCII "
                                                   f"({printable(value, 40)!r}); send ASCII header values "
                                                   f"(percent-encode anything else)")


def charge(request: web.Request) -> None:
    """Count the request against its address's budget (429 ``rate_limited`` past it) and record the address as
    ``request[ADDRESS]``. A request whose headers cannot be read, or whose relay header is forged, is charged to
    the address it came from, then refused."""
    coord = request.app[COORDINATOR]
    now = coord.clock()
    try:
        check_headers(request)
        request[ADDRESS] = client_address(request)
    except ProtocolError:
        coord.guard.check_address(address_key(request.remote or ""), now)
        raise
    coord.guard.check_address(request[ADDRESS], now)


def client_address(request: web.Request) -> str:
    """Whom the per-address budgets count a request against: its remote address (an IPv4 address or IPv6 /64,
    coordinator.core.connections.address_key), or for a call the coordinator's own p2p role relays (its token in
    the header, coordinator.run.relay) the address the caller's libp2p connection comes from. A relay header
    without the token raises ``bad_relay``."""
    if TOKEN_HEADER not in request.headers:
        return address_key(request.remote or "")
    coord = request.app[COORDINATOR]
    if getattr(coord, "key", None) is None:  # not started: no token to check against, so no relay yet
        raise ProtocolError(Reason.BAD_RELAY, "the coordinator is starting; it accepts no relayed call yet")
    return relayed_address(request.headers, coord.relay_token) or ""


async def read_body(request: web.Request, cap: int) -> bytes:
    """The request body, refused (413) as soon as it passes ``cap`` — from Content-Length before a byte is
    read, or while it streams (chunked uploads carry no length): at most ``cap`` + one chunk is ever held.
    A client that hangs up meanwhile raises :class:`ClientGone`."""
    if request.content_length is not None and request.content_length > cap:
        raise ProtocolError(Reason.BODY_TOO_LARGE, f"request body is {request.content_length} bytes; "
                                                   f"the limit for {printable(request.path)} is {cap}")
    netguard.mark(request, Phase.BODY)
    body = bytearray()
    try:
        while chunk := await request.content.read(BODY_CHUNK):
            body += chunk
            if len(body) > cap:
                raise ProtocolError(Reason.BODY_TOO_LARGE, f"request body passed {cap} bytes, the limit for "
                                                           f"{printable(request.path)}; reading stopped there")
    except ConnectionError as exc:  # aiohttp sets ConnectionResetError("Connection lost") on the payload
        raise ClientGone(str(exc)) from None
    except web.RequestPayloadError as exc:  # e.g. a broken chunked encoding
        raise ProtocolError(Reason.MALFORMED, f"the request body could not be read: {exc}") from None
    finally:
        netguard.mark(request, Phase.HANDLING)
    return bytes(body)


async def _body(request: web.Request) -> bytes:
    return await read_body(request, min(MAX_REQUEST_BYTES, request.app[COORDINATOR].body_cap(request.path)))


async def info(request: web.Request) -> web.Response:
    return _packed(wire.encode(request.app[COORDINATOR].view.info()))


async def notices(request: web.Request) -> web.Response:
    return _packed(wire.encode(request.app[COORDINATOR].view.notices()))


async def register(request: web.Request) -> web.Response:
    signin = request.app[COORDINATOR].signin
    return _packed(wire.encode(signin.register(await _body(request), request.get(ADDRESS, ""))))


async def lease(request: web.Request) -> web.Response:
    return _packed(wire.encode(await request.app[COORDINATOR].leasing.lease(await _body(request))))


async def release(request: web.Request) -> web.Response:
    return _packed(wire.encode(request.app[COORDINATOR].leasing.release(await _body(request))))


async def results(request: web.Request) -> web.Response:
    return _packed(wire.encode(await request.app[COORDINATOR].intake.submit(await _body(request))))


#: The handler of each signed call (shared.endpoints; the calls the coordinator's libp2p peer relays here too, §6b).
SIGNED_HANDLERS: dict[str, Callable[[web.Request], Awaitable[web.Response]]] = {
    REGISTER.path: register, LEASE.path: lease, RELEASE.path: release, RESULTS.path: results}
assert set(SIGNED_HANDLERS) == set(SIGNED_POSTS), "every signed call of shared.endpoints needs its handler here"


async def snapshot_manifest(request: web.Request) -> web.Response:
    raw = request.match_info["version"]
    coord = request.app[COORDINATOR]
    version = coord.version if raw == "latest" else int(raw) if _VERSION.fullmatch(raw) else -1
    signed = coord.snapshots.signed_manifest(version)
    if signed is None:
        raise ProtocolError(Reason.NO_SUCH_VERSION, f"version {raw} is not published (or was pruned); "
                                                    f"current is {coord.version}")
    return _packed(signed)


async def blob(request: web.Request) -> web.StreamResponse:
    sha = request.match_info["sha256"]
    path = request.app[COORDINATOR].snapshots.blob_path(sha) if _SHA.fullmatch(sha) else None
    if path is None:
        raise ProtocolError(Reason.NO_SUCH_BLOB, f"no file with sha256 {sha[:64]} is being served")
    return web.FileResponse(path, headers={"Cache-Control": "public, max-age=31536000, immutable"})


async def p2p_info(request: web.Request) -> web.Response:
    coord = request.app[COORDINATOR]
    return _packed(wire.encode(coord.egress.info() if coord.config.p2p.enabled else P2PInfo(enabled=False)))


async def _count_blob_bytes(request: web.Request, response: web.StreamResponse) -> None:
    """Snapshot file bytes sent over HTTP, for the status page's coordinator egress (coordinator.roles.p2p)."""
    resource = request.match_info.route.resource
    if (resource is not None and resource.canonical == BLOB.path and response.status in (200, 206)
            and response.content_length):
        request.app[COORDINATOR].egress.http_bytes += response.content_length


async def status(request: web.Request) -> web.Response:
    public = request.app[PUBLIC_READS]
    public.check(request)
    coord = request.app[COORDINATOR]
    view = "page" if request.query.get("view") == "page" else "full"
    data = public.cache.get(f"status-{view}", coord.version, coord.store.changes,
                            lambda: json.dumps(select_status(coord.view, view), default=str).encode())
    return web.Response(body=data, content_type="application/json", headers={"Cache-Control": "no-store"})


async def _security_headers(request: web.Request, response: web.StreamResponse) -> None:
    for name, value in SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"ok": True, "version": request.app[COORDINATOR].version})


#: The handler of each public read (shared.endpoints.READS).
READ_HANDLERS: dict[Read, Callable[[web.Request], Awaitable[web.StreamResponse]]] = {
    INFO: info, NOTICES: notices, SNAPSHOT: snapshot_manifest, BLOB: blob, P2P_INFO: p2p_info, STATUS: status, HEALTHZ: healthz}
assert set(READ_HANDLERS) == set(READS), "every read of shared.endpoints needs its handler here"


@contextlib.asynccontextmanager
async def api_role(app: web.Application) -> AsyncIterator[None]:
    """Start and stop the API role: its store connection and watch (Coordinator.start), the nonce pruner, and with
    ``p2p.enabled`` the p2p role's report as the egress source. The one-process layout (coordinator.launch.
    one_process) starts the other roles around this, sharing the API's run files and doorbell."""
    coord = app[COORDINATOR]
    background: list[asyncio.Task[None]] = []
    try:
        await coord.start()
        _hand_over(app, coord)
        coord.store.nonces.prune(coord.clock())  # opens (creates) the API's nonce database before serving
        background.append(asyncio.create_task(_prune_nonces(coord), name="nonce-pruner"))
        background.append(asyncio.create_task(_keep_counters(coord), name="counters"))
        if coord.config.p2p.enabled:  # the peer's report, from its own role process (or from this process's peer)
            coord.egress.remote = lambda: stored_report(coord.store.role_status.get(P2P))
        yield
    finally:
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        with contextlib.suppress(Exception):  # the last seconds' bytes; a store already closed loses only them
            coord.egress.flush(lambda n: coord.store.add_to_counter(EGRESS_COUNTER, n))
        await coord.stop()


def _hand_over(app: web.Application, coord: Coordinator) -> None:
    """Hand the admin API, the status pages and the metrics the parts of the started API role they use (during
    the app's startup: it is not frozen yet)."""
    admin.serve(app, Operations(coord.view, coord.run_dir, coord.leasing.notify_jobs, coord.run_io), coord.signin)
    app[status_page.STATUS_VIEW] = coord.view
    app[metrics.METRICS].follow(coord.view, coord.intake)


async def _api_alone(app: web.Application) -> AsyncIterator[None]:
    async with api_role(app):
        yield


async def _keep_counters(coord: Coordinator) -> None:
    """Add the snapshot bytes served to the store's counter every few seconds, so the status page's figure
    survives a restart."""
    while True:
        await asyncio.sleep(EGRESS_FLUSH_S)
        coord.egress.flush(lambda n: coord.store.add_to_counter(EGRESS_COUNTER, n))


async def _prune_nonces(coord: Coordinator) -> None:
    while True:
        await asyncio.sleep(60)
        coord.store.nonces.prune(coord.clock())


def create_app(config: CoordinatorConfig, coordinator: Coordinator | None = None, *,
               roles: Callable[[web.Application], AsyncIterator[None]] = _api_alone) -> web.Application:
    """The HTTP app of the API role. ``roles`` starts and stops what this process runs (an aiohttp cleanup
    context): the API alone by default (the process layout), or the one-process layout's roles around
    :func:`api_role` (coordinator.launch.one_process)."""
    app = web.Application(client_max_size=MAX_REQUEST_BYTES, middlewares=[connection_middleware, durability_middleware, errors_middleware])
    app[COORDINATOR] = coordinator or Coordinator(config)
    app[FATAL] = asyncio.Event()
    app[CONN_GUARD] = netguard.ConnectionGuard(config.server)
    app[PUBLIC_READS] = PublicReads(config.server)
    app[INTERNAL_ERRORS] = BurstLog(INTERNAL_ERROR_LOG_S)
    app[CONN_GUARD].charge = functools.partial(_charge_unparsed, app[COORDINATOR])
    app.on_response_prepare.append(_security_headers)
    app.on_response_prepare.append(_count_blob_bytes)
    app.cleanup_ctx.append(roles)
    for path, handler in SIGNED_HANDLERS.items():
        app.router.add_post(path, handler)
    for read, reader in READ_HANDLERS.items():
        app.router.add_get(read.path, reader)
    # issue 6: /metrics, /v1/admin/*, /
    metrics.install(app, app[CONN_GUARD])
    admin.install(app, Path(config.run_dir))
    status_page.install(app)
    return app
