"""The volunteer protocol's endpoints are declared once (shared.endpoints): the server registers exactly them,
the relay and the size caps read them, and no module of either side spells one of their paths itself."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from coordinator.limits import RESULTS_PATH, SIGNED_POSTS, body_cap
from shared import endpoints
from shared.endpoints import BLOB, RESULTS, SIGNED_CALLS, SNAPSHOT

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("coordinator", "swarm_client", "echo_swarm", "shared")
DECLARATION = REPO / "shared" / "endpoints.py"
# the operator's and the status page's own routes: their own tables (coordinator.api.admin, status_page, metrics)
NOT_VOLUNTEER = ("/v1/admin/", "/v1/volunteers", "/static", "/metrics", "/volunteer")


@pytest.fixture(scope="module")
def routes(tmp_path_factory: pytest.TempPathFactory) -> set[tuple[str, str]]:
    from coordinator.config import load_config
    from coordinator.launch.one_process import create_app

    app = create_app(load_config(None, {"run_dir": str(tmp_path_factory.mktemp("run"))}))
    return {(r.method, r.resource.canonical) for r in app.router.routes()
            if r.method != "HEAD" and r.resource is not None}


def test_the_server_registers_exactly_the_declared_volunteer_endpoints(routes: set[tuple[str, str]]) -> None:
    declared = {("POST", c.path) for c in SIGNED_CALLS} | {("GET", r.path) for r in endpoints.READS}
    volunteer = {(m, p) for m, p in routes if p != "/" and not p.startswith(NOT_VOLUNTEER)}
    assert volunteer == declared, (f"registered, not declared: {sorted(volunteer - declared)}; declared, not "
                                   f"registered: {sorted(declared - volunteer)}")


def test_the_relay_and_the_caps_read_the_declaration() -> None:
    assert tuple(c.path for c in SIGNED_CALLS) == SIGNED_POSTS and RESULTS.path == RESULTS_PATH
    assert body_cap(RESULTS.path, 10**6) > body_cap(endpoints.LEASE.path, 10**6)  # results: the run's own cap


def test_paths_fill_their_parameters() -> None:
    assert SNAPSHOT.at(version=3) == "/v1/snapshots/3" and BLOB.prefix == "/v1/blobs/"
    assert BLOB.at(sha256="ab" * 32) == "/v1/blobs/" + "ab" * 32


def _spelled_paths(path: Path) -> list[str]:
    """String literals (and literal parts of f-strings) in ``path`` that begin with a declared endpoint's path."""
    prefixes = tuple({c.path for c in SIGNED_CALLS} | {r.prefix for r in endpoints.READS})
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
        elif isinstance(node, ast.JoinedStr):
            text = "".join(v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str))
        else:
            continue
        if text.startswith(prefixes) or any(f"{{}}{p}" in text for p in prefixes):
            found.append(f"{path.relative_to(REPO)}:{node.lineno}: {text[:60]!r}")
    return found


def test_no_module_spells_an_endpoint_path_of_its_own() -> None:
    spelled = [hit for pkg in PACKAGES for f in sorted((REPO / pkg).rglob("*.py")) if f != DECLARATION
               for hit in _spelled_paths(f)]
    assert not spelled, ("these modules spell a protocol path instead of reading shared.endpoints (use e.g. "
                         "endpoints.LEASE.path, SNAPSHOT.at(version=v), or api.call(LEASE, request)):\n"
                         + "\n".join(spelled))
