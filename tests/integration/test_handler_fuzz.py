"""Property-based fuzzing of every coordinator handler, against a real coordinator on loopback.

Whatever arrives, no handler fails internally: every reply to a POST is a 200 or a 4xx whose msgpack body is an
``ErrorBody`` naming a documented reason (never ``internal_error``) with the HTTP status that reason maps to, and
an unknown snapshot or blob is a 404 ``ErrorBody``. A refused request writes nothing: the jobs (row by row and by
state), results, versions and clients tables are unchanged, and only a result submission that passed
authentication adds a ``rejections`` row, exactly one (docs/protocol.md §5).

Where docs/protocol.md fixes the answer (the envelope checks of §3, the result checks of §5, the GET rules of §6)
the tests compute the expected reason and compare; elsewhere they require a reason from the set that can apply.
Each test reuses one live coordinator for all of its examples.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import re
import string
import urllib.parse
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, currently_in_test_context, event, example, given, settings
from hypothesis import strategies as st

from shared import PROTOCOL_VERSION, crypto, wire
from shared.errors import HTTP_STATUS, ProtocolError, Reason
from shared.messages import (
    ClientProfile,
    Completion,
    ErrorBody,
    Job,
    LeaseRequest,
    LeaseResponse,
    Manifest,
    Message,
    RegisterRequest,
    RegisterResponse,
    ReleaseRequest,
    ReleaseResponse,
    ResultSubmission,
    SignedManifest,
    SignedRequest,
    SubmitResponse,
)
from shared.records import open_job, open_manifest
from shared.safe_text import UNSAFE_CHARS
from tests.integration.conftest import LiveCoordinator
from tests.integration.helpers import RawClient, db_queries, db_rows

REGISTER, LEASE, RELEASE, RESULTS = "/v1/register", "/v1/lease", "/v1/release", "/v1/results"
ENDPOINTS = (REGISTER, LEASE, RELEASE, RESULTS)
REASON_VALUES = {r.value for r in Reason}

# What can refuse a request before it is authenticated (the envelope, §3), and after.
BODY = frozenset({Reason.MALFORMED, Reason.SCHEMA, Reason.BODY_TOO_LARGE})
BEFORE_AUTH = BODY | {Reason.PROTOCOL_VERSION, Reason.BAD_SIGNATURE, Reason.UNKNOWN_CLIENT, Reason.CLIENT_ID_MISMATCH,
                      Reason.STALE_REQUEST, Reason.REPLAYED_NONCE, Reason.BANNED}
VERIFY = frozenset({Reason.UNKNOWN_JOB, Reason.BODY_TOO_LARGE, Reason.NOT_LEASE_HOLDER, Reason.LEASE_EXPIRED,
                    Reason.JOB_COMPLETED, Reason.WRONG_VERSION, Reason.BINDING_MISMATCH, Reason.SHAPE_MISMATCH,
                    Reason.TOKEN_OUT_OF_RANGE, Reason.FINISH_REASON, Reason.LOGPROB_MISMATCH})
AFTER_AUTH: dict[str, frozenset[Reason]] = {
    REGISTER: BODY | {Reason.CLIENT_ID_MISMATCH},  # /v1/register decodes its body before it knows the client
    LEASE: BODY,
    RELEASE: BODY,
    RESULTS: BODY | VERIFY,
}


def fuzz(max_examples: int) -> Callable[[Any], Any]:
    return settings(max_examples=max_examples, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large, HealthCheck.filter_too_much])


# ---- database: what a refused request must leave alone --------------------------------------------------
@dataclass(frozen=True)
class DbState:
    jobs: list[tuple[Any, ...]]
    by_state: dict[str, int]
    results: int
    versions: int
    rejections: int
    clients: list[tuple[Any, ...]]

    def without_rejections(self) -> dict[str, Any]:
        return {"jobs": self.jobs, "by_state": self.by_state, "results": self.results, "versions": self.versions,
                "clients": self.clients}


def db_state(live: LiveCoordinator) -> DbState:
    """The tables a refused request must leave alone, read through one connection (twice per example)."""
    jobs, by_state, counts, clients = db_queries(
        live.run_dir,
        "SELECT job_id, state, lease_id, lease_client, lease_deadline, issue_count FROM jobs ORDER BY job_id",
        "SELECT state, COUNT(*) FROM jobs GROUP BY state",
        "SELECT (SELECT COUNT(*) FROM results), (SELECT COUNT(*) FROM versions), (SELECT COUNT(*) FROM rejections)",
        "SELECT client_id, public_key, accepted, credit, banned FROM clients ORDER BY client_id")
    ((results, versions, rejections),) = counts
    return DbState(jobs, dict(by_state), results, versions, rejections, clients)


def assert_nothing_written(before: DbState, after: DbState, rejections_added: int, what: str) -> None:
    assert after.without_rejections() == before.without_rejections(), (
        f"{what}: a refused request changed the database\nbefore: {before}\nafter:  {after}")
    assert after.rejections == before.rejections + rejections_added, (
        f"{what}: expected {rejections_added} new rejections row(s), got {after.rejections - before.rejections}")


def changed_jobs(before: DbState, after: DbState) -> list[tuple[tuple[Any, ...] | None, tuple[Any, ...]]]:
    old = {row[0]: row for row in before.jobs}
    return [(old.get(row[0]), row) for row in after.jobs if old.get(row[0]) != row]


def assert_success_consistent(path: str, raw: bytes, before: DbState, after: DbState, client_id: str,
                              what: str) -> None:
    """A 200 must carry the endpoint's reply, and change only what that reply says it changed."""
    same = {"results": before.results, "versions": before.versions, "rejections": before.rejections}
    if path == REGISTER:
        wire.decode(raw, RegisterResponse)
        assert (after.jobs, after.results, after.versions, after.rejections) == (
            before.jobs, before.results, before.versions, before.rejections), what
        assert len(after.clients) - len(before.clients) in (0, 1), what
        return
    assert after.clients == before.clients or path == RESULTS, what
    if path == LEASE:
        reply = wire.decode(raw, LeaseResponse)
        assert {"results": after.results, "versions": after.versions, "rejections": after.rejections} == same, what
        moved = changed_jobs(before, after)
        if reply.job is None:
            assert moved == [], f"{what}: no job leased, but jobs changed: {moved}"
        else:
            assert len(moved) == 1, f"{what}: one job leased, but jobs changed: {moved}"
            _, new = moved[0]
            assert new[1] == "leased" and new[3] == client_id, f"{what}: {moved}"
    elif path == RELEASE:
        reply = wire.decode(raw, ReleaseResponse)
        assert {"results": after.results, "versions": after.versions, "rejections": after.rejections} == same, what
        moved = changed_jobs(before, after)
        if reply.released:
            assert len(moved) == 1 and moved[0][1][1] == "open", f"{what}: {moved}"
        else:
            assert moved == [], f"{what}: released=false, but jobs changed: {moved}"
    else:
        reply = wire.decode(raw, SubmitResponse)
        assert reply.accepted, what
        assert after.results - before.results in (0, 1) and after.rejections == before.rejections, what


# ---- replies ------------------------------------------------------------------------------------------------
def refusal_reason(status: int, raw: bytes, allowed: Collection[Reason], what: str) -> Reason | None:
    """None for a 200; otherwise the refusal's reason, once it is checked to be a well-formed, allowed 4xx."""
    assert status != 500, f"{what}: HTTP 500 {raw[:500]!r}"
    if status == 200:
        return None
    assert 400 <= status < 500, f"{what}: HTTP {status} {raw[:500]!r}"
    try:
        err = wire.decode(raw, ErrorBody)
    except ProtocolError as exc:
        raise AssertionError(f"{what}: HTTP {status} whose body is not an ErrorBody ({exc}): {raw[:500]!r}") from None
    assert err.error in REASON_VALUES, f"{what}: undocumented reason {err.error!r}"
    reason = Reason(err.error)
    assert reason is not Reason.INTERNAL, f"{what}: internal_error: {err.message}"
    assert HTTP_STATUS[reason] == status, f"{what}: {reason.value} sent as HTTP {status}, not {HTTP_STATUS[reason]}"
    assert reason in allowed, f"{what}: refused with {reason.value} ({err.message}); expected one of " \
                              f"{sorted(r.value for r in allowed)}"
    return reason


# ---- a harness around one live coordinator and one registered client -----------------------------------------
@dataclass
class Harness:
    live: LiveCoordinator
    client: RawClient = field(init=False)
    seen_nonces: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.client = RawClient(self.live.url)
        status, raw = self.client.send(REGISTER, self.signed(REGISTER, self.register_body()))
        assert status == 200, raw

    @property
    def now(self) -> float:
        return self.live.clock.now

    def register_body(self, key: bytes | None = None) -> RegisterRequest:
        profile = ClientProfile(name="fuzz", backend="torch", device="cpu", platform="Linux x86_64", cpu_count=2,
                                memory_gb=4.0, software="echo-swarm test")
        return RegisterRequest(public_key=key or self.client.public_key, profile=profile)

    def signed(self, path: str, body: Message | bytes) -> bytes:
        """A correct envelope from the registered client: fresh nonce, signed at the coordinator's clock."""
        return self.client.envelope(path, body, timestamp=self.now)

    def exchange(self, path: str, data: bytes, allowed: Collection[Reason], *, authenticated: bool,
                 what: str, may_succeed: bool = True,
                 send: Callable[[str, bytes], tuple[int, bytes]] | None = None) -> Reason | None:
        """POST, check the reply, and check that a refusal wrote nothing but (for an authenticated result) one
        rejections row."""
        before = db_state(self.live)
        status, raw = (send or self.client.send)(path, data)
        reason = refusal_reason(status, raw, allowed, what)
        if currently_in_test_context():  # a tally of replies, shown by --hypothesis-show-statistics
            event(f"{path}: {reason.value if reason else 'HTTP 200'}")
        after = db_state(self.live)
        if reason is None:
            assert may_succeed, f"{what}: accepted (HTTP 200) {raw[:300]!r}"
            assert_success_consistent(path, raw, before, after, self.client.client_id, what)
        else:
            assert_nothing_written(before, after, int(authenticated and path == RESULTS), what)
        return reason


@pytest.fixture
def harness(live_coordinator: LiveCoordinator) -> Harness:
    return Harness(live_coordinator)


# ---- strategies: msgpack values and raw bytes ----------------------------------------------------------------
def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def raw_map(pairs: list[tuple[Any, Any]]) -> bytes:
    """A msgpack map written pair by pair, so it may repeat a key or use a key of any type."""
    return b"\xdf" + len(pairs).to_bytes(4, "big") + b"".join(pack(k) + pack(v) for k, v in pairs)


SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(),  # floats include NaN and ±inf
    st.text(max_size=40), st.binary(max_size=80),
)
VALUES = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=12), children, max_size=5),
    max_leaves=30,
)
EXTS = st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=16)) | st.builds(
    msgpack.Timestamp, st.integers(0, 2**34 - 1), st.integers(0, 999_999_999))
ENVELOPE_FIELDS = list(SignedRequest.model_fields)
HEX = "0123456789abcdef"
CLIENT_IDS = st.text(HEX, min_size=32, max_size=32)
SHA_HEX = st.text(HEX, min_size=64, max_size=64)
JOB_IDS = st.text(string.ascii_letters + string.digits + "_-", min_size=1, max_size=64)
# envelope fields with values of the right wire type, so that decoding gets as far as it can
PLAUSIBLE_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "protocol": st.integers(0, 70_000),
    "client_id": CLIENT_IDS,
    "timestamp": st.floats(0, 1e11),
    "nonce": st.binary(min_size=14, max_size=34),
    "path": st.sampled_from([*ENDPOINTS, "/v1/info", "/v1/x"]),
    "body": st.binary(max_size=64),
    "signature": st.binary(min_size=63, max_size=65),
}


@st.composite
def envelope_shaped(draw: st.DrawFn) -> dict[str, Any]:
    """A SignedRequest-like map: every field of a plausible type, then a few dropped, replaced or added."""
    fields = {name: draw(PLAUSIBLE_FIELDS[name]) for name in ENVELOPE_FIELDS}
    for name in draw(st.lists(st.sampled_from(ENVELOPE_FIELDS), max_size=3, unique=True)):
        if draw(st.booleans()):
            del fields[name]
        else:
            fields[name] = draw(VALUES)
    return draw(st.dictionaries(st.text(max_size=10), VALUES, max_size=1)) | fields


TRICKY_BYTES = st.sampled_from([
    b"", b"\xc1", b"\x80", b"\x90", b"\xc0", b"\x81\xa1a\xc0\xc0",  # never-used byte, empty map/list, trailing
    b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff",  # huge lengths
    b"\xc7\x00\x05", b"\xd4\xff\x00", b"\xd6\xff\x00\x00\x00\x00",  # ext, including the timestamp ext
    b"\xa2\xc3\x28", b"\xa3\xed\xa0\x80",  # invalid UTF-8, an encoded surrogate
    b"\x91" * 200 + b"\xc0", b"\x81\xa1a" * 40 + b"\xc0",  # nesting far deeper than 16
])


@st.composite
def exotic_msgpack(draw: st.DrawFn) -> bytes:
    """msgpack that Python values alone cannot produce: repeated keys, non-string keys, ext types, deep nesting."""
    kind = draw(st.sampled_from(["dup", "keys", "ext", "deep_list", "deep_map"]))
    if kind == "dup":
        key = draw(st.sampled_from(ENVELOPE_FIELDS) | st.text(max_size=8))
        return raw_map([(key, draw(VALUES)), (key, draw(VALUES))])
    if kind == "keys":
        keys = st.integers(-5, 5) | st.binary(max_size=8) | st.none() | st.booleans() | st.floats() | st.text(max_size=8)
        return raw_map(draw(st.lists(st.tuples(keys, VALUES), min_size=1, max_size=4)))
    if kind == "ext":
        return pack(draw(st.dictionaries(st.sampled_from(ENVELOPE_FIELDS), EXTS | VALUES, min_size=1, max_size=3)
                         | EXTS | st.lists(EXTS, min_size=1, max_size=3)))
    depth = draw(st.integers(1, 40))
    return pack({"body": nested(depth, list)} if kind == "deep_list" else nested(depth, dict))


def nested(depth: int, kind: type) -> Any:
    value: Any = None
    for _ in range(depth):
        value = [value] if kind is list else {"a": value}
    return value


MSGPACK_PAYLOADS = st.one_of(VALUES.map(pack), envelope_shaped().map(pack), exotic_msgpack())
Edit = tuple[str, int, int]
EDITS = st.lists(st.tuples(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]),
                           st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=4)


def mutate(data: bytes, edits: list[Edit]) -> bytes:
    buf = bytearray(data)
    for op, pos, value in edits:
        i = pos % (len(buf) + 1)
        if op == "insert":
            buf.insert(i, value)
        elif op == "truncate":
            del buf[i:]
        elif buf:
            j = i % len(buf)
            if op == "flip":
                buf[j] ^= value or 0x80
            elif op == "set":
                buf[j] = value
            else:
                del buf[j]
    return bytes(buf)


# ---- strategies: valid protocol messages ---------------------------------------------------------------------
LOGPROBS = st.floats(-1e4, 1e-3, allow_nan=False)
# text a valid message may hold: anything but the control, bidi and separator characters of shared.safe_text
PRINTABLE = st.characters(codec="utf-8").filter(lambda c: UNSAFE_CHARS.match(c) is None)
PROFILES = st.builds(
    ClientProfile, name=st.text(PRINTABLE, max_size=64), backend=st.sampled_from(["torch", "llama"]),
    device=st.text(PRINTABLE, max_size=128), platform=st.text(PRINTABLE, max_size=128), cpu_count=st.integers(0, 4096),
    memory_gb=st.floats(0, 1e6), software=st.text(PRINTABLE, max_size=128),
)
COMPLETIONS = st.builds(Completion, token_ids=st.lists(st.integers(0, 2**31 - 1), max_size=8),
                        logprobs=st.lists(LOGPROBS, max_size=8), finish_reason=st.sampled_from(["stop", "length"]))
MESSAGES: dict[str, st.SearchStrategy[Message]] = {
    REGISTER: st.builds(RegisterRequest, public_key=st.binary(min_size=32, max_size=32), profile=PROFILES),
    LEASE: st.builds(LeaseRequest, backend=st.sampled_from(["torch", "llama"]),
                     held_version=st.integers(-1, 2**31 - 1)),
    RELEASE: st.builds(ReleaseRequest, job_id=JOB_IDS, lease_id=JOB_IDS),
    RESULTS: st.builds(
        ResultSubmission, job_id=JOB_IDS, lease_id=JOB_IDS, version=st.integers(0, 2**31 - 1), prompt_hash=SHA_HEX,
        seed=st.integers(0, 2**63 - 1), group_size=st.integers(1, 64), completions=st.lists(COMPLETIONS, min_size=1,
                                                                                           max_size=4),
        backend=st.sampled_from(["torch", "llama"]), generation_s=st.floats(0, 1e6)),
}
OTHER_MESSAGES: list[st.SearchStrategy[Message]] = [
    st.builds(ErrorBody, error=st.sampled_from(sorted(REASON_VALUES)), message=st.text(max_size=100)),
    st.builds(SignedRequest, protocol=st.just(PROTOCOL_VERSION), client_id=CLIENT_IDS, timestamp=st.floats(0, 1e11),
              nonce=st.binary(min_size=16, max_size=32), path=st.sampled_from(ENDPOINTS), body=st.binary(max_size=64),
              signature=st.binary(min_size=64, max_size=64)),
]


@st.composite
def near_miss(draw: st.DrawFn, path: str) -> bytes:
    """The endpoint's own message with one edit: a field dropped, added, or given an arbitrary value (which
    may happen to be valid)."""
    message = draw(MESSAGES[path]).model_dump()
    name = draw(st.sampled_from(sorted(message)))
    edit = draw(st.sampled_from(["drop", "add", "replace"]))
    if edit == "drop":
        del message[name]
    elif edit == "add":
        message[draw(st.text(max_size=12).filter(lambda k: k not in message))] = draw(VALUES)
    else:
        message[name] = draw(VALUES)
    return pack(message)


@st.composite
def inner_bodies(draw: st.DrawFn, path: str, own_key: bytes) -> tuple[str, bytes, frozenset[Reason] | None]:
    """(kind, body bytes, exact expected reasons or None when the endpoint's own rules decide)."""
    kind = draw(st.sampled_from(["bytes", "msgpack", "wrong_type", "near_miss", "own", "foreign_register"]))
    if kind == "own":  # the endpoint's own message, with arbitrary (valid) values
        return kind, wire.encode(draw(MESSAGES[path])), None
    if kind == "bytes":
        return kind, draw(st.binary(max_size=512) | TRICKY_BYTES), BODY - {Reason.BODY_TOO_LARGE}
    if kind == "msgpack":
        return kind, draw(MSGPACK_PAYLOADS), BODY - {Reason.BODY_TOO_LARGE}
    if kind == "wrong_type":
        others = [s for p, s in MESSAGES.items() if p != path] + OTHER_MESSAGES
        return kind, wire.encode(draw(st.one_of(others))), frozenset({Reason.SCHEMA})
    if kind == "near_miss":
        return kind, draw(near_miss(path)), None
    # a well-formed registration of some other key, signed with this client's key
    key = draw(st.binary(min_size=32, max_size=32).filter(lambda k: k != own_key))
    body = RegisterRequest(public_key=key, profile=draw(PROFILES))
    return kind, wire.encode(body), frozenset({Reason.CLIENT_ID_MISMATCH if path == REGISTER else Reason.SCHEMA})


def show(data: bytes) -> str:
    return f"{len(data)} bytes {data[:120]!r}"


# ---- 1. arbitrary bytes --------------------------------------------------------------------------------------
@fuzz(250)
@given(path=st.sampled_from(ENDPOINTS), payload=st.binary(max_size=2048) | TRICKY_BYTES | EDITS)
def test_arbitrary_bytes_are_refused_cleanly(harness: Harness, path: str, payload: bytes | list[Edit]) -> None:
    if isinstance(payload, list):  # damage a correct envelope from the registered client
        body: Message = {REGISTER: harness.register_body(), LEASE: LeaseRequest(backend="torch", held_version=-1),
                         RELEASE: ReleaseRequest(job_id="nope", lease_id="nope"),
                         RESULTS: ReleaseRequest(job_id="nope", lease_id="nope")}[path]
        original = harness.signed(path, body)
        data = mutate(original, payload)
        try:  # the damage may leave the values (hence the signature) intact: then it is a genuine request
            authentic = wire.decode(data, SignedRequest, max_bytes=len(data)) == wire.decode(original, SignedRequest)
        except ProtocolError:
            authentic = False
    else:
        data, authentic = payload, False
    allowed = AFTER_AUTH[path] if authentic else BEFORE_AUTH
    harness.exchange(path, data, allowed, authenticated=authentic, may_succeed=authentic,
                     what=f"POST {path} {show(data)}")


# ---- 2. arbitrary msgpack values ------------------------------------------------------------------------------
@fuzz(250)
@given(path=st.sampled_from(ENDPOINTS), data=MSGPACK_PAYLOADS)
def test_arbitrary_msgpack_values_are_refused_cleanly(harness: Harness, path: str, data: bytes) -> None:
    harness.exchange(path, data, BEFORE_AUTH, authenticated=False, may_succeed=False, what=f"POST {path} {show(data)}")


# ---- 3. authenticated envelopes carrying arbitrary bodies -----------------------------------------------------
@fuzz(300)
@given(path=st.sampled_from(ENDPOINTS), data=st.data())
def test_authenticated_requests_with_arbitrary_bodies_are_refused_cleanly(harness: Harness, path: str,
                                                                          data: st.DataObject) -> None:
    kind, body, expected = data.draw(inner_bodies(path, harness.client.public_key), label="body")
    allowed = expected if expected is not None else AFTER_AUTH[path]
    harness.exchange(path, harness.signed(path, body), allowed, authenticated=True,
                     may_succeed=kind in ("near_miss", "own"), what=f"POST {path} signed, {kind} body {show(body)}")


# ---- 4. well-formed results with arbitrary values -------------------------------------------------------------
@dataclass
class ResultContext:
    job: Job
    vocab_size: int

    @property
    def stops(self) -> list[int]:
        return list(self.job.sampling.stop_token_ids)

    @property
    def max_tokens(self) -> int:
        return self.job.sampling.max_tokens


@pytest.fixture
def leased(harness: Harness) -> tuple[Harness, ResultContext]:
    status, raw = harness.client.send(LEASE, harness.signed(LEASE, LeaseRequest(backend="torch", held_version=-1)))
    assert status == 200, raw
    reply = wire.decode(raw, LeaseResponse)
    assert reply.job is not None
    job = open_job(reply.job, harness.live.coordinator.public_key)
    status, raw = harness.client.get("/v1/status")  # documented in §4: learner.vocab_size
    assert status == 200, raw
    vocab_size = int(json.loads(raw)["learner"]["vocab_size"])
    return harness, ResultContext(job, vocab_size)


FIELDS = ("job_id", "lease_id", "version", "prompt_hash", "seed", "group_size", "count")


def plain_tokens(ctx: ResultContext) -> st.SearchStrategy[int]:
    """Token ids in the vocabulary that are not stop tokens (the i-th such id, so nothing is filtered away)."""
    stops = sorted(set(ctx.stops))

    def nth(i: int) -> int:
        for s in stops:
            i += i >= s
        return i

    return st.integers(0, ctx.vocab_size - 1 - len(stops)).map(nth)


@st.composite
def completions(draw: st.DrawFn, ctx: ResultContext, well_formed: bool) -> Completion:
    stops, max_tokens, plain = ctx.stops, ctx.max_tokens, plain_tokens(ctx)
    anything = st.one_of(plain, st.sampled_from(stops), st.integers(0, 2**31 - 1),
                         st.sampled_from([ctx.vocab_size - 1, ctx.vocab_size, 2**31 - 1]))
    shape = draw(st.sampled_from(["stop", "length"] if well_formed else ["stop", "length", "arbitrary", "long"]))
    if shape == "stop":  # ends at its only stop token
        tokens = draw(st.lists(plain, max_size=max_tokens - 1)) + [draw(st.sampled_from(stops))]
        reason = "stop"
    elif shape == "length":  # exactly max_tokens tokens, no stop token
        tokens, reason = draw(st.lists(plain, min_size=max_tokens, max_size=max_tokens)), "length"
    else:
        size = (0, max_tokens + 3) if shape == "arbitrary" else (max_tokens + 1, 400)
        tokens = draw(st.lists(anything, min_size=size[0], max_size=size[1]))
        reason = draw(st.sampled_from(["stop", "length"]))
    n_logprobs = len(tokens) if well_formed or draw(st.integers(0, 3)) else draw(st.integers(0, len(tokens) + 2))
    return Completion(token_ids=tokens, logprobs=draw(st.lists(LOGPROBS, min_size=n_logprobs, max_size=n_logprobs)),
                      finish_reason=reason)


@st.composite
def submissions(draw: st.DrawFn, ctx: ResultContext, other_job_ids: list[str]) -> ResultSubmission:
    """Mostly the leased job's own terms with a few fields changed; completions either all well formed (so the
    checks get as far as the logprob recompute) but for at most one, or all arbitrary."""
    job = ctx.job
    n = len(job.prompts) * job.group_size
    corrupt = draw(st.just(frozenset[str]()) | st.frozensets(st.sampled_from(FIELDS), min_size=1, max_size=3))
    pick: dict[str, st.SearchStrategy[Any]] = {
        "job_id": st.sampled_from(other_job_ids) | JOB_IDS, "lease_id": JOB_IDS, "version": st.integers(0, 2**31 - 1),
        "prompt_hash": SHA_HEX, "seed": st.integers(0, 2**63 - 1), "group_size": st.integers(1, 64),
        "count": st.integers(1, 24),
    }
    value = {name: draw(pick[name]) for name in sorted(corrupt)}
    count = value.get("count", n)
    if draw(st.booleans()):
        comps = draw(st.lists(completions(ctx, True), min_size=count, max_size=count))
        odd = draw(st.none() | st.integers(0, count - 1))
        if odd is not None:
            comps[odd] = draw(completions(ctx, False))
    else:
        comps = draw(st.lists(completions(ctx, False), min_size=count, max_size=count))
    return ResultSubmission(
        job_id=value.get("job_id", job.job_id), lease_id=value.get("lease_id", job.lease_id),
        version=value.get("version", job.version), prompt_hash=value.get("prompt_hash", job.prompt_hash),
        seed=value.get("seed", job.seed), group_size=value.get("group_size", job.group_size), completions=comps,
        backend=draw(st.sampled_from(["torch", "llama"])), generation_s=draw(st.floats(0, 1e6)),
    )


def expected_result_reason(harness: Harness, ctx: ResultContext, sub: ResultSubmission,
                           body: bytes) -> frozenset[Reason] | None:
    """docs/protocol.md §5, in order. None: a resend of an accepted result (200). The last step, the logprob
    recompute, may accept the result (a 200), which random logprobs all but never pass."""
    run_dir, me = harness.live.run_dir, harness.client.client_id
    if sub.backend != "torch":  # the harness's identity is pinned to torch/cpu; §5 checks the claim first
        return frozenset({Reason.BINDING_MISMATCH})
    earlier = db_rows(run_dir, "SELECT client_id, content_sha256 FROM results WHERE job_id=?", (sub.job_id,))
    if earlier and earlier[0] == (me, hashlib.sha256(body).hexdigest()):
        return None
    rows = db_rows(run_dir, "SELECT state, lease_id, lease_client, lease_deadline, prompt_ids, seed, group_size "
                            "FROM jobs WHERE job_id=?", (sub.job_id,))
    if not rows:
        return frozenset({Reason.UNKNOWN_JOB})
    state, lease_id, lease_client, deadline, prompt_ids, seed, group_size = rows[0]
    n_prompts = len(json.loads(prompt_ids))
    max_tokens = ctx.max_tokens
    n = n_prompts * group_size
    if len(body) > 4096 + n * (64 + max_tokens * 14):
        return frozenset({Reason.BODY_TOO_LARGE})
    if state == "done":
        return frozenset({Reason.JOB_COMPLETED})
    if lease_client != me or lease_id != sub.lease_id:
        return frozenset({Reason.NOT_LEASE_HOLDER})
    if state != "leased" or deadline is None or harness.now >= deadline:
        return frozenset({Reason.LEASE_EXPIRED})
    job = ctx.job  # the job this client holds: its signed terms
    assert job.job_id == sub.job_id
    if sub.version != job.version:
        return frozenset({Reason.WRONG_VERSION})
    if sub.prompt_hash != job.prompt_hash or sub.seed != seed or sub.group_size != group_size:
        return frozenset({Reason.BINDING_MISMATCH})
    if len(sub.completions) != n:
        return frozenset({Reason.SHAPE_MISMATCH})
    stops = set(ctx.stops)
    for comp in sub.completions:
        k = len(comp.token_ids)
        if k != len(comp.logprobs):
            return frozenset({Reason.SHAPE_MISMATCH})
        if k == 0 or k > max_tokens or any(t >= ctx.vocab_size for t in comp.token_ids):
            return frozenset({Reason.TOKEN_OUT_OF_RANGE})
        at = [i for i, t in enumerate(comp.token_ids) if t in stops]
        if comp.finish_reason == "stop" and at != [k - 1]:
            return frozenset({Reason.FINISH_REASON})
        if comp.finish_reason == "length" and (at or k != max_tokens):
            return frozenset({Reason.FINISH_REASON})
    return frozenset({Reason.LOGPROB_MISMATCH})


@fuzz(250)
@given(data=st.data())
def test_well_formed_results_are_refused_with_the_documented_reason(leased: tuple[Harness, ResultContext],
                                                                    data: st.DataObject) -> None:
    harness, ctx = leased
    others = [r[0] for r in db_rows(harness.live.run_dir, "SELECT job_id FROM jobs WHERE job_id != ?",
                                    (ctx.job.job_id,))]
    sub = data.draw(submissions(ctx, others or ["none"]), label="submission")
    body = wire.encode(sub)
    expected = expected_result_reason(harness, ctx, sub, body)
    allowed = expected if expected is not None else frozenset()
    harness.exchange(RESULTS, harness.signed(RESULTS, body), allowed, authenticated=True,
                     may_succeed=expected is None or expected == {Reason.LOGPROB_MISMATCH},
                     what=f"POST {RESULTS} {sub!r}"[:3000])


# ---- 5. arbitrary snapshot versions and blob names ------------------------------------------------------------
SEGMENT_SUFFIXES = ["", "\n", " ", "0", "/", "%0A", "\x00"]
SEGMENTS = st.one_of(
    st.text(min_size=1, max_size=80), st.binary(min_size=1, max_size=80),
    st.from_regex(r"[0-9]{1,12}", fullmatch=True), SHA_HEX, SHA_HEX.map(str.upper),
    st.sampled_from(["latest", "LATEST", "latest\n", "0", "00", "000000000", "0000000000", "-1", "+0", " 0", "0 ",
                     "0\n", "\u0660", "\uff10", "1e3", "0x0", ".", "..", "%", "%30", "%2e%2e"]),
    st.tuples(st.integers(0, 255), st.sampled_from(SEGMENT_SUFFIXES)),  # a served sha256 plus a suffix
)


@dataclass
class Served:
    versions: set[int]
    blobs: list[str]


@pytest.fixture
def served(harness: Harness) -> tuple[Harness, Served]:
    versions = {v for (v,) in db_rows(harness.live.run_dir, "SELECT version FROM versions")}
    blobs: list[str] = []
    for v in sorted(versions):
        status, raw = harness.client.get(f"/v1/snapshots/{v}")
        if status == 200:
            manifest, _ = open_manifest(wire.decode(raw, SignedManifest), harness.live.coordinator.public_key)
            blobs += [f.sha256 for f in manifest.files]
    assert versions and blobs
    return harness, Served(versions, sorted(set(blobs)))


@fuzz(300)
@given(kind=st.sampled_from(["snapshots", "blobs"]), segment=SEGMENTS)
@example(kind="snapshots", segment="0\n")  # `$` in a Python regex also matches before a final newline
@example(kind="blobs", segment=(0, "\n"))
@example(kind="snapshots", segment="{0}")  # aiohttp's default `{name}` pattern is [^{}/]+: braces miss the route
@example(kind="blobs", segment="}")
def test_arbitrary_snapshot_and_blob_names_are_404_or_served(served: tuple[Harness, Served], kind: str,
                                                             segment: str | bytes | tuple[int, str]) -> None:
    harness, known = served
    if isinstance(segment, tuple):
        segment = known.blobs[segment[0] % len(known.blobs)] + segment[1]
    quoted = urllib.parse.quote(segment, safe="")
    try:
        text: str | None = segment.decode() if isinstance(segment, bytes) else segment
    except UnicodeDecodeError:
        text = None  # the server keeps undecodable escapes as they are: it never matches a version or a sha256
    before = db_state(harness.live)
    status, raw = harness.client.get(f"/v1/{kind}/{quoted}")
    what = f"GET /v1/{kind}/{quoted}"
    event(f"/v1/{kind}: HTTP {status}")
    if kind == "snapshots":
        version = None
        if text == "latest":
            version = max(known.versions)
        elif text is not None and re.fullmatch(r"[0-9]{1,9}", text) and int(text) in known.versions:
            version = int(text)
        if version is None:
            assert refusal_reason(status, raw, {Reason.NO_SUCH_VERSION}, what) is Reason.NO_SUCH_VERSION
        else:
            assert status == 200, f"{what}: HTTP {status} {raw[:300]!r}"
            manifest, _ = open_manifest(wire.decode(raw, SignedManifest), harness.live.coordinator.public_key)
            assert isinstance(manifest, Manifest) and manifest.version == version
    else:
        if text is not None and re.fullmatch(r"[0-9a-f]{64}", text) and text in known.blobs:
            assert status == 200, f"{what}: HTTP {status} {raw[:300]!r}"
            assert hashlib.sha256(raw).hexdigest() == text
        else:
            assert refusal_reason(status, raw, {Reason.NO_SUCH_BLOB}, what) is Reason.NO_SUCH_BLOB
    assert db_state(harness.live) == before, what


# ---- 6. envelopes signed over arbitrary protocol numbers, ids, paths, timestamps and nonces ---------------------
def envelope(key: Any, *, protocol: int, client_id: str, timestamp: float | int, nonce: bytes, path: str,
             body: bytes) -> bytes:
    """A SignedRequest signed over exactly the values sent (docs/protocol.md §3). An int timestamp is signed as
    an int, as a careless client would: the coordinator signs it as a float64, so it must not verify."""
    signature = crypto.sign(key, crypto.REQUEST_DOMAIN, pack([protocol, client_id, timestamp, nonce, path, body]))
    return pack({"protocol": protocol, "client_id": client_id, "timestamp": timestamp, "nonce": nonce, "path": path,
                 "body": body, "signature": signature})


PATH_PATTERN = re.compile(r"/v1/[a-z_/]{1,64}")
FAULTS = ("protocol", "protocol_range", "path", "client", "int_timestamp", "stale", "nonce_size", "replay")


@fuzz(250)
@given(endpoint=st.sampled_from(ENDPOINTS),
       faults=st.just(frozenset[str]()) | st.frozensets(st.sampled_from(FAULTS), min_size=1, max_size=3),
       data=st.data())
def test_envelope_checks_follow_the_documented_order(harness: Harness, endpoint: str, faults: frozenset[str],
                                                     data: st.DataObject) -> None:
    """Envelopes correctly signed over the values sent, with zero or more of §3's checks made to fail: the
    reply is the first failing check in the documented order (or, with none, the body's own fate)."""
    me, window = harness.client.client_id, harness.live.coordinator.config.verification.request_window_s
    draw = data.draw
    protocol = PROTOCOL_VERSION
    if "protocol" in faults:
        protocol = draw(st.integers(0, 65535), label="protocol")
    if "protocol_range" in faults:
        protocol = draw(st.integers(65536, 2**32), label="protocol")
    signed_path = endpoint
    if "path" in faults:
        signed_path = draw(st.sampled_from([*ENDPOINTS, "/v1/info", "/v1/lease/", "/v1/lease\n", "/v2/lease",
                                            "/v1/LEASE", "/v1/"]) | st.from_regex(r"/v1/[a-z_/]{1,64}", fullmatch=True),
                           label="path")
    client_id = draw(CLIENT_IDS, label="client_id") if "client" in faults else me
    offset = draw(st.floats(-window, window), label="offset")
    if "stale" in faults:
        offset = draw(st.sampled_from([-window, window, -window - 1e-3, window + 1e-3, 1e6, -1e6])
                      | st.floats(-4 * window, 4 * window), label="offset")
    timestamp: float | int = min(max(harness.now + offset, 0.0), 1e11)
    int_timestamp = "int_timestamp" in faults
    if int_timestamp:
        timestamp = int(timestamp)
    nonce = draw(st.binary(min_size=16, max_size=32), label="nonce")
    if "nonce_size" in faults:
        nonce = draw(st.binary(max_size=15) | st.binary(min_size=33, max_size=40), label="nonce")
    if "replay" in faults and harness.seen_nonces:
        nonce = harness.seen_nonces[draw(st.integers(0, len(harness.seen_nonces) - 1), label="replayed")]
    body = wire.encode(harness.register_body()) if endpoint == REGISTER else b"\xc1"  # 0xc1: never valid msgpack
    data_bytes = envelope(harness.client.key, protocol=protocol, client_id=client_id, timestamp=timestamp,
                          nonce=nonce, path=signed_path, body=body)

    def expected() -> Reason | None:
        if protocol > 65535 or not PATH_PATTERN.fullmatch(signed_path) or not 16 <= len(nonce) <= 32:
            return Reason.SCHEMA
        if protocol != PROTOCOL_VERSION:
            return Reason.PROTOCOL_VERSION
        if signed_path != endpoint:
            return Reason.BAD_SIGNATURE
        if endpoint == REGISTER and client_id != me:  # the id must derive from the key in the body
            return Reason.CLIENT_ID_MISMATCH
        if client_id != me:
            return Reason.UNKNOWN_CLIENT
        if int_timestamp:
            return Reason.BAD_SIGNATURE
        if abs(float(timestamp) - harness.now) > window:
            return Reason.STALE_REQUEST
        if nonce in harness.seen_nonces:
            return Reason.REPLAYED_NONCE
        harness.seen_nonces.append(nonce)
        return None if endpoint == REGISTER else Reason.MALFORMED  # authenticated: the body is decoded last

    want = expected()
    authenticated = want is None or (want is Reason.MALFORMED and endpoint != REGISTER)
    got = harness.exchange(endpoint, data_bytes, {want} if want is not None else frozenset(),
                           authenticated=authenticated, may_succeed=want is None,
                           what=f"POST {endpoint} protocol={protocol} client_id={client_id} path={signed_path!r} "
                                f"timestamp={timestamp!r} (now {harness.now!r}) nonce={nonce.hex()}")
    assert got is want


# ---- 7. oversized requests ---------------------------------------------------------------------------------------
MAX_REQUEST_BYTES = 16 * 1024 * 1024  # docs/protocol.md §2: an envelope ≤ 16 MiB, any inner message ≤ 8 MiB
MAX_MESSAGE_BYTES = 8 * 1024 * 1024


def send_chunked(url: str, path: str, data: bytes) -> tuple[int, bytes]:
    """POST with chunked transfer encoding: no Content-Length for the server to check up front."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        chunks = (data[i : i + (1 << 20)] for i in range(0, len(data), 1 << 20))
        conn.request("POST", path, body=chunks, encode_chunked=True,
                     headers={"Content-Type": "application/msgpack", "Transfer-Encoding": "chunked"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_oversized_requests_are_refused_cleanly(harness: Harness) -> None:
    too_big = b"\x00" * (MAX_REQUEST_BYTES + 1)
    for path in ENDPOINTS:
        harness.exchange(path, too_big, {Reason.BODY_TOO_LARGE}, authenticated=False, may_succeed=False,
                         what=f"POST {path} {len(too_big)} bytes")
        harness.exchange(path, too_big, {Reason.BODY_TOO_LARGE}, authenticated=False, may_succeed=False,
                         what=f"POST {path} {len(too_big)} bytes, chunked",
                         send=lambda p, d: send_chunked(harness.live.url, p, d))
        body = b"\xc4" + b"\x00" * MAX_MESSAGE_BYTES  # one byte over the inner message limit
        # refused by the per-endpoint body cap before authentication, so not even a rejection row is written
        harness.exchange(path, harness.signed(path, body), {Reason.BODY_TOO_LARGE}, authenticated=False,
                         may_succeed=False, what=f"POST {path} signed, {len(body)}-byte body")
