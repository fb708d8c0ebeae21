"""Fault-injection tests reuse the integration fixtures (a live coordinator on loopback; hivemind, the p2p extra)."""

from tests.integration.conftest import hivemind, live_coordinator  # noqa: F401 — re-exported fixtures
