"""slow_link on a real link: a token-bucket rate limit (``tc ... tbf``) on this node's own network interface.

Only where the launcher gave the node its own network namespace (``RANKSIGHT_NET_IFACE`` names the node's end of
its veth pair, see cli/netns.py): shaping that interface slows everything this node sends, as a degraded NIC would.
"""

from __future__ import annotations

import os
import subprocess


class LinkShaper:
    def __init__(self, iface: str):
        self.iface = iface

    @classmethod
    def from_env(cls) -> LinkShaper | None:
        iface = os.environ.get("RANKSIGHT_NET_IFACE", "")
        return cls(iface) if iface else None

    def apply(self, rate_mbit: float) -> None:
        """Limit the interface's egress to ``rate_mbit``; the burst holds ~10 ms at that rate (at least one MTU)."""
        burst = max(16_000, int(rate_mbit * 1e6 / 8 / 100))
        subprocess.run(["tc", "qdisc", "replace", "dev", self.iface, "root", "tbf", "rate", f"{rate_mbit}mbit",
                        "burst", str(burst), "latency", "400ms"], check=True, capture_output=True)

    def clear(self) -> None:
        subprocess.run(["tc", "qdisc", "del", "dev", self.iface, "root"], check=False, capture_output=True)
