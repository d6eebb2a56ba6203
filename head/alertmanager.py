"""Findings pushed to Alertmanager's API (``POST <url>/api/v2/alerts``), so silences, inhibition, grouping and
routing apply to them like to any Prometheus alert (``ranksight head --alertmanager-url URL``).

One alert per finding episode (the live analysis' ``FindingsBook``): labels ``alertname="ranksight_<kind>"``,
``run_id``, ``severity``, ``kind``, ``analyzer``, ``episode`` (the episode id: two episodes of one kind stay two
alerts), ``nodes`` and ``ranks`` (comma lists, bounded to ``MAX_LISTED`` entries: labels are for routing and
silencing, the full lists are in the API); annotations ``summary``, ``recommendation``; ``startsAt`` when the
episode was first seen. Like Prometheus, the pusher re-sends every open episode each ``interval`` without an
``endsAt``, so Alertmanager keeps it firing and lets it resolve by itself (its ``resolve_timeout``) if the head
goes away; a closed episode is sent once more with ``endsAt``, which resolves it at once. A new finding is sent at
the next wake-up (``notify``, a finding listener), not after a full interval.

Nothing is retried out of band: a failed push is logged and counted (``errors``), and the next round sends the
state again.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.request
from datetime import datetime, timezone

log = logging.getLogger("ranksight.head.alertmanager")

MAX_LISTED = 8  # ranks/nodes named in a label; more are counted ("0,1,...,7,+24")
DEFAULT_INTERVAL_S = 60.0  # Prometheus' default resend for firing alerts is 1m; Alertmanager's resolve_timeout 5m


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).isoformat().replace("+00:00", "Z")


def bounded_list(values) -> str:
    vals = sorted(set(int(v) for v in values))
    head = ",".join(str(v) for v in vals[:MAX_LISTED])
    return head + (f",+{len(vals) - MAX_LISTED}" if len(vals) > MAX_LISTED else "")


def alert_of(f, ends_at: float | None = None) -> dict:
    """The Alertmanager v2 ``postableAlert`` of a finding episode."""
    labels = {"alertname": f"ranksight_{f.kind}", "run_id": f.run_id, "severity": str(f.severity), "kind": f.kind,
              "analyzer": f.analyzer, "episode": f.id}
    if f.nodes:
        labels["nodes"] = bounded_list(f.nodes)
    if f.ranks:
        labels["ranks"] = bounded_list(f.ranks)
    if f.simulated:
        labels["simulated"] = "true"
    alert = {"labels": {k: v for k, v in labels.items() if v != ""},
             "annotations": {k: v for k, v in (("summary", f.summary), ("recommendation", f.recommendation)) if v},
             "startsAt": _iso(f.t or time.time())}
    if ends_at is not None:
        alert["endsAt"] = _iso(ends_at)
    return alert


class AlertmanagerPusher:
    """Pushes the episodes of ``analysis.findings`` (``{run_id: FindingsBook}``) to one Alertmanager."""

    def __init__(self, url: str, analysis, *, interval: float = DEFAULT_INTERVAL_S, timeout: float = 5.0,
                 headers: dict[str, str] | None = None):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--alertmanager-url must be http(s)://host:port, got {url!r}")
        self.endpoint = url.rstrip("/") + "/api/v2/alerts"
        self.analysis = analysis
        self.interval = interval
        self.timeout = timeout
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self.sent = 0  # alerts accepted by Alertmanager
        self.errors = 0
        self._resolved: set[str] = set()  # episodes whose endsAt Alertmanager accepted
        self._wake = threading.Event()

    def notify(self, findings) -> None:
        """A finding listener: push at once rather than at the next interval."""
        self._wake.set()

    def alerts(self, now: float | None = None) -> list[dict]:
        """What one round sends: every open episode, and each closed one not yet resolved (with ``endsAt``)."""
        now = time.time() if now is None else now
        out = []
        for book in list(self.analysis.findings.values()):
            for f in book.current():
                if f.status == "closed":
                    if f.id not in self._resolved:
                        out.append(alert_of(f, ends_at=min(now, f.updated or now)))
                else:
                    out.append(alert_of(f))
        return out

    def push_once(self, now: float | None = None) -> bool:
        alerts = self.alerts(now)
        if not alerts:
            return True
        req = urllib.request.Request(self.endpoint, data=json.dumps(alerts).encode(), headers=self.headers,
                                     method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                r.read()
        except Exception as e:  # Alertmanager away: the next round sends the whole state again
            self.errors += 1
            log.warning("head: pushing %d alert(s) to %s failed: %s", len(alerts), self.endpoint, e)
            return False
        self.sent += len(alerts)
        self._resolved.update(a["labels"]["episode"] for a in alerts if "endsAt" in a)
        return True

    def run(self, stop: threading.Event) -> None:
        """The pusher thread: a round every ``interval`` seconds or on ``notify``, until ``stop``."""
        while not stop.is_set():
            try:
                self.push_once()
            except Exception:  # never let a bug stop the head's other threads
                log.exception("head: alertmanager push failed")
            self._wake.wait(self.interval)
            self._wake.clear()

    def start(self, stop: threading.Event) -> threading.Thread:
        def stopper():
            stop.wait()
            self._wake.set()

        threading.Thread(target=stopper, daemon=True, name="head-alertmanager-stop").start()
        t = threading.Thread(target=self.run, args=(stop,), daemon=True, name="head-alertmanager")
        t.start()
        return t
