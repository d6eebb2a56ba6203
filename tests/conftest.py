"""Shared fixtures. Servers bind 127.0.0.1 only; every process a test starts is stopped by it."""

from __future__ import annotations

import pytest

from cli.local_cluster import free_port  # noqa: F401  (tests import it from here)


@pytest.fixture
def port() -> int:
    return free_port()


# The test files that take longest (real multi-process runs), longest first: `make test` runs files on pytest-xdist
# workers, one file per worker at a time, so a long file that comes last in the alphabet (test_trainer_parallel)
# would run alone at the end while the other worker idles. Started first, the short files fill in around them.
# Files not listed keep their order after these. The list is an ordering hint, not a set the suite depends on.
LONGEST_FIRST = (
    "test_trainer_parallel.py", "test_agent_e2e_training.py", "test_examples.py", "test_fault_injection_smoke.py",
    "test_elastic.py", "test_netns.py", "test_bench_scale.py", "test_tui_layout.py", "test_trainer_checkpoint.py",
    "test_launch.py", "test_tui.py", "test_nccl_tests.py", "test_tui_traces.py", "test_prometheus_scrape.py",
    "test_ops_e2e.py", "test_overhead_toggle.py", "test_diagnose_real.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # a stable sort: ties keep collection order
