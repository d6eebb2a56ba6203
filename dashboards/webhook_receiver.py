"""A tiny reference receiver for ranksight webhooks (and Alertmanager's), standard library only.

    ranksight dashboards webhook-receiver --port 9095 --secret "$RANKSIGHT_WEBHOOK_SECRET" \
        [--bearer-token T] [--out deliveries.jsonl]

It binds 127.0.0.1 and accepts a POST (any path) when either

- it carries ``X-Ranksight-Signature``/``X-Ranksight-Timestamp`` and the HMAC verifies with
  ``--secret`` within the timestamp tolerance, and its ``X-Ranksight-Delivery`` id was not
  seen before (a replay or a retry of a delivery already received is answered 200 and
  ignored, not processed twice); or
- ``--bearer-token`` is set and the request has ``Authorization: Bearer <that token>``:
  the way Alertmanager authenticates (``http_config.authorization`` in its webhook_config),
  since Alertmanager cannot sign.

Each accepted delivery is printed as one JSON line on stdout (and appended to ``--out``):
``{"received_at", "path", "auth": "signature"|"bearer", "event", "delivery", "payload"}``.
Anything else gets a 4xx with the reason and a line on stderr. Copy this file together
with ``webhook_signature.py`` to start your own receiver.
"""

from __future__ import annotations

import hmac
import json
import sys
import threading
import time
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

try:  # inside the ranksight package
    from dashboards.webhook_signature import (DEFAULT_TOLERANCE_S, HDR_DELIVERY, HDR_EVENT, HDR_SIGNATURE,
                                              SignatureError, verify_headers)
except ImportError:  # copied next to webhook_signature.py
    from webhook_signature import (DEFAULT_TOLERANCE_S, HDR_DELIVERY, HDR_EVENT, HDR_SIGNATURE,  # type: ignore
                                   SignatureError, verify_headers)

MAX_BODY = 4 * 1024 * 1024


class _Seen:
    """Delivery ids seen within the tolerance window (bounded), to refuse replays."""

    def __init__(self, ttl: float, cap: int = 100_000):
        self.ttl, self.cap = ttl, cap
        self._d: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, key: str, now: float) -> bool:
        with self._lock:
            while self._d and (next(iter(self._d.values())) < now - self.ttl or len(self._d) >= self.cap):
                self._d.popitem(last=False)
            if key in self._d:
                return False
            self._d[key] = now
            return True


class WebhookReceiver(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, port: int, secret: str | list[str], *, bearer_token: str = "", bind: str = "127.0.0.1",
                 tolerance: float = DEFAULT_TOLERANCE_S, out_path: str | None = None,
                 on_delivery: Callable[[dict[str, Any]], None] | None = None, echo: bool = True):
        if not secret and not bearer_token:
            raise ValueError("give a --secret (signed ranksight webhooks) and/or a --bearer-token (Alertmanager)")
        self.secret = secret
        self.bearer_token = bearer_token
        self.tolerance = tolerance
        self.out_path = out_path
        self.on_delivery = on_delivery
        self.echo = echo
        self.seen = _Seen(2 * tolerance)
        self.deliveries: list[dict[str, Any]] = []
        self.rejected: list[tuple[int, str]] = []
        self.duplicates = 0
        self._lock = threading.Lock()
        super().__init__((bind, port), _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def accept(self, rec: dict[str, Any]) -> None:
        line = json.dumps(rec, sort_keys=True)
        with self._lock:
            self.deliveries.append(rec)
            if self.out_path:
                with open(self.out_path, "a") as f:
                    f.write(line + "\n")
            if self.echo:
                print(line, flush=True)
        if self.on_delivery is not None:
            self.on_delivery(rec)


class _Handler(BaseHTTPRequestHandler):
    server: WebhookReceiver
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):
        pass

    def _reply(self, status: int, msg: str) -> None:
        body = json.dumps({"ok": status < 300, "message": msg}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _refuse(self, status: int, msg: str) -> None:
        self.close_connection = True
        with self.server._lock:
            self.server.rejected.append((status, msg))
        print(f"webhook-receiver: refused {self.command} {self.path} from {self.client_address[0]}: {status} {msg}",
              file=sys.stderr, flush=True)
        self._reply(status, msg)

    def do_GET(self):
        if self.path.split("?")[0] == "/healthz":
            self._reply(200, "ok")
        else:
            self._refuse(405, "POST a webhook here")

    def do_POST(self):
        srv = self.server
        try:
            n = int(self.headers.get("Content-Length") or -1)
        except ValueError:
            n = -1
        if not 0 <= n <= MAX_BODY:
            self._refuse(411 if n < 0 else 413, "a Content-Length up to 4 MiB is required")
            return
        body = self.rfile.read(n)
        auth = ""
        if self.headers.get(HDR_SIGNATURE) is not None:
            if not srv.secret:
                self._refuse(401, "signed request but this receiver has no --secret")
                return
            try:
                verify_headers(srv.secret, body, self.headers, tolerance=srv.tolerance)
            except SignatureError as e:
                self._refuse(401, str(e))
                return
            delivery = self.headers.get(HDR_DELIVERY) or ""
            if not delivery:
                self._refuse(400, f"missing {HDR_DELIVERY} header")
                return
            now = time.time()
            # The signature covers timestamp + body: the same signature again is a replay. The delivery id
            # (same on every retry) makes retries of an already received delivery idempotent. Either way the
            # duplicate is answered 200 (so a sender stops retrying) and not processed again.
            fresh_sig = srv.seen.add("sig:" + self.headers.get(HDR_SIGNATURE, ""), now)
            fresh_id = srv.seen.add("id:" + delivery, now)
            if not (fresh_sig and fresh_id):
                with srv._lock:
                    srv.duplicates += 1
                print(f"webhook-receiver: duplicate delivery {delivery} ignored", file=sys.stderr, flush=True)
                self._reply(200, "duplicate delivery ignored")
                return
            auth = "signature"
        elif srv.bearer_token:
            got = self.headers.get("Authorization") or ""
            if not (got.startswith("Bearer ") and hmac.compare_digest(got[7:].strip().encode(),
                                                                       srv.bearer_token.encode())):
                self._refuse(401, "missing or wrong bearer token")
                return
            auth = "bearer"
        else:
            self._refuse(401, f"unsigned request (no {HDR_SIGNATURE} header)")
            return
        try:
            payload = json.loads(body)
        except ValueError:
            self._refuse(400, "body is not JSON")
            return
        srv.accept({"received_at": time.time(), "path": self.path, "auth": auth,
                    "event": self.headers.get(HDR_EVENT) or ("alertmanager" if auth == "bearer" else ""),
                    "delivery": self.headers.get(HDR_DELIVERY) or "", "payload": payload})
        self._reply(200, "accepted")


def serve(port: int, secret: str, *, bearer_token: str = "", tolerance: float = DEFAULT_TOLERANCE_S,
          out_path: str | None = None, bind: str = "127.0.0.1") -> None:
    """Run the receiver in the foreground until SIGINT/SIGTERM."""
    import signal

    srv = WebhookReceiver(port, secret, bearer_token=bearer_token, tolerance=tolerance, out_path=out_path, bind=bind)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True)
    t.start()
    print(f"webhook-receiver: listening on {srv.url} (signed: {'yes' if secret else 'no'}, "
          f"bearer: {'yes' if bearer_token else 'no'})", file=sys.stderr, flush=True)
    try:
        stop.wait()
    finally:
        srv.shutdown()
        srv.server_close()


if __name__ == "__main__":  # python webhook_receiver.py PORT SECRET
    serve(int(sys.argv[1]), sys.argv[2])
