"""slow_link on a real link: a token-bucket rate limit (``tc ... tbf``) on this node's own network interface.

Only where the launcher gave the node its own network namespace (``RANKSIGHT_NET_IFACE`` names the node's end of
its veth pair, see cli/netns.py): shaping that interface slows everything this node sends to other nodes, as a
degraded NIC would; its ranks' traffic among themselves stays on the namespace's loopback, unshaped.
"""

from __future__ import annotations

import os
import subprocess

ENV = "RANKSIGHT_NET_IFACE"
BURST_S = 0.010  # the bucket holds this much time at the rate: short bursts pass at line speed, as on a real NIC ...
MIN_BURST_BYTES = 16_000  # ... and never less than ~10 full-size frames (the kernel also needs >= rate / HZ)
# How long a packet may queue before the qdisc drops it. Generous: a drop costs TCP a retransmission timeout
# (hundreds of ms, at random steps) where a queue costs only the time the rate itself implies.
LATENCY = "500ms"


class ShapeError(RuntimeError):
    """``tc`` refused the rate limit (the message has its reason)."""


class LinkShaper:
    """The egress rate limit of one network interface of this network namespace."""

    def __init__(self, iface: str):
        self.iface = iface

    @classmethod
    def from_env(cls) -> LinkShaper | None:
        """The shaper of this node's own interface, or None where the node has none (no namespace per node)."""
        iface = os.environ.get(ENV, "").strip()
        return cls(iface) if iface else None

    @staticmethod
    def burst_bytes(rate_mbit: float) -> int:
        return max(MIN_BURST_BYTES, int(rate_mbit * 1e6 / 8 * BURST_S))

    def apply(self, rate_mbit: float) -> None:
        """Limit what this interface sends to ``rate_mbit`` megabit/s (replacing any limit it had)."""
        if not rate_mbit > 0:
            raise ValueError(f"rate_mbit must be > 0, got {rate_mbit}")
        cmd = ["tc", "qdisc", "replace", "dev", self.iface, "root", "tbf", "rate", f"{max(1, round(rate_mbit * 1000))}kbit",
               "burst", str(self.burst_bytes(rate_mbit)), "latency", LATENCY]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:
            raise ShapeError(f"`{' '.join(cmd)}`: {e}") from None
        if r.returncode != 0:
            raise ShapeError(f"`{' '.join(cmd)}` failed: {(r.stderr or r.stdout).strip()}")

    def clear(self) -> None:
        """Remove the limit. Idempotent: no limit, a gone interface or no ``tc`` at all is not an error."""
        try:
            subprocess.run(["tc", "qdisc", "del", "dev", self.iface, "root"], capture_output=True)
        except OSError:
            pass

    def current(self) -> str:
        """The interface's root qdisc as ``tc`` shows it ('' where it cannot be read)."""
        try:
            r = subprocess.run(["tc", "qdisc", "show", "dev", self.iface, "root"], capture_output=True, text=True)
        except OSError:
            return ""
        return r.stdout.strip() if r.returncode == 0 else ""
