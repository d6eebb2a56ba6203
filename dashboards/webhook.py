"""Signed alert webhooks: the head's findings POSTed to URLs.

    sender = WebhookSender([WebhookTarget(url="https://hooks.example/ranksight", secret="s3cret")])
    sender.send_findings(new_findings)      # returns at once: deliveries go through a background queue
    ...
    sender.close(timeout=5)                 # flush what is pending (bounded), stop the workers

Each delivery is one HTTP POST with a JSON body and the headers

    Content-Type: application/json
    X-Ranksight-Event: finding | alertmanager
    X-Ranksight-Delivery: <uuid, the same on every retry of this delivery>
    X-Ranksight-Timestamp: <unix seconds>
    X-Ranksight-Signature: sha256=<hex HMAC-SHA256(secret, timestamp + "." + body)>

(``dashboards.webhook_signature`` defines and verifies the scheme). Body formats, per target:

- ``finding``: the ``ranksight.schema.Finding`` itself, as msgspec encodes it (decode it
  with ``msgspec.json.decode(body, type=Finding)``);
- ``alertmanager``: an Alertmanager webhook (version 4) payload with one alert per finding,
  so receivers written for Alertmanager (chat relays, incident tools) take it unchanged.

Delivery: a bounded in-memory queue (``queue_size``; beyond it new deliveries are dropped
and counted) served by ``workers`` threads. A 2xx answer is success; a connection error,
timeout, 408, 429 or 5xx is retried with exponential backoff and jitter (``backoff_s``
doubling up to ``backoff_max_s``, a ``Retry-After`` is honoured within that bound) up to
``max_attempts``; any other 4xx, and any redirect (not followed), is a permanent failure
(the receiver refused: wrong secret, bad URL). The timestamp and signature are recomputed on each attempt. Nothing
here blocks the caller for more than a lock acquisition. ``stats()`` has the counters.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import json
import logging
import os
import random
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Iterable, Literal

import msgspec

from dashboards.webhook_signature import HDR_DELIVERY, HDR_EVENT, sign
from ranksight import schema

log = logging.getLogger("ranksight.webhook")

FORMATS = ("finding", "alertmanager")
RETRY_STATUS = {408, 425, 429, 500, 502, 503, 504}
AM_ZERO_TIME = "0001-01-01T00:00:00Z"


class WebhookTarget(msgspec.Struct, kw_only=True):
    url: str
    secret: str
    format: Literal["finding", "alertmanager"] = "finding"
    min_severity: schema.Severity = "warning"  # findings below it are not sent to this target
    timeout_s: float = 5.0
    name: str = ""

    def validate(self) -> "WebhookTarget":
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"webhook URL must start with http:// or https://, got {self.url!r}")
        if not self.secret:
            raise ValueError(f"webhook {self.url}: a signing secret is required (unsigned webhooks are refused)")
        if self.format not in FORMATS:
            raise ValueError(f"webhook {self.url}: format must be one of {FORMATS}, got {self.format!r}")
        if self.min_severity not in schema.SEVERITY_ORDER:
            raise ValueError(f"webhook {self.url}: min_severity must be one of {tuple(schema.SEVERITY_ORDER)}")
        if not 0 < self.timeout_s <= 60:
            raise ValueError(f"webhook {self.url}: timeout_s must be in (0, 60]")
        return self


# ------------------------------------------------------------------------------------------
# Payloads
# ------------------------------------------------------------------------------------------

def _rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t or time.time(), tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def alertname_for(kind: str) -> str:
    """``straggler`` -> ``RanksightFindingStraggler``, ``gpu_health`` -> ``RanksightFindingGpuHealth``."""
    return "RanksightFinding" + "".join(p.capitalize() for p in kind.split("_") if p)


def finding_alert(f: schema.Finding, generator_url: str = "") -> dict[str, Any]:
    """One Alertmanager alert (webhook v4 shape) for a finding."""
    labels = {
        "alertname": alertname_for(f.kind),
        "severity": f.severity,
        "run_id": f.run_id,
        "kind": f.kind,
        "analyzer": f.analyzer,
        "source": "ranksight-head",
        "simulated": "true" if f.simulated else "false",
    }
    if f.ranks:
        labels["rank"] = ",".join(str(r) for r in f.ranks)
    if f.nodes:
        labels["node"] = ",".join(str(n) for n in f.nodes)
    steps = ""
    if f.step_start is not None:
        steps = f"{f.step_start}" + (f"-{f.step_end}" if f.step_end is not None and f.step_end != f.step_start else "")
    summary = f.summary or f"{f.kind} on ranks {labels.get('rank', '?')}"
    if f.simulated:
        summary = "[SIMULATED] " + summary
    annotations = {
        "summary": summary,
        "description": (f.recommendation + ("\n" if f.recommendation else "")
                        + f"evidence: {json.dumps(f.evidence, sort_keys=True, default=str)}"),
        "recommendation": f.recommendation,
        "evidence": json.dumps(f.evidence, sort_keys=True, default=str),
        "confidence": f"{f.confidence:.2f}",
    }
    if steps:
        annotations["steps"] = steps
    fp = hashlib.sha256(json.dumps(sorted(labels.items()) + [steps]).encode()).hexdigest()[:16]
    return {"status": "firing", "labels": labels, "annotations": annotations, "startsAt": _rfc3339(f.t),
            "endsAt": AM_ZERO_TIME, "generatorURL": generator_url, "fingerprint": fp}


def alertmanager_payload(findings: list[schema.Finding], *, receiver: str = "ranksight",
                         external_url: str = "") -> dict[str, Any]:
    """An Alertmanager webhook (version 4) body carrying ``findings`` as firing alerts."""
    if not findings:
        raise ValueError("alertmanager_payload needs at least one finding")
    alerts = [finding_alert(f, external_url) for f in findings]
    common_labels = dict(alerts[0]["labels"])
    for a in alerts[1:]:
        common_labels = {k: v for k, v in common_labels.items() if a["labels"].get(k) == v}
    common_ann = dict(alerts[0]["annotations"])
    for a in alerts[1:]:
        common_ann = {k: v for k, v in common_ann.items() if a["annotations"].get(k) == v}
    group = {k: common_labels[k] for k in ("alertname", "run_id") if k in common_labels}
    group_key = "{}:{" + ", ".join(f'{k}="{v}"' for k, v in group.items()) + "}"
    return {"receiver": receiver, "status": "firing", "alerts": alerts, "groupLabels": group,
            "commonLabels": common_labels, "commonAnnotations": common_ann, "externalURL": external_url,
            "version": "4", "groupKey": group_key, "truncatedAlerts": 0}


# ------------------------------------------------------------------------------------------
# Sender
# ------------------------------------------------------------------------------------------

@dataclass(order=True)
class _Delivery:
    due: float
    seq: int
    target: WebhookTarget = field(compare=False)
    body: bytes = field(compare=False)
    event: str = field(compare=False)
    id: str = field(compare=False)
    attempt: int = field(default=0, compare=False)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A signed POST is not followed to another URL (urllib would turn it into a GET): a 3xx is a failure."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)

_COUNTERS = ("queued", "delivered", "retried", "failed", "dropped", "abandoned")


class WebhookSender:
    """Formats findings per target and delivers them through a bounded, retrying queue served by worker threads.

    Its ~15 methods are the public surface (constructors, send, flush, close, stats, context manager) and the
    queue's few internals (enqueue, post, worker); the queue shares the sender's lock and counters, which a
    class of its own would only pass back and forth."""

    def __init__(self, targets: Iterable[WebhookTarget], *, queue_size: int = 1000, max_attempts: int = 5,
                 backoff_s: float = 0.5, backoff_max_s: float = 30.0, workers: int = 2, external_url: str = "",
                 user_agent: str = "ranksight-webhook/1"):
        self.targets = [t.validate() for t in targets]
        if not self.targets:
            raise ValueError("WebhookSender needs at least one target")
        if queue_size < 1 or max_attempts < 1 or workers < 1 or backoff_s < 0 or backoff_max_s < backoff_s:
            raise ValueError("queue_size, max_attempts and workers must be >= 1, 0 <= backoff_s <= backoff_max_s")
        self.queue_size = queue_size
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.external_url = external_url
        self.user_agent = user_agent
        self._heap: list[_Delivery] = []
        self._inflight = 0
        self._cv = threading.Condition()
        self._seq = itertools.count()
        self._closed = False
        self._counts = {c: 0 for c in _COUNTERS}
        self._per_target = {t.url: {c: 0 for c in _COUNTERS} for t in self.targets}
        self.last_error: dict[str, str] = {}
        self._threads = [threading.Thread(target=self._worker, name=f"webhook-{i}", daemon=True) for i in range(workers)]
        for t in self._threads:
            t.start()

    # -- configuration helpers ------------------------------------------------------------------
    @classmethod
    def from_urls(cls, urls: Iterable[str], secret: str, *, fmt: str = "finding", min_severity: str = "warning",
                  **kw) -> "WebhookSender":
        return cls([WebhookTarget(url=u, secret=secret, format=fmt, min_severity=min_severity) for u in urls], **kw)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **kw) -> "WebhookSender | None":
        """From ``RANKSIGHT_WEBHOOK_URLS`` (comma-separated), ``RANKSIGHT_WEBHOOK_SECRET``,
        ``RANKSIGHT_WEBHOOK_FORMAT`` (finding|alertmanager) and ``RANKSIGHT_WEBHOOK_MIN_SEVERITY``.
        ``None`` when no URL is configured; ``ValueError`` when URLs are given without a secret."""
        env = os.environ if env is None else env
        urls = [u.strip() for u in (env.get("RANKSIGHT_WEBHOOK_URLS") or "").split(",") if u.strip()]
        if not urls:
            return None
        return cls.from_urls(urls, env.get("RANKSIGHT_WEBHOOK_SECRET", ""),
                             fmt=env.get("RANKSIGHT_WEBHOOK_FORMAT", "finding"),
                             min_severity=env.get("RANKSIGHT_WEBHOOK_MIN_SEVERITY", "warning"), **kw)

    # -- enqueueing (never blocks on the network) ---------------------------------------------------
    def _count(self, url: str, what: str, n: int = 1) -> None:
        self._counts[what] += n
        self._per_target[url][what] += n

    def _enqueue(self, target: WebhookTarget, body: bytes, event: str) -> bool:
        with self._cv:
            if self._closed:
                raise RuntimeError("WebhookSender is closed")
            if len(self._heap) + self._inflight >= self.queue_size:
                self._count(target.url, "dropped")
                log.error("webhook: queue full (%d), dropping a %s delivery to %s", self.queue_size, event, target.url)
                return False
            heapq.heappush(self._heap, _Delivery(time.monotonic(), next(self._seq), target, body, event,
                                                 uuid.uuid4().hex))
            self._count(target.url, "queued")
            self._cv.notify()
            return True

    def send_finding(self, finding: schema.Finding) -> int:
        return self.send_findings([finding])

    def send_findings(self, findings: Iterable[schema.Finding]) -> int:
        """Queue one delivery per finding and target (respecting each target's min_severity); returns how many."""
        n = 0
        for f in findings:
            if not isinstance(f, schema.Finding):
                raise TypeError(f"send_findings takes ranksight.schema.Finding, got {type(f).__name__}")
            for t in self.targets:
                if not schema.severity_at_least(f.severity, t.min_severity):
                    continue
                if t.format == "finding":
                    body = msgspec.json.encode(f)
                else:
                    body = json.dumps(alertmanager_payload([f], external_url=self.external_url)).encode()
                n += self._enqueue(t, body, t.format)
        return n

    # -- delivery ------------------------------------------------------------------------------------
    def _post(self, d: _Delivery) -> tuple[bool, bool, float | None, str]:
        """(ok, retryable, retry_after, error)."""
        headers = {"Content-Type": "application/json", "User-Agent": self.user_agent, HDR_EVENT: d.event,
                   HDR_DELIVERY: d.id, **sign(d.target.secret, d.body)}
        req = urllib.request.Request(d.target.url, data=d.body, method="POST", headers=headers)
        try:
            with _OPENER.open(req, timeout=d.target.timeout_s) as r:
                r.read(65536)
                return True, False, None, ""
        except urllib.error.HTTPError as e:
            retry_after = None
            ra = e.headers.get("Retry-After") if e.headers else None
            if ra and ra.strip().isdigit():
                retry_after = float(ra.strip())
            return False, e.code in RETRY_STATUS, retry_after, f"HTTP {e.code}"
        except (urllib.error.URLError, OSError, ValueError) as e:
            return False, True, None, f"{type(e).__name__}: {getattr(e, 'reason', e)}"

    def _worker(self) -> None:
        while True:
            with self._cv:
                while True:
                    if self._closed and not self._heap:
                        return
                    now = time.monotonic()
                    if self._heap and self._heap[0].due <= now:
                        d = heapq.heappop(self._heap)
                        self._inflight += 1
                        break
                    if self._closed:
                        return
                    self._cv.wait(None if not self._heap else max(0.01, self._heap[0].due - now))
            ok, retryable, retry_after, err = self._post(d)
            with self._cv:
                self._inflight -= 1
                d.attempt += 1
                url = d.target.url
                if ok:
                    self._count(url, "delivered")
                elif retryable and d.attempt < self.max_attempts and not self._closed:
                    delay = min(self.backoff_max_s, self.backoff_s * 2 ** (d.attempt - 1)) * random.uniform(0.8, 1.2)
                    if retry_after is not None:
                        delay = min(self.backoff_max_s, max(delay, retry_after))
                    d.due = time.monotonic() + delay
                    heapq.heappush(self._heap, d)
                    self._count(url, "retried")
                    self.last_error[url] = err
                    log.warning("webhook: %s delivery %s to %s failed (%s); retry %d/%d in %.1fs", d.event, d.id, url,
                                err, d.attempt, self.max_attempts - 1, delay)
                else:
                    self._count(url, "failed")
                    self.last_error[url] = err
                    log.error("webhook: %s delivery %s to %s failed for good after %d attempt(s): %s", d.event, d.id,
                              url, d.attempt, err)
                self._cv.notify_all()

    # -- lifecycle -------------------------------------------------------------------------------------
    def pending(self) -> int:
        with self._cv:
            return len(self._heap) + self._inflight

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait (at most ``timeout`` s) until nothing is queued or in flight; True if so."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._heap or self._inflight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(min(left, 0.1))
            return True

    def close(self, timeout: float = 5.0) -> None:
        """Give pending deliveries up to ``timeout`` s, then stop; what is left is counted as abandoned."""
        self.flush(timeout)
        with self._cv:
            self._closed = True
            left = list(self._heap)
            self._heap.clear()
            for d in left:
                self._count(d.target.url, "abandoned")
            self._cv.notify_all()
        if left:
            log.error("webhook: closing with %d undelivered deliveries (abandoned)", len(left))
        for t in self._threads:
            t.join(timeout=max(0.1, max(tg.timeout_s for tg in self.targets) + 1))

    def stats(self) -> dict[str, Any]:
        with self._cv:
            return {**self._counts, "pending": len(self._heap) + self._inflight,
                    "per_target": {u: dict(c) for u, c in self._per_target.items()},
                    "last_error": dict(self.last_error)}

    def __enter__(self) -> "WebhookSender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
