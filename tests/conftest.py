"""Shared fixtures. Servers bind 127.0.0.1 only; every process a test starts is stopped by it."""

from __future__ import annotations

import pytest

from cli.local_cluster import free_port  # noqa: F401  (tests import it from here)


@pytest.fixture
def port() -> int:
    return free_port()
