"""How many CPUs this process may use: for the checks forked after the load (``analyzers.forked``) and the load's
converting threads (``analyzers.columnar``)."""

from __future__ import annotations

import os


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, a container's cpuset), not the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)
