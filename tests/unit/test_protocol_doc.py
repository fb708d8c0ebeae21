"""docs/protocol.md is the spec third-party clients are written from: it must agree with the code.

Everything compared here is derived from the code (the protocol version, the routes a real ``create_app``
registers, the Reason enum and its HTTP statuses), so adding an endpoint or a reason code only needs the doc
updated — and this test says which line is missing.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from shared import PROTOCOL_VERSION
from shared.errors import HTTP_STATUS, Reason

DOCS = Path(__file__).resolve().parents[2] / "docs"
PROTOCOL_DOC = DOCS / "protocol.md"
OPERATIONS_DOC = DOCS / "operations.md"

# Operator surfaces are documented in docs/operations.md, not in the volunteer protocol (protocol.md §4 says so).
ADMIN_PREFIX = "/v1/admin/"
OPERATOR_PATHS = {"/metrics", "/", "/volunteer"}  # the status page's two HTML pages and the metrics
STATIC_PREFIX = "/static"  # the status page's own JS and CSS files: not an endpoint


def section(text: str, number: str) -> str:
    """The body of ``## <number>. ...`` up to the next level-2 heading."""
    match = re.search(rf"^## {re.escape(number)}\. .*?(?=^## |\Z)", text, re.M | re.S)
    assert match is not None, f"docs/protocol.md has no '## {number}.' section"
    return match.group()


@pytest.fixture(scope="module")
def doc() -> str:
    return PROTOCOL_DOC.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def routes(tmp_path_factory: pytest.TempPathFactory) -> set[tuple[str, str]]:
    """(method, path) of every route the real app registers (HEAD, which aiohttp adds to each GET, left out)."""
    from coordinator.config import load_config
    from coordinator.launch.one_process import create_app

    config = load_config(None, {"run_dir": str(tmp_path_factory.mktemp("run"))})
    app = create_app(config)  # registers every route; the coordinator is not started, nothing is loaded
    found = set()
    for route in app.router.routes():
        if route.method != "HEAD" and route.resource is not None:
            found.add((route.method, route.resource.canonical))
    assert ("GET", "/v1/info") in found and ("POST", "/v1/results") in found  # the walk itself works
    return found


# ---- protocol version --------------------------------------------------------------------------------------
def test_title_names_the_codes_protocol_version(doc: str) -> None:
    title = doc.splitlines()[0]
    match = re.fullmatch(r"# echo-swarm wire protocol \(version (\d+)\)", title)
    assert match is not None, f"unexpected title line {title!r}"
    assert int(match.group(1)) == PROTOCOL_VERSION, (
        f"docs/protocol.md's title says version {match.group(1)}, shared/__init__.py PROTOCOL_VERSION is "
        f"{PROTOCOL_VERSION}: update the title (and describe the change in §11)")


def test_versioning_section_names_the_codes_protocol_version(doc: str) -> None:
    body = section(doc, "11")
    match = re.search(r"`PROTOCOL_VERSION` in `shared/__init__.py` is \*\*(\d+)\*\*", body)
    assert match is not None, "§11 no longer states PROTOCOL_VERSION as **N**"
    assert int(match.group(1)) == PROTOCOL_VERSION, f"§11 says {match.group(1)}, the code {PROTOCOL_VERSION}"
    assert re.search(rf"^\| {PROTOCOL_VERSION} \|", body, re.M), f"§11's history table has no row for {PROTOCOL_VERSION}"


def test_worked_example_signs_with_the_codes_protocol_version(doc: str) -> None:
    # a client copied from §10 must not be refused with protocol_version
    assert re.findall(r"^PROTOCOL = (\d+)$", section(doc, "10"), re.M) == [str(PROTOCOL_VERSION)]


# ---- endpoints ---------------------------------------------------------------------------------------
ENDPOINT = re.compile(r"\b(GET|POST|PUT|PATCH|DELETE) (/[^\s,`]*)")


def documented_endpoints(doc: str) -> set[tuple[str, str]]:
    """(method, path) named in the doc's endpoint headings (`### POST /v1/register — ...`: §4 and §6)."""
    found: set[tuple[str, str]] = set()
    for heading in re.findall(r"^### (.*)$", doc, re.M):
        found.update(ENDPOINT.findall(heading))
    return found


def volunteer_routes(routes: set[tuple[str, str]]) -> set[tuple[str, str]]:
    return {(m, p) for m, p in routes if not p.startswith((ADMIN_PREFIX, STATIC_PREFIX)) and p not in OPERATOR_PATHS}


def test_every_registered_endpoint_has_a_heading(doc: str, routes: set[tuple[str, str]]) -> None:
    missing = volunteer_routes(routes) - documented_endpoints(doc)
    assert not missing, (f"coordinator/api/app.py registers {sorted(missing)} but docs/protocol.md has no '### METHOD "
                         f"/path' heading for them: document each endpoint (§4)")


def test_every_documented_endpoint_exists(doc: str, routes: set[tuple[str, str]]) -> None:
    extra = documented_endpoints(doc) - volunteer_routes(routes)
    assert not extra, f"docs/protocol.md documents {sorted(extra)}, which coordinator/api/app.py does not register"


def test_admin_endpoints_are_the_ones_operations_md_lists(routes: set[tuple[str, str]]) -> None:
    ops = OPERATIONS_DOC.read_text(encoding="utf-8")
    listed = set(re.findall(r"^\| `(/v1/admin/[a-z_/]+)` \|", ops, re.M))
    registered = {p for m, p in routes if p.startswith(ADMIN_PREFIX)}
    assert all(m == "POST" for m, p in routes if p.startswith(ADMIN_PREFIX))  # operations.md: POST /v1/admin/*
    assert registered == listed, (f"admin routes not in docs/operations.md's table: {sorted(registered - listed)}; "
                                  f"listed but not registered: {sorted(listed - registered)}")


def test_operator_endpoints_are_in_operations_md(routes: set[tuple[str, str]]) -> None:
    ops = OPERATIONS_DOC.read_text(encoding="utf-8")
    for method, path in sorted(r for r in routes if r[1] in OPERATOR_PATHS):
        assert re.search(re.escape(f"{method} {path}") + r"(?![\w/{])", ops), f"{method} {path} is undocumented"


# ---- reason codes ------------------------------------------------------------------------------------
def documented_reasons(doc: str) -> dict[str, int]:
    rows = re.findall(r"^\| `([a-z_]+)` \| (\d{3}) \|", section(doc, "9"), re.M)
    codes = [code for code, _ in rows]
    assert len(codes) == len(set(codes)), f"§9 lists a reason twice: {sorted(c for c in codes if codes.count(c) > 1)}"
    return {code: int(status) for code, status in rows}


def test_every_reason_has_an_http_status() -> None:
    assert set(HTTP_STATUS) == set(Reason), f"shared/errors.py HTTP_STATUS lacks {set(Reason) - set(HTTP_STATUS)}"


def test_reason_table_matches_the_code(doc: str) -> None:
    in_code = {reason.value: HTTP_STATUS[reason] for reason in Reason}
    in_doc = documented_reasons(doc)
    missing = {c: s for c, s in in_code.items() if c not in in_doc}
    extra = sorted(set(in_doc) - set(in_code))
    wrong = {c: (in_doc[c], s) for c, s in in_code.items() if c in in_doc and in_doc[c] != s}
    assert not missing, f"docs/protocol.md §9 has no row for {missing} (code: HTTP status); add one each"
    assert not extra, f"docs/protocol.md §9 documents {extra}, which shared/errors.py Reason does not define"
    assert not wrong, f"§9 gives the wrong HTTP status (doc, code) for {wrong}"


# ---- signed calls over libp2p (§6b) --------------------------------------------------------------------------
def test_the_call_protocol_section_matches_the_code(doc: str) -> None:
    from coordinator.limits import SIGNED_POSTS
    from shared.messages import MAX_CALL_BYTES, CallReply, CallRequest
    from shared.p2p_calls import CALL_PROTOCOL, MAX_HEAD

    body = section(doc, "6b")
    assert f"`{CALL_PROTOCOL}`" in body, f"§6b does not name the stream protocol id {CALL_PROTOCOL}"
    missing = [p for p in SIGNED_POSTS if f"`{p}`" not in body]
    assert not missing, f"§6b does not list the relayed calls {missing} (coordinator.limits.SIGNED_POSTS)"
    for model in (CallRequest, CallReply):
        fields = re.search(rf"`{model.__name__}` = (.*?)(?:, then|\)\n|$)", body, re.S)
        assert fields is not None, f"§6b does not define `{model.__name__}` = ..."
        named = set(re.findall(r"`([a-z_]+)`", fields.group(1)))
        assert named == set(model.model_fields), f"§6b's {model.__name__} names {named}, the code {set(model.model_fields)}"
    assert f"(≤ {MAX_HEAD})" in body and MAX_CALL_BYTES == 16 * 1024 * 1024 and "≤ 16 MiB" in body


# ---- every statement of the protocol number (issue 24: the heading said 4, the tables of §1–4 said 2) --------
# Each phrasing the document uses to state which protocol number is required; a new phrasing needs a line here.
PROTOCOL_STATEMENTS = (
    r"`protocol` ≠ (\d+)",
    r"exactly (\d+) \(`PROTOCOL_VERSION`\)",
    r"anything but (\d+) is refused",
    r"`protocol` must be (\d+)",
    r"\| protocol \| int \(=(\d+)\) \|",
    r"\| protocol \| int \| = (\d+) \|",
    r"`protocol` as the smallest int form \(`0x([0-9a-f]{2})`\)",
)


def test_every_statement_of_the_protocol_number_matches_the_code(doc: str) -> None:
    found = []
    for pattern in PROTOCOL_STATEMENTS:
        for match in re.finditer(pattern, doc):
            value = int(match.group(1), 16) if "0x" in pattern else int(match.group(1))
            found.append((match.group(0), value))
    assert len(found) >= len(PROTOCOL_STATEMENTS), found  # each phrasing is still there (or drop it above)
    wrong = [text for text, value in found if value != PROTOCOL_VERSION]
    assert not wrong, f"docs/protocol.md states another protocol number than {PROTOCOL_VERSION}: {wrong}"


def test_manifest_protocols_are_the_codes_range(doc: str) -> None:
    from shared.messages import MANIFEST_PROTOCOLS

    low, high = MANIFEST_PROTOCOLS
    assert f"`Manifest`: `protocol` ({low} to {high}:" in section(doc, "6")


# ---- field tables: each documented message's fields are its model's --------------------------------------
def field_table(doc: str, anchor: str) -> list[str]:
    """The first-column names of the first table after ``anchor`` (a cell naming several, comma-separated, split)."""
    lines = doc[doc.index(anchor):].splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("| "))
    table = []
    for line in lines[first:]:
        if not line.startswith("|"):
            break
        table.append(line)
    names = [n.strip() for row in table[2:] for n in row.split("|")[1].split(",")]  # past the header and rule
    return [n for n in names if n]


def table_cases() -> list[tuple[str, Any, dict[str, Any]]]:
    from shared import messages as m

    return [
        ("Every `POST` body is a `SignedRequest`:", m.SignedRequest, {}),
        ("### GET /v1/info", m.Info, {}),
        ("### POST /v1/register", m.RegisterRequest, {"profile": m.ClientProfile}),
        ("### POST /v1/lease", m.LeaseResponse, {}),
        ("`Job`:\n", m.Job, {"prompts": m.JobPrompt, "sampling": m.SamplingParams, "environment": m.EnvironmentSpec}),
        ("### POST /v1/results", m.ResultSubmission, {"completions": m.Completion, "turns": m.Turn}),
    ]


@pytest.mark.parametrize("case", range(6))
def test_each_field_table_lists_exactly_its_models_fields(doc: str, case: int) -> None:
    anchor, model, nested = table_cases()[case]
    names = field_table(doc, anchor)
    top = {n.split(".", 1)[0].removesuffix("[]") for n in names}  # `sampling.temperature` documents `sampling` too
    top -= {p for p in nested if p not in model.model_fields}  # a list nested in a list (completions[].turns)
    assert top == set(model.model_fields), (
        f"the table after {anchor.strip()!r} lists {sorted(top)}; {model.__name__} has "
        f"{sorted(model.model_fields)}: document each field once (and only those)")
    for name in (n for n in names if "." in n):
        parent, field = name.split(".", 1)
        sub = nested.get(parent.removesuffix("[]"))
        assert sub is not None, f"{name}: no model given for {parent!r} in this test"
        assert field in sub.model_fields, f"{name} is not a field of {sub.__name__} ({sorted(sub.model_fields)})"
    for parent, sub in nested.items():
        listed = {n.split(".", 1)[1] for n in names if "." in n and n.split(".", 1)[0].removesuffix("[]") == parent}
        assert listed == set(sub.model_fields), (f"{anchor.strip()!r}: {parent}.* lists {sorted(listed)}, "
                                                 f"{sub.__name__} has {sorted(sub.model_fields)}")
