"""Unit-test configuration: hypothesis keeps no example database (nothing is written outside tmp dirs)."""

from __future__ import annotations

from hypothesis import settings

settings.register_profile("echo-swarm-unit", database=None, deadline=None)
settings.load_profile("echo-swarm-unit")
