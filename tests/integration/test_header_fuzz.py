"""Property-based fuzzing of the headers, methods and paths of every endpoint, sent directly and as relayed libp2p
calls (the relay's own headers with the run's token), against a real coordinator on loopback (issue 24).

The property, for every request: no 500 (nor any other 5xx); nothing written to the store; the request charged to
exactly one address's budget (the per-address bucket loses one token, or the request is refused ``rate_limited``).
A header that is not ASCII is answered 400 ``bad_header`` naming the header. The endpoints are the ones the real
app registers (its route table: ``create_app``'s router), each with a concrete path for its template.

Requests are written byte for byte on a socket: an HTTP client library would refuse (or re-encode) exactly the
bytes under test.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.run.relay import ADDRESS_HEADER, PEER_HEADER, TOKEN_HEADER
from shared.errors import HTTP_STATUS, Reason
from tests.integration.conftest import LiveCoordinator, running_coordinator
from tests.integration.helpers import db_rows

PEER = "12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo"
#: a budget that never runs out and never refills (the clock is the fake one): every charge is visible as one token
BURST = 1e9
REASONS = {r.value: HTTP_STATUS[r] for r in Reason}


def endpoints(run_dir: Path) -> list[tuple[str, str]]:
    """(method, concrete path) for every route of the real app, HEAD left out (aiohttp adds it to every GET)."""
    from coordinator.config import load_config
    from coordinator.launch.one_process import create_app

    app = create_app(load_config(None, {"run_dir": str(run_dir)}))
    concrete = {"{version}": "latest", "{sha256}": "0" * 64, "{client_id}": "a" * 32}
    found = set()
    for route in app.router.routes():
        if route.method == "HEAD" or route.resource is None:
            continue
        path = route.resource.canonical
        for template, value in concrete.items():
            path = path.replace(template, value)
        if path.startswith("/static"):
            path = "/static/app.js"
        found.add((route.method, path))
    assert ("POST", "/v1/register") in found and ("GET", "/v1/blobs/" + "0" * 64) in found
    assert len(found) >= 12, found
    return sorted(found)


ENDPOINTS = endpoints(Path("/nonexistent-run-dir-for-the-route-table"))


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[LiveCoordinator]:
    tmp = tmp_path_factory.mktemp("headers")
    # served as `echo-swarm coordinator` serves it: what aiohttp's parser refuses is charged by the connection guard
    with running_coordinator(tmp, tiny_model_dir, limits={"per_address_rps": 1e-9, "per_address_burst": BURST},
                             learner={"max_steps": 1}, guarded=True) as live:
        yield live


def fuzz(max_examples: int) -> Any:
    return settings(max_examples=max_examples, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


# ---- the raw request ---------------------------------------------------------------------------------------
def send(url: str, method: bytes, path: bytes, headers: list[tuple[bytes, bytes]], body: bytes = b""
         ) -> tuple[int, bytes]:
    host, port = re.fullmatch(r"http://([^:]+):(\d+)", url).groups()  # type: ignore[union-attr]
    head = [method + b" " + path + b" HTTP/1.1", b"Host: " + host.encode(), b"Connection: close",
            b"Content-Length: " + str(len(body)).encode()]
    head += [name + b": " + value for name, value in headers]
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(b"\r\n".join(head) + b"\r\n\r\n" + body)
        data = bytearray()
        while chunk := sock.recv(65536):
            data += chunk
    status_line, _, rest = bytes(data).partition(b"\r\n")
    status = int(status_line.split()[1])
    return status, rest.partition(b"\r\n\r\n")[2]


def error_of(body: bytes) -> tuple[str, str] | None:
    try:
        err = msgpack.unpackb(body, raw=False)
    except Exception:
        return None
    return (err["error"], err["message"]) if isinstance(err, dict) and "error" in err else None


def tokens(live: LiveCoordinator) -> tuple[float, int]:
    buckets = live.coordinator.guard.per_address._buckets
    return sum(b.tokens for b in buckets.values()), len(buckets)


def store_state(live: LiveCoordinator) -> list[tuple[Any, ...]]:
    return db_rows(live.run_dir, "SELECT (SELECT COUNT(*) FROM clients), (SELECT COUNT(*) FROM results), "
                                 "(SELECT COUNT(*) FROM rejections), (SELECT COUNT(*) FROM audit), "
                                 "(SELECT COUNT(*) FROM jobs WHERE state != 'open'), (SELECT COUNT(*) FROM versions)")


def check(live: LiveCoordinator, method: bytes, path: bytes, headers: list[tuple[bytes, bytes]], what: str
          ) -> tuple[int, tuple[str, str] | None]:
    before, before_state = tokens(live), store_state(live)
    status, body = send(live.url, method, path, headers)
    after = tokens(live)
    charged = before[0] + BURST * (after[1] - before[1]) - after[0]
    err = error_of(body)
    assert status < 500, f"{what}: {status} {body[:300]!r}"
    assert round(charged, 6) == 1 or (err is not None and err[0] == "rate_limited"), (
        f"{what}: charged {charged} tokens (want exactly 1); reply {status} {body[:200]!r}")
    assert store_state(live) == before_state, f"{what}: the request wrote to the store"
    if err is not None:
        assert REASONS.get(err[0]) == status, f"{what}: {status} with {err}"
    return status, err


# ---- strategies ----------------------------------------------------------------------------------------
# header values as bytes: printable ASCII, and the obs-text bytes 0x80–0xFF an HTTP parser lets through (valid
# UTF-8 or not) — the control bytes below 0x20 end a header line, so a parser refuses them before any app
NAMES = st.sampled_from([b"User-Agent", b"Accept", b"Content-Type", b"X-Forwarded-For", b"Authorization",
                         b"Range", b"Cookie", b"If-None-Match", b"Accept-Language", b"X-Anything",
                         TOKEN_HEADER.encode(), PEER_HEADER.encode(), ADDRESS_HEADER.encode()])
VALUE_BYTES = st.binary(max_size=40).map(lambda b: bytes(c for c in b if c >= 0x20 and c != 0x7F))
UTF8_VALUES = st.text(st.characters(min_codepoint=0x20, blacklist_categories=("Cs", "Cc")), max_size=20).map(
    lambda t: t.encode("utf-8"))
VALUES = st.one_of(VALUE_BYTES, UTF8_VALUES, st.just(b"\xff\xfe"), st.just("é".encode()))
# a repeated singleton header (User-Agent, Content-Type) is refused by aiohttp's parser before the app: charged by
# the connection guard instead (netguard.ReplyWritten)
HEADERS = st.lists(st.tuples(NAMES, VALUES), max_size=4)
METHODS = st.sampled_from([b"GET", b"POST", b"PUT", b"DELETE", b"PATCH", b"OPTIONS", b"HEAD", b"TRACE",
                           b"PROPFIND", b"X-CUSTOM"])
SEGMENT = st.binary(max_size=12).map(lambda b: "".join(f"%{c:02X}" for c in b).encode())
PATH_TEXT = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E, blacklist_characters="#?%"), max_size=16)
# raw bytes in a path or query, as sent (not percent-encoded): UTF-8 or not, some parsers pass them through
RAW_PATH = st.binary(min_size=1, max_size=12).map(lambda b: bytes(c for c in b if c > 0x20 and c not in b"#?% \x7f"))


def relayed(live: LiveCoordinator, address: bytes = b"198.51.100.7") -> list[tuple[bytes, bytes]]:
    """The p2p role's own headers (the run's token): the call is charged to ``address``."""
    return [(TOKEN_HEADER.encode(), live.coordinator.relay_token.encode()), (PEER_HEADER.encode(), PEER.encode()),
            (ADDRESS_HEADER.encode(), address)]


# ---- the properties --------------------------------------------------------------------------------------
@fuzz(150)
@given(endpoint=st.sampled_from(ENDPOINTS), headers=HEADERS, relay=st.booleans())
def test_fuzzed_headers_on_every_endpoint_are_charged_and_never_a_500(
        live: LiveCoordinator, endpoint: tuple[str, str], headers: list[tuple[bytes, bytes]], relay: bool) -> None:
    method, path = endpoint
    sent = (relayed(live) if relay else []) + headers
    status, err = check(live, method.encode(), path.encode(), sent, f"{method} {path} relay={relay} {headers!r}")
    bad = [name for name, value in sent if not value.isascii()]
    names = [name.lower() for name, _ in sent]
    if bad and len(set(names)) == len(names):  # (a repeated header may be refused by the parser first)  # the client's fault, said so: 400 bad_header naming a header that is not ASCII
        assert err is not None and err[0] == "bad_header" and status == 400, (status, err)
        assert any(name.decode() in err[1] for name in bad), err


@fuzz(120)
@given(method=METHODS, endpoint=st.sampled_from(ENDPOINTS),
       tail=st.one_of(SEGMENT, PATH_TEXT.map(str.encode), RAW_PATH),
       query=st.one_of(st.just(b""), SEGMENT.map(lambda s: b"?q=" + s), SEGMENT.map(lambda s: b"?view=" + s),
                       RAW_PATH.map(lambda s: b"?q=" + s)),
       relay=st.booleans())
def test_fuzzed_methods_and_paths_are_charged_and_never_a_500(
        live: LiveCoordinator, method: bytes, endpoint: tuple[str, str], tail: bytes, query: bytes, relay: bool
) -> None:
    path = endpoint[1].encode()
    for target in (path + query, path.rsplit(b"/", 1)[0] + b"/" + tail + query):
        check(live, method, target or b"/", relayed(live) if relay else [],
              f"{method!r} {target!r} relay={relay}")


def test_a_relayed_call_with_an_undecodable_header_is_a_400_charged_to_its_sender(live: LiveCoordinator) -> None:
    """The finding of issue 24: a relay header of non-UTF-8 bytes made the handler raise (a 500 per request, never
    charged). Now: 400 bad_header naming it, charged to the sender (127.0.0.1), nothing written."""
    before = live.coordinator.guard.per_address._buckets.get("127.0.0.1")
    for _ in range(5):
        status, err = check(live, b"POST", b"/v1/register", [(TOKEN_HEADER.encode(), b"\xff" * 64)], "relay \\xff")
        assert status == 400 and err is not None and err[0] == "bad_header" and TOKEN_HEADER in err[1]
    after = live.coordinator.guard.per_address._buckets["127.0.0.1"]
    assert (before.tokens if before else BURST) - after.tokens == pytest.approx(5)


def test_a_relayed_call_is_charged_to_its_observed_address(live: LiveCoordinator) -> None:
    buckets = live.coordinator.guard.per_address._buckets
    before = buckets["203.0.113.77"].tokens if "203.0.113.77" in buckets else BURST
    check(live, b"POST", b"/v1/lease", relayed(live, b"203.0.113.77"), "relayed lease")
    assert before - buckets["203.0.113.77"].tokens == pytest.approx(1)
