"""Fixtures shared by every test directory."""

from __future__ import annotations

import os
import secrets
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

NO_SKIPS_ENV = "ECHO_SWARM_NO_SKIPS"  # `make test` sets it: CI counts a skip as a failure


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    """Where ECHO_SWARM_NO_SKIPS is set, a skipped test is reported failed with its reason: a test that CI cannot
    run (a missing package, service or file) is a setup to fix, not a pass that tested nothing."""
    outcome = yield
    report = outcome.get_result()
    if os.environ.get(NO_SKIPS_ENV) and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped, and {NO_SKIPS_ENV} allows no skip (make test sets it): {reason}"


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The built-in tiny model (built once into the shared cache, ~1 minute on 2 cores, then reused)."""
    from coordinator.engine.tiny_model import ensure_tiny_model

    return ensure_tiny_model()


# -- the store's two engines: every store test runs against SQLite and against a real PostgreSQL server -----
@pytest.fixture(scope="session")
def postgres_server() -> Iterator[Any]:
    """One throwaway PostgreSQL server for the session (the OS package's binaries; `make test` installs them),
    on a free loopback port in a temp dir; each test gets its own database (:func:`pg_url`)."""
    from echo_swarm.pgserver import LocalPostgres, PostgresUnavailable

    try:
        server = LocalPostgres(durable=False).start()
    except PostgresUnavailable as exc:
        pytest.fail(f"the PostgreSQL store tests need a PostgreSQL server: {exc}")
    yield server
    server.stop()


@pytest.fixture()
def pg_url(postgres_server: Any) -> Iterator[str]:
    """A fresh, empty schema on the session's server (a URL whose search_path is it), dropped after the test.
    A schema, not a database: CREATE/DROP DATABASE cost a checkpoint each."""
    name = f"t_{secrets.token_hex(6)}"
    url = postgres_server.create_schema(name)
    yield url
    postgres_server.drop_schema(name)


@pytest.fixture(params=["sqlite", "postgresql"])
def store_target(request: pytest.FixtureRequest, tmp_path: Path) -> str | Path:
    """What Store() opens: a SQLite file in the test's tmp dir, or a fresh PostgreSQL database's URL."""
    if request.param == "sqlite":
        return tmp_path / "coordinator.sqlite"
    return str(request.getfixturevalue("pg_url"))
