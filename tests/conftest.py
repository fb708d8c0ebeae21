"""Fixtures shared by every test directory."""

from __future__ import annotations

import os
import secrets
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

NO_SKIPS_ENV = "ECHO_SWARM_NO_SKIPS"  # `make test` sets it: CI counts a skip as a failure

# pytest-xdist starts its workers with COLUMNS=80 and LINES=24, which rich reads once when a module creates its
# Console and then never again: the CLI tests, which give each invocation its own width (CliRunner's env), would
# see 80 columns under `make test` and 200 when run alone. Removed before any test module imports a CLI.
for _name in ("COLUMNS", "LINES"):
    os.environ.pop(_name, None)


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


class SkippedAtCollection(pytest.Item):
    """Stands in for a module (or directory) that skipped while it was collected — a module-level
    ``pytest.skip(..., allow_module_level=True)`` or ``pytest.importorskip``, in it or in its conftest.py — and
    fails with the skip's reason when it runs. Such a skip has no test to report it, so
    :func:`pytest_runtest_makereport` never sees it; as a test of its own it fails like any other, in the same
    summary and JUnit report, while the rest of the suite still runs (a collection error would stop the run)."""

    def __init__(self, *, reason: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.reason = reason

    def runtest(self) -> None:
        pytest.fail(f"skipped at collection, and {NO_SKIPS_ENV} allows no skip (make test sets it): {self.reason}",
                    pytrace=False)

    def reportinfo(self) -> tuple[Path, None, str]:
        return self.path, None, f"{self.name}: {self.reason}"


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, pytest.CollectReport,
                                                                          pytest.CollectReport]:
    """Where ECHO_SWARM_NO_SKIPS is set, a collector that skipped yields one :class:`SkippedAtCollection` test."""
    report = yield
    if not os.environ.get(NO_SKIPS_ENV) or not report.skipped:
        return report
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    item = SkippedAtCollection.from_parent(collector, name="skipped-at-collection", reason=reason)
    return pytest.CollectReport(report.nodeid, "passed", None, [item])


#: The longest tests (CI's --durations, stop 28), run first: with `make test`'s two workers (pytest-xdist) the
#: rest packs in around them instead of one long test finishing alone at the end. Update when --durations moves.
LONGEST_FIRST = (
    "tests/adversarial/test_adversaries.py",
    "tests/integration/test_volunteer_client.py::test_a_client_outlasts",
    "tests/integration/test_demo.py",
    "tests/integration/test_llama_demo.py",
    "tests/adversarial/test_trust_boundary.py",
    "tests/integration/test_installer.py",
    "tests/adversarial/test_episode_replay.py",
    "tests/faults/test_flood.py",
    "tests/faults/test_roles.py",  # one run per store, each ~150 s (issue 37)
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest first (LONGEST_FIRST), the rest in file order; the same order in every worker, as xdist needs. A
    test that uses a module- or class-scoped fixture (a swarm of processes the module's tests share) joins its
    module's xdist group, so that `--dist loadgroup` runs the module on one worker and starts the swarm once."""
    def rank(item: pytest.Item) -> int:
        return next((k for k, prefix in enumerate(LONGEST_FIRST) if item.nodeid.startswith(prefix)),
                    len(LONGEST_FIRST))

    items.sort(key=rank)  # stable: ties keep pytest's order
    for item in items:
        if _shares_a_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))


def _shares_a_fixture(item: pytest.Item) -> bool:
    """Whether the test uses a fixture wider than itself and narrower than the session."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(d.scope in ("module", "class", "package") for defs in info.name2fixturedefs.values() for d in defs)


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
