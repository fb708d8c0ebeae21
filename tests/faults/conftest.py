"""Fault-injection tests reuse the integration fixtures (a live coordinator on loopback)."""

from tests.integration.conftest import live_coordinator  # noqa: F401 — re-exported fixture
