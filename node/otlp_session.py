"""The HTTP sessions the node agent's OTLP exporters send through (their ``session=`` argument).

For a plain-http head without a proxy, one kept-alive ``http.client`` connection (``LeanSession``): much less CPU
per export than requests + urllib3, and no keep-alive watcher thread (``bench/agent_cycle.py`` measures both).
TLS and proxies keep requests (``env_once_session``).
"""

from __future__ import annotations

import json
import logging
import threading
import zlib
from typing import Any

from ranksight.zstd import zstd_codec

log = logging.getLogger("ranksight.agent")


def exporter_session(url: str):
    """The HTTP session of an OTLP exporter: ``LeanSession`` for a plain-http head that no proxy setting applies
    to (the usual case: the head on the cluster network, or this host), else a ``requests.Session``
    (``env_once_session``) for TLS and proxies."""
    import urllib.parse

    try:
        from requests.utils import get_environ_proxies

        proxied = bool(get_environ_proxies(url))
    except Exception:  # noqa: BLE001 - unsure: take the general path
        proxied = True
    if urllib.parse.urlsplit(url).scheme == "http" and not proxied:
        return LeanSession(url)
    return env_once_session()


class _LeanResponse:
    """What the SDK's requests transport reads of a response."""

    __slots__ = ("status_code", "reason", "content", "headers")

    def __init__(self, status_code: int, reason: str, content: bytes, headers):
        self.status_code, self.reason, self.content, self.headers = status_code, reason, content, headers

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self):
        return json.loads(self.content)


class LeanSession:
    """A ``requests.Session`` stand-in for the OTLP exporters (``session=``) that sends each export over one
    kept-alive ``http.client`` connection, without the per-request work of requests and urllib3 and without the
    keep-alive watcher thread urllib3-future adds per connection pool. Only what the SDK's transport uses is
    implemented: ``request()`` (no redirects, no proxies, no TLS: ``exporter_session`` picks it for plain http
    without a proxy only) and the ``verify`` / ``cert`` attributes it sets. Failures raise requests' exception types, so the SDK's retry rules
    (one immediate retry on a connection error, backoff on 429/502/503/504) are unchanged. A kept-alive connection
    the head closed in between is re-opened and the request sent once more."""

    def __init__(self, url: str):
        import urllib.parse

        u = urllib.parse.urlsplit(url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.verify: Any = True
        self.cert: Any = None
        self._conn = None
        self._lock = threading.Lock()

    def _drop(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except OSError:
                pass
            self._conn = None

    def request(self, method: str, url: str, headers=None, data=None, timeout=None, allow_redirects=False, **_):
        import http.client
        import urllib.parse

        import requests

        u = urllib.parse.urlsplit(url)
        path = (u.path or "/") + ("?" + u.query if u.query else "")
        with self._lock:
            for attempt in (0, 1):
                reused = self._conn is not None
                if not reused:
                    self._conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
                try:
                    if reused:
                        self._conn.timeout = timeout
                        if self._conn.sock is not None:
                            self._conn.sock.settimeout(timeout)
                    self._conn.request(method, path, body=data, headers=dict(headers or {}))
                    r = self._conn.getresponse()
                    body = r.read()
                except TimeoutError as e:
                    self._drop()
                    raise requests.exceptions.ReadTimeout(f"{self.host}:{self.port}: {e}") from e
                except (http.client.HTTPException, OSError) as e:
                    self._drop()
                    if reused and attempt == 0:
                        continue  # the head closed the idle connection: once more on a new one
                    raise requests.exceptions.ConnectionError(f"{self.host}:{self.port}: {e}") from e
                if r.will_close:
                    self._drop()
                return _LeanResponse(r.status, r.reason, body, r.headers)
        raise AssertionError("unreachable")

    def close(self) -> None:
        with self._lock:
            self._drop()


def env_once_session():
    """A ``requests.Session`` for the OTLP exporters that resolves the environment's proxy and CA-bundle
    settings once per URL instead of on every request (``merge_environment_settings`` parses the proxy
    variables each time). The environment of a running agent does not
    change, so the settings are the same. A CA file set on the session (``--tls-ca``) is not overridden by the
    environment's CA bundle."""
    import requests

    class Session(requests.Session):
        def __init__(self):
            super().__init__()
            self._env_cache: dict = {}

        def merge_environment_settings(self, url, proxies, stream, verify, cert):
            if verify is None and isinstance(self.verify, str):
                # An explicit CA file (the exporter's certificate_file: --tls-ca) wins over REQUESTS_CA_BUNDLE /
                # CURL_CA_BUNDLE: requests would otherwise let the environment replace the session's CA
                # (psf/requests#3829), and a host that sets them would fail to verify the head.
                verify = self.verify
            key = (url, tuple(sorted((proxies or {}).items())), stream, verify, cert, self.trust_env,
                   tuple(sorted(self.proxies.items())), self.verify, self.cert)
            got = self._env_cache.get(key)
            if got is None:
                if len(self._env_cache) > 64:
                    self._env_cache.clear()
                got = self._env_cache[key] = super().merge_environment_settings(url, proxies, stream, verify, cert)
            return dict(got, proxies=dict(got["proxies"]))

    return Session()


class CompressingSession:
    """The agent's exports compressed here instead of in the SDK exporter (which knows only gzip and deflate): zstd
    (``Content-Encoding: zstd``, pyarrow's codec) for a head that takes it, which
    costs the head less to decompress than deflate; deflate (zlib level 6, as before) from the first 415 on, which is
    what a head older than zstd answers, or when this Python's pyarrow has no zstd. Everything else (status codes,
    retries, the response) is the wrapped session's; the exporter must be built with ``Compression.NoCompression``
    so the body arrives here uncompressed."""

    def __init__(self, inner, zstd: bool = True):
        self.inner = inner
        self.zstd = zstd and zstd_codec() is not None
        self.fell_back = False  # the head refused zstd once: deflate for good

    def request(self, method: str, url: str, headers=None, data=None, **kwargs):
        headers = dict(headers or {})
        if data is None or "Content-Encoding" in headers:  # compressed already, or nothing to compress
            return self.inner.request(method, url, headers=headers, data=data, **kwargs)
        raw = bytes(data)
        if self.zstd:
            headers["Content-Encoding"] = "zstd"
            r = self.inner.request(method, url, headers=headers, data=zstd_codec().compress(raw, asbytes=True),
                                   **kwargs)
            if r.status_code != 415:
                return r
            self.zstd, self.fell_back = False, True
            log.warning(
                "agent: the head refused a zstd body (415: %s): sending deflate from now on", r.text[:200])
        headers["Content-Encoding"] = "deflate"
        return self.inner.request(method, url, headers=headers, data=zlib.compress(raw, 6), **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __setattr__(self, name, value):
        if name in ("inner", "zstd", "fell_back"):
            object.__setattr__(self, name, value)
        else:  # ``verify``, ``cert``: set by the SDK's transport on the session
            setattr(self.inner, name, value)
